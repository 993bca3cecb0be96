"""Health alarms a person sees before a run collapses: each reads the step metrics the loops log.

- `alarm/malformed_tool_calls`: the share of model turns whose tool call the gateway could not
  parse (per step, from the cumulative `gateway/turns_ill_formed` / `gateway/turns_served`) is at
  least `malformed_floor` over the last `window` steps and `rise` times the lowest window the run
  had. A Qwen3.5/3.6 agent's malformed rate climbs before its RL run collapses (verl issue #6252).
- `alarm/masked_fraction`: the rollout-correction masked fraction (verl's
  `rollout_corr/rollout_rs_masked_fraction` or `..._is_masked_fraction`, whichever is logged)
  rises the same way, with `masked_floor` (the toolkit's async-RL report saw it reach 3 %).
- `alarm/length_bias`: over the last `window` steps the trained rollouts' mean generated tokens
  (`rollout/trained_response_tokens_mean`) or mean model turns are below `1 - length_bias` of all
  finished rollouts' (`rollout/response_tokens_mean`, `rollout/turns_mean`: failed, expired and
  filtered ones too): staleness dropping or filtering starves the long, hard rollouts.

- `alarm/truncated_share`: over the last `window` steps at least `truncated_floor` of the finished
  rollouts ran out of context (`rollout/truncated_share`: status `truncated`, workers/rollout/overflow.py):
  the context or `rollout.max_context_tokens` is too small for the task, and what those rollouts
  train on is `rollout.overflow`'s choice, not the agent's work.

- `alarm/reward_hacking`: the share of rollouts that look like reward hacking rises like the
  malformed rate (at least `hacking_floor` over the last `window` steps and `rise` times the run's
  lowest window). A step's share is the larger of the clean-sandbox grader's two flags
  (`agent/hacking/protected_paths`: the diff touched tests or test config;
  `agent/hacking/episode_vs_graded`: the episode's own tests passed where the clean grading failed;
  examples/agents/agent_common/grading.py): a policy that learns to edit tests, or to pass them
  from inside the package, shows here before its reward does.

An alarm's metric is on every step: 1.0 while its rule holds, else 0.0. A console warning says
so on the step it starts, and once when it clears; the run report lists the steps it held
(orchestrator/watch/report.py).

Invariant: pure (no I/O but the log line), bounded memory (windows of `window` steps).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass, field

from orchestrator.watch.report_data import MASKED_KEYS

log = logging.getLogger(__name__)

ALARMS = ("alarm/malformed_tool_calls", "alarm/masked_fraction", "alarm/length_bias", "alarm/truncated_share",
          "alarm/reward_hacking")
HACKING_KEYS = ("agent/hacking/protected_paths", "agent/hacking/episode_vs_graded")  # batching.agent_metric_means


@dataclass(frozen=True)
class AlarmSettings:
    """window: steps per window; rise: how many times the run's lowest window a rate must reach;
    malformed_floor / masked_floor: the least rate that alarms (fractions); length_bias: the
    relative shortfall of trained vs all finished rollouts that alarms; truncated_floor: the share of
    finished rollouts that ran out of context that alarms (over the window); hacking_floor: the least
    share of rollouts flagged as reward hacking that alarms (over the window)."""

    window: int = 5
    rise: float = 2.0
    malformed_floor: float = 0.05
    masked_floor: float = 0.02
    length_bias: float = 0.2
    truncated_floor: float = 0.1
    hacking_floor: float = 0.05

    def __post_init__(self) -> None:
        if (self.window < 1 or self.rise < 1 or not 0 < self.length_bias < 1 or not 0 < self.truncated_floor <= 1
                or not 0 < self.hacking_floor <= 1):
            raise ValueError(f"alarm settings out of range: {self}")


@dataclass
class _Rising:
    """A rate over the last `window` steps against the lowest full window seen."""

    window: int
    values: deque = field(default_factory=deque)
    lowest: float = math.inf

    def observe(self, value: float | None) -> float | None:
        """Add a step's rate (None: no data this step); the current window mean once full."""
        if value is None:
            return None
        self.values.append(value)
        if len(self.values) > self.window:
            self.values.popleft()
        if len(self.values) < self.window:
            return None
        mean = sum(self.values) / self.window
        self.lowest = min(self.lowest, mean)
        return mean


class HealthAlarms:
    """Feed it each step's metrics (`observe`); it adds the `alarm/*` metrics and warns."""

    def __init__(self, settings: AlarmSettings | None = None) -> None:
        self.s = settings or AlarmSettings()
        self._malformed = _Rising(self.s.window)
        self._masked = _Rising(self.s.window)
        self._hacking = _Rising(self.s.window)
        self._served = self._ill = 0.0
        self._lengths: deque = deque(maxlen=self.s.window)  # (all tokens, trained tokens, all turns, trained turns)
        self._truncated: deque = deque(maxlen=self.s.window)  # per-step share of rollouts that ran out of context
        self._on: dict[str, bool] = dict.fromkeys(ALARMS, False)

    def observe(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """The `alarm/*` metrics of this step (1.0: holds); logs a warning when one starts or clears."""
        fired = {
            "alarm/malformed_tool_calls": self._rising(self._malformed, self._malformed_rate(metrics),
                                                       self.s.malformed_floor),
            "alarm/masked_fraction": self._rising(self._masked, _first(metrics, MASKED_KEYS), self.s.masked_floor),
            "alarm/length_bias": self._length_bias(metrics),
            "alarm/truncated_share": self._truncated_share(metrics.get("rollout/truncated_share")),
            "alarm/reward_hacking": self._rising(self._hacking, hacking_share(metrics), self.s.hacking_floor),
        }
        for name, why in fired.items():
            if (why is not None) != self._on[name]:
                self._on[name] = why is not None
                if why is not None:
                    log.warning("step %d: %s: %s", step, name, why)
                else:
                    log.warning("step %d: %s cleared", step, name)
        return {name: float(why is not None) for name, why in fired.items()}

    def _malformed_rate(self, m: dict[str, float]) -> float | None:
        served, ill = m.get("gateway/turns_served"), m.get("gateway/turns_ill_formed")
        if served is None or ill is None:
            return None
        d_served, d_ill = served - self._served, ill - self._ill
        self._served, self._ill = served, ill
        return d_ill / d_served if d_served > 0 else None

    def _rising(self, tracker: _Rising, value: float | None, floor: float) -> str | None:
        mean = tracker.observe(value)
        if mean is None or mean < floor or mean < self.s.rise * tracker.lowest:
            return None
        return (f"{mean:.1%} over the last {self.s.window} steps (the run's lowest window: {tracker.lowest:.1%}; "
                f"alarms from {floor:.0%} and {self.s.rise:g}x the lowest)")

    def _truncated_share(self, share: float | None) -> str | None:
        if share is None or not math.isfinite(share):
            return None
        self._truncated.append(share)
        mean = sum(self._truncated) / len(self._truncated)
        if len(self._truncated) < self.s.window or mean < self.s.truncated_floor:
            return None
        return (f"{mean:.1%} of the rollouts of the last {self.s.window} steps ran out of context (status truncated; "
                f"alarms from {self.s.truncated_floor:.0%}): raise rollout.max_context_tokens, or see rollout.overflow")

    def _length_bias(self, m: dict[str, float]) -> str | None:
        keys = ("rollout/response_tokens_mean", "rollout/trained_response_tokens_mean", "rollout/turns_mean",
                "rollout/trained_turns_mean")
        vals = [m.get(k) for k in keys]
        if any(v is None or not math.isfinite(v) for v in vals):
            return None
        self._lengths.append(vals)
        if len(self._lengths) < self.s.window:
            return None
        all_tok, tr_tok, all_turns, tr_turns = (sum(v[i] for v in self._lengths) for i in range(4))
        short = [f"{what} {tr / al:.0%} of all finished rollouts'" for what, al, tr in
                 (("generated tokens", all_tok, tr_tok), ("turns", all_turns, tr_turns))
                 if al > 0 and tr < (1 - self.s.length_bias) * al]
        return f"trained rollouts' mean {' and '.join(short)} over the last {self.s.window} steps" if short else None


def hacking_share(m: dict[str, float]) -> float | None:
    """A step's reward-hacking share: the larger of `HACKING_KEYS` (a lower bound on the share of
    rollouts either flags); None when no agent of the step reported them."""
    vals = [v for k in HACKING_KEYS if isinstance(v := m.get(k), (int, float)) and math.isfinite(v)]
    return max(vals) if vals else None


def _first(m: dict[str, float], keys: tuple[str, ...]) -> float | None:
    for k in keys:
        v = m.get(k)
        if isinstance(v, (int, float)) and math.isfinite(v):
            return float(v)
    return None
