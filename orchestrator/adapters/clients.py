"""Driver-side clients of the actors: the trainer client, the sample store, the gateway probe.

Each turns a loop protocol call into calls on the actors (or any object with the same methods),
so the loop never sees Ray. The driver is a control plane: it handles metadata, never a token.
Invariants: `TrainerClient.update` sends a train order (keys, groups, rewards; the trainer ranks
read the rows from the trajectory buffer themselves, with the buffer handle, pad id and advantage
setting they got once at start) and nothing when no row is to be trained; `BufferStore` clears
by the keys the rollout results carry, never listing a partition. `DriverBytes` measures the
first claim per step: everything the driver received through Ray and from TransferQueue
(`driver/bytes_from_ray`, `driver/bytes_from_buffer`), per rollout returned.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, TypeVar

from workers.buffer.codec import stored_keys
from workers.core.calls import ByteMeter, actor_died
from workers.core.types import EngineLoad, RolloutRequest, RolloutResult, SampleInfo, TrainOrder
from workers.gateway.client import GatewayClient
from workers.inference.client import ReplicaClient

T = TypeVar("T")


class DriverBytes:
    """What the driver received per step, metered at its clients: `ray` counts every Ray call result
    (workers/core/calls.py `meter_ray_results`: rollout results, trainer metrics, probes, weight-sync
    reports), `buffer` every TransferQueue answer (`TrajectoryBuffer.meter_received`). Per step:
    `driver/bytes_from_ray`, `driver/bytes_from_buffer`, `driver/rollouts_returned` (rollout results
    the pools returned, `MeteredRollouts`) and `driver/bytes_per_rollout`: all the bytes over those
    rollouts (0 in a step that returned none)."""

    def __init__(self) -> None:
        self.ray, self.buffer = ByteMeter(), ByteMeter()
        self._returned = 0

    def on_returned(self, count: int) -> None:
        self._returned += count

    async def __call__(self) -> dict[str, float]:
        """The step's counts (then reset)."""
        (ray_b, _), (tq_b, _) = self.ray.take(), self.buffer.take()
        out = {"driver/bytes_from_ray": float(ray_b), "driver/bytes_from_buffer": float(tq_b),
               "driver/rollouts_returned": float(self._returned),
               "driver/bytes_per_rollout": (ray_b + tq_b) / self._returned if self._returned else 0.0}
        self._returned = 0
        return out


class MeteredRollouts:
    """The loop's Rollouts over a rollout pool, counting the results `run_all` returns (`DriverBytes`)."""

    def __init__(self, pool: Any, meter: DriverBytes) -> None:
        self._pool, self._meter = pool, meter

    async def run_all(self, reqs: list[RolloutRequest], partition: str) -> list[RolloutResult]:
        results = await self._pool.run_all(reqs, partition)
        self._meter.on_returned(len(results))
        return results


class TrainerClient:
    """Loop-facing trainer: hands a train order to the trainer (a TrainerGroup: its ranks read their
    own rows, with the `OrderData` they were given once at start: `TrainerGroup.open_data`)."""

    def __init__(self, trainer: Any) -> None:
        self._trainer = trainer

    async def update(self, order: TrainOrder) -> dict[str, float]:
        """One optimizer step on `order`; no step when no row is to be trained (all masked). Adds
        `trainer/rows_ordered` (rows the order asked the ranks to read; the ranks report
        `trainer/rows_read`) to the trainer's metrics."""
        if not order.num_rows:
            return {"actor/num_tokens": 0.0, "perf/total_num_tokens": 0.0, "actor/step_skipped": 1.0,
                    "trainer/rows_ordered": 0.0, "trainer/rows_read": 0.0}
        return await self._trainer.update(order) | {"trainer/rows_ordered": float(order.num_rows)}


class BufferStore:
    """The loop's SampleStore over a TrajectoryBuffer: clears samples by the keys their results
    carry (`codec.stored_keys`: no listing), or a whole partition."""

    def __init__(self, buffer: Any) -> None:
        self._buffer = buffer

    async def clear(self, partition: str) -> None:
        await self._buffer.clear(partition)

    async def clear_samples(self, partition: str, samples: list[SampleInfo]) -> None:
        await self._buffer.clear_keys(partition, [k for s in samples for k in stored_keys(s)])


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
