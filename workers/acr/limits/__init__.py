"""Cluster-wide ACR limits: one request-rate limiter and one open-session cap for the whole run
(and, for the A2A contract's setup/run split, one rollout-slot cap: the inference budget).

ACR bounds a runtime's request rate and its concurrent sessions per account, not per process, so
a per-actor limiter multiplies with the number of rollout actors. Here each limit lives in ONE
named Ray actor (`RATE_ACTOR_NAME`, `SESSIONS_ACTOR_NAME`, created with `get_if_exists`) that every
rollout actor shares; the limits come from config (`rollout.acr.limits`).

Layers, one module each (the logic is free of Ray, asyncio and clocks; the wrappers are thin):

- state.py: `TokenBucket`, `SlotPool`: pure state machines, time passed in.
- services.py: `RateLimiterService`, `SessionCapService`: async services holding one of them; wrapped with
  `ray.remote` in `start_limit_actors` (and used directly in one process by tests and the bench).
- pumps.py: `Coalescer`, `SessionSlots`: the per-process client side. Acquiring one token per ACR call
  through a Ray actor costs a round trip per call, so concurrent waiters in one process are
  coalesced: one pump task asks the service for `k` tokens (k = waiters now), the service
  grants what it can at once and the pump hands them out FIFO. Tokens are never stored on the
  client: a token no waiter can take any more (its caller was cancelled) is dropped, a session
  slot is given back.
- config.py: `AcrLimitsConfig`, the limits as `rollout.acr.limits` sets them, checked.
- actors.py: the named actors (`start_limit_actors`), the same services in one process
  (`local_limits`), the typed clients of a service and a process's `LimitClients`.

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

from workers.acr.limits.actors import (ROLLOUT_SLOTS_ACTOR_NAME, RATE_ACTOR_NAME, SESSION_RATE_ACTOR_NAME,
                                       SESSIONS_ACTOR_NAME, LimitClients, LimitHandles, RateLimiterClient,
                                       SessionCapClient, limit_clients, limit_stats, local_limits, start_limit_actors)
from workers.acr.limits.config import AcrLimitsConfig
from workers.acr.limits.pumps import AcquireMany, Coalescer, SessionSlots
from workers.acr.limits.services import MAX_BATCH, Clock, LimitStats, MonotonicClock, RateLimiterService, SessionCapService
from workers.acr.limits.state import SlotPool, TokenBucket

__all__ = [
    "AcquireMany", "AcrLimitsConfig", "Clock", "Coalescer", "LimitClients", "LimitHandles", "LimitStats", "MAX_BATCH",
    "MonotonicClock", "RATE_ACTOR_NAME", "ROLLOUT_SLOTS_ACTOR_NAME", "RateLimiterClient", "RateLimiterService",
    "SESSIONS_ACTOR_NAME", "SESSION_RATE_ACTOR_NAME", "SessionCapClient", "SessionCapService", "SessionSlots", "SlotPool",
    "TokenBucket", "limit_clients", "limit_stats", "local_limits", "start_limit_actors",
]
