"""Servers of the local stack report the port they bound through a ready file.

A child server binds port 0 itself (no port is picked for it, so none can be taken between picking
and binding), then calls `write_ready_file(path, {"endpoint": ..., ...})` once it serves. The
parent waits with `wait_ready_file`, which returns that dict.

Invariants: the file appears complete or not at all (written beside, then renamed into place);
`wait_ready_file` returns only a file written after the child started (the parent passes a path
that does not exist yet), and raises `ServerNotReady` with the child's log tail when the child
exits first or the deadline passes.

Callers: workers.embedded.emulator and workers.embedded.moto_s3 write; workers.embedded.local_stack waits.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

LOG_TAIL_BYTES = 4000  # of a child's log quoted in ServerNotReady
POLL_MAX_S = 0.2  # longest pause between two looks at the ready file


class ServerNotReady(RuntimeError):
    """A child server exited or did not write its ready file in time; the message has its log tail."""


def write_ready_file(path: str | Path, info: dict[str, Any]) -> None:
    """Write `info` as JSON to `path` atomically (a temporary file beside it, then rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, path)


def wait_ready_file(
    name: str, path: Path, proc: subprocess.Popen, timeout_s: float, log_path: Path | None = None
) -> dict[str, Any]:
    """Wait until `proc` has written `path`; return its JSON.

    Raises ServerNotReady naming `name` when `proc` exits first or `timeout_s` passes.
    """
    deadline = time.monotonic() + timeout_s
    delay_s = 0.01
    while True:
        if path.exists():
            return json.loads(path.read_text())
        if proc.poll() is not None:
            raise ServerNotReady(f"{name} exited with {proc.returncode}; log tail:\n{log_tail(log_path)}")
        if time.monotonic() > deadline:
            raise ServerNotReady(f"{name} not ready within {timeout_s}s; log tail:\n{log_tail(log_path)}")
        time.sleep(delay_s)
        delay_s = min(delay_s * 2, POLL_MAX_S)


def log_tail(path: Path | None, num_bytes: int = LOG_TAIL_BYTES) -> str:
    """The last `num_bytes` of a log file, decoded; "<no log>" when there is none."""
    try:
        data = path.read_bytes() if path is not None else b""
    except OSError:
        return "<no log>"
    return data[-num_bytes:].decode(errors="replace") if data else "<no log>"
