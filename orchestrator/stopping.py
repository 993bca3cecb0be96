"""Stop on the first Ctrl-C or SIGTERM, fast and clean.

`Interrupts` turns the first SIGINT or SIGTERM that reaches the driver's event loop into the
cancellation of the work it guards (building the parts, then the loop), so the loop unwinds through
its own `finally` blocks and the driver still closes every part (rollouts stop their ACR sessions
while the emulator answers) and writes `summary.json` with `interrupted: true`. A second signal
gets Python's default behaviour back (KeyboardInterrupt for SIGINT, death for SIGTERM): the user
insists, and the run's reaper (orchestrator/reaper.py) cleans up after the driver.

Invariant: once a signal has arrived, `guard` returns or raises within about `2 * CANCEL_GRACE_S`
plus the guarded task's own unwinding: it cancels the task, and cancels it again after
`CANCEL_GRACE_S` when the task is still running (a cancellation swallowed by `asyncio.wait_for`
on Python 3.11, when the awaited future completes in the same iteration, must not keep a run
going to its last step), then stops waiting after another `CANCEL_GRACE_S`.

Where the stop time goes: from the signal on, `mark` writes one line per stop step to the driver
log (`stop +1.23s: what`, RUN_DIR/logs/driver.log); scripts/bench_stop.py prints them.

Callers: orchestrator/main.py.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from typing import Awaitable, TypeVar

T = TypeVar("T")
CANCEL_GRACE_S = 3.0  # wait for a cancelled task to unwind before cancelling it again (seconds)
SIGNALS = (signal.SIGINT, signal.SIGTERM)
STOP_MARK = "stop +"  # prefix of the stop-timeline lines in the driver log

log = logging.getLogger(__name__)
_signalled_at: list[float] = []  # time.monotonic() of this process's first signal (one per process)


def mark(what: str) -> None:
    """Log `stop +{seconds since the signal}s: what` to the driver log; nothing before a signal."""
    if _signalled_at:
        log.info("%s%.2fs: %s", STOP_MARK, time.monotonic() - _signalled_at[0], what)


class RunInterrupted(Exception):
    """The run was stopped by a signal (the message names it)."""


class Interrupts:
    """The driver loop's SIGINT / SIGTERM handling (see the module docstring)."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._fired: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def install(self) -> None:
        """Handle SIGINT and SIGTERM on the running loop (call from inside it)."""
        self._loop = asyncio.get_running_loop()
        self._fired = asyncio.Event()
        for sig in SIGNALS:
            self._loop.add_signal_handler(sig, self.fire, sig)

    def fire(self, sig: int) -> None:
        """A signal arrived: remember it, wake `guard`, give later signals their default action."""
        if self.signal is not None:
            return
        self.signal = sig
        _signalled_at[:1] = [time.monotonic()]
        mark(signal.Signals(sig).name)
        assert self._fired is not None and self._loop is not None
        self._fired.set()
        for s in SIGNALS:
            self._loop.remove_signal_handler(s)

    @property
    def interrupted(self) -> bool:
        return self.signal is not None

    async def guard(self, work: Awaitable[T]) -> T:
        """Await `work`; on a signal, cancel it (twice if need be) and raise RunInterrupted.

        Raises whatever `work` raises when it ends by itself."""
        assert self._fired is not None, "install() first"
        task = asyncio.ensure_future(work)
        if not self._fired.is_set():
            fired = asyncio.ensure_future(self._fired.wait())
            try:
                await asyncio.wait({task, fired}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                fired.cancel()
        if task.done() and not task.cancelled():
            return task.result()
        for _ in range(2):
            if task.done():
                break
            task.cancel()
            await asyncio.wait({task}, timeout=CANCEL_GRACE_S)
        if task.done() and not task.cancelled() and task.exception() is not None:
            task.exception()  # retrieved: the interrupt is what the user sees
        mark("guarded work cancelled" if task.done() else "guarded work still running; left behind")
        raise RunInterrupted(signal.Signals(self.signal).name if self.signal else "cancelled")
