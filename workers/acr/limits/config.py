"""`AcrLimitsConfig`: the cluster-wide ACR limits as `rollout.acr.limits` sets them.

Invariant: a constructed config holds values the services accept; a bad one raises ValueError
naming the dotted key. No asyncio or Ray: the driver's config schema imports it
(orchestrator/config/rollout.py).
"""

from __future__ import annotations

from dataclasses import dataclass


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
