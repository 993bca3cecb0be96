"""The fate of the rollouts of a dead rollout actor (workers/rollout/recovery.py), pure logic."""

from __future__ import annotations

import itertools

import pytest

from workers.core.types import RolloutRequest
from workers.rollout.recovery import Attempt, plan_lost


def _attempts(n: int, number: int = 0) -> list[Attempt]:
    return [Attempt(RolloutRequest(group_id=i // 2, input_id=f"row-{i // 2}", sample_index=i % 2), f"s{i}", number)
            for i in range(n)]


def _fresh():
    counter = itertools.count()
    return lambda r: f"new-g{r.group_id}-s{r.sample_index}-{next(counter)}"


def test_each_lost_attempt_lands_in_exactly_one_fate():
    lost = _attempts(6)
    plan = plan_lost(lost, stored={"s1", "s4"}, max_redispatch=1, new_session_id=_fresh())
    assert [a.session_id for a in plan.settled] == ["s1", "s4"]  # stored before the death: outcome stands
    # the other 4 run again, in order, as attempt 1 under fresh session ids
    assert [(a.req.group_id, a.req.sample_index, a.number) for a in plan.redispatch] == [
        (0, 0, 1), (1, 0, 1), (1, 1, 1), (2, 1, 1)]
    assert all(a.session_id.startswith("new-") for a in plan.redispatch)
    assert plan.failed == ()
    assert plan.to_stop == ("s0", "s1", "s2", "s3", "s4", "s5")  # stored ones too: stored before stopped


def test_a_second_loss_fails_the_rollout_actor_lost_instead_of_running_it_a_third_time():
    lost = _attempts(3, number=1)  # already re-dispatched once
    plan = plan_lost(lost, stored={"s2"}, max_redispatch=1, new_session_id=_fresh())
    assert [a.session_id for a in plan.failed] == ["s0", "s1"]
    assert [a.session_id for a in plan.settled] == ["s2"]
    assert plan.redispatch == ()


def test_no_redispatch_fails_at_once():
    plan = plan_lost(_attempts(2), stored=set(), max_redispatch=0, new_session_id=_fresh())
    assert [a.session_id for a in plan.failed] == ["s0", "s1"]


def test_randomized_partition_is_exact():
    import random

    rng = random.Random(3)
    for _ in range(200):
        n = rng.randint(0, 12)
        lost = [Attempt(a.req, a.session_id, rng.randint(0, 2)) for a in _attempts(n)]
        stored = {a.session_id for a in lost if rng.random() < 0.3}
        k = rng.randint(0, 2)
        plan = plan_lost(lost, stored, max_redispatch=k, new_session_id=_fresh())
        keys = lambda xs: sorted((a.req.group_id, a.req.sample_index) for a in xs)  # noqa: E731
        assert keys([*plan.settled, *plan.redispatch, *plan.failed]) == keys(lost)
        assert all(a.number <= k for a in plan.redispatch)
        assert all(a.session_id not in stored for a in [*plan.failed])


def test_bad_input_raises():
    with pytest.raises(ValueError, match="redispatch_lost"):
        plan_lost([], set(), max_redispatch=-1, new_session_id=_fresh())
    a = _attempts(1)[0]
    with pytest.raises(ValueError, match="twice"):
        plan_lost([a, a], set(), max_redispatch=1, new_session_id=_fresh())
