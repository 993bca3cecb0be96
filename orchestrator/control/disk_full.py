"""A full disk named as one: which path ran out of space and what was being written there.

With the run directory on a 3 MB tmpfs the weight export failed inside the trainer actor: a raw
traceback, no summary.json. `disk_full` finds the out-of-space OSError (ENOSPC, or EDQUOT: a quota)
anywhere in an exception's chain, Ray's wrappers included (a RayTaskError keeps the remote error
in `.cause`), and `what_was_written` names the run file it hit by its place in the run directory.
orchestrator/main.py then ends the run with `run failed: ...` (exit 1) and a summary.json that says
so, keeping what was consistent: checkpoints are staged and renamed atomically
(orchestrator/control/checkpoint.py), so the last good one stays the one `checkpoints/latest` names;
metrics.jsonl keeps every whole line written.

Invariant: pure (no I/O); `disk_full` returns None for any other error, so nothing else is
re-worded as a full disk.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from pathlib import Path

OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT)
MAX_CHAIN = 32  # exceptions followed through __cause__ / __context__ / .cause (a cycle guard)

# a path's place in the run directory -> what the run was writing there (first match wins)
WRITTEN = (
    ("weights", "the policy weights exported for the inference engines (weight sync)"),
    ("checkpoints", "a checkpoint (the last complete one is kept; checkpoints/latest names it)"),
    ("metrics.jsonl", "the step metrics"),
    ("consumed_prompts.jsonl", "the consumed-prompt journal"),
    ("logs", "the run's logs"),
    ("report", "the run report"),
    ("acr_sessions", "the ACR session journal"),
)


@dataclass(frozen=True)
class DiskFull:
    """The out-of-space error found: the file it names (None when the error named none) and the errno."""

    path: str | None
    errno: int


def disk_full(exc: BaseException) -> DiskFull | None:
    """The out-of-space OSError in `exc`'s chain (itself, `__cause__`, `__context__`, Ray's
    `.cause`, an exception group's members), or None when there is none."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo and len(seen) < MAX_CHAIN:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in OUT_OF_SPACE:
            return DiskFull(path=e.filename, errno=e.errno)
        if isinstance(e, BaseExceptionGroup):  # a task group's failures
            todo.extend(e.exceptions)
        cause = getattr(e, "cause", None)
        todo.extend([cause if isinstance(cause, BaseException) else None, e.__cause__, e.__context__])
    return None


def what_was_written(path: str | None, run_dir: Path) -> str:
    """What the run was writing at `path`, by its place under `run_dir` ("a file" when unknown)."""
    if path is None:
        return "a file (the error named none)"
    try:
        parts = Path(path).resolve().relative_to(run_dir.resolve()).parts
    except ValueError:
        return f"a file outside the run directory ({path})"
    for name, what in WRITTEN:
        if parts and parts[0] == name:
            return what
    return f"{parts[0] if parts else path}"


def disk_full_message(found: DiskFull, run_dir: Path) -> str:
    """One line: which path ran out of space, what was being written, what to do."""
    where = found.path or str(run_dir)
    kind = "disk quota exceeded" if found.errno == errno.EDQUOT else "no space left on device"
    return (f"{kind} writing {where}: {what_was_written(found.path, run_dir)}. Free space there (or move "
            f"run_dir to a larger disk) and resume with trainer.resume_mode=auto; summary.json and the last "
            f"complete checkpoint are kept")
