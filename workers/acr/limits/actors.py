"""Where the limit services run: named Ray actors shared by the cluster, or objects in one process,
and the typed clients a process calls them through.

Invariant: one named actor per limit and name suffix in a cluster (`get_if_exists`); a second
start with different limits raises instead of silently sharing the first one's. Callers:
workers/rollout/pool.py and actor.py, workers/acr/sweep.py, tests and scripts/bench_rollout.py.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from workers.acr.limits.config import AcrLimitsConfig
from workers.acr.limits.pumps import Coalescer, SessionSlots
from workers.acr.limits.services import Clock, LimitStats, RateLimiterService, SessionCapService
from workers.core.calls import PartClient, invoke

RATE_ACTOR_NAME = "acr-request-rate-limiter"
SESSIONS_ACTOR_NAME = "acr-open-session-cap"
ROLLOUT_SLOTS_ACTOR_NAME = "rollout-slot-cap"
SESSION_RATE_ACTOR_NAME = "acr-session-rate-limiter"


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
