"""The sync loop: generate a whole batch, wait for it, train `sync_every` mini-batches, sync weights.

Handed its `LoopParts` (orchestrator/loop/common.py) through small protocols, so a simulated engine, pool or trainer can
stand in for the real ones. Invariant: at the end of every step, every rollout dispatched in that
step is closed in the ledger (trained as `completed`, `filtered` or `failed`), the step's buffer
partition is cleared, and the policy version has increased by exactly one when the step trained a
group (a step with nothing to train neither updates nor syncs weights: the version stays); the loop
holds only the samples' metadata, the results the rollout pool returned, and the trainer
ranks read the rows of each update's train order themselves; a step in
which every rollout failed ends the run there (`LoopReport.stopped` says why: nothing could ever
train). Validation (`parts.validator`) runs at the step boundary on the weights just synced, and
before the first step (logged as step 0) with `trainer.val_before_train`.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.loop.batching import assemble, split_groups, train_order
from orchestrator.loop.common import (LoopParts, LoopPosition, LoopReport, close_trained, close_untrained, dispatch_group,
                                       end_step, finish, report_groups, run_rollouts, step_metrics, start_position,
                                       sync_weights)
from workers.core.types import RolloutRequest


@dataclass(frozen=True)
class SyncLoopSettings:
    total_steps: int
    batch_size: int  # prompts (groups) per step
    n: int  # samples per prompt
    sync_every: int  # mini-batches (optimizer updates) per step, then one weight sync
    filter_zero_variance: bool


async def run_sync(parts: LoopParts, cfg: SyncLoopSettings, *, start: LoopPosition | None = None) -> LoopReport:
    """Run sync steps up to `cfg.total_steps` (from `start.step + 1` when resuming from a checkpoint).
    Returns the ledger counts and the final policy version."""
    start = start_position(parts, start)
    version, next_group, trained_groups = parts.weights.version(), start.next_group_id, start.trained_groups
    if parts.validator is not None and start.step == 0 and parts.validator.due(0, cfg.total_steps):
        parts.logger.log(0, await parts.validator.run(version))
    for step in range(start.step + 1, cfg.total_steps + 1):
        t_step = parts.clock()
        reqs: list[RolloutRequest] = []
        for row in parts.prompts.next_rows(cfg.batch_size):
            reqs += dispatch_group(parts.ledger, row, next_group, cfg.n)
            next_group += 1
        partition = f"step-{step}"

        t0 = parts.clock()
        samples = await run_rollouts(parts, reqs, partition)
        t_gen = parts.clock() - t0

        report_groups(parts.prompts, samples)
        batch = assemble(samples, filter_zero_variance=cfg.filter_zero_variance)
        close_untrained(parts.ledger, batch)
        stopped = parts.first_rollouts.observe(samples) if parts.first_rollouts is not None else None
        if stopped is None and samples and len(batch.failed) == len(samples):  # nothing can ever train: end after this step
            errors = sorted({str(s.error)[:200] for s in batch.failed})
            stopped = (f"step {step}: all {len(samples)} rollouts failed ({len(errors)} distinct error(s); "
                       f"e.g. {errors[0][:160]})")

        t0 = parts.clock()
        updates = [await parts.trainer.update(train_order(partition, chunk))
                   for chunk in split_groups(batch.trainable, cfg.sync_every)]
        close_trained(parts.ledger, batch.trainable)
        t_update = parts.clock() - t0

        t0 = parts.clock()
        if updates:  # a step with nothing to train (all filtered) has no new weights: the version stays
            version = await sync_weights(parts)
        t_sync = parts.clock() - t0
        await parts.store.clear(partition)
        trained_groups += cfg.batch_size  # every group of the step is consumed (trained, filtered or failed)

        metrics = step_metrics(parts, samples=samples, updates=updates, t_gen=t_gen, t_update=t_update,
                               t_sync=t_sync, step_s=parts.clock() - t_step, version=version,
                               trained=[s for g in batch.trainable for s in g.samples])
        metrics.update({"rollout/step_completed": float(sum(len(g.samples) for g in batch.trainable)),
                        "rollout/step_failed": float(len(batch.failed)),
                        "rollout/step_filtered": float(len(batch.filtered)),
                        "rollout/step_dropped": float(len(batch.dropped))})
        if parts.validator is not None and parts.validator.due(step, cfg.total_steps):
            metrics.update(await parts.validator.run(version))
        position = LoopPosition(step, version, next_group, trained_groups)  # nothing runs beside a sync step
        await end_step(parts, step, metrics, lambda: position)
        if stopped is not None:
            return finish(parts, step, version, stopped=stopped)
    return finish(parts, cfg.total_steps, version)
