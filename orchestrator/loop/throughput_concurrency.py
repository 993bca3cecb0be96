"""`rollout.concurrency=adaptive`: a cap on running groups that seeks the best measured throughput.

The rule (after prime-rl's newest concurrency controller and OpenPipe ART's online autotuning of
rollout workers; written here from their description, not their code):

- **Probe.** From the current cap c, try c_up = max(c + 1, ⌈(1 + probe_step)·c⌉) for one
  measurement window; keep it if its throughput is within `tolerance` of the best of the two,
  else try c_down = ⌊c / (1 + probe_step)⌋ and keep the largest cap whose throughput is within
  `tolerance` of the best measured (ties go up: a larger cap never costs throughput there and
  leaves headroom). With the defaults, ~25 % above and below, 5 %. A cap that consecutive
  cycles keep is measured again for 1, 3, 7, then at most `MAX_DWELL_WINDOWS` windows before the
  next probe (each probe costs throughput once the best is found); a move halves that wait.
- **KV levels only trim, never push.** An up probe starts only while the engines' mean KV usage
  is below `grow_below` (0.6); at `trim_at` (0.8) the cap is cut by the probe factor at once; above
  `cancel_above` (0.9) it is cut and the groups running over the new cap are to be cancelled,
  youngest first (`cancel_groups()`).
- **A persistent waiting queue cuts.** Agent loads rarely preempt (a rollout spends most of its
  life in its tools), so vLLM's waiting queue, standing for `waiting_persist_s` above
  `max_waiting` requests (time-averaged, `LoadWindow`), is the overload signal; a new preemption
  cuts too.
- **Never past the staleness bound.** The cap stays in [min_groups, max_groups], max_groups the
  groups the async loop's staleness budget lets be in flight ((η + 1)·k·B).

Throughput is **groups finished per second**, counted by the gate as groups release their slot
(`on_group_done`), on the loop's clock. Why this and not tokens: it is the rate the trainer
consumes (a mini-batch is B groups), it needs no engine counter (the same in the product and the
simulator), and it counts only finished work: a cap that makes the engines generate more tokens
but finish fewer rollouts (preemption, a queue) scores lower. It lags a cap change by a rollout's
latency, so each window first lets the groups running turn over once (`cap` groups finished,
the settle) and then measures until another `cap` groups finished and at least `min_window_s`.

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
DEFAULT_MIN_WINDOW_S = 20.0  # seconds a measurement lasts at least (after its settle)
MAX_DWELL_WINDOWS = 8  # a cap kept by consecutive probe cycles is measured 1, 3, 7, then at most 8 windows between probes
OBSERVE_INTERVAL_S = 2.0  # seconds between two observations the wrappers aim at (slot steering's period)

Decision = Literal["start", "measure", "probe_up", "probe_down", "keep", "trim_kv", "cancel_kv",
                   "cut_waiting", "cut_preempted"]
DECISIONS: tuple[Decision, ...] = ("start", "measure", "probe_up", "probe_down", "keep", "trim_kv", "cancel_kv",
                                   "cut_waiting", "cut_preempted")
CUTS: tuple[Decision, ...] = ("trim_kv", "cancel_kv", "cut_waiting", "cut_preempted")


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
    min_window_s: float = DEFAULT_MIN_WINDOW_S

    def __post_init__(self) -> None:
        checks = (("probe_step", 0 < self.probe_step <= 1, "in (0, 1]"),
                  ("tolerance", 0 <= self.tolerance < 1, "in [0, 1)"),
                  ("grow_below", 0 < self.grow_below <= 1, "in (0, 1]"),
                  ("trim_at", self.grow_below <= self.trim_at <= 1, "in [grow_below, 1]"),
                  ("cancel_above", self.trim_at <= self.cancel_above <= 1, "in [trim_at, 1]"),
                  ("max_waiting", self.max_waiting >= 0, ">= 0"),
                  ("waiting_persist_s", self.waiting_persist_s >= 0, ">= 0 seconds"),
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
    done: int = 0  # groups finished since it began
    measure_from_s: float | None = None  # when the settle ended
    measured: int = 0  # groups finished since the settle ended
    bound_s: float = 0.0  # seconds of the measurement the cap bound (running >= cap)
    seen_s: float = 0.0  # seconds of the measurement observed


class ThroughputConcurrency:
    """Group cap that probes for the best measured throughput; see the module docstring.

    Args: settings (`ProbeSettings`); min_groups >= 1 (the floor and the cold start: B, one
    mini-batch, in the product); max_groups >= min_groups (the staleness budget's groups, None:
    unbounded). Raises ValueError naming `rollout.adaptive.min_groups` / `max_groups`.
    """

    interval_s = OBSERVE_INTERVAL_S

    def __init__(self, settings: ProbeSettings | None = None, *, min_groups: int = 1,
                 max_groups: int | None = None) -> None:
        if min_groups < 1:
            raise ValueError(f"rollout.adaptive.min_groups must be >= 1, got {min_groups}")
        if max_groups is not None and max_groups < min_groups:
            raise ValueError(f"rollout.adaptive.max_groups must be >= min_groups ({min_groups}), got {max_groups}")
        self.settings = settings or ProbeSettings()
        self.min_groups, self.max_groups = min_groups, max_groups if max_groups is not None else math.inf
        self.limit = min_groups
        self.decision: Decision = "start"
        self.counts = {d: 0 for d in DECISIONS}  # how often the limit moved (or held) for each reason
        self.usage = self.waiting = math.nan  # the signals of the last observation
        self.throughput: dict[int, float] = {}  # cap -> groups/s measured in the current probe cycle
        self.last_throughput = math.nan  # groups/s of the last finished window
        self.best_cap: int | None = None
        self._base: int | None = None  # the cap the current probe cycle started from
        self._window: _Window | None = None
        self._last_s: float | None = None
        self._preempted: int | None = None
        self._queue_since_s: float | None = None
        self._cancel = 0
        self._dwell = self._dwell_left = 0  # windows to stay at a cap the last probe cycle kept
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
        elif w.done >= w.cap:
            w.measure_from_s = now_s  # the groups that ran before this cap have turned over

    def observe(self, loads: Sequence[EngineLoad], now_s: float, running_groups: int) -> None:
        """Decide from the engines' `loads` at `now_s` (seconds) with `running_groups` running."""
        dt = 0.0 if self._last_s is None else max(0.0, now_s - self._last_s)
        self._last_s = now_s
        if self._window is None:
            self._window = _Window(self.limit, now_s)
        w = self._window
        if w.measure_from_s is not None:
            w.seen_s += dt
            if running_groups >= w.cap:
                w.bound_s += dt
        if loads:
            if self._congested(loads, now_s, running_groups):
                return
        if w.measure_from_s is not None and w.measured >= w.cap and now_s - w.measure_from_s >= self.settings.min_window_s:
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
        """Apply a trim if the engines are congested; True when one was applied (or is holding)."""
        s = self.settings
        preempted = sum(ld.num_preempted for ld in loads)
        new_preemption = self._preempted is not None and preempted > self._preempted
        self._preempted = preempted
        self.usage, self.waiting = self._load.means(loads)
        if self.waiting > s.max_waiting:
            self._queue_since_s = now_s if self._queue_since_s is None else self._queue_since_s
        else:
            self._queue_since_s = None
        queued = self._queue_since_s is not None and now_s - self._queue_since_s >= s.waiting_persist_s
        if self.usage > s.cancel_above:
            reason: Decision = "cancel_kv"
        elif self.usage >= s.trim_at:
            reason = "trim_kv"
        elif queued:
            reason = "cut_waiting"
        elif new_preemption:
            reason = "cut_preempted"
        else:
            return False
        w = self._window
        if w is not None and w.measure_from_s is None and self.decision in CUTS:
            return True  # the last cut has not turned over yet: what we see is the load from before it
        new = self._clamp(math.floor(self.limit / (1 + s.probe_step)))
        if reason == "cancel_kv":
            new = self._clamp(math.floor(min(self.limit, max(running, 1)) / (1 + s.probe_step)))
            self._cancel = max(0, running - new)
        self._queue_since_s = None
        self._move(new, reason, now_s)
        self.throughput.clear()
        self._base = None
        self._dwell = self._dwell_left = 0
        return True

    def _window_done(self, w: _Window, now_s: float) -> None:
        """A window ended: record its throughput and take the cycle's next step (module docstring)."""
        s = self.settings
        rate = w.measured / max(now_s - w.measure_from_s, 1e-9)
        self.last_throughput = rate
        self.throughput[w.cap] = rate
        old = base = self._base if self._base is not None else w.cap
        bound = w.seen_s > 0 and w.bound_s >= 0.5 * w.seen_s  # the cap held the producer: more may help
        up, down = self._up(base), self._down(base)
        if w.cap == up != base and bound and rate >= (1 - s.tolerance) * max(rate, self.throughput.get(base, 0.0)):
            base = up  # the larger cap is as good (within tolerance) or better: it becomes the base
        elif w.cap == down != base:
            best = max(self.throughput.values())
            base = max(c for c, r in self.throughput.items() if r >= (1 - s.tolerance) * best)
        elif w.cap == up != base:  # worse, or never bound (no evidence): try below the base
            if down < base and down not in self.throughput:
                return self._start(down, "probe_down", now_s, base)
        elif w.cap == base and self._dwell_left > 0:  # settled here: measure again before the next probe
            self._dwell_left -= 1
            return self._start(base, "measure", now_s, base)
        if w.cap != base or base != old:  # a probe cycle ended
            # the same cap kept: probe half as often; a move (noise within tolerance flips between
            # neighbours): probe twice as often, not at once (a real shift shows within a few cycles)
            self._dwell = self._dwell // 2 if base != old else min(2 * self._dwell + 1, MAX_DWELL_WINDOWS)
            self._dwell_left = self._dwell
        self.best_cap = base
        self.throughput = {base: self.throughput[base]}
        may_grow = math.isnan(self.usage) or self.usage < s.grow_below
        up, down = self._up(base), self._down(base)
        base_bound = bound if w.cap == base else True  # a cap just adopted bound in its own window
        if self._dwell_left > 0:
            self._dwell_left -= 1
            self._start(base, "keep" if base == self.limit else "probe_down", now_s, base)
        elif up > base and may_grow and base_bound:
            self._start(up, "probe_up", now_s, base)
        elif down < base:
            self._start(down, "probe_down", now_s, base)  # not growing: check the slope below
        else:
            self._start(base, "measure", now_s, base)

    def _up(self, cap: int) -> int:
        return self._clamp(max(cap + 1, math.ceil(cap * (1 + self.settings.probe_step))))

    def _down(self, cap: int) -> int:
        return self._clamp(math.floor(cap / (1 + self.settings.probe_step)))

    def _start(self, cap: int, reason: Decision, now_s: float, base: int) -> None:
        self._base = base
        self._move(cap, reason, now_s)

    def _move(self, cap: int, reason: Decision, now_s: float, *, settle: bool = True) -> None:
        self.limit = cap
        self.decision = reason
        self.counts[reason] += 1
        if settle:
            self._window = _Window(cap, now_s)

    def _clamp(self, n: float) -> int:
        return int(min(max(n, self.min_groups), self.max_groups))
