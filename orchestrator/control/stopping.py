"""Stop on the first Ctrl-C or SIGTERM, fast and clean, from the driver's first line to its last.

Three windows, one handler each (the driver installs them in this order):
- before the run started anything (imports, config, pre-flight): `install_before_start`; a signal
  ends the process at once with one line and exit status 130: there is nothing to stop.
- outside the event loop once the run has started things (the local stack, Ray, shutdown):
  `install_unwinding`; the first signal raises KeyboardInterrupt where the main thread is, so the
  driver's ExitStack stops what was started and summary.json says `interrupted: true`.
- inside the event loop (building the parts, the loop): `Interrupts` turns the first signal into
  the cancellation of the work it guards, so the loop unwinds through its own `finally` blocks and
  the driver still closes every part (rollouts stop their ACR sessions while the emulator answers).
  The guarded work awaits every slow start (actors, engines) instead of blocking the loop's thread,
  so the signal is seen at once.
In every window a second signal ends the process without unwinding (`exit_at_once`: one line,
status 130): the user insists, and the run's reaper (orchestrator/control/reaper.py) cleans up after
the driver. Before it exits it runs the run's last words (`before_exit_at_once`: the driver's
summary.json and report, so a double Ctrl-C still leaves them) in a thread, for at most
`LAST_WORDS_S`; a third signal exits at once without waiting for them.

Invariant: a second signal ends the process within `LAST_WORDS_S` (a third one at once), whatever
the last words do or wait for. Once a signal has arrived, `guard` returns or raises within about `2 * CANCEL_GRACE_S`
plus the guarded task's own unwinding: it cancels the task, and cancels it again after
`CANCEL_GRACE_S` when the task is still running (a cancellation swallowed by `asyncio.wait_for`
on Python 3.11, when the awaited future completes in the same iteration, must not keep a run
going to its last step), then stops waiting after another `CANCEL_GRACE_S`.

Where the stop time goes: from the signal on, `mark` writes one line per stop step to the driver
log (`stop +1.23s: what`, RUN_DIR/logs/driver.log); scripts/bench_stop.py prints them.

Callers: orchestrator/main.py.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import TYPE_CHECKING, Awaitable, Callable, NoReturn, TypeVar

if TYPE_CHECKING:
    import asyncio  # imported where used: the driver imports this module first thing, before its handlers are in

T = TypeVar("T")
CANCEL_GRACE_S = 3.0  # wait for a cancelled task to unwind before cancelling it again (seconds)
SIGNALS = (signal.SIGINT, signal.SIGTERM)
STOP_MARK = "stop +"  # prefix of the stop-timeline lines in the driver log
EXIT_INTERRUPTED = 130  # exit status of a run ended by SIGINT or SIGTERM (128 + SIGINT, the shell's Ctrl-C)
LAST_WORDS_S = 20.0  # a second signal's last words (summary.json, the report) get at most this long (seconds)

log = logging.getLogger(__name__)
_signalled_at: list[float] = []  # time.monotonic() of this process's first signal (one per process)
_last_words: list[Callable[[], None]] = []  # run by a second signal before it exits (`before_exit_at_once`)


def mark(what: str) -> None:
    """Log `stop +{seconds since the signal}s: what` to the driver log; nothing before a signal."""
    if _signalled_at:
        log.info("%s%.2fs: %s", STOP_MARK, time.monotonic() - _signalled_at[0], what)


def _note(sig: int) -> None:
    _signalled_at[:1] = [time.monotonic()]
    mark(signal.Signals(sig).name)


def _say_and_exit(line: str) -> NoReturn:
    os.write(2, line.encode() + b"\n")  # async-signal-safe: a handler may run inside a print
    os._exit(EXIT_INTERRUPTED)


def _exit_nothing_started(sig: int, frame: object) -> NoReturn:
    _say_and_exit(f"interrupted: {signal.Signals(sig).name} before the run started anything")


def before_exit_at_once(last_words: Callable[[], None]) -> None:
    """Have a second signal run `last_words` before the process exits (see `exit_at_once`). It runs
    in a thread while the main thread is stopped wherever the signal found it, so it must not need
    the main thread (no event loop, no lock the driver may hold); it may write to stderr with
    os.write only. Its errors are ignored."""
    _last_words.append(last_words)


def _run_last_words() -> None:
    for words in _last_words:
        try:
            words()
        except BaseException:  # noqa: BLE001  a broken summary or report never keeps the process alive
            pass


def exit_at_once(sig: int, frame: object) -> NoReturn:
    """The second signal's handler: one line, the last words (`before_exit_at_once`, at most
    LAST_WORDS_S; a third signal skips them), exit 130 (no unwinding); the reaper stops the rest."""
    name = signal.Signals(sig).name
    if not _last_words:
        _say_and_exit(f"interrupted again ({name}): exiting now; the run's reaper stops what is still running")
    for s in SIGNALS:
        signal.signal(s, _exit_without_last_words)
    os.write(2, f"interrupted again ({name}): writing summary.json and the report, then exiting (at most "
                f"{LAST_WORDS_S:.0f} s; once more exits now); the run's reaper stops what is still running\n".encode())
    words = threading.Thread(target=_run_last_words, name="last-words", daemon=True)
    words.start()
    words.join(LAST_WORDS_S)  # a third signal interrupts the wait (POSIX) and exits
    os._exit(EXIT_INTERRUPTED)


def _exit_without_last_words(sig: int, frame: object) -> NoReturn:
    _say_and_exit(f"interrupted a third time ({signal.Signals(sig).name}): exiting now")


def _raise_first(sig: int, frame: object) -> NoReturn:  # the first signal outside the event loop
    _note(sig)
    for s in SIGNALS:
        signal.signal(s, exit_at_once)
    raise KeyboardInterrupt(signal.Signals(sig).name)


def interrupt_from(exc: SystemExit) -> NoReturn:
    """Raise `exc` again, or, when it is `sys.exit(SIGTERM)` (what ray.init's own SIGTERM handler
    raises while ray.init runs), what the first SIGTERM raises here: KeyboardInterrupt, and later
    signals exit at once."""
    if exc.code != signal.SIGTERM:
        raise exc
    _raise_first(signal.SIGTERM, None)


def install_before_start() -> None:
    """A signal ends the process at once (exit 130, one line): call first, before anything starts."""
    for sig in SIGNALS:
        signal.signal(sig, _exit_nothing_started)


def install_unwinding() -> None:
    """Outside the event loop, once the run has started things: the first signal raises
    KeyboardInterrupt (SIGTERM too) in the main thread; a later one exits at once. Call again after
    anything that installs its own handlers (`ray.init`, an event loop's close)."""
    for sig in SIGNALS:
        signal.signal(sig, exit_at_once if _signalled_at else _raise_first)


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
        import asyncio

        self._loop = asyncio.get_running_loop()
        self._fired = asyncio.Event()
        for sig in SIGNALS:
            self._loop.add_signal_handler(sig, self.fire, sig)

    def fire(self, sig: int) -> None:
        """A signal arrived: remember it, wake `guard`; a later signal exits at once (`exit_at_once`)."""
        if self.signal is not None:
            return
        self.signal = sig
        _note(sig)
        assert self._fired is not None and self._loop is not None
        self._fired.set()
        for s in SIGNALS:
            self._loop.remove_signal_handler(s)
            signal.signal(s, exit_at_once)

    @property
    def interrupted(self) -> bool:
        return self.signal is not None

    async def guard(self, work: Awaitable[T]) -> T:
        """Await `work`; on a signal, cancel it (twice if need be) and raise RunInterrupted.

        Raises whatever `work` raises when it ends by itself."""
        import asyncio

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
