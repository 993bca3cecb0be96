"""A virtual clock for asyncio: an event loop whose time jumps to the next timer.

`VirtualLoop` is an ordinary `asyncio` selector loop in every respect but time: `time()` is the
simulated clock, and every timer (`call_at`, `call_later`, so `asyncio.sleep`, `wait_for`,
`asyncio.timeout`) goes into one heap shared with the simulated hardware's own events
(`schedule`). When the loop has nothing ready, its selector runs heap events in time order,
advancing the clock, until one of them makes asyncio work ready; it never waits for real.
So the product's loops (orchestrator/loop/sync_loop.py, async_loop.py) run unchanged over simulated
hours in seconds, and plain-function hardware events (an engine step ending, a tool call
returning) cost one heap pop each, without an asyncio iteration.

Invariant: the clock never goes backwards; events run in (time, insertion) order; a loop with
nothing ready and nothing scheduled is a deadlock and raises `SimDeadlock` instead of hanging.
Callers: orchestrator/planning/sim/run.py. No Ray, no HTTP, no wall clock.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import selectors
from typing import Any, Callable


class SimDeadlock(RuntimeError):
    """The loop waits, and no timer or simulated event is left to wake it."""


class _Selector(selectors.BaseSelector):
    """Keeps the loop's registrations (its self-pipe) in a real selector that is only ever polled
    with timeout 0; a blocking select runs simulated events instead of sleeping."""

    def __init__(self) -> None:
        self._real = selectors.DefaultSelector()
        self.loop: VirtualLoop | None = None

    def register(self, fileobj, events, data=None):
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj):
        return self._real.unregister(fileobj)

    def modify(self, fileobj, events, data=None):
        return self._real.modify(fileobj, events, data)

    def get_map(self):
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()

    def select(self, timeout=None):
        if timeout is None or timeout > 0:
            self.loop._advance()  # type: ignore[union-attr]
        return self._real.select(0)


class VirtualLoop(asyncio.SelectorEventLoop):
    """See the module docstring. `now` is the virtual time in seconds (starts at 0)."""

    def __init__(self) -> None:
        sel = _Selector()
        super().__init__(selector=sel)
        sel.loop = self
        self.now = 0.0
        self._heap: list[tuple[float, int, Any, tuple]] = []
        self._seq = itertools.count()
        self._woken = False
        self.events_run = 0

    def time(self) -> float:
        return self.now

    # --- simulated hardware events ------------------------------------------------------------

    def schedule(self, when: float, fn: Callable[..., None], *args: Any) -> None:
        """Run the plain function `fn(*args)` at virtual time `when` (never earlier than now)."""
        heapq.heappush(self._heap, (when if when > self.now else self.now, next(self._seq), fn, args))

    # --- asyncio timers go into the same heap -------------------------------------------------

    def call_at(self, when, callback, *args, context=None):
        handle = asyncio.TimerHandle(when, callback, args, self, context)
        heapq.heappush(self._heap, (when if when > self.now else self.now, next(self._seq), handle, None))
        return handle

    def call_soon(self, callback, *args, context=None):
        self._woken = True
        return super().call_soon(callback, *args, context=context)

    def drain(self) -> None:
        """Run scheduled events in time order until none is left, outside `run_until_complete`
        (for parts that use no asyncio: a replica driven by plain events)."""
        while self._heap:
            try:
                self._advance()
            except SimDeadlock:
                return

    def _advance(self) -> None:
        """Run heap events in time order until one makes asyncio work ready."""
        heap, pop = self._heap, heapq.heappop
        self._woken = False
        n = 0
        while heap:
            when, _, item, args = pop(heap)
            if args is None:  # an asyncio timer
                if item._cancelled:
                    continue
                self.now = when
                item._run()  # the timer's callback, as asyncio's own loop would run it
            else:
                self.now = when
                item(*args)
            n += 1
            if self._woken:
                self.events_run += n
                return
        raise SimDeadlock(f"nothing ready and nothing scheduled at virtual time {self.now:.3f} s")


def run_virtual(main: Callable[[], Any]) -> tuple[Any, VirtualLoop]:
    """Run the coroutine function `main()` to completion on a fresh VirtualLoop; return its
    result and the loop (closed)."""
    loop = VirtualLoop()
    try:
        return loop.run_until_complete(main()), loop
    finally:
        loop.close()
