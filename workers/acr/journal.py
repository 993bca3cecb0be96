"""The open-session journal of a run: every ACR session the run may hold open, on disk in run_dir.

ACR bills a session until it is stopped or reaches its idle timeout. A run that ends normally (or
on Ctrl-C) stops its sessions itself; one killed outright (SIGKILL, OOM, a lost node) cannot. The
journal is what such a run leaves behind, so that the next start of the same run_dir and the run's
reaper can stop those sessions through the real StopRuntimeSession call (workers/acr/sweep.py).

Layout: `RUN_DIR/acr_sessions/<name>.json`, one small JSON object per session:
`{"session_id", "arn", "qualifier", "local"}`. `local`: the session was opened on the run's own
embedded emulator, which dies with the run that started it (workers/embedded/local_stack.py), so it
needs no stop call. An entry is written under a temporary name and renamed into place: a reader
never sees half of one. The session id is in the entry; the file name is only a unique key.

Invariant: a session has its entry from before its invoke is dispatched until its stop is known
to have succeeded (or ACR no longer knew it). An entry may outlive its session (a stop that could
not be confirmed, a request cancelled before its invoke): stopping it again is harmless, ACR answers
ResourceNotFound. Entries survive the death of the process, not the loss of the disk (no fsync per
rollout; keep run_dir on shared storage for a node that may be lost with its disk).

Writers: the driver's rollout pool (workers/rollout/pool.py). Readers: workers/acr/sweep.py.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import uuid
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)

JOURNAL_DIRNAME = "acr_sessions"
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
_TMP_PREFIX = ".tmp-"


@dataclass(frozen=True)
class JournalEntry:
    """One session the run may hold open: its id, the runtime it was opened on, and whether that
    runtime is the run's own embedded emulator (`local`: no stop call needed once the run is gone)."""

    session_id: str
    arn: str
    qualifier: str | None = None
    local: bool = False


def _file_name(session_id: str) -> str:
    if _SAFE_NAME.match(session_id):
        return session_id + ".json"
    return "h-" + hashlib.sha256(session_id.encode()).hexdigest()[:40] + ".json"


class SessionJournal:
    """The journal directory of one run_dir (see the module docstring). Not thread-safe: one writer
    (the driver's event loop); readers run when that writer is gone or has not started yet."""

    def __init__(self, run_dir: Path) -> None:
        self.dir = Path(run_dir) / JOURNAL_DIRNAME

    def add(self, entries: Iterable[JournalEntry]) -> None:
        """Record `entries` (before their invokes are dispatched). Raises OSError when run_dir is
        not writable: a session that cannot be journaled must not be opened."""
        entries = list(entries)
        if not entries:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        for e in entries:
            tmp = self.dir / f"{_TMP_PREFIX}{uuid.uuid4().hex}"
            tmp.write_text(json.dumps(asdict(e)), encoding="utf-8")
            os.replace(tmp, self.dir / _file_name(e.session_id))

    def remove(self, session_ids: Iterable[str]) -> None:
        """Forget sessions whose stop succeeded (or that ACR no longer knew); absent ones are fine."""
        for sid in session_ids:
            try:
                (self.dir / _file_name(sid)).unlink()
            except FileNotFoundError:
                pass

    def entries(self) -> list[JournalEntry]:
        """Every recorded session, sorted by id. An unreadable entry is skipped with a warning and
        left in place (it is never deleted unread); temporary files of an interrupted write are removed."""
        if not self.dir.is_dir():
            return []
        out = []
        for path in sorted(self.dir.iterdir()):
            if path.name.startswith(_TMP_PREFIX):
                path.unlink(missing_ok=True)  # its rename never happened: the entry was never recorded
                continue
            try:
                d = json.loads(path.read_text(encoding="utf-8"))
                out.append(JournalEntry(session_id=str(d["session_id"]), arn=str(d["arn"]),
                                        qualifier=d.get("qualifier"), local=bool(d.get("local", False))))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("ACR session journal: skipping unreadable entry %s (%s)", path, exc)
        return sorted(out, key=lambda e: e.session_id)


class JournalWriter:
    """One run's writer of the journal: its sessions all share a runtime (`arn`, `qualifier`) and
    whether it is the run's own emulator (`local`). Knows which entries it wrote and has not removed
    (`recorded`), so that `forget_all_but` never removes an entry an earlier run left (one a sweep
    could not stop yet)."""

    def __init__(self, journal: SessionJournal, arn: str, qualifier: str | None, *, local: bool) -> None:
        self.journal = journal
        self._entry = lambda sid: JournalEntry(session_id=sid, arn=arn, qualifier=qualifier, local=local)
        self.recorded: set[str] = set()

    def record(self, session_ids: Iterable[str]) -> None:
        """Before the invokes of `session_ids` are dispatched (raises OSError: run_dir not writable)."""
        ids = [s for s in session_ids if s and s not in self.recorded]
        self.journal.add(self._entry(s) for s in ids)
        self.recorded.update(ids)

    def forget(self, session_ids: Iterable[str]) -> None:
        """`session_ids` are known to be stopped (or never opened)."""
        ids = [s for s in session_ids if s in self.recorded]
        self.journal.remove(ids)
        self.recorded.difference_update(ids)

    def forget_all_but(self, still_open: Iterable[str]) -> None:
        """At the end of a run whose every rollout actor shut down: all but `still_open` are closed."""
        keep = set(still_open)
        self.forget([s for s in self.recorded if s not in keep])
