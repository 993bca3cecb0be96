"""Driver-side clients of the actors: the trainer client, the sample store, the gateway probe.

Each turns a loop protocol call into calls on Ray actor handles (or any object with the same
methods), so the loop never sees Ray. Invariant of `TrainerClient.update`: the batch it sends holds
exactly the rows of the given groups, each row carrying its sample's GRPO advantage.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, TypeVar

import torch

from workers.core.algorithms.advantages import grpo_outcome_advantages
from workers.core.algorithms.batch import SampleTable, TrainBatch
from workers.core.calls import actor_died
from workers.core.types import EngineLoad
from workers.gateway.client import GatewayClient
from workers.inference.client import ReplicaClient
from orchestrator.loop.batching import Group

T = TypeVar("T")


def build_train_batch(groups: tuple[Group, ...], *, pad_id: int, norm_adv_by_std: bool) -> TrainBatch:
    """Rows of every sample in `groups`, each with its sample's GRPO advantage ([rows, seq] tensors).

    The batch carries a SampleTable (group and reward of every sample, row -> sample) so the trainer
    can recompute group advantages when rejection masks exclude a sample (algorithms/rejection.py).
    """
    samples = [s for g in groups for s in g.samples]
    rewards = torch.tensor([float(s.reward) for s in samples], dtype=torch.float32)  # type: ignore[arg-type]
    group_ids = [s.group_id for s in samples]
    adv = grpo_outcome_advantages(rewards, group_ids, norm_adv_by_std=norm_adv_by_std)
    rows, row_adv, row_sample = [], [], []
    for i, (s, a) in enumerate(zip(samples, adv.tolist())):
        for r in s.rows:
            if r.num_generated > 0:
                rows.append(r)
                row_adv.append(a)
                row_sample.append(i)
    table = SampleTable(group_index=torch.tensor(group_ids, dtype=torch.long), rewards=rewards,
                        row_sample=torch.tensor(row_sample, dtype=torch.long), norm_adv_by_std=norm_adv_by_std)
    return TrainBatch.from_rows(rows, row_adv, pad_id=pad_id, samples=table)


def total_num_tokens(groups: tuple[Group, ...]) -> int:
    """Every token (prompt, environment and generated) of the samples in `groups` that train on at
    least one token: a trained batch's sequence tokens before padding, as verl counts
    `perf/total_num_tokens` (the attention mask's sum; its `perf/throughput` divides it by the step's
    seconds and GPUs). A sample whose tokens are all loss-masked (stale, kept masked) trains
    nothing and is not counted."""
    return sum(len(r.token_ids) for g in groups for s in g.samples if any(r.num_generated for r in s.rows)
               for r in s.rows)


class TrainerClient:
    """Loop-facing trainer: builds the batch on the driver, updates on the trainer actor."""

    def __init__(self, actor: Any, *, pad_id: int, norm_adv_by_std: bool) -> None:
        self._actor = actor
        self._pad_id = pad_id
        self._norm = norm_adv_by_std

    async def update(self, groups: tuple[Group, ...]) -> dict[str, float]:
        """One optimizer step on `groups`; no step when no token is trainable (all masked). Adds
        `perf/total_num_tokens` (`total_num_tokens`) to the trainer's metrics."""
        if not any(r.num_generated for g in groups for s in g.samples for r in s.rows):
            return {"actor/num_tokens": 0.0, "perf/total_num_tokens": 0.0, "actor/step_skipped": 1.0}
        batch = build_train_batch(groups, pad_id=self._pad_id, norm_adv_by_std=self._norm)
        return await self._actor.update.remote(batch) | {"perf/total_num_tokens": float(total_num_tokens(groups))}


class BufferStore:
    """The loop's SampleStore over a TrajectoryBuffer: waits until each group is whole."""

    def __init__(self, buffer: Any, group_size: int, timeout_s: float) -> None:
        self._buffer = buffer
        self._n = group_size
        self._timeout_s = timeout_s

    async def get_groups(self, partition: str, group_ids: list[int]) -> list:
        return await self._buffer.get_groups(partition, group_ids, group_size=self._n, timeout_s=self._timeout_s)

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
