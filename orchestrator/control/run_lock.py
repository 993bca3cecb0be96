"""One run per run directory: an exclusive lock on `RUN_DIR/run.lock`, held for the life of the run.

A second launch on a run directory in use used to overwrite the first run's `pids.json` and
`config.yaml` and write an `interrupted: true` summary into it. Pre-flight now takes this lock before
it changes anything in run_dir (staging folders, set-aside attempts, config.yaml); a second launch
fails at once with the holder's PID.

Invariant: while a process holds the lock, no other process acquires it; the kernel releases it when
the holder's last descriptor closes (normal exit, crash or SIGKILL alike), so a dead run never leaves
a stale lock. The lock is `flock(2)`, which conflicts between two open file descriptions even in one
process; a process that already holds a directory's lock gets it again (pre-flight may run twice in
one process: tests, a trainer restart). The file's text is the holder's PID, for the message only.
Caller: orchestrator/control/preflight.py.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from orchestrator.config import ConfigError

LOCK_NAME = "run.lock"
_HELD: dict[Path, int] = {}  # run_dir (resolved) -> the descriptor holding its lock, for this process's life


def holder_pid(run_dir: Path) -> int | None:
    """The PID written by the lock's holder (None when unreadable)."""
    try:
        return int((run_dir / LOCK_NAME).read_text().strip())
    except (OSError, ValueError):
        return None


def lock_run_dir(run_dir: Path) -> None:
    """Take `run_dir`'s lock for the rest of this process's life (run_dir must exist). Raises
    ConfigError naming run_dir and the holder's PID when another process holds it."""
    run_dir = run_dir.resolve()
    if run_dir in _HELD:
        return
    fd = os.open(run_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by child processes
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        pid = holder_pid(run_dir)
        raise ConfigError(f"run_dir {run_dir} is in use by another run (PID {pid if pid is not None else '?'}): "
                          "wait for it to end (or stop it: kill -INT <PID>), or choose another run_dir") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    _HELD[run_dir] = fd
