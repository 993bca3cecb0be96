"""Cluster-wide ACR limits: one request-rate limiter and one open-session cap for the whole run
(and, for the A2A contract's setup/run split, one rollout-slot cap: the inference budget).

ACR bounds a runtime's request rate and its concurrent sessions per account, not per process, so
a per-actor limiter multiplies with the number of rollout actors. Here each limit lives in ONE
named Ray actor (`RATE_ACTOR_NAME`, `SESSIONS_ACTOR_NAME`, created with `get_if_exists`) that every
rollout actor shares; the limits come from config (`rollout.acr.limits`).

Layers (the logic is free of Ray, asyncio and clocks; the wrappers are thin):

- `TokenBucket`, `SlotPool`: pure state machines, time passed in.
- `RateLimiterService`, `SessionCapService`: async services holding one of them; wrapped with
  `ray.remote` in `start_limit_actors` (and used directly in one process by tests and the bench).
- `Coalescer`, `SessionSlots`: the per-process client side. Acquiring one token per ACR call
  through a Ray actor costs a round trip per call, so concurrent waiters in one process are
  coalesced: one pump task asks the service for `k` tokens (k = waiters now), the service
  grants what it can at once and the pump hands them out FIFO. Tokens are never stored on the
  client: a token no waiter can take any more (its caller was cancelled) is dropped, a session
  slot is given back.

Invariants:
- requests granted in any interval [t0, t1] <= burst + rate_per_s * (t1 - t0) (token bucket); the
  bucket is sized below the configured limit by `AcrLimitsConfig.headroom` so that requests SENT
  (a grant travels back before its request leaves) stay within the limit too;
- slots held <= max_open_sessions at every moment; a slot is held from before the invoke that
  creates a session until its StopRuntimeSession returned (or ACR said it did not exist). A
  session is one container (an ACR microVM): these are the container slots;
- rollout slots held <= rollout_slots: a rollout slot is held only while an agent runs its rollout
  after its setup (contract=a2a), so containers beyond rollout_slots set up ahead: a warm pool
  (the toolkit's `run_rollout_with_bounds`);
- a slot cap serves its waiters by (priority, arrival), and rollouts ask with their group id: slots
  go to groups in the order they were dispatched, across processes too (the pumps ask with their
  first waiter's priority), so a later group never holds a container an earlier one waits for.

Callers: `workers.acr.client.AsyncAcrClient` (rate: a botocore `before-send` hook, so every HTTP
attempt, botocore retries included, takes a token) and `workers.rollout.worker.RolloutWorker`
(`async with slots.slot():` around one session's life).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol

from workers.core.calls import PartClient, invoke

log = logging.getLogger(__name__)

RATE_ACTOR_NAME = "acr-request-rate-limiter"
SESSIONS_ACTOR_NAME = "acr-open-session-cap"
ROLLOUT_SLOTS_ACTOR_NAME = "rollout-slot-cap"
SESSION_RATE_ACTOR_NAME = "acr-session-rate-limiter"
MAX_BATCH = 256  # most tokens one pump asks for in one round trip (bounds one grant's burst)


# ----------------------------------------------------------------------------- pure logic


class TokenBucket:
    """`rate_per_s` tokens per second, at most `burst` stored; time (seconds) is passed in.

    Raises ValueError on rate <= 0, burst < 1, n < 1, or time going backwards.
    """

    def __init__(self, rate_per_s: float, burst: int, now_s: float) -> None:
        if rate_per_s <= 0:
            raise ValueError(f"rate_per_s must be > 0, got {rate_per_s}")
        if burst < 1:
            raise ValueError(f"burst must be >= 1, got {burst}")
        self.rate_per_s = float(rate_per_s)
        self.burst = int(burst)
        self._tokens = float(burst)
        self._last_s = now_s
        self.granted = 0

    def _refill(self, now_s: float) -> None:
        if now_s < self._last_s:
            raise ValueError(f"time went backwards: {now_s} < {self._last_s}")
        self._tokens = min(float(self.burst), self._tokens + (now_s - self._last_s) * self.rate_per_s)
        self._last_s = now_s

    def take(self, n: int, now_s: float) -> int:
        """Take up to `n` whole tokens available at `now_s`; return how many were taken (0..n)."""
        if n < 1:
            raise ValueError(f"take needs n >= 1, got {n}")
        self._refill(now_s)
        got = min(n, int(self._tokens + 1e-9))
        self._tokens -= got
        self.granted += got
        return got

    def wait_s(self, now_s: float) -> float:
        """Seconds from `now_s` until one whole token is available (0.0 if one is now)."""
        self._refill(now_s)
        return max(0.0, (1.0 - self._tokens) / self.rate_per_s)


class SlotPool:
    """`capacity` slots; `take` hands out free ones, `give` returns them. Pure, no waiting.

    Invariant: 0 <= in_use <= capacity, except after `resize` lowered the capacity under what is in
    use (no slot is taken back: none is handed out until use is under it); `peak` is the most ever
    in use. Raises ValueError on a give of more than is in use (a double release is a bug, not a
    state to tolerate).
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.in_use = 0
        self.peak = 0

    @property
    def free(self) -> int:
        return max(0, self.capacity - self.in_use)

    def resize(self, capacity: int) -> None:
        """Set the capacity (>= 1; raises ValueError otherwise)."""
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity

    def take(self, n: int) -> int:
        """Take up to `n` free slots; return how many were taken (0..n)."""
        if n < 1:
            raise ValueError(f"take needs n >= 1, got {n}")
        got = min(n, self.free)
        self.in_use += got
        self.peak = max(self.peak, self.in_use)
        return got

    def give(self, n: int) -> None:
        if n < 0 or n > self.in_use:
            raise ValueError(f"give({n}) with {self.in_use} slots in use")
        self.in_use -= n


# ----------------------------------------------------------------------------- services (the actors)


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


# ----------------------------------------------------------------------------- per-process clients


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


# ----------------------------------------------------------------------------- wiring


@dataclass(frozen=True)
class AcrLimitsConfig:
    """Cluster-wide ACR limits.

    requests_per_s: L, the cap on ACR data-plane requests (invoke, get, stop, command; botocore
        retries included) in any 1 s window, as ACR counts TPS.
    headroom: fraction h of L held back for delivery jitter: a token granted at t is sent at
        t + delta (Ray return trip, event-loop wake-up), so the bucket runs at rate (1 - h) * L
        with burst max(1, h * L / 2). Any 1 s window then sees at most
        burst + (1 - h) * L * (1 + delta_max) <= L requests while delta_max <= h / (2 (1 - h)) s
        (125 ms at h = 0.2).
    max_open_sessions: sessions open at once (invoked and not yet stopped), whole cluster: the
        container slots.
    rollout_slots: rollouts running at once past their setup (contract=a2a), whole cluster; None:
        no cap beyond the container slots.
    sessions_per_s: new sessions (containers) created per second, whole cluster, taken after the
        container slot and before the first invoke (the toolkit's `session_rate_limiter`; burst 1);
        None: only the request rate bounds them.
    """

    requests_per_s: float = 25.0
    max_open_sessions: int = 1000
    headroom: float = 0.2
    rollout_slots: int | None = None
    sessions_per_s: float | None = None

    def __post_init__(self) -> None:
        if self.requests_per_s <= 0:
            raise ValueError(f"rollout.acr.limits.requests_per_s must be > 0, got {self.requests_per_s}")
        if not 0.0 <= self.headroom < 1.0:
            raise ValueError(f"rollout.acr.limits.headroom must be in [0, 1), got {self.headroom}")
        if self.max_open_sessions < 1:
            raise ValueError(f"rollout.acr.limits.max_open_sessions must be >= 1, got {self.max_open_sessions}")
        if self.rollout_slots is not None and self.rollout_slots < 1:
            raise ValueError(f"rollout.rollout_slots must be >= 1 or null, got {self.rollout_slots}")
        if self.sessions_per_s is not None and self.sessions_per_s <= 0:
            raise ValueError(f"rollout.acr.limits.sessions_per_s must be > 0 or null, got {self.sessions_per_s}")

    @property
    def bucket_rate_per_s(self) -> float:
        return (1.0 - self.headroom) * self.requests_per_s

    @property
    def bucket_burst(self) -> int:
        return max(1, int(self.headroom * self.requests_per_s / 2))


@dataclass(frozen=True)
class LimitHandles:
    """The services: Ray actor handles (`.method.remote(...)`) or local objects; `rollouts` is
    None without a rollout-slot cap."""

    rate: Any
    sessions: Any
    rollouts: Any = None
    session_rate: Any = None  # the session-creation rate limiter; None without sessions_per_s


@dataclass
class LimitClients:
    """What one process uses: a token per ACR request, a slot per session (container), a slot
    per running rollout (None: no cap)."""

    requests: Coalescer
    sessions: SessionSlots
    rollouts: SessionSlots | None = None
    new_sessions: Coalescer | None = None  # one unit per session created (None: no session rate)


def local_limits(cfg: AcrLimitsConfig, clock: Clock | None = None) -> LimitHandles:
    """The services as plain objects in this process (tests, the bench, a one-process run)."""
    return LimitHandles(RateLimiterService(cfg.bucket_rate_per_s, cfg.bucket_burst, clock),
                        SessionCapService(cfg.max_open_sessions, clock),
                        SessionCapService(cfg.rollout_slots, clock) if cfg.rollout_slots else None,
                        RateLimiterService(cfg.sessions_per_s, 1, clock) if cfg.sessions_per_s else None)


async def start_limit_actors(cfg: AcrLimitsConfig, *, suffix: str = "") -> LimitHandles:
    """Get or create the two named limit actors (one per cluster and name suffix), awaiting them
    (a driver's event loop stays free for a Ctrl-C meanwhile). Raises ValueError when an actor of
    that name already runs with different limits."""
    import ray

    def named(cls: type, name: str) -> Any:
        return ray.remote(num_cpus=0, max_concurrency=1000)(cls).options(name=name + suffix, get_if_exists=True)

    h = LimitHandles(named(RateLimiterService, RATE_ACTOR_NAME).remote(cfg.bucket_rate_per_s, cfg.bucket_burst),
                     named(SessionCapService, SESSIONS_ACTOR_NAME).remote(cfg.max_open_sessions),
                     named(SessionCapService, ROLLOUT_SLOTS_ACTOR_NAME).remote(cfg.rollout_slots)
                     if cfg.rollout_slots else None,
                     named(RateLimiterService, SESSION_RATE_ACTOR_NAME).remote(cfg.sessions_per_s, 1)
                     if cfg.sessions_per_s else None)
    r, s = await limit_stats(h)
    ro = (await SessionCapClient(h.rollouts).stats()).configured if h.rollouts is not None else None  # steered: its limit moves
    sr = (await RateLimiterClient(h.session_rate).stats()).limit if h.session_rate is not None else None
    if (r.limit, r.burst, s.limit, ro, sr) != (cfg.bucket_rate_per_s, cfg.bucket_burst, cfg.max_open_sessions,
                                               cfg.rollout_slots, cfg.sessions_per_s):
        raise ValueError(f"limit actors '{RATE_ACTOR_NAME + suffix}'/'{SESSIONS_ACTOR_NAME + suffix}' already run "
                         f"with rate={r.limit}/burst={r.burst}/sessions={s.limit}/rollout_slots={ro}/"
                         f"sessions_per_s={sr}, not {cfg}")
    return h


def limit_clients(handles: LimitHandles, owner: str = "") -> LimitClients:
    """Per-process clients over `handles` (actor handles or local services). Call inside the
    event loop that will use them. owner: the name the session cap counts this process's slots
    under (a rollout actor's name: `release_owner` frees them if it dies)."""
    def slots(cap: Any) -> SessionSlots:
        c = SessionCapClient(cap)
        return SessionSlots(functools.partial(c.acquire, owner=owner), functools.partial(c.release, owner=owner))

    return LimitClients(Coalescer(RateLimiterClient(handles.rate).acquire), slots(handles.sessions),
                        slots(handles.rollouts) if handles.rollouts is not None else None,
                        Coalescer(RateLimiterClient(handles.session_rate).acquire)
                        if handles.session_rate is not None else None)


async def limit_stats(handles: LimitHandles) -> tuple[LimitStats, LimitStats]:
    """(rate, sessions) stats of the two services (actor handles or local services)."""
    return await RateLimiterClient(handles.rate).stats(), await SessionCapClient(handles.sessions).stats()


class RateLimiterClient(PartClient):
    """A RateLimiterService (actor handle or local object) as its users call it."""

    async def acquire(self, n: int) -> int:
        return await invoke(self.target.acquire, n)

    async def stats(self) -> LimitStats:
        return await invoke(self.target.stats)


class SessionCapClient(PartClient):
    """A SessionCapService (actor handle or local object) as its users call it."""

    async def acquire(self, n: int, owner: str = "", priority: float = 0.0) -> int:
        return await invoke(self.target.acquire, n, owner=owner, priority=priority)

    async def release(self, n: int, owner: str = "") -> None:
        await invoke(self.target.release, n, owner=owner)

    async def set_capacity(self, n: int) -> None:
        await invoke(self.target.set_capacity, n)

    async def release_owner(self, owner: str) -> int:
        """Give back every slot `owner` (a dead rollout actor's name) held; returns how many."""
        return await invoke(self.target.release_owner, owner)

    async def stats(self) -> LimitStats:
        return await invoke(self.target.stats)
