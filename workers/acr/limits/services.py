"""The limit services: one async object per limit, holding one piece of state (state.py).

Each is wrapped with `ray.remote` as a named actor in actors.py (`start_limit_actors`), or used in
one process (`local_limits`: tests and the bench). Invariants: `RateLimiterService` grants in
arrival order and never beyond its bucket; `SessionCapService` serves its waiters by (priority,
arrival), counts every slot under its owner, and `release_owner` gives back exactly what a dead
owner held.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from dataclasses import dataclass
from typing import Protocol

from workers.acr.limits.state import SlotPool, TokenBucket

MAX_BATCH = 256  # most tokens one pump asks for in one round trip (bounds one grant's burst)


class Clock(Protocol):
    def now(self) -> float: ...
    async def sleep(self, dt_s: float) -> None: ...


class MonotonicClock:
    """The real clock: `time.monotonic` and `asyncio.sleep`."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, dt_s: float) -> None:
        await asyncio.sleep(dt_s)


@dataclass(frozen=True)
class LimitStats:
    """What a limit service has done: grants so far, slots now / at peak and `held_s`, the
    slot-seconds held since it started `age_s` seconds ago (the integral of `in_use` over time;
    slot caps only)."""

    limit: float
    burst: int
    granted: int
    in_use: int = 0
    peak_in_use: int = 0
    held_s: float = 0.0
    age_s: float = 0.0
    configured: int | None = None  # a slot cap's size at start (`limit` is its size now: it may be steered)


class RateLimiterService:
    """The request-rate limiter: `acquire(n)` waits until at least one token is available and
    returns how many (1..n) it granted. Callers are served one at a time, in arrival order."""

    def __init__(self, rate_per_s: float, burst: int, clock: Clock | None = None) -> None:
        self._clock = clock or MonotonicClock()
        self._bucket = TokenBucket(rate_per_s, burst, self._clock.now())
        self._lock: asyncio.Lock | None = None

    async def acquire(self, n: int) -> int:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            while True:
                now = self._clock.now()
                got = self._bucket.take(min(n, MAX_BATCH), now)
                if got:
                    return got
                await self._clock.sleep(self._bucket.wait_s(now))

    def stats(self) -> LimitStats:
        b = self._bucket
        return LimitStats(limit=b.rate_per_s, burst=b.burst, granted=b.granted)


class SessionCapService:
    """The open-session cap: `acquire(n, owner, priority)` waits until a slot is free and it is
    the first waiter by (priority, arrival), and returns how many (1..n) it granted;
    `release(n, owner)` gives slots back. Rollouts ask with their group id as the priority, so
    slots go to groups in arrival order whichever process asks (an earlier group is never
    starved by a later one). Slots are counted per owner (a rollout actor's name), so
    `release_owner` can give back every slot of an actor that died holding them
    (workers/rollout/pool.py)."""

    def __init__(self, max_open: int, clock: Clock | None = None) -> None:
        self._pool = SlotPool(max_open)
        self._configured = max_open
        self._granted = 0
        self._held: dict[str, int] = {}
        self._cond: asyncio.Condition | None = None
        self._queue: list[tuple[float, int]] = []  # heap of (priority, ticket) of the waiters
        self._tickets = itertools.count()
        self._clock = (clock or MonotonicClock()).now
        self._held_s = 0.0
        self._since = self._started = self._clock()

    def _account(self) -> None:
        """Add the slot-seconds since the last change (call before `in_use` changes)."""
        now = self._clock()
        self._held_s += self._pool.in_use * (now - self._since)
        self._since = now

    def _condition(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    async def acquire(self, n: int, owner: str = "", priority: float = 0.0) -> int:
        cond = self._condition()
        async with cond:
            me = (priority, next(self._tickets))
            heapq.heappush(self._queue, me)
            try:
                await cond.wait_for(lambda: self._pool.free > 0 and self._queue[0] == me)
            finally:  # granted or cancelled: out of the queue, and the next waiter may look
                self._queue.remove(me)
                heapq.heapify(self._queue)
                cond.notify_all()
            self._account()
            got = self._pool.take(min(n, MAX_BATCH))
            self._granted += got
            self._held[owner] = self._held.get(owner, 0) + got
            return got

    async def release(self, n: int, owner: str = "") -> None:
        cond = self._condition()
        async with cond:
            n = min(n, self._held.get(owner, 0))  # an owner released by release_owner gives back nothing twice
            self._held[owner] = self._held.get(owner, 0) - n
            self._account()
            self._pool.give(n)
            cond.notify_all()

    async def set_capacity(self, n: int) -> None:
        """Resize the cap to `n` slots (the adaptive steering of rollout slots,
        orchestrator/loop/slot_steering.py); waiters are served at once when it grew."""
        cond = self._condition()
        async with cond:
            self._pool.resize(n)
            cond.notify_all()

    async def release_owner(self, owner: str) -> int:
        """Give back every slot `owner` holds (its process died); returns how many."""
        cond = self._condition()
        async with cond:
            n = self._held.pop(owner, 0)
            self._account()
            self._pool.give(n)
            cond.notify_all()
            return n

    def stats(self) -> LimitStats:
        p = self._pool
        self._account()
        return LimitStats(limit=p.capacity, burst=p.capacity, granted=self._granted, in_use=p.in_use,
                          peak_in_use=p.peak, held_s=self._held_s,
                          age_s=self._since - self._started, configured=self._configured)
