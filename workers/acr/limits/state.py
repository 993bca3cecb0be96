"""The pure state of the cluster-wide ACR limits: a token bucket and a slot pool, time passed in.

Invariants: a bucket grants at most burst + rate_per_s * (t1 - t0) tokens in [t0, t1]; a pool has
0 <= in_use <= capacity (but after a resize below use) and refuses a give of more than is in use.
No asyncio, clock or Ray here. Callers: workers/acr/limits/services.py, the simulator's slot queues
(orchestrator/planning/sim/slots.py).
"""

from __future__ import annotations


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
