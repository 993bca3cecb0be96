"""Fault injection and session lifecycle of the ACR emulator, with the stub agent behind it.

Pure: FaultRates / FaultPlan. Real: LocalStack (moto S3 + emulator + `workers.embedded.stub_agent`
processes) driven by boto3 over loopback; each fault is observed where a client would see it
(a botocore exception class, the S3 result object, or the HTTP-contract record).
"""

from __future__ import annotations

import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import boto3
import pytest
from botocore.config import Config

from stand_ins import STUB_AGENT, new_session_id, wait_until
from workers.embedded.faults import (
    AGENT_FAULTS, EMULATOR_FAULT_ERRORS, EMULATOR_FAULTS, FAULT_HEADER, FAULT_KINDS, FaultPlan, FaultRates,
    fault_from_headers,
)  # fmt: skip
from workers.embedded.local_stack import LocalStack
RATES = FaultRates.uniform(0.8, seed=11)  # 0.1 per kind, 0.2 none: every kind easy to find
PLAN = FaultPlan(RATES)
MAX_OPEN = 8


def new_sid() -> str:
    return new_session_id("fault-session")


def sid_with(kind: str | None) -> str:
    """A fresh session id the plan gives `kind` (None: no fault); expected 10 draws."""
    for _ in range(10_000):
        sid = new_sid()
        if PLAN.fault_for(sid) == kind:
            return sid
    raise AssertionError(f"no session id with fault {kind}")


# ----------------------------------------------------------------------------- pure


def test_fault_rates_validate_and_round_trip():
    r = FaultRates.uniform(0.4, seed=3)
    assert r.total() == pytest.approx(0.4) and r.throttle == pytest.approx(0.05)
    assert FaultRates.from_json(r.to_json()) == r
    with pytest.raises(ValueError, match="faults.crash"):
        FaultRates(crash=1.5)
    with pytest.raises(ValueError, match="sum"):
        FaultRates(crash=0.6, slow=0.6)
    with pytest.raises(ValueError, match="unknown fault keys"):
        FaultRates.from_json('{"explode": 0.1}')


def test_fault_plan_is_deterministic_and_matches_the_rates():
    sids = [f"s-{i:06d}-padding-to-thirty-three-chars" for i in range(20_000)]
    counts = PLAN.count(sids)
    assert counts == FaultPlan(FaultRates.uniform(0.8, seed=11)).count(sids)  # same seed, same plan
    assert counts != FaultPlan(FaultRates.uniform(0.8, seed=12)).count(sids)
    for kind in FAULT_KINDS:  # binomial(20000, 0.1): sd 42; 5 sd = 212
        assert abs(counts[kind] - 2000) < 212, (kind, counts[kind])
    assert abs(counts[None] - 4000) < 300
    assert sum(counts.values()) == len(sids)  # at most one kind per session
    assert FaultPlan(FaultRates()).count(sids) == {None: len(sids)}
    only = FaultPlan(FaultRates(nan_reward=1.0))
    assert {only.fault_for(s) for s in sids[:100]} == {"nan_reward"}


def test_fault_header_is_read_case_insensitively():
    assert fault_from_headers({FAULT_HEADER.lower(): "slow"}) == "slow"
    assert fault_from_headers({"other": "x"}) is None and fault_from_headers(None) is None
    with pytest.raises(ValueError, match="unknown agent fault"):
        fault_from_headers({FAULT_HEADER: "throttle"})  # emulator-side kinds never reach agents


# ----------------------------------------------------------------------------- real stack


@pytest.fixture(scope="module")
def fault_stack(local_stack):
    return local_stack(STUB_AGENT, num_agents=2, session_rate_per_s=1000, max_open_sessions=MAX_OPEN, faults=RATES)


@pytest.fixture()
def env(fault_stack, stack_env):
    return stack_env(fault_stack)


def client(attempts: int = 1):
    retries = {"mode": "standard", "total_max_attempts": attempts}
    return boto3.client("bedrock-agentcore", config=Config(retries=retries))


def s3_payload(stack: LocalStack, **row) -> bytes:
    return json.dumps({**row, "_rollout": {"exp_id": "exp-f", "input_id": "row", "s3_bucket": stack.bucket}}).encode()


def http_start(invocation_id: str, background: bool = False) -> bytes:
    env_ = {"version": 1, "operation": "start", "invocation_id": invocation_id, "background": background}
    return json.dumps({"reward": 0.5, "_config": {}, "_agentcore_runtime": env_}).encode()


def http_get(invocation_id: str) -> bytes:
    env_ = {"version": 1, "operation": "get", "invocation_id": invocation_id}
    return json.dumps({"_config": {}, "_agentcore_runtime": env_}).encode()


@pytest.mark.parametrize("kind", EMULATOR_FAULTS)
def test_emulator_side_fault_answers_its_error_once_then_recovers(env, kind):
    c, arn, sid = client(), env.agent_runtime_arn, sid_with(kind)
    name, status = EMULATOR_FAULT_ERRORS[kind]
    with pytest.raises(getattr(c.exceptions, name)) as e:
        c.invoke_agent_runtime(agentRuntimeArn=arn, runtimeSessionId=sid, payload=s3_payload(env))
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == status
    assert env.stats().sessions_open == 0  # nothing was created
    # repeats=1: botocore's retry of the same session goes through
    resp = client(attempts=3).invoke_agent_runtime(agentRuntimeArn=arn, runtimeSessionId=sid, payload=s3_payload(env))
    assert json.loads(resp["response"].read())["status"] == "processing"
    c.stop_runtime_session(agentRuntimeArn=arn, runtimeSessionId=sid)


def test_agent_side_faults_shape_the_s3_result(env):
    c, arn, s3 = client(), env.agent_runtime_arn, boto3.client("s3")
    sids = {kind: sid_with(kind) for kind in (None, *AGENT_FAULTS)}
    for sid in sids.values():
        c.invoke_agent_runtime(agentRuntimeArn=arn, runtimeSessionId=sid, payload=s3_payload(env, reward=0.25))

    def body(kind):
        try:
            return s3.get_object(Bucket=env.bucket, Key=f"exp-f/row/{sids[kind]}.json")["Body"].read()
        except s3.exceptions.NoSuchKey:
            return None

    written = ("crash", "malformed_result", "nan_reward", None)
    assert wait_until(lambda: all(body(k) is not None for k in written), 20)
    assert json.loads(body(None)) == {"rewards": 0.25}
    crash = json.loads(body("crash"))
    assert crash["status_code"] == 500 and "rewards" not in crash  # the toolkit's error object
    with pytest.raises(json.JSONDecodeError):
        json.loads(body("malformed_result"))
    assert not math.isfinite(json.loads(body("nan_reward"))["rewards"])
    assert body("no_result") is None and body("slow") is None  # no_result had as long as the others
    for sid in sids.values():
        c.stop_runtime_session(agentRuntimeArn=arn, runtimeSessionId=sid)


def test_agent_side_faults_shape_the_http_contract_record(env):
    c, arn = client(), env.agent_runtime_arn

    def call(sid, payload):
        return c.invoke_agent_runtime(agentRuntimeArn=arn, runtimeSessionId=sid, payload=payload)["response"].read()

    sids = {kind: sid_with(kind) for kind in (None, *AGENT_FAULTS)}
    assert json.loads(call(sids[None], http_start("inv-1")))["result"] == {"reward": 0.5}
    assert json.loads(call(sids[None], http_get("inv-1")))["status"] == "completed"  # record kept
    assert json.loads(call(sids[None], http_get("inv-unknown")))["status"] == "not_found"
    assert json.loads(call(sids["crash"], http_start("inv-1")))["status"] == "interrupted"
    assert json.loads(call(sids["no_result"], http_start("inv-1")))["result"] == {}
    with pytest.raises(json.JSONDecodeError):
        json.loads(call(sids["malformed_result"], http_start("inv-1")))
    assert not math.isfinite(json.loads(call(sids["nan_reward"], http_start("inv-1")))["result"]["reward"])
    assert json.loads(call(sids["slow"], http_start("inv-1", background=True)))["status"] == "in_progress"
    assert json.loads(call(sids["slow"], http_get("inv-1")))["status"] == "in_progress"
    for sid in sids.values():
        c.stop_runtime_session(agentRuntimeArn=arn, runtimeSessionId=sid)


def test_injected_fault_counts_match_the_plan(env):
    c, arn = client(), env.agent_runtime_arn
    before = env.stats().faults_injected
    sids = [new_sid() for _ in range(40)]
    for sid in sids:
        try:
            c.invoke_agent_runtime(agentRuntimeArn=arn, runtimeSessionId=sid, payload=s3_payload(env, delay_s=0))
        except c.exceptions.ClientError as e:
            assert PLAN.fault_for(sid) in EMULATOR_FAULTS, e
            continue
        c.stop_runtime_session(agentRuntimeArn=arn, runtimeSessionId=sid)
    after = env.stats()
    expected = PLAN.count(sids)
    for kind in FAULT_KINDS:
        assert after.faults_injected.get(kind, 0) - before.get(kind, 0) == expected[kind], kind
    assert after.sessions_open == 0 and after.peak_open <= MAX_OPEN


def test_open_session_quota_is_service_quota_exceeded(env):
    c, arn = client(), env.agent_runtime_arn
    assert env.stats().sessions_open == 0
    sids = [sid_with(None) for _ in range(MAX_OPEN + 1)]
    for sid in sids[:MAX_OPEN]:
        c.invoke_agent_runtime(agentRuntimeArn=arn, runtimeSessionId=sid, payload=s3_payload(env))
    with pytest.raises(c.exceptions.ServiceQuotaExceededException) as e:
        c.invoke_agent_runtime(agentRuntimeArn=arn, runtimeSessionId=sids[-1], payload=s3_payload(env))
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 402
    c.stop_runtime_session(agentRuntimeArn=arn, runtimeSessionId=sids[0])
    c.invoke_agent_runtime(agentRuntimeArn=arn, runtimeSessionId=sids[-1], payload=s3_payload(env))  # room again
    for sid in sids[1:]:
        c.stop_runtime_session(agentRuntimeArn=arn, runtimeSessionId=sid)
    stats = env.stats()
    assert stats.peak_open == MAX_OPEN and stats.quota_refused >= 1 and stats.sessions_open == 0


# ----------------------------------------------------------------------------- lifecycle


@pytest.fixture(scope="module")
def short_lived_stack(local_stack):
    return local_stack(STUB_AGENT, num_agents=1, session_rate_per_s=1000, idle_timeout_s=0.5, max_lifetime_s=3.0)


def test_idle_session_expires_and_healthy_busy_keeps_one_alive_until_max_lifetime(short_lived_stack, stack_env):
    stack = stack_env(short_lived_stack)
    c, arn = client(), stack.agent_runtime_arn
    idle = new_sid()
    c.invoke_agent_runtime(agentRuntimeArn=arn, runtimeSessionId=idle, payload=http_start("i", background=False))
    assert wait_until(lambda: stack.stats().sessions_expired >= 1, 5)  # idle 0.5 s, agent not busy
    with pytest.raises(c.exceptions.ResourceNotFoundException):
        c.stop_runtime_session(agentRuntimeArn=arn, runtimeSessionId=idle)

    # The busy session works 6 s with no call in flight: only the agent's HealthyBusy /ping keeps it
    # past its idle timeouts (0.5 s), until max lifetime (3 s) ends it, busy or not. The emulator
    # says which limit ended it, so this holds however slowly this machine runs the test.
    before = stack.stats()
    busy = new_sid()
    t0 = time.monotonic()
    c.invoke_agent_runtime(agentRuntimeArn=arn, runtimeSessionId=busy, payload=s3_payload(stack, delay_s=6.0))
    assert wait_until(lambda: stack.stats().sessions_open == 0, 15)
    assert time.monotonic() - t0 >= 3.0
    after = stack.stats()
    assert after.sessions_expired - before.sessions_expired == 1
    assert after.sessions_expired_max_lifetime - before.sessions_expired_max_lifetime == 1  # by lifetime, not idle


def test_stub_posts_its_result_to_result_url_after_the_s3_write(env):
    received: list[tuple[str, bytes]] = []

    class Sink(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            received.append((self.headers["Authorization"], self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        c, sid = client(), sid_with(None)
        url = f"http://127.0.0.1:{server.server_address[1]}/results"
        rollout = {"exp_id": "exp-u", "input_id": "row", "s3_bucket": env.bucket, "result_url": url, "api_key": "tok"}
        payload = json.dumps({"reward": 0.75, "_rollout": rollout})
        c.invoke_agent_runtime(agentRuntimeArn=env.agent_runtime_arn, runtimeSessionId=sid, payload=payload)
        assert wait_until(lambda: received, 20)
        assert received == [("Bearer tok", b'{"rewards": 0.75}')]
        s3_body = boto3.client("s3").get_object(Bucket=env.bucket, Key=f"exp-u/row/{sid}.json")["Body"].read()
        assert json.loads(s3_body) == {"rewards": 0.75}  # durable copy written first
        c.stop_runtime_session(agentRuntimeArn=env.agent_runtime_arn, runtimeSessionId=sid)
    finally:
        server.shutdown()
        server.server_close()
