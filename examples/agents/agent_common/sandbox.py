"""Run commands in an ACR session's sandbox through `InvokeAgentRuntimeCommand` (boto3).

In the spirit of agentcore-rl-toolkit's `SandboxClient` (0.2.0, `agentcore_rl_toolkit.sandbox`),
but over ACR's own command API rather than its `agentcore-sandboxd` daemon: `SandboxClient(arn).start()`
opens a session (its first command creates it), `Sandbox.exec(argv, timeout_s, cwd, env)` runs one
program and returns an `ExecResult` (the toolkit's fields), `Sandbox.stop()` (alias `terminate()`, the
toolkit's name; or leaving the `with` block) calls StopRuntimeSession. Agents and their graders use
it (grading.py); it is blocking and thread-safe, so async callers use `asyncio.to_thread`. It lives
with the example agents' shared helpers and imports only boto3, so an agent container depends on it
by copying `agent_common/` (or putting `examples/agents` on its path), not on the orchestrator.

Contract of `exec`:
- a non-zero exit and a timeout are results (`exit_code`, `timed_out`), never exceptions. The
  toolkit 0.2.0 differs on timeouts: its `exec` raises `ExecTimeoutError` carrying the same
  `ExecResult` in `.result`; grading.py accepts both;
- each output stream keeps its first `max_output_bytes` bytes (UTF-8; cut on a character
  boundary) and says so in `stdout_truncated` / `stderr_truncated`; the local emulator
  (workers.embedded.emulator_commands) caps its own streams higher (1 MiB), so a truncation there
  is always flagged here too;
- a transport or service failure raises: botocore's ClientError subclasses for HTTP errors and
  for exception events in the stream (EventStreamError), `SandboxError` for a stream that breaks
  the protocol (no contentStop). botocore's retry mode retries errors before the stream starts.

The command API takes one shell string; argv, cwd and env become
`cd -- CWD && export K=V && exec ARGV...` with every word shell-quoted, so no argument is ever
interpreted by the shell. A relative cwd is relative to the session's working directory.
"""

from __future__ import annotations

import math
import re
import shlex
import uuid
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import boto3
from botocore.config import Config

DEFAULT_MAX_OUTPUT_BYTES = 256 * 1024  # per stream, like agentcore-sandboxd
DEFAULT_TIMEOUT_S = 300.0  # service default
MIN_TIMEOUT_S, MAX_TIMEOUT_S = 1, 3600  # service model bounds of InvokeAgentRuntimeCommand.timeout
READ_TIMEOUT_MARGIN_S = 60.0  # socket read timeout = the longest command + this
SESSION_ID_MIN_LEN, SESSION_ID_MAX_LEN = 33, 256
_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class ExecResult:
    """Outcome of one command. exit_code: the program's status (-1 when killed at the deadline;
    128 + n when killed by signal n; 126/127 when it could not be started)."""

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool
    stdout_truncated: bool = False
    stderr_truncated: bool = False


class SandboxError(RuntimeError):
    """The command stream broke ACR's protocol (for example it ended without contentStop)."""


def shell_command(argv: Sequence[str], cwd: str | None = None, env: Mapping[str, str] | None = None) -> str:
    """The `/bin/sh -c` string that runs argv in cwd with env; every word quoted.

    Raises TypeError on a non-list argv or non-string items, ValueError on an empty argv or an
    environment name that is not a shell identifier.
    """
    if isinstance(argv, (str, bytes)) or not all(isinstance(a, str) for a in argv):
        raise TypeError("argv must be a sequence of strings, e.g. ['pytest', '-q']")
    if not argv:
        raise ValueError("argv must not be empty")
    steps = []
    if cwd is not None:
        steps.append(f"cd -- {shlex.quote(cwd)}")
    for name, value in (env or {}).items():
        if not _ENV_NAME_RE.fullmatch(name):
            raise ValueError(f"env name {name!r} is not a valid variable name")
        steps.append(f"export {name}={shlex.quote(str(value))}")
    steps.append("exec " + shlex.join(argv))
    return " && ".join(steps)


class _Capped:
    """Collects one stream's text up to a byte cap."""

    def __init__(self, cap_bytes: int) -> None:
        self._cap = cap_bytes
        self._parts: list[bytes] = []
        self._kept = 0
        self.truncated = False

    def add(self, text: str) -> None:
        data = text.encode()
        room = self._cap - self._kept
        if len(data) > room:
            self.truncated = True
            data = data[: max(0, room)]
        self._parts.append(data)
        self._kept += len(data)

    def text(self) -> str:
        return b"".join(self._parts).decode(errors="ignore")  # drops a character cut at the cap


class SandboxClient:
    """Client bound to one agent runtime (data plane). Endpoint, region and credentials come
    from the standard AWS configuration (AWS_ENDPOINT_URL_BEDROCK_AGENTCORE locally).

    client: an existing boto3 `bedrock-agentcore` client to use instead of making one.
    """

    def __init__(
        self,
        runtime_arn: str,
        *,
        qualifier: str = "DEFAULT",
        max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
        region: str | None = None,
        max_attempts: int = 5,
        client: Any | None = None,
    ) -> None:
        if max_output_bytes < 1:
            raise ValueError(f"max_output_bytes must be >= 1, got {max_output_bytes}")
        self.runtime_arn = runtime_arn
        self.qualifier = qualifier
        self.max_output_bytes = max_output_bytes
        if client is None:
            config = Config(
                retries={"mode": "standard", "total_max_attempts": max_attempts},
                read_timeout=MAX_TIMEOUT_S + READ_TIMEOUT_MARGIN_S,
            )
            parts = runtime_arn.split(":")
            region = region or (parts[3] if len(parts) > 3 and parts[3] else None)
            client = boto3.client("bedrock-agentcore", region_name=region, config=config)
        self._client = client

    def start(self, session_id: str | None = None) -> "Sandbox":
        """Open a session (runs `true` in it, which creates it) and return its handle."""
        sandbox = self.attach(session_id or f"sandbox-{uuid.uuid4()}")
        result = sandbox.exec(["true"], timeout_s=60)
        if result.exit_code != 0:
            raise SandboxError(f"sandbox session {sandbox.session_id} did not start: {result}")
        return sandbox

    def attach(self, session_id: str) -> "Sandbox":
        """A handle on an existing (or to be created) session; no call is made."""
        if not SESSION_ID_MIN_LEN <= len(session_id) <= SESSION_ID_MAX_LEN:
            bounds = f"{SESSION_ID_MIN_LEN}-{SESSION_ID_MAX_LEN}"
            raise ValueError(f"session_id must be {bounds} characters, got {len(session_id)}")
        return Sandbox(self, session_id)


class Sandbox:
    """One sandbox session. A context manager: leaving it stops the session."""

    def __init__(self, client: SandboxClient, session_id: str) -> None:
        self._c = client
        self.session_id = session_id
        self.stopped = False

    def exec(
        self,
        argv: Sequence[str],
        timeout_s: float = DEFAULT_TIMEOUT_S,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        *,
        timeout: float | None = None,
    ) -> ExecResult:
        """Run argv in the session; see the module docstring for what raises and what returns.

        timeout_s (or `timeout`, the toolkit's name, which wins when given) is rounded up to whole
        seconds and must lie in [1, 3600] (ValueError).
        """
        if timeout is not None:
            timeout_s = timeout
        if self.stopped:
            raise RuntimeError(f"sandbox {self.session_id} is stopped")
        timeout = math.ceil(timeout_s)
        if not MIN_TIMEOUT_S <= timeout <= MAX_TIMEOUT_S:
            raise ValueError(f"timeout_s must be in [{MIN_TIMEOUT_S}, {MAX_TIMEOUT_S}], got {timeout_s}")
        resp = self._c._client.invoke_agent_runtime_command(
            agentRuntimeArn=self._c.runtime_arn,
            runtimeSessionId=self.session_id,
            qualifier=self._c.qualifier,
            contentType="application/json",
            accept="application/vnd.amazon.eventstream",
            body={"command": shell_command(argv, cwd, env), "timeout": timeout},
        )
        out, err = _Capped(self._c.max_output_bytes), _Capped(self._c.max_output_bytes)
        stop = None
        for event in resp["stream"]:
            chunk = event.get("chunk")
            if chunk is None:
                raise SandboxError(f"unexpected event in command stream: {sorted(event)}")
            if "contentDelta" in chunk:
                delta = chunk["contentDelta"]
                if "stdout" in delta:
                    out.add(delta["stdout"])
                if "stderr" in delta:
                    err.add(delta["stderr"])
            elif "contentStop" in chunk:
                stop = chunk["contentStop"]
        if stop is None:
            raise SandboxError(f"command stream of session {self.session_id} ended without contentStop")
        return ExecResult(
            exit_code=int(stop["exitCode"]),
            stdout=out.text(),
            stderr=err.text(),
            timed_out=stop["status"] == "TIMED_OUT",
            stdout_truncated=out.truncated,
            stderr_truncated=err.truncated,
        )

    def stop(self) -> bool:
        """StopRuntimeSession; True if this call stopped it, False if it was not open. Idempotent."""
        if self.stopped:
            return False
        self.stopped = True
        try:
            self._c._client.stop_runtime_session(
                agentRuntimeArn=self._c.runtime_arn, runtimeSessionId=self.session_id, qualifier=self._c.qualifier
            )
        except self._c._client.exceptions.ResourceNotFoundException:
            return False
        return True

    def terminate(self) -> None:
        """The toolkit's name for `stop` (idempotent)."""
        self.stop()

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
