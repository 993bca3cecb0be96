"""The per-process client side of a limit: one round trip for every waiter of a process.

Acquiring one token per ACR call through a Ray actor costs a round trip per call, so concurrent
waiters in one process are coalesced: one pump task asks the service for `k` units (k = waiters
now) and hands them out in order. Invariant: a unit is never stored on the client: one no waiter
can take any more (its caller was cancelled) goes to `on_unused` (dropped for a rate, given back
for a slot cap). Callers: actors.py (`limit_clients`), workers/rollout/worker.py, workers/acr/client.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
from typing import AsyncIterator, Awaitable, Callable

from workers.acr.limits.services import MAX_BATCH

log = logging.getLogger(__name__)



AcquireMany = Callable[[int], Awaitable[int]]


class Coalescer:
    """Hands out units one per `acquire()` call, asking `acquire_many(k)` for all current
    waiters in one round trip (one pump task per Coalescer).

    on_unused(k): called with units granted that no waiter could take (waiters cancelled);
    a rate limiter drops them (None), a session cap gives them back. prioritised: waiters are
    served by (priority, arrival) and the pump asks with the first waiter's priority
    (`acquire_many(k, priority=p)`: a session cap); else in arrival order.
    """

    def __init__(self, acquire_many: AcquireMany, on_unused: Callable[[int], None] | None = None,
                 prioritised: bool = False) -> None:
        self._acquire_many = acquire_many
        self._on_unused = on_unused
        self._prioritised = prioritised
        self._waiters: list[tuple[float, int, asyncio.Future]] = []  # a heap
        self._tickets = itertools.count()
        self._pump: asyncio.Task | None = None
        self.round_trips = 0

    async def acquire(self, priority: float = 0.0) -> None:
        """Wait for one unit (`priority`: lower first, when prioritised). Cancellation-safe: a
        unit granted to a cancelled caller is passed to `on_unused`."""
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (priority if self._prioritised else 0.0, next(self._tickets), fut))
        if self._pump is None or self._pump.done():
            self._pump = asyncio.get_running_loop().create_task(self._run_pump())
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._unused(1)  # granted just as we were cancelled
            raise

    def _unused(self, k: int) -> None:
        if k and self._on_unused is not None:
            self._on_unused(k)

    async def _run_pump(self) -> None:
        while True:
            while self._waiters and self._waiters[0][2].done():
                heapq.heappop(self._waiters)  # cancelled while waiting
            if not self._waiters:
                return
            want = min(len(self._waiters), MAX_BATCH)
            try:
                if self._prioritised:
                    got = await self._acquire_many(want, priority=self._waiters[0][0])
                else:
                    got = await self._acquire_many(want)
            except BaseException as exc:  # the service is gone: every waiter learns it
                for _, _, f in self._waiters:
                    if not f.done():
                        f.set_exception(exc if isinstance(exc, Exception) else RuntimeError(repr(exc)))
                self._waiters.clear()
                if isinstance(exc, asyncio.CancelledError):
                    raise
                return
            self.round_trips += 1
            while got and self._waiters:
                f = heapq.heappop(self._waiters)[2]
                if not f.done():
                    f.set_result(None)
                    got -= 1
            self._unused(got)


class SessionSlots:
    """Client of the session cap: `async with slots.slot():` holds one slot for a session's life.

    Releases are batched: a release schedules one flush task that returns every slot released
    since, so a burst of finished rollouts costs one round trip.
    """

    def __init__(self, acquire_many: AcquireMany, release_many: Callable[[int], Awaitable[None]]) -> None:
        self._release_many = release_many
        self._to_release = 0
        self._flush: asyncio.Task | None = None
        self._coalescer = Coalescer(acquire_many, on_unused=self.release, prioritised=True)
        self.held = 0

    async def acquire(self, priority: float = 0.0) -> None:
        """Wait for one slot; `priority` (lower first): the rollout's group id, its arrival order."""
        await self._coalescer.acquire(priority)
        self.held += 1

    def release(self, n: int = 1) -> None:
        """Give back `n` slots (not awaited: flushed by a background task)."""
        self._to_release += n
        if self._flush is None or self._flush.done():
            self._flush = asyncio.get_running_loop().create_task(self._run_flush())

    def release_held(self) -> None:
        """Give back one slot taken with `acquire`."""
        self.held -= 1
        self.release(1)

    async def _run_flush(self) -> None:
        while self._to_release:
            n, self._to_release = self._to_release, 0
            try:
                await self._release_many(n)
            except Exception:  # noqa: BLE001 - the cap actor is gone; nothing left to give back to
                log.exception("releasing %d session slots failed", n)
                return

    async def drain(self) -> None:
        """Wait until every release so far reached the service."""
        while self._flush is not None and not self._flush.done():
            await asyncio.shield(self._flush)

    @contextlib.asynccontextmanager
    async def slot(self, priority: float = 0.0) -> AsyncIterator[None]:
        await self.acquire(priority)
        try:
            yield
        finally:
            self.release_held()
