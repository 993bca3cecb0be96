"""`rollout.concurrency=adaptive`: a cap on running groups that seeks the best measured throughput.

The rule (after prime-rl's newest concurrency controller and OpenPipe ART's online autotuning of
rollout workers; written here from their description, not their code):

- **Cold start where the fixed policy runs**, `start_groups`: the product passes the in-flight
  cap `rollout.concurrency=fixed` would use ((η + 1)·B, or `async.max_concurrent_rollouts`). The
  policy moves off it only on a measurement, so it starts no worse than fixed, and a load whose
  best cap is the fixed one (the real model's at η = 1) pays only its probes. From one
  mini-batch instead, the climb to the tiny model's best cap in one run (8 -> 40 groups, 7
  windows) took 110 s of a 130 s run: 0.86x fixed.
- **Probe.** From the current cap c, try c_up = max(c + 1, ⌈(1 + probe_step)·c⌉) for one
  measurement window. It wins if it is within `tolerance` of the peak measured throughput (ties go
  up: a larger cap never costs throughput there and leaves headroom); a win climbs on from it. If
  the first step up loses (or c is max_groups), try c_down = ⌊c / (1 + probe_step)⌋; while a down
  probe beats every larger cap measured by more than `tolerance` it descends on (unless the cap
  below it was measured worse), so a start above the knee walks down one window per step; then
  keep the largest cap within `tolerance` of the peak. The peak is over each cap's last
  measurement of the last `HISTORY_WINDOWS` windows, so tolerance cannot ratchet the cap down
  step by step, and a measurement that old no longer counts (the workload drifts). With the
  defaults, ~25 % above and below, 5 %. A cap that consecutive cycles keep is measured again
  for 1, 3, 7, then at most `MAX_DWELL_WINDOWS` windows before the next probe (each probe costs
  throughput once the best is found); a move halves that wait.
- **KV levels only trim, never push.** An up probe starts only while the engines' mean KV usage
  is below `grow_below` (0.6). Usage standing at or above `trim_at` (0.8) for `kv_persist_s`
  (10 s) cuts the cap by the probe factor; above `cancel_above` (0.9) then, the cut is from the
  groups running and those over the new cap are to be cancelled, youngest first
  (`cancel_groups()`). A spike does not cut: a cache of a few blocks (the tiny model's 6) reads
  0.8-0.93 for a 2 s window at any cap, and cutting on each one walked the cap from the fixed
  one (40) down to 9-16 groups, clearing the measurements each time (0.54x the best fixed cap).
- **A standing queue cuts unless it pays.** vLLM's waiting queue, standing for
  `waiting_persist_s` above `max_waiting` requests (time-averaged, `LoadWindow`), marks the
  window. A kept cap whose window was marked is cut by the probe factor when the window ends,
  unless it beat the nearest measured cap below by more than `tolerance`; an up probe whose window
  was marked wins only by beating its base by more than `tolerance` (the tie goes down). Agent
  loads queue at an engine that is not the bottleneck (most of a rollout waits on tools or the
  agent's host), so a queue alone does not prove overload: measured on the tiny model's 6-block
  cache, the cap with the longest queue gave the most throughput. Preemptions are not a signal of
  their own: the throughput they cost is measured (a small cache preempts at every cap, and
  cutting on each one pinned the cap to its floor).
- **Never past the staleness bound.** The cap stays in [min_groups, max_groups], max_groups the
  groups the async loop's staleness budget lets be in flight ((η + 1)·k·B).

Throughput is **groups finished per second**, counted by the gate as groups release their slot
(`on_group_done`), on the loop's clock. Why this and not tokens: it is the rate the trainer
consumes (a mini-batch is B groups), it needs no engine counter (the same in the product and the
simulator), and it counts only finished work: a cap that makes the engines generate more tokens
but finish fewer rollouts (preemption, a queue) scores lower. It lags a cap change by a rollout's
latency, so each window first lets the groups running turn over once (`cap` groups finished,
the settle) and then measures until another `cap` groups, and at least two mini-batches
(2·min_groups), finished and at least `min_window_s` passed. A loop that finishes groups in
bursts (a sync-like load: one mini-batch generated, then the trainer's update) is so measured
over at least two bursts: on the real model at η = 1 one mini-batch's windows read 0.25 to 1.13
groups/s at the same cap, depending on where in the step they fell.

Pure: no asyncio, no clock of its own (times come in as arguments), no Ray. Invariant, checked by
tests/test_throughput_concurrency.py: min_groups <= limit <= max_groups after every call; a
congested observation never raises the limit; `decision` names why the limit last moved.
Callers: orchestrator/loop/concurrency.py `ConcurrencyGate` (product and simulator alike).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Sequence

from workers.core.types import EngineLoad

DEFAULT_PROBE_STEP = 0.25  # an up probe tries (1 + step) x the cap, a down probe cap / (1 + step)
DEFAULT_TOLERANCE = 0.05  # a cap within 5 % of the best measured throughput counts as the best
DEFAULT_GROW_BELOW = 0.6  # mean KV usage (0..1) under which an up probe may start
DEFAULT_TRIM_AT = 0.8  # mean KV usage at which the cap is cut by the probe factor at once
DEFAULT_CANCEL_ABOVE = 0.9  # mean KV usage above which the groups over the cut cap are cancelled
DEFAULT_MAX_WAITING = 0.5  # requests waiting on an engine (window mean) above which it queues
DEFAULT_WAITING_PERSIST_S = 30.0  # seconds a queue must stand before it cuts (a burst does not)
DEFAULT_KV_PERSIST_S = 10.0  # seconds KV usage must stand at or above trim_at before it cuts (a spike does not)
DEFAULT_MIN_WINDOW_S = 20.0  # seconds a measurement lasts at least (after its settle)
MAX_DWELL_WINDOWS = 8  # a cap kept by consecutive probe cycles is measured 1, 3, 7, then at most 8 windows between probes
OBSERVE_INTERVAL_S = 2.0  # seconds between two observations the wrappers aim at (slot steering's period)

HISTORY_WINDOWS = 12  # a cap's last measurement counts toward the peak for this many windows

Decision = Literal["start", "measure", "probe_up", "probe_down", "keep", "trim_kv", "cancel_kv", "cut_waiting"]
DECISIONS: tuple[Decision, ...] = ("start", "measure", "probe_up", "probe_down", "keep", "trim_kv", "cancel_kv",
                                   "cut_waiting")
CUTS: tuple[Decision, ...] = ("trim_kv", "cancel_kv", "cut_waiting")


@dataclass(frozen=True)
class ProbeSettings:
    """`rollout.adaptive.*` of the throughput-seeking policy; see the module docstring. Raises
    ValueError naming `rollout.adaptive.<key>` on a bad value."""

    probe_step: float = DEFAULT_PROBE_STEP
    tolerance: float = DEFAULT_TOLERANCE
    grow_below: float = DEFAULT_GROW_BELOW
    trim_at: float = DEFAULT_TRIM_AT
    cancel_above: float = DEFAULT_CANCEL_ABOVE
    max_waiting: float = DEFAULT_MAX_WAITING
    waiting_persist_s: float = DEFAULT_WAITING_PERSIST_S
    kv_persist_s: float = DEFAULT_KV_PERSIST_S
    min_window_s: float = DEFAULT_MIN_WINDOW_S

    def __post_init__(self) -> None:
        checks = (("probe_step", 0 < self.probe_step <= 1, "in (0, 1]"),
                  ("tolerance", 0 <= self.tolerance < 1, "in [0, 1)"),
                  ("grow_below", 0 < self.grow_below <= 1, "in (0, 1]"),
                  ("trim_at", self.grow_below <= self.trim_at <= 1, "in [grow_below, 1]"),
                  ("cancel_above", self.trim_at <= self.cancel_above <= 1, "in [trim_at, 1]"),
                  ("max_waiting", self.max_waiting >= 0, ">= 0"),
                  ("waiting_persist_s", self.waiting_persist_s >= 0, ">= 0 seconds"),
                  ("kv_persist_s", self.kv_persist_s >= 0, ">= 0 seconds"),
                  ("min_window_s", self.min_window_s > 0, "> 0 seconds"))
        for key, ok, want in checks:
            if not ok:
                raise ValueError(f"rollout.adaptive.{key} must be {want}, got {getattr(self, key)}")


class LoadWindow:
    """The engines' mean KV usage and longest queue over the last window of >= `interval_s` of
    their own clocks when every engine reports its integrals (a real vLLM replica: one step's
    snapshot is noise), else the snapshot (the simulator's replica, exact at every instant). The
    window restarts when the engines change (a replaced replica's integrals restart)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._start: list[tuple] | None = None
        self._means: tuple[float, float] | None = None

    def means(self, loads: Sequence[EngineLoad]) -> tuple[float, float]:
        """(mean KV usage over engines 0..1, longest queue in requests waiting on one engine)."""
        refs = [(ld.kv_usage_integral_s, ld.waiting_integral_s, ld.clock_s) for ld in loads]
        snapshot = (sum(ld.kv_cache_usage for ld in loads) / len(loads), float(max(ld.num_waiting for ld in loads)))
        if any(v is None for ref in refs for v in ref):
            return snapshot
        if self._start is None or len(self._start) != len(refs) or any(
                i < i0 or w < w0 or t < t0 for (i, w, t), (i0, w0, t0) in zip(refs, self._start)):
            self._start, self._means = refs, None
        elif all(t - t0 >= self.interval_s for (_, _, t), (_, _, t0) in zip(refs, self._start)):
            pairs = list(zip(refs, self._start))
            self._means = (sum((i - i0) / (t - t0) for (i, _, t), (i0, _, t0) in pairs) / len(refs),
                           max((w - w0) / (t - t0) for (_, w, t), (_, w0, t0) in pairs))
            self._start = refs
        return snapshot if self._means is None else self._means


@dataclass
class _Window:
    """One cap's measurement: settles until `cap` groups finished since it began, then measures."""

    cap: int
    began_s: float
    phase: Literal["measure", "up", "down"] = "measure"  # a kept cap measured again, or a probe
    done: int = 0  # groups finished since it began
    measure_from_s: float | None = None  # when the settle ended
    measured: int = 0  # groups finished since the settle ended
    last_done_s: float | None = None  # when the last of them finished
    queued: bool = False  # a queue stood `waiting_persist_s` during it


def _since(since_s: float | None, holds: bool, now_s: float) -> float | None:
    """When a condition that `holds` now began to hold (None: it does not hold)."""
    return (now_s if since_s is None else since_s) if holds else None


def _stood(since_s: float | None, persist_s: float, now_s: float) -> bool:
    """True when the condition has held since `since_s` for at least `persist_s` seconds."""
    return since_s is not None and now_s - since_s >= persist_s


class ThroughputConcurrency:
    """Group cap that probes for the best measured throughput; see the module docstring.

    Args: settings (`ProbeSettings`); min_groups >= 1 (the floor: B, one mini-batch, in the
    product); max_groups >= min_groups (the staleness budget's groups, None: unbounded);
    start_groups (the cold start, clamped to [min_groups, max_groups]; None: min_groups). Raises
    ValueError naming `rollout.adaptive.min_groups` / `max_groups`.
    """

    interval_s = OBSERVE_INTERVAL_S

    def __init__(self, settings: ProbeSettings | None = None, *, min_groups: int = 1,
                 max_groups: int | None = None, start_groups: int | None = None) -> None:
        if min_groups < 1:
            raise ValueError(f"rollout.adaptive.min_groups must be >= 1, got {min_groups}")
        if max_groups is not None and max_groups < min_groups:
            raise ValueError(f"rollout.adaptive.max_groups must be >= min_groups ({min_groups}), got {max_groups}")
        self.settings = settings or ProbeSettings()
        self.min_groups, self.max_groups = min_groups, max_groups if max_groups is not None else math.inf
        self.limit = self._clamp(start_groups if start_groups is not None else min_groups)  # the cold start
        self.decision: Decision = "start"
        self.counts = {d: 0 for d in DECISIONS}  # how often the limit moved (or held) for each reason
        self.usage = self.waiting = math.nan  # the signals of the last observation
        self.history: dict[int, tuple[float, int]] = {}  # cap -> (groups/s, window number) of its last window
        self.last_throughput = math.nan  # groups/s of the last finished window
        self.best_cap: int | None = None
        self._windows = 0  # windows finished
        self._base: int | None = None  # the cap the current probe cycle started from
        self._cycle_from: int | None = None  # the base when the cycle began (did the cycle move it?)
        self._window: _Window | None = None
        self._queue_since_s: float | None = None
        self._kv_since_s: float | None = None  # since when mean KV usage stands at or above trim_at
        self._cancel = 0
        self._dwell = self._dwell_left = 0  # windows to stay at a cap the last probe cycle kept
        self._kept_before: tuple[int, ...] = ()  # the caps the last cycle started from and kept
        self._load = LoadWindow(self.interval_s)

    # --- facts in ---------------------------------------------------------------------------

    def on_group_done(self, now_s: float) -> None:
        """A group released its slot at `now_s` (seconds on the caller's clock)."""
        w = self._window
        if w is None:
            return
        w.done += 1
        if w.measure_from_s is not None:
            w.measured += 1
            w.last_done_s = now_s
        elif w.done >= w.cap:
            w.measure_from_s = now_s  # the groups that ran before this cap have turned over

    def observe(self, loads: Sequence[EngineLoad], now_s: float, running_groups: int) -> None:
        """Decide from the engines' `loads` at `now_s` (seconds) with `running_groups` running."""
        if self._window is None:
            self._window = _Window(self.limit, now_s)
        w = self._window
        if loads and self._congested(loads, now_s, running_groups):
            return
        if (w.measure_from_s is not None and w.measured >= max(w.cap, 2 * self.min_groups)
                and now_s - w.measure_from_s >= self.settings.min_window_s):
            self._window_done(w, now_s)

    # --- queries ----------------------------------------------------------------------------

    def may_admit(self, running_groups: int) -> bool:
        return running_groups < self.limit

    def cancel_groups(self) -> int:
        """Groups to cancel now, youngest first (set by a KV usage above `cancel_above`); reading
        it hands them over (the next call answers 0 until the next such cut)."""
        n, self._cancel = self._cancel, 0
        return n

    def metrics(self) -> dict[str, float]:
        """`rollout/concurrency_limit`, the probe's measurements (`rollout/concurrency_window_cap`,
        `..._throughput_gps`: groups/s of the last window, `..._best_cap`) and why it moved
        (`rollout/concurrency_decision`: the index in DECISIONS; `rollout/concurrency_<decision>`:
        how often)."""
        out = {"rollout/concurrency_limit": float(self.limit),
               "rollout/concurrency_window_cap": float(self._window.cap if self._window else self.limit),
               "rollout/concurrency_throughput_gps": self.last_throughput,
               "rollout/concurrency_best_cap": float(self.best_cap) if self.best_cap is not None else math.nan,
               "rollout/concurrency_decision": float(DECISIONS.index(self.decision)),
               "rollout/kv_usage_signal": self.usage, "rollout/waiting_signal": self.waiting}
        out.update({f"rollout/concurrency_{d}": float(c) for d, c in self.counts.items() if d != "start"})
        return out

    # --- the rule ---------------------------------------------------------------------------

    def _congested(self, loads: Sequence[EngineLoad], now_s: float, running: int) -> bool:
        """Apply a cut if the engines are congested; True when one was applied (or is holding)."""
        s = self.settings
        self.usage, self.waiting = self._load.means(loads)
        self._queue_since_s = _since(self._queue_since_s, self.waiting > s.max_waiting, now_s)
        w = self._window
        if w is not None and _stood(self._queue_since_s, s.waiting_persist_s, now_s):
            w.queued = True
        # until the last cut has turned over, what the engines report is the load from before it
        holding = w is not None and w.measure_from_s is None and self.decision in CUTS
        self._kv_since_s = _since(self._kv_since_s, self.usage >= s.trim_at and not holding, now_s)
        if not _stood(self._kv_since_s, s.kv_persist_s, now_s):
            return False  # (a standing queue is judged with the window's throughput when it ends: _window_done)
        reason: Decision = "cancel_kv" if self.usage > s.cancel_above else "trim_kv"
        new = self._clamp(math.floor(self.limit / (1 + s.probe_step)))
        if reason == "cancel_kv":
            new = self._clamp(math.floor(min(self.limit, max(running, 1)) / (1 + s.probe_step)))
            self._cancel = max(0, running - new)
        if new >= self.limit and not self._cancel:
            return False  # at the floor: nothing to cut, the measurement goes on
        self._cut(new, reason, now_s)
        return True

    def _cut(self, new: int, reason: Decision, now_s: float) -> None:
        self._queue_since_s = self._kv_since_s = None
        self._move(new, reason, now_s)
        if reason != "cut_waiting":  # the engines' load changed: what was measured no longer holds
            self.history.clear()
        self._base = self._cycle_from = None
        self._dwell = self._dwell_left = 0

    def _queue_pays(self, cap: int) -> bool:
        """True when `cap`'s last window beat the nearest measured cap below it by more than the
        tolerance: a standing queue that buys throughput is kept (agent loads queue at the engine
        while most of a rollout waits on tools, so a queue alone does not prove overload)."""
        below = [c for c in self.history if c < cap]
        return cap in self.history and bool(below) and (
            self.history[cap][0] > (1 + self.settings.tolerance) * self.history[max(below)][0])

    def _kept(self) -> int:
        """The largest measured cap within `tolerance` of the peak measured throughput."""
        peak = max(r for r, _ in self.history.values())
        return max(c for c, (r, _) in self.history.items() if r >= (1 - self.settings.tolerance) * peak)

    def _window_done(self, w: _Window, now_s: float) -> None:
        """A window ended: record its throughput and take the cycle's next step (module docstring)."""
        s = self.settings
        # groups per second between completions: the time since the last one is not the cap's work
        rate = w.measured / max((w.last_done_s or now_s) - w.measure_from_s, 1e-9)
        self.last_throughput = rate
        self._windows += 1
        self.history[w.cap] = (rate, self._windows)
        self.history = {c: v for c, v in self.history.items() if self._windows - v[1] < HISTORY_WINDOWS}
        base = self._base if self._base is not None else w.cap
        self._cycle_from = base if self._cycle_from is None else self._cycle_from
        may_grow = math.isnan(self.usage) or self.usage < s.grow_below
        up, down = self._up(base), self._down(base)
        if w.phase == "up":
            base_rate = self.history.get(base, (0.0, 0))[0]
            won = (rate > (1 + s.tolerance) * base_rate) if w.queued else self._kept() >= w.cap
            if won:  # as good as the peak (strictly better when it queued): climb on from it
                if may_grow and (higher := self._up(w.cap)) > w.cap:
                    return self._start(higher, "probe_up", now_s, w.cap, "up")
                return self._end_cycle(w.cap, now_s)
            if base == self._cycle_from and down < base:
                return self._start(down, "probe_down", now_s, base, "down")  # the first step up lost: look below
            return self._end_cycle(base, now_s)
        if w.phase == "down":
            lower = self._down(w.cap)
            known_worse = lower in self.history and self.history[lower][0] < rate
            if self._kept() == w.cap and lower < w.cap and not known_worse:
                return self._start(lower, "probe_down", now_s, w.cap, "down")  # a clear win: descend on
            return self._end_cycle(self._kept(), now_s)
        if w.queued and not self._queue_pays(w.cap) and self._down(w.cap) < w.cap:
            return self._cut(self._down(w.cap), "cut_waiting", now_s)
        if self._dwell_left > 0:  # settled here: measure again before the next probe
            self._dwell_left -= 1
            return self._start(base, "measure", now_s, base, "measure")
        self._cycle_from = base
        if up > base and may_grow:
            return self._start(up, "probe_up", now_s, base, "up")
        if down < base:
            return self._start(down, "probe_down", now_s, base, "down")  # not growing: check the slope below
        return self._start(base, "measure", now_s, base, "measure")

    def _end_cycle(self, base: int, now_s: float) -> None:
        """A probe cycle ended at `base`: keep it, and wait longer before the next probe when the
        cycle kept a cap one of the last two cycles kept (noise near the tolerance flips between
        two neighbours: that is not a move); a move halves the wait rather than probing at once."""
        moved = base != self._cycle_from and base not in self._kept_before
        self._kept_before = (self._cycle_from if self._cycle_from is not None else base, base)
        self._dwell = self._dwell // 2 if moved else min(2 * self._dwell + 1, MAX_DWELL_WINDOWS)
        self._dwell_left, self._cycle_from, self.best_cap = self._dwell, None, base
        self._start(base, "keep", now_s, base, "measure")

    def _up(self, cap: int) -> int:
        return self._clamp(max(cap + 1, math.ceil(cap * (1 + self.settings.probe_step))))

    def _down(self, cap: int) -> int:
        return self._clamp(math.floor(cap / (1 + self.settings.probe_step)))

    def _start(self, cap: int, reason: Decision, now_s: float, base: int,
               phase: Literal["measure", "up", "down"]) -> None:
        self._base = base
        self._move(cap, reason, now_s, phase)

    def _move(self, cap: int, reason: Decision, now_s: float, phase: Literal["measure", "up", "down"] = "measure") -> None:
        self.limit = cap
        self.decision = reason
        self.counts[reason] += 1
        self._window = _Window(cap, now_s, phase)

    def _clamp(self, n: float) -> int:
        return int(min(max(n, self.min_groups), self.max_groups))
