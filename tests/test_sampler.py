"""The difficulty-aware prompt sampler (orchestrator/loop/sampler.py): pure logic, resume, and both
shipped loops driven with simulated parts (no models, no Ray)."""

import asyncio
import dataclasses
import json
import math
import random

import pytest
from hypothesis import given, settings as hsettings, strategies as st

from orchestrator.loop.batching import RolloutLedger
from orchestrator.control.checkpoint import RunState, load_latest
from orchestrator.loop.async_loop import AsyncLoopSettings, run_async
from orchestrator.loop.common import LoopParts
from orchestrator.loop.sync_loop import SyncLoopSettings, run_sync
from orchestrator.loop.prompts import PromptCycle
from orchestrator.control.run_checkpoint import LoopPosition, ResumablePrompts, position_of, RunCheckpointer
from orchestrator.loop.sampler import DifficultySampler, SamplerSettings, group_outcome
from orchestrator.loop.staleness import AdmissionState
from stand_ins import FileTrainer, ListLogger, MemoryStore, RecordingTrainer, SimReplica, SimRollouts

ROWS = [{"input_id": f"p{i}", "prompt": f"x{i}"} for i in range(40)]


def teaching(input_id: str) -> bool:
    """Even prompts teach (rewards differ within a group); odd ones are solved (all 1.0)."""
    return int(input_id[1:]) % 2 == 0


def sim_rewards(input_id: str, n: int = 4) -> list[float]:
    return [float(i % 2) for i in range(n)] if teaching(input_id) else [1.0] * n


def drive(sampler: DifficultySampler, draws: int) -> list[str]:
    """Draw one prompt at a time and feed its simulated group straight back."""
    out = []
    for _ in range(draws):
        (row,) = sampler.next_rows(1)
        sampler.on_group_rewards(row["input_id"], sim_rewards(row["input_id"]))
        out.append(row["input_id"])
    return out


def test_group_outcome_matches_the_zero_variance_filter():
    assert group_outcome([1.0, 1.0, 1.0]) == (1.0, False)
    assert group_outcome([0.5, 0.5]) == (0.5, False)  # partial credit, all equal: no signal
    assert group_outcome([0.0, 1.0]) == (0.5, True)
    assert group_outcome([0.7]) == (0.7, False)  # one sample cannot form a baseline


def test_sampler_learns_to_draw_teaching_prompts_and_counts_skipped_easy():
    s = DifficultySampler(ROWS, seed=3)
    drive(s, 200)
    late = drive(s, 200)
    share = sum(teaching(i) for i in late) / len(late)
    assert share > 0.8  # uniform would be 0.5
    p = s.probabilities()
    assert min(p) >= s.settings.floor / len(ROWS) - 1e-12 and math.isclose(sum(p), 1.0)
    m = s.take_metrics()
    assert m["sampler/skipped_easy"] >= 15 and m["sampler/skipped_hard"] == 0
    assert 0.0 < m["sampler/entropy"] < 1.0
    # importance weighting recovers the uniform-draw mean reward (0.5·0.5 + 0.5·1.0) from skewed draws
    assert m["sampler/reward_uniform"] == pytest.approx(0.75, abs=0.1)


def test_rows_with_the_same_prompt_share_one_history():
    rows = [{"input_id": "a", "prompt": "same"}, {"input_id": "b", "prompt": "same"},
            {"input_id": "c", "prompt": "other"}]
    s = DifficultySampler(rows, seed=0)
    s.next_rows(2)
    s.on_group_rewards("a", [1.0, 1.0, 1.0, 1.0])  # "a" tied: "b" is the same prompt, so it drops too
    s.on_group_rewards("c", [0.0, 1.0, 0.0, 1.0])
    p = s.probabilities()
    assert p[0] == p[1] < p[2]
    assert s.take_metrics()["sampler/skipped_easy"] == 1.0  # one prompt, two rows


def test_restore_refuses_a_state_with_history_per_row():
    state = DifficultySampler(ROWS, seed=0).state()
    del state["history_by"]
    with pytest.raises(ValueError, match="per row"):
        DifficultySampler.from_state(ROWS, state)


def test_hard_prompts_are_counted_as_skipped_hard():
    s = DifficultySampler(ROWS[:2], seed=0)
    s.next_rows(2)
    s.on_group_rewards("p0", [0.0, 0.0, 0.0])
    s.on_group_rewards("p1", [0.2, 0.9, 0.9])
    assert s.take_metrics()["sampler/skipped_hard"] == 1.0


def test_draw_sequence_after_save_and_restore_equals_the_uninterrupted_one():
    a = DifficultySampler(ROWS, seed=7)
    drive(a, 50)
    a.next_rows(3)  # three groups in flight at the save: their draw probabilities are state too
    saved = json.loads(json.dumps(a.state()))
    b = DifficultySampler.from_state(ROWS, saved)
    for s in (a, b):
        for pid in ("p0", "p1", "p2"):
            s.on_group_rewards(pid, sim_rewards(pid))
    assert drive(a, 100) == drive(b, 100)
    assert a.state() == b.state()


def test_restore_refuses_other_rows():
    state = DifficultySampler(ROWS, seed=0).state()
    with pytest.raises(ValueError, match="dataset changed"):
        DifficultySampler.from_state(ROWS[:-1], state)


def test_run_state_round_trips_the_sampler_state_and_resume_refuses_the_other_sampler():
    s = DifficultySampler(ROWS, seed=1)
    drive(s, 20)
    state = RunState(step=2, policy_version=2, next_group_id=20, prompts=s.state(),
                     admission=AdmissionState(2, 16), pending_rows=(ROWS[0],))
    back = RunState.from_json(json.loads(json.dumps(state.to_json())))
    resumed = ResumablePrompts.restore(ROWS, 0, back, SamplerSettings())
    assert resumed.next_rows(1) == [ROWS[0]]  # pending first
    assert resumed.next_rows(5) == DifficultySampler.from_state(ROWS, s.state()).next_rows(5)
    with pytest.raises(ValueError, match="task.sampler=difficulty"):
        ResumablePrompts.restore(ROWS, 0, back, None)


@hsettings(max_examples=60, deadline=None)
@given(num_rows=st.integers(1, 30), floor=st.floats(1e-4, 1.0), sharpness=st.floats(0.1, 8.0),
       prior=st.floats(0.01, 10.0), window=st.integers(1, 6),
       feedback=st.lists(st.tuples(st.integers(0, 29), st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0]),
                                                                 max_size=6)), max_size=80))
def test_every_prompt_keeps_a_non_zero_probability(num_rows, floor, sharpness, prior, window, feedback):
    rows = [{"input_id": f"r{i}", "prompt": f"q{i % 7}"} for i in range(num_rows)]  # some share content
    s = DifficultySampler(rows, seed=0, settings=SamplerSettings(floor, window, prior, sharpness))
    for idx, rewards in feedback:
        s.next_rows(1)
        s.on_group_rewards(f"r{idx % num_rows}", rewards)
        p = s.probabilities()
        assert all(x >= floor / num_rows * (1 - 1e-9) for x in p)
        assert math.isclose(sum(p), 1.0, rel_tol=1e-9)


def test_prompt_cycle_ignores_feedback():
    c = PromptCycle(ROWS, seed=0)
    c.on_group_rewards("p0", [1.0, 1.0])
    assert c.take_metrics() == {} and c.next_rows(3) == PromptCycle(ROWS, seed=0).next_rows(3)


def sim_parts(prompts, engine_version=0):
    store, engine = MemoryStore(), SimReplica(engine_version)
    rollouts = SimRollouts(store, engine, random.Random(0),
                           lambda r: float(r.sample_index % 2) if teaching(r.input_id) else 1.0, 0.005)
    return LoopParts(prompts=prompts, rollouts=rollouts, store=store, trainer=RecordingTrainer(engine, store),
                     weights=engine, logger=ListLogger(), ledger=RolloutLedger())


def filtered_fraction(parts) -> float:
    c = parts.ledger.counts()
    return c["rollout/filtered"] / c["rollout/dispatched"]


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_difficulty_sampler_filters_fewer_rollouts_than_uniform_through_the_loop(mode):
    async def run(prompts):
        parts = sim_parts(prompts)
        if mode == "sync":
            await run_sync(parts, SyncLoopSettings(total_steps=30, batch_size=4, n=4, sync_every=1,
                                                   filter_zero_variance=True))
        else:
            await asyncio.wait_for(run_async(parts, AsyncLoopSettings(
                total_steps=30, groups_per_update=4, n=4, sync_every=1, max_staleness=1, on_stale="drop",
                filter_zero_variance=True, drain_timeout_s=10)), timeout=60)
        return parts

    uniform = await run(PromptCycle(ROWS, seed=0))
    difficulty = await run(DifficultySampler(ROWS, seed=0))
    assert filtered_fraction(uniform) > 0.35  # half the prompts never teach
    assert filtered_fraction(difficulty) < 0.3  # uniform: about 0.5
    m = difficulty.logger.steps[-1][1]
    for key in ("sampler/entropy", "sampler/skipped_easy", "sampler/skipped_hard", "sampler/reward_uniform"):
        assert key in m, key
    assert m["sampler/skipped_easy"] > 0
    assert "sampler/entropy" not in uniform.logger.steps[-1][1]
    c = difficulty.ledger.counts()
    assert c["rollout/trained_groups"] * 4 <= c["rollout/completed"] + c["rollout/expired"]


async def test_async_run_checkpoints_the_sampler_and_a_resume_continues_from_it(tmp_path):
    prompts = ResumablePrompts(DifficultySampler(ROWS, seed=4))
    parts = sim_parts(prompts)
    parts.checkpoint = RunCheckpointer(tmp_path, FileTrainer(), prompts, save_freq=3, keep_last=1)
    run = AsyncLoopSettings(total_steps=3, groups_per_update=4, n=4, sync_every=1, max_staleness=1, on_stale="drop",
                            filter_zero_variance=True, drain_timeout_s=10)
    await asyncio.wait_for(run_async(parts, run), timeout=60)
    saved = load_latest(tmp_path)
    assert saved is not None and saved.state.prompts["kind"] == "difficulty" and saved.state.prompts["history"]

    resumed = ResumablePrompts.restore(ROWS, seed=999, state=saved.state, sampler=SamplerSettings())
    pending = len(saved.state.pending_rows)
    assert resumed.next_rows(pending) == list(saved.state.pending_rows)
    assert resumed.next_rows(5) == DifficultySampler.from_state(ROWS, saved.state.prompts).next_rows(5)
    parts2 = sim_parts(ResumablePrompts.restore(ROWS, seed=999, state=saved.state, sampler=SamplerSettings()),
                       engine_version=saved.state.policy_version)
    report = await asyncio.wait_for(run_async(parts2, dataclasses.replace(run, total_steps=6),
                                              start=position_of(saved.state)), timeout=60)
    assert report.policy_version == 6 and not parts2.ledger.open_rollouts()
