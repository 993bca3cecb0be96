"""Sandbox exec through InvokeAgentRuntimeCommand: the emulator's event stream and SandboxClient.

The event-stream encoder is checked against botocore's own decoder and parser; everything else
runs against the real emulator (LocalStack, one echo agent) with real boto3 clients.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import uuid

import boto3
import botocore.session
import pytest
from botocore.config import Config
from botocore.eventstream import EventStream, EventStreamBuffer
from botocore.exceptions import EventStreamError
from botocore.parsers import EventStreamJSONParser

from stand_ins import ECHO_AGENT, REPO
from workers.embedded.emulator_commands import chunk_event, exception_event

sys.path.insert(0, str(REPO / "examples/agents"))  # the agents' shared helpers, as an agent imports them
from agent_common.sandbox import SandboxClient, SandboxError, shell_command  # noqa: E402


# ----------------------------------------------------------------------------- wire format


class _RawStream:
    def __init__(self, data: bytes) -> None:
        self._data = data

    def stream(self):
        for i in range(0, len(self._data), 7):  # odd-sized pieces: messages span reads
            yield self._data[i : i + 7]

    def close(self) -> None:
        pass


def _botocore_stream(data: bytes) -> EventStream:
    model = botocore.session.get_session().get_service_model("bedrock-agentcore")
    shape = model.operation_model("InvokeAgentRuntimeCommand").get_event_stream_output()
    # the parser botocore hands to EventStream for rest-json services
    return EventStream(_RawStream(data), shape, EventStreamJSONParser(), "InvokeAgentRuntimeCommand")


def test_encoded_events_decode_with_botocore():
    events = [
        {"contentStart": {}},
        {"contentDelta": {"stdout": "héllo\n"}},
        {"contentStop": {"exitCode": 3, "status": "COMPLETED"}},
    ]
    data = b"".join(chunk_event(e) for e in events)
    buf = EventStreamBuffer()
    buf.add_data(data)
    messages = list(buf)
    assert [m.headers[":event-type"] for m in messages] == ["chunk"] * 3
    assert all(m.headers[":message-type"] == "event" for m in messages)  # CRCs were checked
    assert [json.loads(m.payload) for m in messages] == events
    assert [e["chunk"] for e in _botocore_stream(data)] == events


def test_exception_event_raises_event_stream_error_in_botocore():
    data = chunk_event({"contentStart": {}}) + exception_event("internalServerException", "boom")
    with pytest.raises(EventStreamError) as e:
        list(_botocore_stream(data))
    assert e.value.response["Error"] == {"Code": "internalServerException", "Message": "boom"}


def test_shell_command_quotes_every_word():
    cmd = shell_command(["echo", "a b", "$(rm -rf /)", "'"], cwd="my dir", env={"K": "v w"})
    assert cmd == "cd -- 'my dir' && export K='v w' && exec echo 'a b' '$(rm -rf /)' ''\"'\"''"
    with pytest.raises(TypeError):
        shell_command("echo hi")  # a string, not argv
    with pytest.raises(ValueError):
        shell_command(["true"], env={"BAD-NAME": "1"})


# ----------------------------------------------------------------------------- real emulator


@pytest.fixture(scope="module")
def stack(local_stack):
    return local_stack(ECHO_AGENT, num_agents=1)


@pytest.fixture()
def sandbox_client(stack, stack_env):
    stack_env(stack)
    return SandboxClient(stack.agent_runtime_arn, max_output_bytes=4096)


def test_raw_command_stream_is_start_deltas_stop(stack, stack_env):
    stack_env(stack)
    c = boto3.client("bedrock-agentcore")
    sid = f"cmd-session-{uuid.uuid4()}"
    resp = c.invoke_agent_runtime_command(
        agentRuntimeArn=stack.agent_runtime_arn,
        runtimeSessionId=sid,
        body={"command": "echo out; echo err >&2; exit 4", "timeout": 10},
    )
    assert resp["runtimeSessionId"] == sid
    chunks = [e["chunk"] for e in resp["stream"]]
    assert chunks[0] == {"contentStart": {}} and chunks[-1] == {"contentStop": {"exitCode": 4, "status": "COMPLETED"}}
    deltas = [c["contentDelta"] for c in chunks[1:-1]]
    assert "".join(d.get("stdout", "") for d in deltas) == "out\n"
    assert "".join(d.get("stderr", "") for d in deltas) == "err\n"
    with pytest.raises(c.exceptions.ValidationException):  # service bounds: timeout in [1, 3600]
        c.invoke_agent_runtime_command(
            agentRuntimeArn=stack.agent_runtime_arn, runtimeSessionId=sid, body={"command": "true", "timeout": 0}
        )
    assert stack.stats().commands >= 2
    c.stop_runtime_session(agentRuntimeArn=stack.agent_runtime_arn, runtimeSessionId=sid)


def test_exec_returns_exit_codes_and_output_as_results(sandbox_client):
    with sandbox_client.start() as sb:
        ok = sb.exec(["python3", "-c", "import sys; print('hi'); print('warn', file=sys.stderr)"], timeout_s=30)
        assert (ok.exit_code, ok.stdout, ok.stderr, ok.timed_out) == (0, "hi\n", "warn\n", False)
        bad = sb.exec(["sh", "-c", "exit 7"], timeout_s=10)
        assert bad.exit_code == 7 and not bad.timed_out
        missing = sb.exec(["no-such-program-xyz"], timeout_s=10)
        assert missing.exit_code == 127 and "not found" in missing.stderr
        literal = sb.exec(["echo", "$HOME", "a;b", "*"], timeout_s=10)
        assert literal.stdout == "$HOME a;b *\n"  # no shell expansion of arguments


def test_exec_uses_the_session_directory_cwd_and_env(sandbox_client):
    with sandbox_client.start() as a, sandbox_client.start() as b:
        assert a.exec(["mkdir", "sub"], timeout_s=10).exit_code == 0
        wrote = a.exec(["sh", "-c", "echo $GREETING > note.txt"], timeout_s=10, cwd="sub", env={"GREETING": "hello there"})
        assert wrote.exit_code == 0
        assert a.exec(["cat", "sub/note.txt"], timeout_s=10).stdout == "hello there\n"
        assert b.exec(["ls"], timeout_s=10).stdout == ""  # another session: another directory
        workdir = a.exec(["pwd"], timeout_s=10).stdout.strip()
        assert os.path.isdir(workdir)
        assert a.exec(["true"], timeout_s=10, cwd="nope").exit_code != 0  # a failed cd is a result
    assert not os.path.exists(workdir)  # removed with the session


def test_timeout_kills_the_command_and_is_a_result(sandbox_client):
    with sandbox_client.start() as sb:
        t0 = time.monotonic()
        r = sb.exec(["sh", "-c", "echo started; sleep 30 & wait"], timeout_s=1)
        assert r.timed_out and r.exit_code == -1 and r.stdout == "started\n"
        assert time.monotonic() - t0 < 10  # the whole process group died at the deadline


def test_output_is_capped_per_stream_and_flagged(sandbox_client):
    with sandbox_client.start() as sb:
        r = sb.exec(["python3", "-c", "import sys; print('é' * 5000); print('e', file=sys.stderr)"], timeout_s=30)
        assert r.exit_code == 0 and r.stdout_truncated and not r.stderr_truncated
        assert len(r.stdout.encode()) <= 4096 and set(r.stdout) == {"é"}  # cut on a character boundary
        assert r.stderr == "e\n"


def test_stopping_the_session_kills_its_running_command(sandbox_client):
    sb = sandbox_client.start()
    results = []
    t = threading.Thread(target=lambda: results.append(sb.exec(["sleep", "60"], timeout_s=120)))
    t.start()
    time.sleep(0.5)
    assert sb.stop() is True and sb.stop() is False
    t.join(15)
    assert not t.is_alive() and results[0].exit_code == 137 and not results[0].timed_out  # SIGKILL
    # what the dead container was about to run next never reopens the session (it would stay billed)
    again = sandbox_client.attach(sb.session_id)  # e.g. an agent thread that attached before the stop
    with pytest.raises(sandbox_client._client.exceptions.ResourceNotFoundException, match="was stopped"):
        again.exec(["true"], timeout_s=5)
    assert again.stop() is False


def test_transport_failures_raise(stack, stack_env):
    stack_env(stack)
    wrong = SandboxClient(stack.agent_runtime_arn.replace("emulator0", "nobody"), max_attempts=1)
    with pytest.raises(wrong._client.exceptions.ResourceNotFoundException):
        wrong.start()
    with pytest.raises(ValueError):
        SandboxClient(stack.agent_runtime_arn).attach("short")
    no_retry = Config(retries={"total_max_attempts": 1})
    dead = boto3.client("bedrock-agentcore", endpoint_url="http://127.0.0.1:9", config=no_retry)
    with pytest.raises(Exception) as e:
        SandboxClient(stack.agent_runtime_arn, client=dead).attach(f"s-{uuid.uuid4()}").exec(["true"], timeout_s=5)
    assert not isinstance(e.value, SandboxError)  # botocore's connection error, not a result
