"""The console a person watches: setup phase messages, then one progress display per run: a rich
progress bar (step/total, ETA, reward, throughput, rollouts in flight, failures) on a terminal,
plain `[step N/T] ...` lines otherwise (CI, `ray job submit` logs, a pipe), and the warnings of
orchestrator/watch/run_watch.py, shown however quiet the console is.

Invariant: every step record given to `ProgressSink.log` is shown (a bar update or one line) and
every warning StepWatch raises is printed once; a plain line always starts `[step N/T]`.
Callers: orchestrator/watch/metrics.py (`build_sinks`: the `console` sink), orchestrator/main.py and
orchestrator/wiring/runtime.py (`phase`).
"""

from __future__ import annotations

import logging
import math
import sys
import time
from typing import Any, Callable, TextIO

from orchestrator.watch.run_watch import FINISHED, StepWatch

_T0 = time.monotonic()  # phase messages give the time since the driver started
# every console line also goes to this logger, so RUN_DIR/logs/driver.log holds the run's story;
# orchestrator/watch/console_log.py keeps its records off the console (they were printed already)
CONSOLE_LOGGER = "orchestrator.console"
_LOG = logging.getLogger(CONSOLE_LOGGER)


def phase(msg: str, stream: TextIO | None = None) -> None:
    """One setup line, `[  12s] msg`, so the minutes before step 1 are never silent (also logged)."""
    line = f"[{time.monotonic() - _T0:4.0f}s] {msg}"
    print(line, file=stream or sys.stdout, flush=True)
    _LOG.info(line)


def _f(v: Any, fmt: str) -> str | None:
    return format(v, fmt) if isinstance(v, (int, float)) and math.isfinite(v) else None


def _eta(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def step_fields(m: dict[str, float]) -> list[tuple[str, str]]:
    """(name, value) pairs of a step record worth one glance; NaN and missing values are left out."""
    in_flight = m.get("rollout/dispatched", 0.0) - sum(m.get(k, 0.0) for k in FINISHED)
    pairs = [
        ("reward", _f(m.get("reward/mean"), ".3f")),
        ("tok/s", _f(m.get("perf/throughput"), ".0f")),
        ("step", (f"{m['timing_s/step']:.1f}s" if _f(m.get("timing_s/step"), ".1f") else None)),
        ("wait" if "timing_s/wait_for_batch" in m else "gen", _f(m.get("timing_s/gen"), ".1f")),
        ("update", _f(m.get("timing_s/update_actor"), ".1f")),
        ("sync", _f(m.get("timing_s/update_weights"), ".2f")),
        ("in_flight", _f(in_flight, ".0f") if "rollout/dispatched" in m else None),
        ("failed_total", _f(m.get("rollout/failed"), ".0f")),  # the run's so far, as in metrics.jsonl
        ("filtered_total", _f(m.get("rollout/filtered"), ".0f")),
        ("staleness", _f(m.get("staleness/mean"), ".2f")),
        ("is_mean", _f(m.get("rollout_corr/is_mean"), ".3f")),
    ]
    if "val/reward/mean" in m:
        pairs.append(("val", f"{m['val/reward/mean']:.3f}@v{int(m.get('val/policy_version', 0))}"))
    return [(k, v) for k, v in pairs if v is not None]


BAR_FIELDS = ("reward", "tok/s", "step", "in_flight", "failed_total", "filtered_total", "val")  # a bar keeps to one line


class ProgressSink:
    """The `console` metric sink. `tty`: draw a rich bar (default: whether `stream` is a terminal);
    `clock`: seconds, for the ETA of a bar-less run."""

    def __init__(self, total_steps: int, stream: TextIO = sys.stdout, *, tty: bool | None = None,
                 warn_stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._total = total_steps
        self._stream = stream
        self._warn = warn_stream or sys.stderr
        self._watch = StepWatch()
        self._step_s: list[float] = []
        self._bar = None
        if tty if tty is not None else stream.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(), TimeRemainingColumn(),
                                 TextColumn("{task.fields[info]}"), console=Console(file=stream), transient=False)
            self._task = self._bar.add_task("train", total=total_steps, info="")
        self._started = False  # the bar is drawn from the first record on, after the setup phase lines

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self._bar is not None and not self._started:
            self._bar.start()
            self._started = True
        fields = step_fields(metrics)
        if "timing_s/step" not in metrics:  # a validation record of its own (step 0, or the final weights)
            self._say(f"[validation @ step {step}] " + " ".join(f"{k}={v}" for k, v in fields))
            return
        self._step_s.append(float(metrics["timing_s/step"]))
        for w in self._watch.on_step(step, metrics):
            self._say(f"warning: {w}", warn=True)
        if self._bar is not None:
            info = " ".join(f"{k}={v}" for k, v in fields if k in BAR_FIELDS)
            self._bar.update(self._task, completed=step, info=info)
            return
        eta = (self._total - step) * sum(self._step_s) / len(self._step_s)
        line = f"[step {step}/{self._total}] " + " ".join(f"{k}={v}" for k, v in fields) + f" eta={_eta(eta)}"
        print(line, file=self._stream, flush=True)
        _LOG.info(line)

    def _say(self, line: str, warn: bool = False) -> None:
        _LOG.log(logging.WARNING if warn else logging.INFO, line)
        if self._bar is not None:
            self._bar.console.print(line, style="yellow" if warn else None, markup=False, highlight=False)
        else:
            print(line, file=self._warn if warn else self._stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def summary_text(summary: dict) -> str:
    """The run's end in two lines (summary.json holds every figure)."""
    def num(k: str) -> str:
        v = summary.get(k)
        return _f(v, ".3f") or "-"

    counts = ", ".join(f"{int(summary.get(f'rollout/{k}', 0))} {name}" for k, name in
                       (("completed", "trained"), ("filtered", "filtered"), ("failed", "failed"), ("expired", "expired")))
    if summary.get("rollout/truncated"):  # ran out of context (rollout.overflow decided their training)
        counts += f", {int(summary['rollout/truncated'])} truncated"
    if summary.get("rollout/open"):  # an interrupted run: the step in progress never ended
        counts += f", {int(summary['rollout/open'])} still running when it stopped"
    return (f"done: {summary.get('steps', 0)} steps, policy version {summary.get('policy_version', 0)}, "
            f"reward {num('reward/initial')} -> {num('reward/final')} (mean of the first and last 10 % of steps), "
            f"{summary.get('wall_s', 0):.0f} s\n"
            f"rollouts: {int(summary.get('rollout/dispatched', 0))} dispatched: {counts}; "
            f"ACR throttled {summary.get('acr/throttled', 0)}")
