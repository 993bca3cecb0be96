"""InvokeAgentRuntimeCommand for the ACR emulator: run a shell command in a session's sandbox
and stream its output as an AWS event stream that botocore parses.

Wire format (botocore service model bedrock-agentcore 2024-02-28): the response body is
`application/vnd.amazon.eventstream`; each message has headers `:message-type: event`,
`:event-type: chunk`, `:content-type: application/json` and a JSON payload, in order:
`{"contentStart": {}}`, then any number of `{"contentDelta": {"stdout": s}}` /
`{"contentDelta": {"stderr": s}}`, then `{"contentStop": {"exitCode": n, "status":
"COMPLETED" | "TIMED_OUT"}}`. An error after the stream started is one `:message-type:
exception` message whose `:exception-type` names a member of the stream shape (e.g.
`internalServerException`); botocore raises it as EventStreamError while iterating.

Invariants:
- a command runs as `/bin/sh -c <command>` in its own process group, in the session's working
  directory (`Workspaces`: one temp dir per session, created on first use, removed with every
  process still running in it when the session stops or expires);
- at the deadline the whole process group is SIGKILLed; the stop event then says TIMED_OUT
  with exitCode -1 (ACR: -1 = platform error, killed); a process killed by another signal n
  reports 128 + n, as a shell would;
- each stream forwards at most `max_output_bytes` bytes (decoded as UTF-8, invalid bytes
  replaced); the rest is read and dropped, so a chatty command never blocks on a full pipe.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import os
import shutil
import signal
import struct
import tempfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable

EVENTSTREAM_CONTENT_TYPE = "application/vnd.amazon.eventstream"
DEFAULT_COMMAND_TIMEOUT_S = 300  # service model: default 300 s
MIN_COMMAND_TIMEOUT_S, MAX_COMMAND_TIMEOUT_S = 1, 3600  # service model bounds
MAX_COMMAND_CHARS = 65_536  # service model: command string max length
DEFAULT_MAX_OUTPUT_BYTES = 1 << 20  # per stream; above the SandboxClient's default cap on purpose
READ_CHUNK_BYTES = 64 * 1024
KILL_WAIT_S = 5.0  # after SIGKILL of the group: wait this long for its pipes to close
_STRING_HEADER = 7  # event-stream header value type: string


# ----------------------------------------------------------------------------- event stream


def encode_message(headers: dict[str, str], payload: bytes) -> bytes:
    """One AWS event-stream message: prelude (total length, headers length, CRC32), string
    headers, payload, message CRC32 (big endian). The format botocore.eventstream decodes."""
    parts = []
    for name, value in headers.items():
        k, v = name.encode(), value.encode()
        parts.append(struct.pack("!B", len(k)) + k + struct.pack("!BH", _STRING_HEADER, len(v)) + v)
    hdr = b"".join(parts)
    total = 12 + len(hdr) + len(payload) + 4
    prelude = struct.pack("!II", total, len(hdr))
    prelude += struct.pack("!I", zlib.crc32(prelude) & 0xFFFFFFFF)
    body = prelude + hdr + payload
    return body + struct.pack("!I", zlib.crc32(body) & 0xFFFFFFFF)


def chunk_event(chunk: dict) -> bytes:
    """A `chunk` event carrying one ResponseChunk member (contentStart / contentDelta / contentStop)."""
    headers = {":message-type": "event", ":event-type": "chunk", ":content-type": "application/json"}
    return encode_message(headers, json.dumps(chunk).encode())


def exception_event(member: str, message: str) -> bytes:
    """An exception event; `member` is the stream shape's member name, e.g. internalServerException."""
    headers = {":message-type": "exception", ":exception-type": member, ":content-type": "application/json"}
    return encode_message(headers, json.dumps({"message": message}).encode())


# ----------------------------------------------------------------------------- workspaces


@dataclass
class _Workspace:
    path: Path
    procs: set[asyncio.subprocess.Process] = field(default_factory=set)


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class Workspaces:
    """One working directory per session under `root`, and the command processes running in it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._by_session: dict[str, _Workspace] = {}

    def path(self, session_id: str) -> Path:
        """The session's directory, created on first use."""
        ws = self._by_session.get(session_id)
        if ws is None:
            ws = _Workspace(Path(tempfile.mkdtemp(prefix="session-", dir=self.root)))
            self._by_session[session_id] = ws
        return ws.path

    def attach(self, session_id: str, proc: asyncio.subprocess.Process) -> None:
        self._by_session[session_id].procs.add(proc)

    def detach(self, session_id: str, proc: asyncio.subprocess.Process) -> None:
        ws = self._by_session.get(session_id)
        if ws is not None:
            ws.procs.discard(proc)

    def close(self, session_id: str) -> None:
        """Kill the session's running commands (process groups) and remove its directory."""
        ws = self._by_session.pop(session_id, None)
        if ws is None:
            return
        for proc in list(ws.procs):
            _kill_group(proc)
        shutil.rmtree(ws.path, ignore_errors=True)

    def close_all(self) -> None:
        for sid in list(self._by_session):
            self.close(sid)

    def open_count(self) -> int:
        return len(self._by_session)


# ----------------------------------------------------------------------------- running


@dataclass(frozen=True)
class CommandOutcome:
    exit_code: int
    status: str  # "COMPLETED" | "TIMED_OUT"
    stdout_bytes: int  # total bytes the command wrote, forwarded or not
    stderr_bytes: int


async def run_command(
    command: str,
    cwd: Path,
    timeout_s: float,
    max_output_bytes: int,
    send: Callable[[bytes], Awaitable[None]],
    on_start: Callable[[asyncio.subprocess.Process], None] = lambda p: None,
) -> CommandOutcome:
    """Run `command` with /bin/sh in `cwd`, calling `send` with each encoded event in order
    (contentStart, contentDelta..., contentStop). Kills the process group at the deadline, and
    when `send` raises (client gone) before re-raising. See the module invariants."""
    proc = await asyncio.create_subprocess_exec(
        "/bin/sh", "-c", command, cwd=str(cwd), stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    on_start(proc)
    queue: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue()
    totals = {"stdout": 0, "stderr": 0}

    async def pump(name: str, stream: asyncio.StreamReader) -> None:
        while data := await stream.read(READ_CHUNK_BYTES):
            await queue.put((name, data))

    pumps = [asyncio.create_task(pump("stdout", proc.stdout)), asyncio.create_task(pump("stderr", proc.stderr))]
    done = asyncio.create_task(_wait_all(proc, pumps))
    decoders = {n: codecs.getincrementaldecoder("utf-8")(errors="replace") for n in totals}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    timed_out = False

    async def forward(name: str, data: bytes) -> None:
        keep = max(0, min(len(data), max_output_bytes - totals[name]))
        totals[name] += len(data)
        if keep and (text := decoders[name].decode(data[:keep])):
            await send(chunk_event({"contentDelta": {name: text}}))

    async def drain() -> None:
        while not queue.empty():
            await forward(*queue.get_nowait())

    try:
        await send(chunk_event({"contentStart": {}}))
        while True:
            if done.done():
                await drain()
                break
            remaining = deadline - loop.time()
            if remaining <= 0:
                timed_out = True
                _kill_group(proc)
                # pipes close when the group dies; a child that left the group may hold them
                await asyncio.wait({done}, timeout=KILL_WAIT_S)
                await drain()
                break
            getter = asyncio.ensure_future(queue.get())
            await asyncio.wait({getter, done}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            if getter.done():
                await forward(*getter.result())
            else:
                getter.cancel()
        for name, dec in decoders.items():
            tail = dec.decode(b"", final=True)
            if tail and totals[name] <= max_output_bytes:
                await send(chunk_event({"contentDelta": {name: tail}}))
        if proc.returncode is None:
            await asyncio.wait({asyncio.ensure_future(proc.wait())}, timeout=KILL_WAIT_S)
        rc = proc.returncode if proc.returncode is not None else -1
        exit_code = -1 if timed_out else (128 - rc if rc < 0 else rc)
        status = "TIMED_OUT" if timed_out else "COMPLETED"
        await send(chunk_event({"contentStop": {"exitCode": exit_code, "status": status}}))
        return CommandOutcome(exit_code, status, totals["stdout"], totals["stderr"])
    finally:
        _kill_group(proc)
        for t in (*pumps, done):
            t.cancel()


async def _wait_all(proc: asyncio.subprocess.Process, pumps: list[asyncio.Task]) -> None:
    await asyncio.gather(*pumps)
    await proc.wait()
