"""Pure tests of the gateway's trajectory capture (workers/gateway/capture.py) and replica router.

No HTTP, no tokenizer: turns are built from plain id lists with `result(...)`.
"""

from __future__ import annotations

import random

import pytest

from workers.core.types import PROMPT_VERSION, GenerateResult
from workers.gateway.capture import (
    CaptureStore,
    SamplingDefaults,
    SessionClosed,
    SessionExists,
    SessionNotFound,
    TurnKind,
    TurnLimitExceeded,
    Unauthorized,
)
from workers.gateway.router import NoReplicas, ReplicaRouter

SID = "session-" + "a" * 40  # ACR session ids are 33-256 chars


def result(out: list[int], *, version: int = 0, lp0: float = -0.5, finish: str = "stop") -> GenerateResult:
    """Builder: output ids with distinct, recognisable log-probs lp0, lp0-0.01, ..."""
    return GenerateResult(
        output_ids=tuple(out),
        logprobs=tuple(lp0 - 0.01 * i for i in range(len(out))),
        finish_reason=finish,  # type: ignore[arg-type]
        policy_version=version,
    )


def store() -> CaptureStore:
    return CaptureStore(default_max_context_tokens=128)


# -- auth and lifecycle ------------------------------------------------------------------------


def test_token_authenticates_its_session_only():
    s = store()
    t1 = s.open(SID)
    t2 = s.open(SID + "b", max_context_tokens=64)
    assert s.authenticate(t1).session_id == SID
    assert s.authenticate(t2).max_context_tokens == 64
    assert s.authenticate(t1).max_context_tokens == 128  # store default
    assert t1 != t2 and len(t1) >= 43  # token_urlsafe(32) -> 43 chars
    for bad in (None, "", "x", t1[:-1], t1 + "x"):
        with pytest.raises(Unauthorized):
            s.authenticate(bad)


def test_closed_session_token_is_revoked_and_close_is_once():
    s = store()
    tok = s.open(SID)
    s.close(SID)
    with pytest.raises(SessionClosed):  # closed, not unknown: answered 409
        s.authenticate(tok)
    with pytest.raises(SessionNotFound):
        s.close(SID)
    with pytest.raises(SessionNotFound):
        s.record_turn(SID, [1, 2], result([3]))
    # the id can be reopened, with a new token; the old token stays dead
    tok2 = s.open(SID)
    assert tok2 != tok and s.authenticate(tok2).session_id == SID
    with pytest.raises(SessionClosed):
        s.authenticate(tok)


def test_open_twice_and_bad_budget_raise():
    s = store()
    s.open(SID)
    with pytest.raises(SessionExists):
        s.open(SID)
    with pytest.raises(ValueError, match="max_context_tokens"):
        s.open("other", max_context_tokens=1)
    with pytest.raises(ValueError, match="session_id"):
        s.open("")


def test_sampling_defaults_travel_with_the_session():
    s = store()
    tok = s.open(SID, sampling=SamplingDefaults(temperature=0.7, top_p=0.9, max_tokens=5, enforce=True))
    sess = s.authenticate(tok)
    assert (sess.sampling.temperature, sess.sampling.top_p, sess.sampling.max_tokens, sess.sampling.enforce) == (
        0.7,
        0.9,
        5,
        True,
    )
    with pytest.raises(ValueError, match="top_p"):
        SamplingDefaults(top_p=0.0)


# -- CLEAN / FORK ------------------------------------------------------------------------------


def test_clean_extension_appends_to_one_row_with_masks_versions_logprobs():
    s = store()
    s.open(SID)
    r1 = s.record_turn(SID, [10, 11, 12], result([20, 21], version=3, lp0=-1.0))
    # turn 2's prompt = turn 1's prompt + output + 2 new tokens (tool result / user message)
    r2 = s.record_turn(SID, [10, 11, 12, 20, 21, 13, 14], result([22], version=4, lp0=-2.0))
    assert (r1.kind, r2.kind) == (TurnKind.FIRST, TurnKind.CLEAN)
    assert (r2.row_index, r2.num_prompt_ext, r2.num_output) == (0, 2, 1)
    cap = s.close(SID)
    assert cap.num_turns == 2 and len(cap.rows) == 1
    row = cap.rows[0]
    assert row.token_ids == (10, 11, 12, 20, 21, 13, 14, 22)
    assert row.loss_mask == (0, 0, 0, 1, 1, 0, 0, 1)
    assert row.versions == (PROMPT_VERSION,) * 3 + (3, 3) + (PROMPT_VERSION,) * 2 + (4,)
    # each generated token carries its own sampled log-prob, in order; prompt tokens 0.0
    assert row.rollout_logprobs == pytest.approx((0, 0, 0, -1.0, -1.01, 0, 0, -2.0))
    assert row.generated_versions() == [3, 3, 4]


def test_edited_history_forks_a_new_row():
    s = store()
    s.open(SID)
    s.record_turn(SID, [10, 11], result([20, 21]))
    # the agent rewrote its previous answer (21 -> 99): no row is a prefix of this prompt
    rec = s.record_turn(SID, [10, 11, 20, 99, 13], result([30], version=1))
    assert (rec.kind, rec.row_index, rec.num_prompt_ext) == (TurnKind.FORK, 1, 5)
    cap = s.close(SID)
    assert [r.token_ids for r in cap.rows] == [(10, 11, 20, 21), (10, 11, 20, 99, 13, 30)]
    assert cap.rows[1].loss_mask == (0, 0, 0, 0, 0, 1)  # the whole forked prompt is mask 0


def test_prompt_shorter_than_row_forks():
    """A prompt that is a strict prefix of the row (history truncated) cannot extend it."""
    s = store()
    s.open(SID)
    s.record_turn(SID, [1, 2, 3], result([4, 5]))
    rec = s.record_turn(SID, [1, 2, 3, 4], result([6]))
    assert rec.kind is TurnKind.FORK


def test_interleaved_side_call_returns_to_its_row():
    """Main conversation, an unrelated summariser call, then the main conversation continues."""
    s = store()
    s.open(SID)
    s.record_turn(SID, [1, 2], result([3]))  # main, row 0
    side = s.record_turn(SID, [7, 8], result([9]))  # side call, row 1
    main = s.record_turn(SID, [1, 2, 3, 4], result([5]))  # extends row 0, not the latest row
    assert (side.kind, side.row_index) == (TurnKind.FORK, 1)
    assert (main.kind, main.row_index) == (TurnKind.CLEAN, 0)
    cap = s.close(SID)
    assert [r.token_ids for r in cap.rows] == [(1, 2, 3, 4, 5), (7, 8, 9)]


def test_longest_extended_row_wins():
    s = store()
    s.open(SID)
    s.record_turn(SID, [1], result([2]))  # row 0: (1, 2)
    s.record_turn(SID, [5], result([6]))  # row 1: (5, 6)  (fork)
    s.record_turn(SID, [1, 2, 3], result([4]))  # row 0: (1, 2, 3, 4)
    s.record_turn(SID, [1, 9], result([8]))  # fork, row 2: (1, 9, 8)
    rec = s.record_turn(SID, [1, 2, 3, 4, 5], result([6]))
    assert (rec.kind, rec.row_index) == (TurnKind.CLEAN, 0)


def test_negative_version_on_generated_tokens_is_rejected():
    s = store()
    s.open(SID)
    with pytest.raises(ValueError, match="policy version"):
        s.record_turn(SID, [1], result([2], version=-1))
    assert s.turns(SID) == ()  # nothing half-recorded


def test_randomized_agent_runs_keep_the_row_invariant():
    """Seeded random conversations: every row equals the concatenation of its turns' pieces,
    mask marks exactly the generated tokens, and the turn count adds up."""
    rng = random.Random(1234)
    for trial in range(50):
        s = store()
        s.open(SID)
        expected_rows: list[list[tuple[int, int, float, int]]] = []  # (id, mask, lp, version)
        num_turns = rng.randint(1, 8)
        for t in range(num_turns):
            rows_tokens = [[x[0] for x in r] for r in expected_rows]
            if rows_tokens and rng.random() < 0.7:  # extend a random existing row
                base = rng.choice(rows_tokens)
                prompt = base + [rng.randint(100, 200) for _ in range(rng.randint(0, 3))]
            else:
                prompt = [rng.randint(300, 400) for _ in range(rng.randint(1, 4))]
            out = [rng.randint(0, 99) for _ in range(rng.randint(0, 3))]
            res = result(out, version=t, lp0=-float(t + 1))
            rec = s.record_turn(SID, prompt, res)
            if rec.kind is TurnKind.CLEAN:
                row = expected_rows[rec.row_index]
                assert [x[0] for x in row] == prompt[: len(row)]
            else:
                assert rec.row_index == len(expected_rows)
                expected_rows.append([])
                row = expected_rows[-1]
            n = len(row)
            row.extend((tok, 0, 0.0, PROMPT_VERSION) for tok in prompt[n:])
            row.extend((tok, 1, lp, t) for tok, lp in zip(out, res.logprobs))
        cap = s.close(SID)
        assert cap.num_turns == num_turns, trial
        assert len(cap.rows) == len(expected_rows), trial
        for got, want in zip(cap.rows, expected_rows):
            assert got.token_ids == tuple(x[0] for x in want)
            assert got.loss_mask == tuple(x[1] for x in want)
            assert got.rollout_logprobs == pytest.approx(tuple(x[2] for x in want))
            assert got.versions == tuple(x[3] for x in want)


# -- router ------------------------------------------------------------------------------------


class _Named:
    def __init__(self, name: str) -> None:
        self.name = name

    async def generate(self, req):  # pragma: no cover - never called here
        raise AssertionError


def test_router_sticky_then_least_in_flight():
    a, b = _Named("a"), _Named("b")
    r = ReplicaRouter([a, b])
    with r.lease("s1") as e1:
        assert e1 is a  # tie at 0 in flight: lowest index
        with r.lease("s2") as e2:
            assert e2 is b  # a is busy
            assert r.in_flight() == (1, 1)
            with r.lease("s1") as e3:
                assert e3 is a  # sticky even though a is now the busier one
                assert r.in_flight() == (2, 1)
    assert r.in_flight() == (0, 0)
    assert (r.assigned("s1"), r.assigned("s2")) == (0, 1)
    r.forget("s1")
    assert r.assigned("s1") is None


def test_router_releases_on_error_and_resets_on_new_engines():
    a, b = _Named("a"), _Named("b")
    r = ReplicaRouter([a])
    with pytest.raises(RuntimeError, match="boom"):
        with r.lease("s1"):
            raise RuntimeError("boom")
    assert r.in_flight() == (0,)
    r.set_engines([a, b])
    assert r.assigned("s1") is None and r.in_flight() == (0, 0)
    r.set_engines([])
    with pytest.raises(NoReplicas):
        with r.lease("s1"):
            pass


def test_router_takes_a_failed_replica_out_and_moves_its_sessions():
    a, b, c = object(), object(), object()
    r = ReplicaRouter([a, b, c])  # type: ignore[list-item]
    with r.lease("s1") as e:
        assert e is a
    assert r.mark_failed(a) and not r.mark_failed(a) and r.num_healthy() == 2
    with r.lease("s1") as e1, r.lease("s2") as e2:  # s1 was stuck to a: moved to least-loaded b
        assert (e1, e2) == (b, c)
    with r.lease("s1") as e:
        assert e is b  # and sticks there
    r.mark_failed(b)
    r.mark_failed(c)
    with pytest.raises(NoReplicas, match="all 3"):
        with r.lease("s3"):
            pass
    r.set_engines([a])  # a new list clears the failed marks
    with r.lease("s3") as e:
        assert e is a


def test_turn_cap_and_ill_formed_count():
    s = store()
    s.open(SID, max_turns=2)
    assert s.begin_turn(SID) == 1 and s.begin_turn(SID) == 2
    with pytest.raises(TurnLimitExceeded):
        s.begin_turn(SID)
    s.record_turn(SID, [1, 2], result([3]), ill_formed=True)
    s.record_turn(SID, [1, 2, 3, 4], result([5]))
    assert [t.ill_formed for t in s.turns(SID)] == [True, False]
    assert s.close(SID).num_ill_formed_turns == 1
    with pytest.raises(ValueError, match="max_turns"):
        s.open("x", max_turns=0)


def test_router_sends_new_sessions_to_the_replica_with_fewest_sessions_and_spills_a_congested_one():
    """Regression (found by the simulator, orchestrator/planning/sim/): choosing by requests in flight alone
    piled new agent sessions onto a replica whose sessions were in their tools, and stickiness
    then kept that replica at a full KV cache while the others idled."""
    from workers.gateway.router import SPILL_FACTOR, SPILL_SLACK

    a, b = object(), object()
    r = ReplicaRouter([a, b])
    with r.lease("s1"):
        pass
    with r.lease("s2") as e:
        assert e is b  # nothing in flight anywhere, but a already holds a session
    assert r.sessions() == (1, 1)
    busy = [r.lease(f"x{i}") for i in range(2 * (SPILL_SLACK + 1))]  # new sessions alternate a / b
    for cm in busy:
        cm.__enter__()
    for cm in busy[1::2]:  # b's requests end: a is congested, b idle
        cm.__exit__(None, None, None)
    assert r.in_flight()[0] > SPILL_FACTOR * r.in_flight()[1] + SPILL_SLACK
    with r.lease("s1") as e:
        assert e is b  # s1 was stuck to a: it spills to b and sticks there
    assert r.assigned("s1") == 1
