"""The ACR emulator: pure routing/rate logic, and the real server driven by real boto3.

The HTTP tests start the emulator (with two real BedrockAgentCoreApp agents, tests/acr_echo_agent.py)
through LocalStack on loopback and call it with `boto3.client("bedrock-agentcore")`, configured only
through the standard AWS_ENDPOINT_URL_* env vars.
"""

from __future__ import annotations

import json
import math
import time

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError, ParamValidationError

from stand_ins import ECHO_AGENT, new_session_id
from stand_ins import BlockingAcr
from workers.acr.client import AcrClientConfig
from workers.embedded.emulator_sessions import RateWindow, SessionRefused, SessionTable, TokenBucket


# ----------------------------------------------------------------------------- pure logic


def test_token_bucket_allows_burst_then_refills_at_rate():
    b = TokenBucket(rate_per_s=2.0, burst=3, now_s=0.0)
    assert [b.try_acquire(0.0) for _ in range(4)] == [True, True, True, False]  # burst of 3
    assert not b.try_acquire(0.4)  # 0.4 s * 2/s = 0.8 token
    assert b.try_acquire(0.5)  # 1.0 token
    assert not b.try_acquire(0.5)
    assert [b.try_acquire(100.0) for _ in range(4)] == [True, True, True, False]  # capped at burst


def test_rate_window_peak_is_the_busiest_sliding_second():
    w = RateWindow(1.0)
    for t in (0.0, 0.2, 0.5, 0.9, 0.9):  # all five inside (-0.1, 0.9]
        w.record(t)
    assert w.peak == 5
    assert w.record(1.25) == 4  # window (0.25, 1.25]: 0.5, 0.9, 0.9, 1.25
    assert w.record(5.0) == 1 and w.peak == 5 and w.total == 7


def test_session_table_is_sticky_and_balances_new_sessions():
    t = SessionTable(3, TokenBucket(1000, 1000, 0.0))
    assert [t.route(s, 0.0) for s in ("a", "b", "c", "d")] == [(0, True), (1, True), (2, True), (0, True)]
    assert t.route("b", 1.0) == (1, False)  # sticky, not a creation
    assert t.stop("a") and not t.stop("a")
    # loads after a..d: [2, 1, 1]; a left: [1, 1, 1]; ties go to the lowest index
    assert t.route("e", 1.0) == (0, True)
    t.mark_dead(2)  # loads [2, 1, 1], agent 2 dead -> agent 1
    assert t.route("f", 1.0) == (1, True)
    s = t.snapshot()
    assert (s.sessions_open, s.sessions_created, s.sessions_stopped, s.peak_open) == (5, 6, 1, 5)


def test_session_table_refuses_by_rate_and_quota_without_creating():
    t = SessionTable(1, TokenBucket(1.0, 1, 0.0), max_open=2)
    t.route("a", 0.0)
    with pytest.raises(SessionRefused) as e:
        t.route("b", 0.5)  # bucket empty until t=1.0
    assert e.value.error == "ThrottlingException"
    assert t.route("a", 0.5) == (0, False)  # an open session is never throttled
    t.route("b", 1.0)
    with pytest.raises(SessionRefused) as e:
        t.route("c", 5.0)
    assert e.value.error == "ServiceQuotaExceededException"
    s = t.snapshot()
    assert (s.sessions_open, s.sessions_created, s.throttled, s.quota_refused) == (2, 2, 1, 1)


def test_session_table_expires_idle_sessions_but_not_busy_or_in_flight_ones():
    t = SessionTable(2, TokenBucket(10, 10, 0.0), idle_timeout_s=10.0)
    for sid in ("a", "b", "c", "d"):
        t.route(sid, 0.0)  # a, c -> agent 0; b, d -> agent 1
    for sid in ("a", "b", "c"):
        t.release(sid, 0.0)  # d keeps its call in flight
    t.route("b", 8.0)
    t.release("b", 8.0)  # b active at 8
    t.keep_alive(0, 9.0)  # agent 0 answered HealthyBusy at 9: a and c active
    assert t.expire(12.0) == []  # a, c idle 3 s; b idle 4 s; d in flight
    assert sorted(t.expire(19.5)) == ["a", "b", "c"]  # idle 10.5, 11.5, 10.5 s >= 10 s; d in flight
    s = t.snapshot()
    assert s.sessions_open == s.sessions_created - s.sessions_stopped - s.sessions_expired
    assert s.sessions_expired_max_lifetime == 0  # all three went idle


def test_session_table_max_lifetime_ends_even_busy_sessions():
    t = SessionTable(1, TokenBucket(10, 10, 0.0), idle_timeout_s=100.0, max_lifetime_s=30.0)
    t.route("a", 0.0)  # in flight for ever
    t.route("b", 20.0)
    t.keep_alive(0, 29.0)
    assert t.expire(29.9) == []
    assert t.expire(30.0) == ["a"]  # lifetime counts from creation, whatever the session does
    assert t.expire(50.0) == ["b"]
    assert t.snapshot().sessions_expired == 2
    assert t.snapshot().sessions_expired_max_lifetime == 2  # b's call is in flight too: it cannot go idle


# ----------------------------------------------------------------------------- real server


def acr(**config) -> object:
    return boto3.client("bedrock-agentcore", config=Config(**config))


def test_invoke_reaches_an_agent_and_echoes_the_session_id(echo_env):
    client = acr()
    sid = new_session_id()
    resp = client.invoke_agent_runtime(
        agentRuntimeArn=echo_env.agent_runtime_arn, runtimeSessionId=sid, payload=json.dumps({"x": 1})
    )
    assert resp["runtimeSessionId"] == sid  # echoed response header
    assert resp["contentType"].startswith("application/json")
    body = json.loads(resp["response"].read())
    assert body["session_id"] == sid  # the agent saw ACR's session header
    assert body["payload"] == {"x": 1}
    assert body["pid"] in echo_env.stats().agent_pids
    client.stop_runtime_session(agentRuntimeArn=echo_env.agent_runtime_arn, runtimeSessionId=sid)


def test_same_session_sticks_to_one_agent_and_new_sessions_spread(echo_env):
    c = BlockingAcr()
    arn = echo_env.agent_runtime_arn
    assert echo_env.stats().sessions_open == 0  # every test stops its sessions
    a, b = new_session_id(), new_session_id()
    pids_a = [c.invoke(arn, a, {})["pid"] for _ in range(3)]
    pid_b = c.invoke(arn, b, {})["pid"]
    assert len(set(pids_a)) == 1  # sticky
    assert pid_b != pids_a[0]  # b went to the other, idle agent
    assert echo_env.stats().open_per_agent == (1, 1)
    assert c.stop_session(arn, a) and c.stop_session(arn, b)


def test_short_session_id_is_a_validation_exception(echo_env):
    # botocore checks min length 33 client-side by default ...
    with pytest.raises(ParamValidationError):
        acr().invoke_agent_runtime(agentRuntimeArn=echo_env.agent_runtime_arn, runtimeSessionId="short", payload=b"{}")
    # ... and the emulator answers ACR's ValidationException when that check is off.
    client = acr(parameter_validation=False)
    with pytest.raises(client.exceptions.ValidationException) as e:
        client.invoke_agent_runtime(agentRuntimeArn=echo_env.agent_runtime_arn, runtimeSessionId="short", payload=b"{}")
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 400
    assert e.value.response["reason"] == "FieldValidationFailed"


def test_stop_runtime_session_closes_the_session(echo_env):
    c = BlockingAcr()
    arn = echo_env.agent_runtime_arn
    before = echo_env.stats()
    sid = new_session_id()
    c.invoke(arn, sid, {})
    assert echo_env.stats().sessions_open == before.sessions_open + 1
    resp = acr().stop_runtime_session(agentRuntimeArn=arn, runtimeSessionId=sid)
    assert resp["runtimeSessionId"] == sid
    after = echo_env.stats()
    assert after.sessions_open == before.sessions_open == 0
    assert after.sessions_stopped == before.sessions_stopped + 1
    assert c.stop_session(arn, sid) is False  # already stopped: ResourceNotFoundException -> False


def test_unknown_runtime_or_qualifier_is_resource_not_found_and_a_bad_arn_is_invalid(echo_env):
    client = acr()
    arn = echo_env.agent_runtime_arn.replace("emulator0", "nobody")
    with pytest.raises(client.exceptions.ResourceNotFoundException) as e:
        client.invoke_agent_runtime(agentRuntimeArn=arn, runtimeSessionId=new_session_id(), payload=b"{}")
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404
    with pytest.raises(client.exceptions.ResourceNotFoundException):
        client.invoke_agent_runtime(
            agentRuntimeArn=echo_env.agent_runtime_arn, runtimeSessionId=new_session_id(), payload=b"{}", qualifier="prod"
        )
    with pytest.raises(client.exceptions.ValidationException) as e:
        client.invoke_agent_runtime(agentRuntimeArn="not-an-arn", runtimeSessionId=new_session_id(), payload=b"{}")
    assert e.value.response["fieldList"][0]["name"] == "agentRuntimeArn"
    with pytest.raises(client.exceptions.ResourceNotFoundException):  # stopping a session never opened
        client.stop_runtime_session(agentRuntimeArn=echo_env.agent_runtime_arn, runtimeSessionId=new_session_id())
    assert echo_env.stats().sessions_open == 0  # none of the refused calls opened a session


def test_too_long_session_id_is_a_validation_exception(echo_env):
    client = acr(parameter_validation=False)
    with pytest.raises(client.exceptions.ValidationException):
        client.invoke_agent_runtime(
            agentRuntimeArn=echo_env.agent_runtime_arn, runtimeSessionId="x" * 257, payload=b"{}"
        )


def test_custom_headers_reach_the_agent_and_calls_are_counted(echo_env):
    client = acr()
    before = echo_env.stats()

    def add_header(request, **_):
        request.headers["X-Amzn-Bedrock-AgentCore-Runtime-Custom-Trace"] = "t-42"

    client.meta.events.register("before-sign.bedrock-agentcore.InvokeAgentRuntime", add_header)
    sid = new_session_id()
    resp = client.invoke_agent_runtime(
        agentRuntimeArn=echo_env.agent_runtime_arn, runtimeSessionId=sid, payload=b"{}", contentType="application/json"
    )
    headers = {k.lower(): v for k, v in json.loads(resp["response"].read())["headers"].items()}
    assert headers["x-amzn-bedrock-agentcore-runtime-custom-trace"] == "t-42"  # the SDK's request_headers
    client.stop_runtime_session(agentRuntimeArn=echo_env.agent_runtime_arn, runtimeSessionId=sid)
    after = echo_env.stats()
    assert (after.invocations, after.stops) == (before.invocations + 1, before.stops + 1)
    assert after.requests == after.invocations + after.stops + after.commands
    assert 1 <= after.peak_request_rate <= after.requests


def test_agent_error_is_runtime_client_error(echo_env):
    client = acr(retries={"total_max_attempts": 1})
    sid = new_session_id()
    with pytest.raises(client.exceptions.RuntimeClientError) as e:
        client.invoke_agent_runtime(
            agentRuntimeArn=echo_env.agent_runtime_arn, runtimeSessionId=sid, payload=b'{"fail": true}'
        )
    assert "500" in e.value.response["Error"]["Message"]
    BlockingAcr().stop_session(echo_env.agent_runtime_arn, sid)


def test_streamed_agent_answer_passes_through(echo_env):
    sid = new_session_id()
    resp = acr().invoke_agent_runtime(
        agentRuntimeArn=echo_env.agent_runtime_arn, runtimeSessionId=sid, payload=b'{"stream": 3}'
    )
    assert resp["contentType"].startswith("text/event-stream")
    events = [json.loads(line[len("data: "):]) for line in resp["response"].iter_lines() if line.startswith(b"data: ")]
    assert events == [{"i": i, "session_id": sid} for i in range(3)]
    BlockingAcr().stop_session(echo_env.agent_runtime_arn, sid)


# ----------------------------------------------------------------------------- throttling


@pytest.fixture(scope="module")
def slow_stack(local_stack):
    # 0.5 session creations per second, burst 1: a second creation within 2 s is throttled;
    # at most 15 data-plane calls per second of any kind.
    return local_stack(ECHO_AGENT, num_agents=1, session_rate_per_s=0.5, session_burst=1, request_rate_per_s=15)


def test_burst_past_the_rate_is_throttled_and_botocore_retries_it(slow_stack, stack_env):
    stack_env(slow_stack)
    arn = slow_stack.agent_runtime_arn
    no_retry = acr(retries={"mode": "standard", "total_max_attempts": 1})
    no_retry.invoke_agent_runtime(agentRuntimeArn=arn, runtimeSessionId=new_session_id(), payload=b"{}")
    with pytest.raises(no_retry.exceptions.ThrottlingException) as e:
        no_retry.invoke_agent_runtime(agentRuntimeArn=arn, runtimeSessionId=new_session_id(), payload=b"{}")
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 429
    assert slow_stack.stats().throttled >= 1
    # The same burst through the ACR client: botocore's standard retry mode waits and succeeds.
    c = BlockingAcr(AcrClientConfig(retry_mode="standard", max_attempts=10))
    out = c.invoke(arn, new_session_id(), {"ok": True})
    assert out["payload"] == {"ok": True}
    assert c.stats().retries >= 1  # the bucket was empty: at least one 429 was retried
    assert slow_stack.stats().sessions_created == 2


def test_all_calls_share_the_request_rate_cap_and_the_peak_is_measured(slow_stack, stack_env):
    stack_env(slow_stack)
    client = acr(retries={"mode": "standard", "total_max_attempts": 1})
    arn = slow_stack.agent_runtime_arn
    errors = []
    t0 = time.monotonic()
    for _ in range(40):  # stops of unknown sessions: cheap calls, 404 when let through
        try:
            client.stop_runtime_session(agentRuntimeArn=arn, runtimeSessionId=new_session_id())
        except ClientError as e:
            errors.append(e.response["Error"]["Code"])
    elapsed_s = time.monotonic() - t0
    # bucket: 15 stored + 15/s refill -> at most 15 + 15 * elapsed_s calls let through
    assert errors.count("ThrottlingException") >= 40 - (15 + 15 * elapsed_s) - 1
    assert set(errors) <= {"ThrottlingException", "ResourceNotFoundException"}
    stats = slow_stack.stats()
    # refused calls count too; some 1 s bin of the ceil(elapsed_s) bins held >= 40 / bins calls
    assert stats.peak_request_rate >= 40 / math.ceil(elapsed_s)
    assert stats.stops >= 40 and stats.throttled >= errors.count("ThrottlingException")


def test_the_emulator_binds_the_host_it_is_given(tmp_path):
    """Issue 29: `--host` (like moto_s3's) so the emulator can serve agents on another network, as
    ACR does; with 0.0.0.0 the agents it starts still reach it through loopback."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    from stand_ins import ECHO_AGENT, REPO
    from workers.embedded.emulator_config import DEFAULT_RUNTIME_ARN

    ready = tmp_path / "ready.json"
    proc = subprocess.Popen([sys.executable, "-m", "workers.embedded.emulator", "--host", "0.0.0.0",
                             "--ready-file", str(ready), "--num-agents", "1",
                             "--agent-cmd", " ".join(ECHO_AGENT)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not ready.is_file() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.is_file(), "the emulator never became ready"
        endpoint = json.loads(ready.read_text())["endpoint"]
        port = int(endpoint.rsplit(":", 1)[1])
        listening = [c for c in psutil.Process(proc.pid).net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
        assert listening and listening[0].laddr.ip == "0.0.0.0"
        assert endpoint.startswith("http://127.0.0.1:")  # what its own agents are told
        client = boto3.client("bedrock-agentcore", endpoint_url=endpoint, region_name="us-west-2",
                              aws_access_key_id="x", aws_secret_access_key="x")
        resp = client.invoke_agent_runtime(
            agentRuntimeArn=DEFAULT_RUNTIME_ARN,
            runtimeSessionId=new_session_id(), payload=json.dumps({"x": 1}))
        assert json.loads(resp["response"].read())["payload"] == {"x": 1}
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def test_an_agent_process_that_crashes_is_restarted_like_a_fresh_microvm(echo_env):
    """Issue 47 (item 6): the emulator never restarted an agent process that exited, so after two
    crashes every rollout failed "no agent process is alive" (and the message pointed at the runtime
    ARN and credentials); on ACR a crash costs one session's microVM. Both agents are killed, twice:
    each time the next session is served by a fresh process."""
    import os
    import signal

    from stand_ins import wait_until

    c = BlockingAcr()
    arn = echo_env.agent_runtime_arn
    for _ in range(2):
        before = echo_env.stats().agent_pids
        for pid in before:
            os.kill(pid, signal.SIGKILL)
        assert wait_until(lambda: all(_reaped_or_gone(p) for p in before), 10)
        sid = new_session_id()
        pid = c.invoke(arn, sid, {"after": "crash"})["pid"]  # waits for the restarts: no agent was alive
        assert pid not in before
        assert c.stop_session(arn, sid)
        after = echo_env.stats().agent_pids
        assert wait_until(lambda: len(set(echo_env.stats().agent_pids) - set(before)) == 2, 30), after


def _reaped_or_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"  # a zombie until the emulator reaps it
    except FileNotFoundError:
        return True
