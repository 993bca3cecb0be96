"""The simulated hardware behind the loops' protocols (orchestrator/loop/common.py): trainer,
weight push, the replicas' sleep/wake (for the real `SleepingTrainer`), the per-step probe, the
engines' load (for the real `ConcurrencyGate`) and a timeline sampler.

Trainer: an update of T trained tokens takes `fixed_s + T / (tokens_per_s_per_gpu · gpus)`
seconds alone (longer on a shared CPU machine while other parts work: orchestrator/planning/sim/machine.py). Weight push: `model_bytes / bandwidth_bytes_per_s` seconds of transfer, then every
replica loads the new version (pausing `reload_s`). Colocated replicas sleep `sleep_s` and wake
`wake_s` around each update. Invariant: simulated time only ever passes through `asyncio.sleep`
on the virtual loop; these parts hold no clock of their own.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

from workers.core.types import EngineLoad, TrainOrder
from workers.weight_sync.protocol import WeightSyncReport
from orchestrator.planning.sim.agent import SimAgents
from orchestrator.planning.sim.clock import VirtualLoop
from orchestrator.planning.sim.engine import SimReplica
from orchestrator.planning.sim.machine import SharedCpu


@dataclass(frozen=True)
class SleepReport:
    """What `SleepingTrainer` reads from a replica's sleep (orchestrator/adapters/colocate.py)."""

    level: int = 1
    released_memory: bool = True


class SimReplicaHandle:
    """A replica as `SleepingTrainer` sees it: `sleep()` / `wake_up()` coroutines."""

    def __init__(self, replica: SimReplica, sleep_s: float, wake_s: float) -> None:
        self._r, self._sleep_s, self._wake_s = replica, sleep_s, wake_s

    async def sleep(self) -> SleepReport:
        self._r.sleep()
        await asyncio.sleep(self._sleep_s)
        return SleepReport()

    async def wake_up(self) -> SleepReport:
        await asyncio.sleep(self._wake_s)
        self._r.wake_up()
        return SleepReport()


class SimTrainer:
    """The loops' Trainer: time linear in trained tokens per GPU plus a fixed part.
    `trained_tokens`: trajectory tokens (prompt, tool and generated) of every trained sample."""

    def __init__(self, agents: SimAgents, *, gpus: int, tokens_per_s_per_gpu: float, fixed_s: float,
                 masked_base: float, masked_per_staleness: float, cpu: SharedCpu | None = None) -> None:
        self._agents, self.gpus, self._cpu = agents, gpus, cpu
        self.rate, self.fixed_s = tokens_per_s_per_gpu, fixed_s
        self._masked_base, self._masked_per_st = masked_base, masked_per_staleness
        self.version = 0
        self.trained_tokens = 0
        self.generated_tokens = 0
        self.trained_samples = 0
        self.busy_s = 0.0

    async def update(self, order: TrainOrder) -> dict[str, float]:
        tokens, generated, staleness, n = 0, 0, 0.0, 0
        for s in order.samples:
            if s.row_keys:  # a loss-masked (stale) sample has no row to read: it trains nothing
                total, gen, oldest = self._agents.tokens[s.session_id]
                tokens += total
                generated += gen
                staleness += self.version - oldest
                n += 1
        dt = self.fixed_s + tokens / (self.rate * self.gpus)
        if self._cpu is None:
            await asyncio.sleep(dt)
        else:
            dt = await self._cpu.run_trainer(dt)
        self.trained_samples += n
        self.trained_tokens += tokens
        self.generated_tokens += generated
        self.busy_s += dt
        mean_st = staleness / n if n else 0.0
        # actor/num_tokens: loss-mask (generated) tokens, as the product's trainer counts them;
        # perf/total_num_tokens: every token of the trained trajectories (the product's ranks
        # report it; verl's and the report's measure)
        return {"actor/num_tokens": float(generated), "perf/total_num_tokens": float(tokens),
                "rollout_corr/rollout_rs_masked_fraction": min(1.0, self._masked_base + self._masked_per_st * mean_st)}

class SimWeightSync:
    """The loops' WeightSync: the trainer's weights become `version`, transfer time, then every
    replica loads the version."""

    def __init__(self, replicas: list[SimReplica], trainer: SimTrainer, *, transfer_s: float, reload_s: float,
                 initial_version: int = 0) -> None:
        self._replicas, self._trainer, self.transfer_s, self.reload_s = replicas, trainer, transfer_s, reload_s
        self._version = initial_version
        self.pushes = 0

    def version(self) -> int:
        return self._version

    async def sync(self, version: int) -> WeightSyncReport:
        t0 = asyncio.get_running_loop().time()
        self._trainer.version = version
        await asyncio.sleep(self.transfer_s)
        for r in self._replicas:
            r.load_weights(version, self.reload_s)
        self.pushes += 1
        self._version = version
        return WeightSyncReport(version, len(self._replicas), asyncio.get_running_loop().time() - t0)

    def lost(self) -> frozenset[int]:
        return frozenset()  # simulated replicas do not die

    async def metrics(self) -> dict[str, float]:
        return {}


class SimProbe:
    """Per-step `perf/inference_concurrency` (requests at an engine, time-average per replica over
    the time engines were awake) and `perf/kv_cache_usage` (time-average), since the last call."""

    def __init__(self, replicas: list[SimReplica], gate=None) -> None:
        self._replicas, self._gate = replicas, gate
        self._last = self._totals()

    def _totals(self) -> tuple[float, float, float]:
        for r in self._replicas:
            r.load()  # brings its integrals up to now
        return (sum(r.busy_integral for r in self._replicas), sum(r.kv_integral for r in self._replicas),
                sum(r.awake_s for r in self._replicas))

    async def __call__(self) -> dict[str, float]:
        now = self._totals()
        busy, kv, awake = (a - b for a, b in zip(now, self._last))
        self._last = now
        out = {"perf/inference_concurrency": busy / awake if awake > 0 else math.nan,
               "perf/kv_cache_usage": kv / awake if awake > 0 else math.nan}
        if self._gate is not None:
            out.update(self._gate.metrics())
        return out


async def engine_loads(replicas: list[SimReplica]) -> list[EngineLoad]:
    """The engines' scheduler stats, as `ConcurrencyGate` asks for them."""
    return [r.load() for r in replicas]


class Timeline:
    """Samples concurrency and KV usage (means over replicas) every `every_s` simulated seconds."""

    def __init__(self, loop: VirtualLoop, replicas: list[SimReplica], every_s: float) -> None:
        self._loop, self._replicas, self._every = loop, replicas, every_s
        self.rows: list[dict[str, float]] = []
        loop.schedule(0.0, self._sample)

    def _sample(self) -> None:
        loads = [r.load() for r in self._replicas]
        k = len(loads)
        self.rows.append({"t_s": round(self._loop.now, 3),
                          "running": sum(ld.num_running for ld in loads) / k,
                          "waiting": sum(ld.num_waiting for ld in loads) / k,
                          "kv_cache_usage": round(sum(ld.kv_cache_usage for ld in loads) / k, 4),
                          "preempted": float(sum(ld.num_preempted for ld in loads)),
                          "asleep": float(sum(r.asleep for r in self._replicas)) / k})
        self._loop.schedule(self._loop.now + self._every, self._sample)
