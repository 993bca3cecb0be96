"""A slot cap with a FIFO queue over plain simulated events: the container slots and rollout slots of
the A2A lifecycle (workers/rollout/lifecycle.py) as `SimAgents` (orchestrator/planning/sim/agent.py) holds them.

The count is the product's own pure `SlotPool` (workers/acr/limits/state.py); this adds what the
simulator needs around it: waiters in arrival order, and the time integral of the slots held
(slot-seconds, for utilisation). Time goes in through the methods; nothing here schedules,
sleeps or reads a clock.

Invariant: 0 <= held <= capacity at every call boundary; every `request` that returns False is
handed a slot by exactly one later `release` (the one that returns it), in request order; a
`release` with nothing held raises ValueError (a double release is a bug). `capacity=None`: no cap,
every request is granted at once (the slots are still counted and integrated).
"""

from __future__ import annotations

import sys
from collections import deque
from dataclasses import dataclass
from typing import Generic, TypeVar

from workers.acr.limits import SlotPool

T = TypeVar("T")


@dataclass(frozen=True)
class _Stats:
    in_use: int
    limit: float


class SlotQueue(Generic[T]):
    """`capacity` slots (None: unlimited) and the FIFO of those waiting for one (see the module
    docstring). Times are simulated seconds and never go backwards."""

    def __init__(self, capacity: int | None) -> None:
        if capacity is not None and capacity < 1:
            raise ValueError(f"slot capacity must be >= 1 or None, got {capacity}")
        self.capacity = capacity
        self._pool = SlotPool(capacity if capacity is not None else sys.maxsize)
        self._waiting: deque[T] = deque()
        self._t = 0.0  # time the integral was brought up to
        self._held_s = 0.0  # ∫ held dt, slot-seconds

    @property
    def held(self) -> int:
        return self._pool.in_use

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def peak(self) -> int:
        """The most slots ever held at once."""
        return self._pool.peak

    def held_s(self, now: float) -> float:
        """Slot-seconds held from time 0 to `now`."""
        self._advance(now)
        return self._held_s

    def request(self, who: T, now: float) -> bool:
        """A slot for `who`: True if granted now; False if queued (a later `release` returns it)."""
        self._advance(now)
        if not self._waiting and self._pool.take(1):
            return True
        self._waiting.append(who)
        return False

    def release(self, now: float) -> T | None:
        """Give one held slot back. The head waiter, if any, gets it at once and is returned
        (held stays the same) unless a `resize` left more held than the capacity; None when nobody
        got it. Raises ValueError when nothing is held."""
        self._advance(now)
        if self._pool.in_use < 1:
            raise ValueError("release with no slot held")
        if self._waiting and self._pool.in_use <= self._pool.capacity:
            return self._waiting.popleft()
        self._pool.give(1)
        return None

    def resize(self, capacity: int, now: float) -> list[T]:
        """Set the capacity (>= 1; the adaptive steering of rollout slots,
        orchestrator/loop/slot_steering.py): the waiters a larger one admits, in request order,
        each now holding a slot (the caller starts them); a smaller one takes no slot back."""
        if self.capacity is None:
            raise ValueError("an unlimited slot queue cannot be resized")
        self._advance(now)
        self._pool.resize(capacity)
        self.capacity = capacity
        admitted = []
        while self._waiting and self._pool.take(1):
            admitted.append(self._waiting.popleft())
        return admitted

    def stats(self) -> "_Stats":
        """The product's LimitStats fields the steering reads (in_use, limit)."""
        return _Stats(in_use=self._pool.in_use, limit=float(self.capacity or 0))

    def _advance(self, now: float) -> None:
        if now < self._t:
            raise ValueError(f"time went backwards: {now} < {self._t}")
        self._held_s += self._pool.in_use * (now - self._t)
        self._t = now
