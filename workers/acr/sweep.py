"""Stop the ACR sessions an open-session journal holds (workers/acr/journal.py): what a run left open.

`stop_journaled(journal, acr, deadline_s=...)` calls StopRuntimeSession for every entry that is not
`local`, through `acr` (an AsyncAcrClient whose request gate rate-limits every HTTP attempt,
botocore's retries included), at most MAX_CONCURRENT at once. An entry whose stop succeeded, or
whose session ACR no longer knew (stopped before, expired), is removed. A `local` entry (a session of
a dead run's own embedded emulator, which died with that run) is removed without a call. A stop that
fails keeps its entry, and so does every entry not tried before `deadline_s`: the next sweep tries
again.

Invariant: an entry leaves the journal only once its session is known to be closed.

`sweep_run_dir(run_dir, cfg, rate_per_s=..., deadline_s=...)` sweeps with an ACR client of its own
and creates none when nothing needs a call. Callers: the start of a run (orchestrator/main.py,
before anything is dispatched) and the run's reaper once the driver is gone
(orchestrator/control/reaper.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from workers.acr.journal import JournalEntry, SessionJournal

log = logging.getLogger(__name__)

MAX_CONCURRENT = 8  # stops in flight at once during a sweep (the rate limit is the request gate's)
SWEEP_CONNECT_TIMEOUT_S = 5.0  # a sweep must not wait the rollouts' connect timeout on an endpoint that is down
SWEEP_READ_TIMEOUT_S = 30.0  # StopRuntimeSession answers at once; the rollouts' 900 s is for streamed invokes


class StopCalls(Protocol):
    async def stop_session(self, arn: str, session_id: str, qualifier: str | None = None) -> bool: ...


@dataclass
class SweepResult:
    """What a sweep did, in sessions: `stopped` now, `not_open` (ACR no longer knew them), `local`
    (gone with their run's emulator, no call), `failed` (the stop raised: kept), `left` (not tried
    before the deadline: kept)."""

    stopped: int = 0
    not_open: int = 0
    local: int = 0
    failed: int = 0
    left: int = 0

    @property
    def kept(self) -> int:
        """Entries still in the journal after the sweep."""
        return self.failed + self.left

    @property
    def found(self) -> int:
        """Entries the journal held when the sweep began."""
        return self.stopped + self.not_open + self.local + self.kept


async def stop_journaled(journal: SessionJournal, acr: StopCalls | None, *, deadline_s: float,
                         entries: list[JournalEntry] | None = None) -> SweepResult:
    """Stop the sessions of `journal` (or of `entries`, read from it before) as the module docstring
    says. `acr` may be None only when every entry is local. Never raises for a failed stop."""
    entries = journal.entries() if entries is None else entries
    result = SweepResult()
    local = [e.session_id for e in entries if e.local]
    journal.remove(local)
    result.local = len(local)
    remote = [e for e in entries if not e.local]
    if not remote:
        return result
    if acr is None:
        raise ValueError(f"{len(remote)} journaled ACR sessions need a stop call, and no ACR client was given")
    sem = asyncio.Semaphore(MAX_CONCURRENT)

    async def stop(e: JournalEntry) -> None:
        async with sem:
            try:
                was_open = await acr.stop_session(e.arn, e.session_id, e.qualifier)
            except Exception as exc:  # noqa: BLE001 - kept in the journal: the next sweep tries again
                log.warning("StopRuntimeSession failed for journaled session %s: %s", e.session_id, exc)
                result.failed += 1
                return
        journal.remove([e.session_id])
        if was_open:
            result.stopped += 1
        else:
            result.not_open += 1

    tasks = [asyncio.ensure_future(stop(e)) for e in remote]
    _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline_s))
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    result.left = len(pending)
    return result


class _Gate:
    """The request gate of a sweep's own client: a local token bucket at the run's ACR request rate."""

    def __init__(self, rate_per_s: float) -> None:
        from workers.acr.limits import RateLimiterService

        self._svc = RateLimiterService(rate_per_s, burst=max(1, int(rate_per_s)))

    async def acquire(self) -> None:
        await self._svc.acquire(1)


async def sweep_run_dir(run_dir: Path, cfg, *, rate_per_s: float, deadline_s: float) -> SweepResult:
    """Sweep the journal of `run_dir` with clients of its own, one per region the journaled ARNs name
    (`cfg`: workers.acr.client.AcrClientConfig, its timeouts shortened for a sweep; `rate_per_s`:
    requests per second over every HTTP attempt of the sweep)."""
    from workers.acr.arn import parse_runtime_arn

    journal = SessionJournal(run_dir)
    entries = journal.entries()
    result = await stop_journaled(journal, None, deadline_s=deadline_s, entries=[e for e in entries if e.local])
    by_region: dict[str | None, list[JournalEntry]] = {}
    for e in entries:
        if not e.local:
            try:
                region = parse_runtime_arn(e.arn).region
            except ValueError:  # not an ARN this version accepts: the run's own region
                region = cfg.region_name
            by_region.setdefault(region, []).append(e)
    deadline = time.monotonic() + deadline_s
    gate = _Gate(rate_per_s)  # one rate for the whole sweep
    base = replace(cfg, connect_timeout_s=min(cfg.connect_timeout_s, SWEEP_CONNECT_TIMEOUT_S),
                   read_timeout_s=min(cfg.read_timeout_s, SWEEP_READ_TIMEOUT_S))
    for region, group in by_region.items():
        from workers.acr.client import AsyncAcrClient  # aiobotocore: only when a call is due

        async with AsyncAcrClient(replace(base, region_name=region), request_gate=gate) as acr:
            got = await stop_journaled(journal, acr, deadline_s=deadline - time.monotonic(), entries=group)
        for k in ("stopped", "not_open", "failed", "left"):
            setattr(result, k, getattr(result, k) + getattr(got, k))
    return result
