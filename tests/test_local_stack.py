"""LocalStack end to end: moto S3 + ACR emulator + the letters agent + a real fake model server.

The model endpoint is a small real OpenAI-compatible aiohttp app on 127.0.0.1 (its own thread
and event loop) that answers a fixed completion; the agent reaches it with the official openai
SDK. Results travel the production path: agent -> S3 (moto) -> AsyncAcrClient.wait_for_result.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import uuid
from pathlib import Path

import psutil
import pytest

from stand_ins import ECHO_AGENT, LETTERS_AGENT, TOOLKIT_S3_AGENT, ScriptedChatServer, chat_completion, wait_until
from stand_ins import BlockingAcr
from workers.acr.client import AsyncAcrClient
from workers.embedded.local_stack import LocalStack, LocalStackError

COMPLETION = "q q q q"
HOLD_PROMPT = "hold"  # the fake model waits for release() before answering this prompt
ERROR_PROMPT = "error"  # the fake model answers HTTP 500 to this prompt


class FakeOpenAIServer(ScriptedChatServer):
    """The scripted chat server (stand_ins) answering COMPLETION; it waits for release() before
    answering HOLD_PROMPT and answers HTTP 500 to ERROR_PROMPT."""

    def __init__(self) -> None:
        super().__init__(self._reply)
        self._release = threading.Event()

    def release(self) -> None:
        self._release.set()

    async def _reply(self, body: dict) -> tuple[int, dict]:
        prompt = body["messages"][-1]["content"]
        if prompt == ERROR_PROMPT:
            return 500, {"error": {"message": "boom", "type": "server_error"}}
        if prompt == HOLD_PROMPT:
            await asyncio.get_running_loop().run_in_executor(None, self._release.wait, 60)
        return 200, chat_completion(body, {"role": "assistant", "content": COMPLETION})

    def stop(self) -> None:
        self._release.set()
        super().stop()


@pytest.fixture(scope="module")
def fake_model():
    server = FakeOpenAIServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def letters_stack(local_stack):
    return local_stack(LETTERS_AGENT, num_agents=2)


@pytest.fixture()
def letters_env(letters_stack, stack_env):
    return stack_env(letters_stack)


def payload(stack: LocalStack, model: FakeOpenAIServer, *, prompt: str, count: int, input_id: str) -> dict:
    row = {"prompt": prompt, "letter": "q", "count": count, "max_tokens": 16}
    rollout = {
        "exp_id": "exp-test",
        "input_id": input_id,
        "s3_bucket": stack.bucket,
        "base_url": model.base_url,
        "model_id": "tiny-model",
        "api_key": "session-token-123",
        "temperature": 0.7,
    }
    return {**row, "_rollout": rollout}


def agent_ping(port: int) -> str:
    import json
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=5) as r:
        return json.loads(r.read())["status"]




def test_agent_writes_its_reward_to_s3_and_wait_for_result_finds_it(letters_env, fake_model):
    c = BlockingAcr()
    arn = letters_env.agent_runtime_arn
    sid = f"rollout-{uuid.uuid4()}"
    # count 8, answer "q q q q": 4 right of max(8, 4) -> reward 0.5 (reward.py formula)
    ack = c.invoke(arn, sid, payload(letters_env, fake_model, prompt="Repeat the letter q 8 times.", count=8, input_id="row-1"))
    key = f"exp-test/row-1/{sid}.json"
    assert ack == {"status": "processing", "s3_bucket": letters_env.bucket, "result_key": key}
    result = c.wait_for_result(letters_env.bucket, key, timeout_s=30)
    assert result == {"rewards": 0.5}
    req = next(r for r in fake_model.requests if r["messages"][0]["content"] == "Repeat the letter q 8 times.")
    assert req["auth"] == "Bearer session-token-123"
    assert (req["model"], req["temperature"], req["max_tokens"]) == ("tiny-model", 0.7, 16)
    assert c.stop_session(arn, sid)


def test_ping_is_healthy_busy_while_a_rollout_runs(letters_env, fake_model):
    c = BlockingAcr()
    arn = letters_env.agent_runtime_arn
    sid = f"rollout-{uuid.uuid4()}"
    c.invoke(arn, sid, payload(letters_env, fake_model, prompt=HOLD_PROMPT, count=4, input_id="row-hold"))
    stats = letters_env.stats()
    port = stats.agent_ports[stats.open_per_agent.index(1)] if 1 in stats.open_per_agent else None
    assert port is not None
    assert agent_ping(port) == "HealthyBusy"  # registered before the invocation answered
    assert c.wait_for_result(letters_env.bucket, f"exp-test/row-hold/{sid}.json", timeout_s=0.3) is None
    fake_model.release()
    assert c.wait_for_result(letters_env.bucket, f"exp-test/row-hold/{sid}.json", timeout_s=30) == {"rewards": 1.0}
    assert wait_until(lambda: agent_ping(port) == "Healthy", 10)
    assert c.stop_session(arn, sid)


def test_model_error_writes_an_error_object_and_no_reward(letters_env, fake_model):
    c = BlockingAcr()
    arn = letters_env.agent_runtime_arn
    sid = f"rollout-{uuid.uuid4()}"
    c.invoke(arn, sid, payload(letters_env, fake_model, prompt=ERROR_PROMPT, count=4, input_id="row-err"))
    port = letters_env.stats().agent_ports[letters_env.stats().open_per_agent.index(1)]
    assert wait_until(lambda: any(r["messages"][0]["content"] == ERROR_PROMPT for r in fake_model.requests), 10)
    assert wait_until(lambda: agent_ping(port) == "Healthy", 10)  # the rollout has ended
    result = c.wait_for_result(letters_env.bucket, f"exp-test/row-err/{sid}.json", timeout_s=5)
    assert result is not None and result["status_code"] == 500 and "rewards" not in result  # toolkit's error shape
    assert c.stop_session(arn, sid)


async def test_async_client_runs_the_same_flow(letters_env, fake_model):
    async with AsyncAcrClient() as c:
        arn = letters_env.agent_runtime_arn
        sid = f"rollout-{uuid.uuid4()}"
        ack = await c.invoke(arn, sid, payload(letters_env, fake_model, prompt="Repeat.", count=4, input_id="row-a"))
        assert await c.wait_for_result(letters_env.bucket, ack["result_key"], timeout_s=30) == {"rewards": 1.0}
        assert await c.wait_for_result(letters_env.bucket, "exp-test/none/x.json", timeout_s=0.2) is None
        assert await c.stop_session(arn, sid) is True
        assert await c.stop_session(arn, sid) is False
        assert c.stats().invocations == 1 and c.stats().stops == 1
    assert letters_env.stats().sessions_open == 0


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_moto_keeps_no_object_of_a_deleted_key(letters_stack):
    """Soak finding: moto's models record every instance they create (its /moto-api dashboard
    data), so a deleted key's objects were never freed (RSS +5 KB per request, 77 -> 756 MB over a
    long run). The stand-in turns that off (workers/embedded/moto_s3.py): after puts, reads and
    deletes over real sockets, moto's own instance list holds no key at all."""
    import json
    import urllib.request

    import boto3

    s3 = boto3.client("s3", endpoint_url=letters_stack.s3_endpoint, region_name="us-east-1",
                      aws_access_key_id="test", aws_secret_access_key="test")
    prefix = f"tracked-{uuid.uuid4().hex}"
    for i in range(20):
        key = f"{prefix}/{i}.json"
        s3.put_object(Bucket=letters_stack.bucket, Key=key, Body=b'{"reward": 1.0}')
        assert s3.get_object(Bucket=letters_stack.bucket, Key=key)["Body"].read() == b'{"reward": 1.0}'
        s3.delete_object(Bucket=letters_stack.bucket, Key=key)
    assert s3.list_objects_v2(Bucket=letters_stack.bucket, Prefix=prefix)["KeyCount"] == 0
    with urllib.request.urlopen(f"{letters_stack.s3_endpoint}/moto-api/data.json", timeout=30) as r:
        tracked = json.loads(r.read())
    assert tracked["s3"]["FakeKey"] == [] and tracked["s3"]["FakeBucket"] == []


def test_stop_leaves_no_process_alive(letters_stack):
    pids = list(letters_stack.pids().values()) + list(letters_stack.stats().agent_pids)
    assert len(pids) == 4 and not any(_gone(p) for p in pids)
    letters_stack.stop()
    letters_stack.stop()  # idempotent
    assert letters_stack.pids() == {}
    assert wait_until(lambda: all(_gone(p) for p in pids), 10), [p for p in pids if not _gone(p)]


def test_failed_startup_stops_what_it_started(tmp_path):
    bad_agent = [sys.executable, "-c", "import sys; sys.exit(3)"]
    stack = LocalStack(bad_agent, num_agents=1, startup_timeout_s=30, log_dir=tmp_path)
    with pytest.raises(LocalStackError, match="emulator exited"):
        stack.start()
    assert stack.pids() == {}
    assert "exited with 3" in (tmp_path / "emulator.log").read_text()
    started = stack.started_pids()
    assert set(started) == {"moto", "emulator"}
    assert all(_gone(p) for p in started.values())  # moto was healthy, then stopped by PID


def test_agents_die_with_a_killed_emulator(tmp_path):
    with LocalStack(ECHO_AGENT, num_agents=1, log_dir=tmp_path) as stack:
        agent_pids = stack.stats().agent_pids
        os.kill(stack.pids()["emulator"], signal.SIGKILL)  # no chance to clean up
        assert wait_until(lambda: all(_gone(p) for p in agent_pids), 15)  # PR_SET_PDEATHSIG


def test_agentcore_rl_toolkit_agent_runs_unchanged(tmp_path, stack_env):
    with LocalStack(TOOLKIT_S3_AGENT, num_agents=1, log_dir=tmp_path) as stack:
        stack_env(stack)
        c = BlockingAcr()
        sid = f"rollout-{uuid.uuid4()}"
        rollout = {"exp_id": "exp-tk", "input_id": "row-7", "s3_bucket": stack.bucket}
        ack = c.invoke(stack.agent_runtime_arn, sid, {"answer": "yes", "_rollout": rollout})
        assert ack["result_key"] == f"exp-tk/row-7/{sid}.json"  # the toolkit read ACR's session header
        result = c.wait_for_result(stack.bucket, ack["result_key"], timeout_s=30)
        assert result is not None and result["rewards"] == 1.0 and result["status_code"] == 200
        assert c.stop_session(stack.agent_runtime_arn, sid)


def test_a_bad_agent_cmd_exits_2_naming_the_key_and_quoting_the_agent(tmp_path):
    # the main job starts the ACR stack, whose agent exits at once: a `config error:` naming
    # rollout.acr.agent_cmd with the agent's own output, before the first step (the run dir stays
    # reusable); tests/test_new_user_errors.py has the mistakes caught before anything starts
    import subprocess

    script = tmp_path / "bad_agent.py"
    script.write_text("import sys\nprint('agent: unknown option --bogus', file=sys.stderr)\nsys.exit(2)\n")
    run_dir = tmp_path / "agent"
    agent = subprocess.run([sys.executable, "-m", "orchestrator.main", "logger=console",
                            f"rollout.acr.agent_cmd='{sys.executable} {script}'", f"run_dir={run_dir}"],
                           cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=240)
    assert agent.returncode == 2, agent.stderr[-3000:]
    assert agent.stderr.startswith("config error: rollout.acr.agent_cmd"), agent.stderr[-3000:]
    assert "the agent did not start (agent 0" in agent.stderr and "| agent: unknown option --bogus" in agent.stderr
    assert "Traceback" not in agent.stderr
    assert not (run_dir / "metrics.jsonl").exists()  # failed before its first step: a rerun may reuse run_dir
