"""AdmissionGate: the asyncio wrapper that makes producers wait for an `Admission` slot.

Invariant: a waiter is woken only when capacity may have grown (a group gave its slot back,
groups expired, the policy version changed, or someone called `notify()`), and re-checks
`free_slots()` itself: no polling, no busy-wait, no lost wake-up (the check and `on_admitted`
run with no await between them, on one event loop). All counters live in the pure `Admission`.
`slot()` releases exactly once, even when its body raises or is cancelled.

Callers: `orchestrator/loop/async_loop.py`. Producers take a slot (`await gate.acquire(timeout_s)` or
`async with gate.slot() as s`); whoever bumps the policy version, or calls an `Admission` event
directly, calls `gate.notify()` afterwards.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from orchestrator.loop.staleness import Admission, StalenessError


class Slot:
    """One admitted group inside `AdmissionGate.slot()`. `finish(kept=...)` records its fate once."""

    def __init__(self) -> None:
        self.kept: bool | None = None

    def finish(self, *, kept: bool) -> None:
        if self.kept is not None:
            raise StalenessError("Slot.finish called twice")
        self.kept = kept


class AdmissionGate:
    """Waits until `admission.free_slots() > 0`, then admits one group. One event loop, no threads."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        self._changed = asyncio.Event()  # set and replaced at each notify: wakes every current waiter

    def notify(self) -> None:
        """Capacity may have grown (the version moved, a slot came back): waiters re-check."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def acquire(self, timeout_s: float | None = None) -> bool:
        """Wait until a slot is free, then `on_admitted()` one group and return True; return False
        (nothing admitted) when no slot freed within `timeout_s` seconds (None: wait forever).
        The caller owes one `release(kept=False)` or `admission.on_finished(kept=...)` later;
        `slot()` cannot forget it."""
        try:
            async with asyncio.timeout(timeout_s):
                while self.admission.free_slots() < 1:
                    await self._changed.wait()
        except TimeoutError:
            return False
        self.admission.on_admitted()  # no await since the check: the slot is still free
        return True

    def release(self, *, kept: bool = False) -> None:
        """An admitted group finished (`Admission.on_finished`); by default it was not kept
        (filtered, failed, or never dispatched) and its capacity goes back to the waiters."""
        self.admission.on_finished(kept=kept)
        if not kept:
            self.notify()

    def expired(self, num_groups: int = 1) -> None:
        """Accepted groups dropped as too stale (`Admission.on_expired`); their capacity goes back."""
        self.admission.on_expired(num_groups)
        self.notify()

    @asynccontextmanager
    async def slot(self, timeout_s: float | None = None) -> AsyncIterator[Slot]:
        """`async with gate.slot() as s:` admits one group; call `s.finish(kept=...)` inside.
        On exit the group is released with that verdict; if the body raised, was cancelled or
        never called `finish`, it counts as not kept and its capacity goes back.

        Raises:
            TimeoutError: no slot freed within `timeout_s` seconds (the message gives the counts).
        """
        if not await self.acquire(timeout_s):
            raise TimeoutError(
                f"no admission slot within {timeout_s}s: capacity {self.admission.capacity()}, "
                f"{self.admission.counts()}"
            )
        s = Slot()
        try:
            yield s
        finally:
            self.release(kept=bool(s.kept))
