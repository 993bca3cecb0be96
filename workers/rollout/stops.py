"""The ACR session stops of one rollout worker, so that no session outlives the run that opened it.

A rollout stops its ACR session on every exit path, cancellation included. The stop runs as a task
of its own that `SessionStops` keeps, and the rollout awaits it through `asyncio.shield`: a
rollout cancelled while its stop is in flight (a second time: `RolloutActor.run_many` cancels the
siblings of the first rollout that ends cancelled, and `shutdown` has cancelled them already)
stops waiting, but the stop itself goes on and `close` waits for it. A stop that fails (the
endpoint is restarting) is tried again in the background every STOP_RETRY_EVERY_S for
STOP_RETRY_FOR_S; `close` tries each of them once more, at once.

Invariant: `open_ids()` are the sessions `opened` and not yet stopped; the session-cap slot of a
session is given back (`on_stopped`) exactly once, when its stop succeeds; when `close` returns,
no stop of this worker is in flight or scheduled, so the ACR endpoint (the local emulator) may go.

Callers: workers/rollout/worker.py (`RolloutWorker`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Literal, Protocol

from workers.rollout.failures import STOP_RETRY_EVERY_S, STOP_RETRY_FOR_S

log = logging.getLogger(__name__)

LostStop = Literal["stopped", "not_open", "failed"]  # how the stop of a dead actor's session ended


class StopCalls(Protocol):
    async def stop_session(self, arn: str, session_id: str, qualifier: str | None = None) -> bool: ...


class SessionStops:
    """Stops the ACR sessions of one worker (see the module docstring).

    acr: the ACR client; arn / qualifier: the agent runtime; on_stopped(): called once per session
    whose stop succeeded (gives its session-cap slot back); counts: the worker's counters
    (`acr/stop_failed`, `acr/stop_recovered`); clock: seconds, monotonic.
    """

    def __init__(self, acr: StopCalls, arn: str, qualifier: str | None, *, on_stopped: Callable[[], None],
                 counts: Counter[str], clock: Callable[[], float] = time.monotonic) -> None:
        self._acr = acr
        self._arn = arn
        self._qualifier = qualifier
        self._on_stopped = on_stopped
        self._counts = counts
        self._clock = clock
        self._open: set[str] = set()  # sessions opened (invoked) and not stopped yet
        self._inflight: set[asyncio.Future] = set()  # stops started, not finished
        self._retries: dict[str, asyncio.Future] = {}  # session id -> its background retry loop

    @property
    def open(self) -> int:
        """How many sessions were opened and are not stopped yet."""
        return len(self._open)

    def open_ids(self) -> set[str]:
        """The sessions opened and not stopped yet (their stop failed and is retried, or runs now)."""
        return set(self._open)

    def is_open(self, session_id: str) -> bool:
        return session_id in self._open

    def opened(self, session_id: str) -> None:
        """`session_id` was (or may have been) opened at ACR: record it before the invoke."""
        self._open.add(session_id)

    async def stop(self, session_id: str) -> None:
        """Stop `session_id` (opened before); returns once the stop ended, or raises CancelledError
        when the caller is cancelled meanwhile (the stop goes on: `close` waits for it)."""
        await asyncio.shield(self._track(self._stop(session_id)))

    async def stop_lost(self, session_id: str) -> LostStop:
        """Stop a session this worker did not open (a rollout of a dead actor): "stopped" when ACR
        stopped it, "not_open" when ACR did not know it, "failed" when the stop raised (counted in
        `acr/stop_failed`)."""
        return await asyncio.shield(self._track(self._stop_lost(session_id)))

    async def close(self) -> None:
        """Wait for every stop in flight; try each stop still retried once more, now."""
        while self._inflight:
            await asyncio.gather(*self._inflight, return_exceptions=True)
        retried = list(self._retries)
        for sid in retried:
            self._retries.pop(sid).cancel()
        await asyncio.gather(*(self._try_stop(sid, recovered=True) for sid in retried))

    def _track(self, coro) -> asyncio.Future:
        task = asyncio.ensure_future(coro)
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)
        return task

    async def _stop(self, session_id: str) -> None:
        if not await self._try_stop(session_id, recovered=False):
            self._retries[session_id] = asyncio.ensure_future(self._retry(session_id))

    async def _try_stop(self, session_id: str, *, recovered: bool) -> bool:
        try:
            await self._acr.stop_session(self._arn, session_id, self._qualifier)
        except Exception as exc:  # noqa: BLE001 - counted and visible; the rollout's outcome is already decided
            if not recovered:
                log.warning("StopRuntimeSession failed for %s: %s", session_id, exc)
                self._counts["acr/stop_failed"] += 1
            return False
        self._open.discard(session_id)
        if recovered:
            self._counts["acr/stop_recovered"] += 1
        self._on_stopped()  # a session whose stop failed keeps its slot: never over the cap
        return True

    async def _retry(self, session_id: str) -> None:
        deadline = self._clock() + STOP_RETRY_FOR_S
        while self._clock() < deadline:
            await asyncio.sleep(STOP_RETRY_EVERY_S)
            if await self._try_stop(session_id, recovered=True):
                break
        self._retries.pop(session_id, None)

    async def _stop_lost(self, session_id: str) -> LostStop:
        try:
            return "stopped" if await self._acr.stop_session(self._arn, session_id, self._qualifier) else "not_open"
        except Exception as exc:  # noqa: BLE001 - counted and visible; the rollout's fate is already decided
            log.warning("StopRuntimeSession failed for lost session %s: %s", session_id, exc)
            self._counts["acr/stop_failed"] += 1
            return "failed"
