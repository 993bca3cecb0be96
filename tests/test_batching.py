"""Batching and ledger: every sample lands in exactly one fate; the ledger never double-counts."""

import math
import random

import pytest

from orchestrator.loop.batching import RolloutLedger, assemble, reward_stats, split_groups
from stand_ins import make_sample


def test_failed_and_zero_variance_samples_are_not_trainable():
    samples = [make_sample(0, 0, 1.0), make_sample(0, 1, 0.0), make_sample(0, 2, None, status="failed"),
               make_sample(1, 0, 0.5), make_sample(1, 1, 0.5),  # equal rewards: no GRPO signal
               make_sample(2, 0, 1.0), make_sample(2, 1, None, status="failed")]  # one completed: no baseline
    b = assemble(samples, filter_zero_variance=True)
    assert [g.group_id for g in b.trainable] == [0]
    assert [s.session_id for s in b.trainable[0].samples] == ["s-0-0", "s-0-1"]
    assert {s.session_id for s in b.filtered} == {"s-1-0", "s-1-1", "s-2-0"}
    assert {s.session_id for s in b.failed} == {"s-0-2", "s-2-1"}


def test_zero_variance_groups_kept_when_filter_off():
    b = assemble([make_sample(1, 0, 0.5), make_sample(1, 1, 0.5)], filter_zero_variance=False)
    assert len(b.trainable) == 1 and not b.filtered


def test_randomized_every_sample_has_exactly_one_fate():
    rng = random.Random(0)
    for _ in range(50):
        samples = []
        for g in range(rng.randint(0, 6)):
            for i in range(rng.randint(1, 5)):
                failed = rng.random() < 0.2
                samples.append(make_sample(g, i, None if failed else rng.choice([0.0, 0.5, 1.0]),
                                           status="failed" if failed else "completed"))
        b = assemble(samples, filter_zero_variance=rng.random() < 0.5)
        ids = [s.session_id for g in b.trainable for s in g.samples] + [s.session_id for s in b.filtered] + [
            s.session_id for s in b.failed]
        assert sorted(ids) == sorted(s.session_id for s in samples)
        assert all(s.reward is not None and math.isfinite(s.reward) for g in b.trainable for s in g.samples)


@pytest.mark.parametrize("n_groups,k,sizes", [(8, 1, [8]), (8, 2, [4, 4]), (7, 2, [4, 3]), (2, 4, [1, 1]), (0, 2, [])])
def test_split_groups_whole_groups_near_equal(n_groups, k, sizes):
    b = assemble([make_sample(g, i, float(i)) for g in range(n_groups) for i in range(2)], filter_zero_variance=True)
    chunks = split_groups(b.trainable, k)
    assert [len(c) for c in chunks] == sizes
    assert [g.group_id for c in chunks for g in c] == list(range(n_groups))


def test_ledger_counts_and_refuses_double_close():
    led = RolloutLedger()
    for k in ("a", "b", "c"):
        led.on_dispatched(k)
    led.on_terminal("a", "completed")
    led.on_terminal("b", "failed")
    assert led.open_rollouts() == ["c"]
    assert led.counts()["rollout/open"] == 1  # dispatched == open + terminal at every point
    assert led.settled_counts()["rollout/dispatched"] == 2 and led.settled_counts()["rollout/open"] == 0
    with pytest.raises(ValueError, match="closed without being open"):
        led.on_terminal("a", "filtered")
    with pytest.raises(ValueError, match="dispatched twice"):
        led.on_dispatched("b")
    led.on_terminal("c", "filtered")
    c = led.counts()
    assert c["rollout/dispatched"] == 3 == c["rollout/completed"] + c["rollout/failed"] + c["rollout/filtered"]
    assert c["rollout/open"] == 0


def test_reward_stats_ignores_failed():
    st = reward_stats([make_sample(0, 0, 1.0), make_sample(0, 1, 0.0), make_sample(0, 2, None, status="failed")])
    assert st["reward/mean"] == 0.5 and st["reward/max"] == 1.0
    assert math.isnan(reward_stats([make_sample(0, 0, None, status="failed")])["reward/mean"])
