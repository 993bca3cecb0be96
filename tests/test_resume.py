"""Resume from a checkpoint, at the loop seam: the async loop we ship, with simulated parts.

Regression (async RL bug reports): after a resume the staleness counters must restart from the
restored policy version, not from zero, or the producer admits (η + v + 1)·G groups at once.
And no prompt may be lost: groups in flight at the checkpoint are dispatched again first.
"""

import asyncio
import json
import random

import pytest

from orchestrator.loop.batching import RolloutLedger
from orchestrator.control.checkpoint import load_latest
from orchestrator.loop.async_loop import AsyncLoopSettings, run_async
from orchestrator.loop.common import LoopParts
from orchestrator.loop.prompts import PromptCycle
from orchestrator.control.run_checkpoint import LoopPosition, ResumablePrompts, position_of, RunCheckpointer
from stand_ins import (FileTrainer, ListLogger, MemoryStore, RecordingTrainer, SimReplica, SimRollouts,
                       alternating_reward)

ROWS = [{"input_id": f"p{i}", "prompt": "x"} for i in range(40)]
ETA, B = 1, 2


class BoundCheckingRollouts(SimRollouts):
    """Records, at every dispatch, the groups admitted so far against the engine's version."""

    def __init__(self, *a, trained_before: int = 0, **kw):
        super().__init__(*a, **kw)
        self.groups_seen: set[int] = set()
        self.trained_before = trained_before
        self.peak_excess = -10**9  # max over dispatches of admitted - (η + v + 1)·B
        self.first_rows: list[str] = []

    def _returned_groups(self) -> int:
        """Groups that ended without training (filtered, failed, expired): capacity given back."""
        closed = self.ledger._closed
        return sum(1 for g in self.groups_seen
                   if all(f"g{g}/s{i}" in closed for i in range(4))
                   and not any(closed[f"g{g}/s{i}"] == "completed" for i in range(4)))

    async def run_all(self, reqs, partition):
        gid = reqs[0].group_id
        if gid not in self.groups_seen:
            self.groups_seen.add(gid)
            self.first_rows.append(reqs[0].input_id)
            admitted = self.trained_before + len(self.groups_seen) - self._returned_groups()
            self.peak_excess = max(self.peak_excess, admitted - (ETA + self.engine.served + 1) * B)
        return await super().run_all(reqs, partition)


def build(prompts, engine_version=0, trained_before=0, seed=0):
    store, engine = MemoryStore(), SimReplica(engine_version)
    rollouts = BoundCheckingRollouts(store, engine, random.Random(seed), alternating_reward, 0.03,
                                     trained_before=trained_before)
    trainer, logger = RecordingTrainer(engine, store), ListLogger()
    parts = LoopParts(prompts=prompts, rollouts=rollouts, store=store, trainer=trainer, weights=engine,
                      logger=logger, ledger=RolloutLedger())
    rollouts.ledger = parts.ledger
    return parts, trainer, rollouts


def settings(total_steps):
    return AsyncLoopSettings(total_steps=total_steps, groups_per_update=B, n=4, sync_every=1, max_staleness=ETA,
                             on_stale="drop", filter_zero_variance=True, drain_timeout_s=10)


async def test_resume_keeps_the_staleness_bound_and_dispatches_pending_rows_first(tmp_path):
    prompts = ResumablePrompts(PromptCycle(ROWS, seed=5))
    parts, _, _ = build(prompts)
    ckpt = RunCheckpointer(tmp_path, FileTrainer(), prompts, save_freq=3, keep_last=2)
    positions: list[LoopPosition] = []

    async def hook(pos):
        positions.append(pos)
        await ckpt(pos)

    parts.checkpoint = hook
    # the checkpoint at step 3 is not the run's last step: a run's end admits nothing it cannot
    # train (issue 26), so only a checkpoint mid-run has groups in flight
    await asyncio.wait_for(run_async(parts, settings(total_steps=4)), timeout=60)
    assert [p.step for p in positions] == [1, 2, 3, 4] and len(ckpt.saved) == 1
    saved = load_latest(tmp_path)
    assert saved is not None and saved.state.step == 3 and saved.state.policy_version == 3
    assert saved.state.admission.trained_groups == 3 * B
    assert saved.state.pending_rows, "groups were in flight at the checkpoint (the producer runs ahead)"

    start = position_of(saved.state)
    resumed_prompts = ResumablePrompts.restore(ROWS, seed=999, state=saved.state)
    parts2, trainer2, rollouts2 = build(resumed_prompts, engine_version=3, trained_before=start.trained_groups,
                                        seed=1)
    report = await asyncio.wait_for(run_async(parts2, settings(total_steps=7), start=start), timeout=60)

    assert report.policy_version == 7
    pending_ids = [r["input_id"] for r in saved.state.pending_rows]
    assert rollouts2.first_rows[:len(pending_ids)] == pending_ids  # no prompt lost
    expected_next = PromptCycle.from_state(ROWS, saved.state.prompts).next_rows(3)
    assert rollouts2.first_rows[len(pending_ids):len(pending_ids) + 3] == [r["input_id"] for r in expected_next]
    # counters re-seeded from the restored version: never more than (η + v + 1)·B groups admitted
    assert rollouts2.peak_excess <= 0
    assert min(g for g in rollouts2.groups_seen) == start.next_group_id  # group ids continue, none reused
    assert trainer2.trained and all(v - s.version_range()[0] <= ETA for v, s in trainer2.trained)


async def test_counters_seeded_from_zero_would_break_the_bound():
    """The check above can fail: a resumed controller that forgets the trained groups (the bug)
    admits (η + v + 1)·B groups at version v straight away."""
    prompts = ResumablePrompts(PromptCycle(ROWS, seed=5))
    parts, _, rollouts = build(prompts, engine_version=5, trained_before=5 * B)
    buggy = LoopPosition(step=5, policy_version=5, next_group_id=100, trained_groups=0)
    await asyncio.wait_for(run_async(parts, settings(total_steps=6), start=buggy), timeout=60)
    assert rollouts.peak_excess > 0


def test_resumable_prompts_hand_out_pending_rows_then_the_cycle():
    cycle = PromptCycle(ROWS, seed=2)
    expected = PromptCycle.from_state(ROWS, cycle.state()).next_rows(3)
    p = ResumablePrompts(cycle, pending=({"input_id": "left-over"},))
    assert [r["input_id"] for r in p.next_rows(4)] == ["left-over"] + [r["input_id"] for r in expected]
    state, undrawn = p.snapshot()
    assert undrawn == () and state == cycle.state()


def test_a_changed_dataset_is_refused_on_resume(tmp_path):
    prompts = ResumablePrompts(PromptCycle(ROWS, seed=5))
    prompts.next_rows(2)
    state, _ = prompts.snapshot()

    class Saved:
        pass

    saved = Saved()
    saved.prompts, saved.pending_rows = state, ()
    with pytest.raises(ValueError, match="dataset changed"):
        ResumablePrompts.restore(ROWS[:-1], seed=0, state=saved)


async def test_rows_drawn_while_the_step_end_awaits_are_pending_or_ahead_of_the_cursor(tmp_path):
    """Regression (issue 14, scripts/chaos.py: an async run resumed after a trainer kill never
    trained 2 prompts): the loop read its pending rows before the step's probe awaited, the
    checkpoint read the prompt cursor after it; rows the producer drew in between were neither
    pending nor ahead of the cursor, so a resume skipped them. Across the checkpoint, consumed +
    pending rows must be exactly the cycle's order up to its cursor."""
    prompts = ResumablePrompts(PromptCycle(ROWS, seed=5))
    parts, _, _ = build(prompts)
    ckpt = RunCheckpointer(tmp_path, FileTrainer(), prompts, save_freq=3, keep_last=2)
    parts.checkpoint = ckpt

    async def slow_probe():  # the gateway probe: the producer runs meanwhile (the version just moved)
        await asyncio.sleep(0.2)
        return {}

    parts.probe = slow_probe
    await asyncio.wait_for(run_async(parts, settings(total_steps=3)), timeout=60)
    state = load_latest(tmp_path).state
    consumed = [i for line in (tmp_path / "consumed_prompts.jsonl").read_text().splitlines()
                for i in json.loads(line)["input_ids"]]
    pending = [r["input_id"] for r in state.pending_rows]
    cursor = len(consumed) + len(pending)
    order = [r["input_id"] for r in PromptCycle(ROWS, seed=5).next_rows(cursor + 1)]
    assert sorted(consumed + pending) == sorted(order[:cursor])  # none skipped, none twice
    assert PromptCycle.from_state(ROWS, state.prompts).next_rows(1)[0]["input_id"] == order[cursor]
