"""Replica routing: which inference replica serves a session's next turn.

Policy: a session sticks to the replica that served its first turn (its prompt prefix stays warm
in that replica's KV/prefix cache); a new session goes to the replica with the fewest open
sessions, then the fewest requests in flight (ties: lowest index). Counting sessions, not only
requests, matters for agents: a session in a tool call has no request in flight but will come
back with a longer context, so choosing by requests alone piles new sessions onto a replica whose
sessions happen to be in their tools. A sticky session spills to the replica with the fewest requests in flight when
its own has far more requests in flight (`SPILL_FACTOR`, `SPILL_SLACK`): a replica that congested
is evicting its prefix cache anyway, and stickiness would keep it congested while the others idle
(the simulator, orchestrator/planning/sim/, showed exactly that: one replica at a full KV cache with a
queue, the others empty). A replica whose generate call failed is marked failed (`mark_failed`):
it gets no new turns, and sessions stuck to it move to the least-loaded healthy one (their prefix
cache is lost, their tokens are not: the gateway recorded them). Pure bookkeeping, no asyncio or Ray: the caller holds a lease for the
duration of one generate call.

Invariant: each replica's in-flight count equals the number of leases taken on it and not yet
released, and never goes negative; its session count equals the sessions stuck to it; `set_engines` drops every sticky assignment (indices of the old
list mean nothing for the new one) and every failed mark; a failed replica is never chosen.

Callers: workers/gateway/app.py (one lease per chat request), workers/gateway/server.py
(set_engines, forget on session close).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from workers.core.types import InferenceEngine


SPILL_FACTOR = 2  # a sticky session moves when its replica has more than 2x the least-loaded's requests
SPILL_SLACK = 16  # ... plus 16 in flight (small queues are normal; only a congested replica spills)


class NoReplicas(RuntimeError):
    """The router has no inference replica to send a request to."""


class ReplicaRouter:
    """Sticky-per-session, otherwise fewest-sessions-then-least-in-flight choice among inference replicas."""

    def __init__(self, engines: Sequence[InferenceEngine] = ()) -> None:
        self._engines: list[InferenceEngine] = list(engines)
        self._in_flight: list[int] = [0] * len(self._engines)
        self._sessions: list[int] = [0] * len(self._engines)
        self._sticky: dict[str, int] = {}
        self._failed: set[int] = set()
        self._generation = 0  # bumped by set_engines; leases of an old list release nothing

    def set_engines(self, engines: Sequence[InferenceEngine]) -> None:
        """Replace the replica list; sticky assignments are dropped, in-flight counts restart."""
        self._engines = list(engines)
        self._in_flight = [0] * len(self._engines)
        self._sessions = [0] * len(self._engines)
        self._sticky.clear()
        self._failed.clear()
        self._generation += 1

    def num_replicas(self) -> int:
        return len(self._engines)

    def sessions(self) -> tuple[int, ...]:
        """Open sessions stuck to each replica, in replica order."""
        return tuple(self._sessions)

    def in_flight(self) -> tuple[int, ...]:
        """Requests in flight per replica, in replica order."""
        return tuple(self._in_flight)

    def assigned(self, session_id: str) -> int | None:
        """Index of the replica the session sticks to, or None before its first lease."""
        return self._sticky.get(session_id)

    def num_healthy(self) -> int:
        """Replicas not marked failed."""
        return len(self._engines) - len(self._failed)

    def mark_failed(self, engine: InferenceEngine) -> bool:
        """Take `engine` out of rotation (its generate raised). Returns False if it is not a
        current replica (e.g. the list was replaced meanwhile) or was already marked."""
        for i, e in enumerate(self._engines):
            if e is engine and i not in self._failed:
                self._failed.add(i)
                return True
        return False

    def forget(self, session_id: str) -> None:
        """Drop a closed session's sticky assignment (no-op if it has none)."""
        idx = self._sticky.pop(session_id, None)
        if idx is not None:
            self._sessions[idx] -= 1

    def _choose(self, session_id: str) -> int:
        if not self._engines:
            raise NoReplicas("no inference replica registered with the gateway (call set_engines first)")
        idx = self._sticky.get(session_id)
        spill = idx is not None and idx not in self._failed and self._congested(idx)
        if spill:
            self._sessions[idx] -= 1  # spill: its cache is being evicted on a replica this loaded anyway
            del self._sticky[session_id]
            idx = None
        if idx is None or idx in self._failed:
            healthy = [i for i in range(len(self._engines)) if i not in self._failed]
            if not healthy:
                raise NoReplicas(f"all {len(self._engines)} inference replicas failed; none left to serve")
            if idx is not None:
                self._sessions[idx] -= 1  # moved off a failed replica
            load = self._in_flight
            idx = min(healthy, key=(lambda i: (load[i], i)) if spill else (lambda i: (self._sessions[i], load[i], i)))
            self._sticky[session_id] = idx
            self._sessions[idx] += 1
        return idx

    def _congested(self, idx: int) -> bool:
        """True when replica `idx` has more than SPILL_FACTOR x (+ SPILL_SLACK) the requests in
        flight of the least-loaded healthy replica."""
        least = min(n for i, n in enumerate(self._in_flight) if i not in self._failed)
        return self._in_flight[idx] > SPILL_FACTOR * least + SPILL_SLACK

    @contextmanager
    def lease(self, session_id: str) -> Iterator[InferenceEngine]:
        """Pick the replica for this session and count the request in flight until exit.

        Raises NoReplicas when no replica is registered or all are marked failed.
        """
        idx = self._choose(session_id)
        generation = self._generation
        self._in_flight[idx] += 1
        try:
            yield self._engines[idx]
        finally:
            if generation == self._generation:
                self._in_flight[idx] -= 1
