"""The agent contracts as pure functions (workers/rollout/contract.py) and the fast-completion
result endpoint (workers/rollout/results.py) over a real aiohttp server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import math

import aiohttp
import pytest

from workers.rollout.contract import (
    AgentFailed,
    BadResult,
    BadResultStreak,
    ContractError,
    InvocationRecord,
    http_payload,
    http_reward,
    parse_record,
    parse_result_body,
    parse_reward,
)
from workers.rollout.results import ResultBoard, ResultServer

TIMEOUT_S = 10


# ----------------------------------------------------------------------------- HTTP contract


def test_http_payload_carries_config_and_the_toolkit_envelope():
    row = {"prompt": "p"}
    p = http_payload(row, "row-1", {"base_url": "u", "api_key": "k"}, "start", "inv1", background=True)
    assert p == {"prompt": "p", "_config": {"base_url": "u", "api_key": "k"},
                 "_agentcore_runtime": {"version": 1, "operation": "start", "invocation_id": "inv1", "background": True}}
    g = http_payload(row, "row-1", {}, "get", "inv1")
    assert g["_agentcore_runtime"] == {"version": 1, "operation": "get", "invocation_id": "inv1"}  # no background
    assert row == {"prompt": "p"}


def test_http_payload_envelope_is_accepted_by_the_toolkit_parser():
    from agentcore_rl_toolkit.runtime.protocol import InvocationRequest

    for op in ("start", "get"):
        env = http_payload({}, "r", {}, op, "abc-123", background=False)["_agentcore_runtime"]
        assert InvocationRequest.parse(env).operation == op


@pytest.mark.parametrize("key", ["_rollout", "_config", "_agentcore_runtime"])
def test_http_payload_refuses_reserved_keys_naming_row_and_field(key):
    with pytest.raises(ContractError, match=rf"input_id='row-3' has reserved field\(s\) \['{key}'\]"):
        http_payload({key: 1}, "row-3", {}, "start", "i")


def test_parse_record_reads_records_and_plain_answers():
    rec = parse_record({"version": 1, "invocation_id": "i", "status": "completed", "result": {"reward": 0.5}}, "i", "w")
    assert rec == InvocationRecord("i", "completed", {"reward": 0.5}, None)
    assert http_reward(rec, "w") == 0.5
    assert parse_record({"version": 1, "invocation_id": "i", "status": "in_progress"}, "i", "w").status == "in_progress"
    # an app that ignores the envelope answers its result: a completed record
    assert http_reward(parse_record({"reward": 1}, "i", "w"), "w") == 1.0
    # a record of ANOTHER invocation is not ours: treated as a plain answer (no reward -> bad result)
    other = parse_record({"version": 1, "invocation_id": "j", "status": "completed", "result": {}}, "i", "w")
    with pytest.raises(BadResult, match="no 'reward' field"):
        http_reward(other, "w")


@pytest.mark.parametrize("value, exc, message", [
    ({"version": 1, "invocation_id": "i", "status": "interrupted"}, AgentFailed, "is interrupted"),
    ({"version": 1, "invocation_id": "i", "status": "not_found"}, AgentFailed, "is not_found"),
    ({"version": 1, "invocation_id": "i", "status": "completed", "error": "boom"}, AgentFailed, "failed: boom"),
    ({"version": 1, "invocation_id": "i", "status": "completed", "result": {}}, BadResult, "no 'reward' field"),
    ({"version": 1, "invocation_id": "i", "status": "completed", "result": {"reward": math.nan}}, BadResult,
     "'reward' is not finite"),
    ({"version": 1, "invocation_id": "i", "status": "completed", "result": {"reward": True}}, BadResult,
     "not a number"),
    ({"version": 1, "invocation_id": "i", "status": "completed", "result": {"reward": 1e30}}, BadResult,
     r"'reward' is 1e\+30, beyond \+-1e\+06: a bug in the agent's reward"),  # absurd rewards are not trained
])
def test_http_reward_failures_are_rollout_failures_naming_the_field(value, exc, message):
    with pytest.raises(exc, match=message):
        http_reward(parse_record(value, "i", "session s"), "session s")


def test_parse_record_refuses_invalid_records():
    with pytest.raises(BadResult, match="invalid invocation record"):
        parse_record({"version": 1, "invocation_id": "i", "status": "done"}, "i", "w")
    with pytest.raises(BadResult, match="exactly one of 'result' or 'error'"):
        parse_record({"version": 1, "invocation_id": "i", "status": "completed"}, "i", "w")


# ----------------------------------------------------------------------------- S3 contract, rule


def test_toolkit_error_object_is_an_agent_failure_not_a_bad_result():
    with pytest.raises(AgentFailed, match="status_code 500: boom"):
        parse_reward({"status_code": 500, "stop_reason": "boom"}, "s3://b/k")
    with pytest.raises(BadResult, match=r"not JSON"):
        parse_result_body(b'{"rewards": ', "s3://b/k")
    assert parse_reward(parse_result_body(b'{"rewards": [0, 2]}', "w"), "w") == 2.0


def test_bad_result_streak_stops_the_run_only_when_unbroken():
    s = BadResultStreak(3)
    s.on_bad("a")
    s.on_bad("b")
    s.on_good()  # a good result between: bad luck, not a broken agent
    s.on_bad("c")
    s.on_bad("d")
    with pytest.raises(ContractError, match="3 agent results in a row broke the reward contract; last: e"):
        s.on_bad("e")


# ----------------------------------------------------------------------------- fast completion


async def test_posted_result_wakes_the_waiter_once_and_checks_the_token():
    board = ResultBoard()
    server = ResultServer(board)
    base = await server.start()
    try:
        board.expect("sid-1", "secret")
        waiter = asyncio.ensure_future(board.wait("sid-1"))
        async with aiohttp.ClientSession() as http:
            async def post(sid: str, token: str | None) -> int:
                headers = {"Authorization": f"Bearer {token}"} if token else {}
                async with http.post(f"{base}/{sid}", data=b'{"rewards": 1}', headers=headers) as r:
                    return r.status

            assert await post("sid-1", "wrong") == 401
            assert await post("sid-1", None) == 401
            assert await post("nobody", "secret") == 404
            assert not waiter.done()  # none of those woke it
            assert await post("sid-1", "secret") == 200
            got = await asyncio.wait_for(waiter, TIMEOUT_S)
            assert got.body == b'{"rewards": 1}'
            assert await post("sid-1", "secret") == 200  # a duplicate is accepted, delivered once
            board.forget("sid-1")
            assert await post("sid-1", "secret") == 404  # finished sessions take nothing
        assert (board.posted, board.num_waiting()) == (1, 0)
    finally:
        await server.stop()
