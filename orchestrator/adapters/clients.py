"""Driver-side clients of the actors: the trainer client, the sample store, the gateway probe.

Each turns a loop protocol call into calls on the actors (or any object with the same methods),
so the loop never sees Ray. The driver is a control plane: it handles metadata, never a token.
Invariants: `TrainerClient.update` sends a train order (keys, groups, rewards; the trainer ranks
read the rows from the trajectory buffer themselves) and nothing when no row is to be trained;
`BufferStore.sample_infos` reads the buffer's tags once and raises naming the samples a group
lacks. `DriverBytes` measures both claims per step: the pickled bytes the driver got from the
rollout pool and from the buffer (`driver/bytes_from_rollouts`, `driver/bytes_from_buffer`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
from typing import Any, Awaitable, Callable, TypeVar

from workers.core.calls import actor_died
from workers.core.types import EngineLoad, RolloutRequest, SampleInfo, TrainOrder
from workers.gateway.client import GatewayClient
from workers.inference.client import ReplicaClient

T = TypeVar("T")


class DriverBytes:
    """Pickled bytes the driver received, per step: `driver/bytes_from_rollouts` (what the rollout
    pool's `run_all` returned, for `driver/rollouts_returned` rollouts), `driver/bytes_from_buffer`
    (what the buffer's listings returned, for `driver/samples_listed` samples), and
    `driver/bytes_per_rollout`: the two per-rollout means added (in async mode the rollouts that
    return in a step and the samples it lists differ, so each is divided by its own count)."""

    def __init__(self) -> None:
        self._rollouts = self._buffer = self._returned = self._listed = 0

    def from_rollouts(self, outcomes: Any, count: int) -> None:
        self._rollouts += len(pickle.dumps(outcomes))
        self._returned += count

    def from_buffer(self, infos: list[Any]) -> None:
        self._buffer += len(pickle.dumps(infos))
        self._listed += len(infos)

    async def __call__(self) -> dict[str, float]:
        """The step's counts (then reset)."""
        per = (self._rollouts / self._returned if self._returned else 0.0) + (
            self._buffer / self._listed if self._listed else 0.0)
        out = {"driver/bytes_from_rollouts": float(self._rollouts), "driver/bytes_from_buffer": float(self._buffer),
               "driver/rollouts_returned": float(self._returned), "driver/samples_listed": float(self._listed),
               "driver/bytes_per_rollout": per}
        self._rollouts = self._buffer = self._returned = self._listed = 0
        return out


class MeteredRollouts:
    """The loop's Rollouts over a rollout pool, counting the bytes `run_all` returns (`DriverBytes`)."""

    def __init__(self, pool: Any, meter: DriverBytes) -> None:
        self._pool, self._meter = pool, meter

    async def run_all(self, reqs: list[RolloutRequest], partition: str) -> list[Any]:
        outcomes = await self._pool.run_all(reqs, partition)
        self._meter.from_rollouts(outcomes, len(reqs))
        return outcomes


class TrainerClient:
    """Loop-facing trainer: completes a train order (advantage settings, pad id, the buffer's
    handle) and hands it to the trainer (a TrainerGroup: its ranks read their own rows)."""

    def __init__(self, trainer: Any, *, pad_id: int, norm_adv_by_std: bool, buffer: Any) -> None:
        self._trainer = trainer
        self._pad_id = pad_id
        self._norm = norm_adv_by_std
        self._buffer = buffer  # BufferHandle: picklable, each rank connects with it

    async def update(self, order: TrainOrder) -> dict[str, float]:
        """One optimizer step on `order`; no step when no row is to be trained (all masked). Adds
        `trainer/rows_ordered` (rows the order asked the ranks to read; the ranks report
        `trainer/rows_read`) to the trainer's metrics."""
        if not order.num_rows:
            return {"actor/num_tokens": 0.0, "perf/total_num_tokens": 0.0, "actor/step_skipped": 1.0,
                    "trainer/rows_ordered": 0.0, "trainer/rows_read": 0.0}
        order = dataclasses.replace(order, norm_adv_by_std=self._norm, pad_id=self._pad_id, buffer=self._buffer)
        return await self._trainer.update(order) | {"trainer/rows_ordered": float(order.num_rows)}


class BufferStore:
    """The loop's SampleStore over a TrajectoryBuffer: one listing of tags per call, no token."""

    def __init__(self, buffer: Any, group_size: int, meter: DriverBytes | None = None) -> None:
        self._buffer = buffer
        self._n = group_size
        self._meter = meter

    async def sample_infos(self, partition: str, group_ids: list[int]) -> list[SampleInfo]:
        """The metadata of `group_ids`' samples, read once: their rollouts have returned, so every
        sample is stored (a rollout worker puts before it returns). Raises RuntimeError naming the
        group and the sample indices it lacks (or holds twice)."""
        infos = await self._buffer.sample_infos(partition, group_ids)
        if self._meter is not None:
            self._meter.from_buffer(infos)
        by_group: dict[int, list[int]] = {g: [] for g in group_ids}
        for i in infos:
            by_group[i.group_id].append(i.sample_index)
        wrong = {g: sorted(ix) for g, ix in by_group.items() if sorted(ix) != list(range(self._n))}
        if wrong:
            raise RuntimeError(f"buffer partition {partition!r}: groups whose rollouts returned do not hold samples "
                               f"0..{self._n - 1} (group -> sample indices stored): {wrong}")
        return infos

    async def clear(self, partition: str) -> None:
        await self._buffer.clear(partition)

    async def clear_groups(self, partition: str, group_ids: list[int]) -> None:
        await self._buffer.clear(partition, group_ids)


class GatewayProbe:
    """Per-step `perf/inference_concurrency`: the time-average number of requests at the engines
    over the last interval, by Little's law (engine busy seconds summed over turns ÷ wall seconds);
    `perf/kv_cache_usage`: the replicas' mean KV-cache usage (0..1), time-averaged over the
    interval (idle time counts; workers/inference/engine.py KvCacheUsage); from vLLM's scheduler
    stats at the last engine step, summed over replicas: `rollout/engine_running`,
    `rollout/engine_waiting` requests and `rollout/engine_preempted` (cumulative since start)."""

    def __init__(self, gateway: Any, replicas: list[Any] = (), clock=None) -> None:
        import time

        self._gateway = gateway
        self._replicas = replicas  # the run's list: the supervisor replaces dead replicas in place
        self._clock = clock or time.monotonic
        self._last_t = self._clock()
        self._last_busy = 0.0

    async def __call__(self) -> dict[str, float]:
        m = await GatewayClient(self._gateway).metrics()
        now = self._clock()
        dt, busy = now - self._last_t, m.engine_busy_s - self._last_busy
        self._last_t, self._last_busy = now, m.engine_busy_s
        out = {"perf/inference_concurrency": busy / dt if dt > 0 else 0.0,
               "gateway/turns_served": float(m.turns_served), "gateway/turns_fork": float(m.turns_fork),
               "gateway/turns_ill_formed": float(m.turns_ill_formed), "gateway/turns_length": float(m.turns_length),
               "gateway/turns_context_exceeded": float(m.turns_context_exceeded),
               "gateway/turns_healed": float(m.turns_healed), "gateway/turns_nonlinear": float(m.turns_nonlinear),
               "gateway/healed_prefix_tokens": float(m.healed_prefix_tokens)}
        usage = await self._ask(lambda r: r.kv_cache_usage())
        if usage:
            out["perf/kv_cache_usage"] = sum(usage) / len(usage)
        loads = await self._ask(lambda r: r.engine_load())
        if loads:
            out.update({"rollout/engine_running": float(sum(ld.num_running for ld in loads)),
                        "rollout/engine_waiting": float(sum(ld.num_waiting for ld in loads)),
                        "rollout/engine_preempted": float(sum(ld.num_preempted for ld in loads))})
        return out

    async def _ask(self, ask: Callable[[ReplicaClient], Awaitable[T]]) -> list[T]:
        """Every replica's answer to `ask`; a replica that just died is left out."""
        got = await asyncio.gather(*(ask(ReplicaClient(r)) for r in self._replicas), return_exceptions=True)
        for u in got:
            if isinstance(u, BaseException) and not actor_died(u):
                raise u
        return [u for u in got if not isinstance(u, BaseException)]


class EngineLoads:
    """The replicas' vLLM scheduler stats (`InferenceWorker.engine_load`), for the adaptive
    concurrency gate (orchestrator/loop/concurrency.py)."""

    def __init__(self, replicas: list[Any]) -> None:
        self._replicas = list(replicas)

    async def __call__(self) -> list[EngineLoad]:
        return list(await asyncio.gather(*(ReplicaClient(r).engine_load() for r in self._replicas)))
