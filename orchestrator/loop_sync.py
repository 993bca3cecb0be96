"""The sync loop: generate a whole batch, wait for it, train `sync_every` mini-batches, sync weights.

Handed its parts by `main.py` through small protocols, so a simulated engine, pool or trainer can
stand in for the real ones. Invariant: at the end of every step, every rollout dispatched in that
step is closed in the ledger (trained as `completed`, `filtered` or `failed`), the step's buffer
partition is cleared, and the policy version has increased by exactly one.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol

from orchestrator.batching import Group, RolloutLedger, assemble, reward_stats, split_groups
from orchestrator.run_checkpoint import LoopPosition
from workers.core.types import RolloutRequest, Sample


log = logging.getLogger(__name__)


class PromptSource(Protocol):
    def next_rows(self, num: int) -> list[dict]: ...


class Rollouts(Protocol):
    async def run_all(self, reqs: list[RolloutRequest], partition: str) -> list[Any]: ...


class SampleStore(Protocol):
    async def get_groups(self, partition: str, group_ids: list[int]) -> list[Sample]: ...
    async def clear(self, partition: str) -> None: ...
    async def clear_groups(self, partition: str, group_ids: list[int]) -> None: ...


class Trainer(Protocol):
    async def update(self, groups: tuple[Group, ...]) -> dict[str, float]: ...
    async def export_weights(self, version: int) -> str: ...


class WeightPush(Protocol):
    async def push(self, path: str, version: int) -> None: ...


class StepLogger(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...


@dataclass(frozen=True)
class SyncLoopSettings:
    total_steps: int
    batch_size: int  # prompts (groups) per step
    n: int  # samples per prompt
    sync_every: int  # mini-batches (optimizer updates) per step, then one weight sync
    filter_zero_variance: bool


@dataclass
class SyncLoopParts:
    prompts: PromptSource
    rollouts: Rollouts
    store: SampleStore
    trainer: Trainer
    weights: WeightPush
    logger: StepLogger
    ledger: RolloutLedger = field(default_factory=RolloutLedger)
    clock: Callable[[], float] = time.monotonic
    probe: Callable[[], Awaitable[dict[str, float]]] | None = None  # extra per-step metrics (gateway, engine)
    checkpoint: Callable[[LoopPosition], Awaitable[None]] | None = None  # called after every step


@dataclass(frozen=True)
class LoopReport:
    steps: int
    policy_version: int
    counts: dict[str, int]


def ledger_key(s: Sample | Any) -> str:
    return f"g{s.group_id}/s{s.sample_index}"


async def run_sync(parts: SyncLoopParts, cfg: SyncLoopSettings, *, start: LoopPosition | None = None) -> LoopReport:
    """Run sync steps up to `cfg.total_steps` (from `start.step + 1` when resuming from a checkpoint).
    Returns the ledger counts and the final policy version."""
    start = start or LoopPosition(0, 0, 0, 0)
    version, next_group, trained_groups = start.policy_version, start.next_group_id, start.trained_groups
    for step in range(start.step + 1, cfg.total_steps + 1):
        t_step = parts.clock()
        reqs: list[RolloutRequest] = []
        for row in parts.prompts.next_rows(cfg.batch_size):
            for i in range(cfg.n):
                reqs.append(RolloutRequest(group_id=next_group, input_id=str(row["input_id"]), sample_index=i, row=row))
            next_group += 1
        for r in reqs:
            parts.ledger.on_dispatched(ledger_key(r))
        partition = f"step-{step}"

        t0 = parts.clock()
        await parts.rollouts.run_all(reqs, partition)
        samples = await parts.store.get_groups(partition, sorted({r.group_id for r in reqs}))
        t_gen = parts.clock() - t0
        if {ledger_key(s) for s in samples} != {ledger_key(r) for r in reqs}:
            raise RuntimeError(f"step {step}: buffer returned {len(samples)} samples for {len(reqs)} rollouts")

        batch = assemble(samples, filter_zero_variance=cfg.filter_zero_variance)
        if samples and len(batch.failed) == len(samples):  # nothing can ever train: stop instead of looping
            errors = sorted({str(s.error)[:200] for s in batch.failed})
            raise RuntimeError(f"step {step}: all {len(samples)} rollouts failed; errors: {errors[:3]}")
        for s in batch.failed:
            parts.ledger.on_terminal(ledger_key(s), "failed")
            log.warning("rollout %s failed: %s", s.session_id, s.error)
        for s in batch.filtered:
            parts.ledger.on_terminal(ledger_key(s), "filtered")

        t0 = parts.clock()
        update_metrics: list[dict[str, float]] = []
        for chunk in split_groups(batch.trainable, cfg.sync_every):
            update_metrics.append(await parts.trainer.update(chunk))
        for g in batch.trainable:
            for s in g.samples:
                parts.ledger.on_terminal(ledger_key(s), "completed")
        t_update = parts.clock() - t0

        t0 = parts.clock()
        path = await parts.trainer.export_weights(version + 1)
        await parts.weights.push(path, version + 1)
        version += 1
        t_sync = parts.clock() - t0
        await parts.store.clear(partition)
        trained_groups += cfg.batch_size  # every group of the step is consumed (trained, filtered or failed)

        step_s = parts.clock() - t_step
        trained_tokens = sum(m.get("actor/num_tokens", 0.0) for m in update_metrics)
        metrics: dict[str, float] = {
            **reward_stats(samples),
            "perf/throughput": trained_tokens / step_s if step_s > 0 else 0.0,
            "perf/trained_tokens": trained_tokens,
            "timing_s/gen": t_gen,
            "timing_s/update_actor": t_update,
            "timing_s/update_weights": t_sync,
            "timing_s/step": step_s,
            "rollout/step_completed": float(sum(len(g.samples) for g in batch.trainable)),
            "rollout/step_failed": float(len(batch.failed)),
            "rollout/step_filtered": float(len(batch.filtered)),
            "policy_version": float(version),
            **{k: float(v) for k, v in parts.ledger.counts().items()},
        }
        metrics.update(mean_update_metrics(update_metrics))
        # the short name of verl's `rollout_corr/rollout_is_mean` (mean TIS weight over trained tokens)
        metrics["rollout_corr/is_mean"] = metrics.get("rollout_corr/rollout_is_mean", math.nan)
        latencies = sorted(s.latency_s for s in samples)
        if latencies:
            metrics["rollout/latency_s_p50"] = latencies[len(latencies) // 2]
            metrics["rollout/latency_s_max"] = latencies[-1]
        if parts.probe is not None:
            metrics.update(await parts.probe())
        parts.logger.log(step, metrics)
        if parts.checkpoint is not None:
            await parts.checkpoint(LoopPosition(step, version, next_group, trained_groups))
    if parts.ledger.open_rollouts():
        raise RuntimeError(f"rollouts left open after the loop: {parts.ledger.open_rollouts()[:5]}")
    return LoopReport(steps=cfg.total_steps, policy_version=version, counts=parts.ledger.counts())


def mean_update_metrics(updates: list[dict[str, float]]) -> dict[str, float]:
    """Average each trainer metric over the step's mini-batches (`actor/num_tokens` is summed)."""
    keys = {k for m in updates for k in m}
    out = {}
    for k in sorted(keys):
        vals = [m[k] for m in updates if k in m]
        out[k] = sum(vals) if k == "actor/num_tokens" else sum(vals) / len(vals)
    return out
