"""Agents written with the public agentcore-rl-toolkit run unchanged behind the ACR emulator.

Two real agents (tests/acr_toolkit_agent.py: the S3-result `rollout_entrypoint` decorator;
tests/acr_toolkit_http_agent.py: the HTTP contract's `AgentCoreRuntimeApp`) are invoked through
the emulator with plain boto3, and the HTTP one also with the toolkit's own async client
(`AgentCoreHttpClient`, aiobotocore), configured only by the standard AWS_ENDPOINT_URL_* env.
"""

from __future__ import annotations

import asyncio
import json
import time

import boto3
import pytest
from agentcore_rl_toolkit import AgentCoreHttpClient

from stand_ins import TOOLKIT_HTTP_AGENT, TOOLKIT_S3_AGENT, new_session_id, wait_until


def new_sid() -> str:
    return new_session_id("toolkit-session")


def read_object(s3, bucket: str, key: str) -> dict | None:
    try:
        return json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    except s3.exceptions.NoSuchKey:
        return None


@pytest.fixture(scope="module")
def s3_stack(local_stack):
    return local_stack(TOOLKIT_S3_AGENT, num_agents=1)


@pytest.fixture(scope="module")
def http_stack(local_stack, tmp_path_factory):
    state = tmp_path_factory.mktemp("toolkit-state")
    return local_stack(TOOLKIT_HTTP_AGENT, num_agents=1, agent_env={"TOOLKIT_STATE_DIR": str(state)})


def test_s3_decorator_agent_writes_its_result_at_the_session_key(s3_stack, stack_env):
    stack = stack_env(s3_stack)
    acr, s3 = boto3.client("bedrock-agentcore"), boto3.client("s3")
    ok, broken = new_sid(), new_sid()
    rollout = {"exp_id": "exp-tk", "input_id": "row-3", "s3_bucket": stack.bucket}
    for sid, row in ((ok, {"answer": "yes"}), (broken, {"raise": True})):
        payload = json.dumps({**row, "_rollout": rollout})
        resp = acr.invoke_agent_runtime(agentRuntimeArn=stack.agent_runtime_arn, runtimeSessionId=sid, payload=payload)
        assert resp["runtimeSessionId"] == sid
        ack = json.loads(resp["response"].read())
        assert ack == {"status": "processing", "s3_bucket": stack.bucket, "result_key": f"exp-tk/row-3/{sid}.json"}
    good = wait_until(lambda: read_object(s3, stack.bucket, f"exp-tk/row-3/{ok}.json"), 30)
    assert good is not None and good["rewards"] == 1.0 and good["status_code"] == 200
    bad = wait_until(lambda: read_object(s3, stack.bucket, f"exp-tk/row-3/{broken}.json"), 30)
    assert bad is not None and bad["status_code"] == 500 and "rewards" not in bad  # toolkit's error object
    for sid in (ok, broken):
        acr.stop_runtime_session(agentRuntimeArn=stack.agent_runtime_arn, runtimeSessionId=sid)
    assert stack.stats().sessions_open == 0


def test_http_contract_start_and_get_through_boto3(http_stack, stack_env):
    stack = stack_env(http_stack)
    acr, arn, sid = boto3.client("bedrock-agentcore"), http_stack.agent_runtime_arn, new_sid()

    def call(envelope: dict, **row) -> dict:
        payload = {**row, "_config": {"expected": "yes"}, "_agentcore_runtime": {"version": 1, **envelope}}
        resp = acr.invoke_agent_runtime(agentRuntimeArn=arn, runtimeSessionId=sid, payload=json.dumps(payload))
        return json.loads(resp["response"].read())

    done = call({"operation": "start", "invocation_id": "fg-1"}, answer="yes")
    assert done["status"] == "completed" and done["result"] == {"reward": 1.0, "session_id": sid}
    started = call({"operation": "start", "invocation_id": "bg-1", "background": True}, answer="no", sleep_s=0.5)
    assert started["status"] == "in_progress"
    deadline = time.monotonic() + 20
    while (rec := call({"operation": "get", "invocation_id": "bg-1"}))["status"] == "in_progress":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert rec["status"] == "completed" and rec["result"]["reward"] == 0.0
    assert call({"operation": "get", "invocation_id": "never"})["status"] == "not_found"
    failed = call({"operation": "start", "invocation_id": "fail-1"}, fail=True)
    assert failed["status"] == "completed" and "asked to fail" in failed["error"] and "result" not in failed
    acr.stop_runtime_session(agentRuntimeArn=arn, runtimeSessionId=sid)
    assert stack.stats().sessions_open == 0


async def test_toolkit_http_client_runs_against_the_emulator(http_stack, stack_env):
    stack = stack_env(http_stack)
    sid = new_sid()
    async with AgentCoreHttpClient(stack.agent_runtime_arn) as client:
        result = await asyncio.wait_for(
            client.invoke({"answer": "yes", "_config": {"expected": "yes"}}, session_id=sid), timeout=30
        )
        assert result == {"reward": 1.0, "session_id": sid}
        handle = await client.invoke(
            {"answer": "x", "sleep_s": 0.3, "_config": {"expected": "yes"}}, session_id=sid, background=True
        )
        deadline = time.monotonic() + 20
        while (state := await handle.status())["status"] == "in_progress":  # get operations
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        assert state["result"]["reward"] == 0.0
        missing = await client.get_invocation(session_id=sid, invocation_id="nope").status()
        assert missing["status"] == "not_found"
        assert stack.stats().sessions_open == 1
        await client.stop_session(sid)
    assert stack.stats().sessions_open == 0 and stack.stats().stops >= 1
