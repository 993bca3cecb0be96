"""Rollout concurrency policy (`rollout.concurrency`): how many groups may generate at once.

`fixed`: no window of its own: the async loop's admission (orchestrator/loop/staleness.py) caps
the groups in flight at (η + 1)·B (`fixed_max_running`, or `async.max_concurrent_rollouts`); the
sync loop dispatches whole batches. `adaptive`: a cap that probes ~25 % above and below itself and
keeps the largest within 5 % of the best measured throughput, trimmed by the engines' KV usage and
a standing queue, never past the staleness budget (orchestrator/loop/throughput_concurrency.py).
`aimd`: the earlier policy, kept for comparison: admit groups while the inference engines' KV
cache is below a target and nothing is queued or preempted, so the cache fills instead of idling
at the 25 % an agent workload leaves it at with a fixed concurrency.

`AimdConcurrency` is pure (no asyncio, no clock of its own): it is told the engines' load
(vLLM's scheduler stats, `EngineLoad`) and the time, and answers `may_admit(running_groups)`. Its
rule is additive-increase / multiplicative-decrease on a limit of running groups (TCP's
congestion control, Chiu & Jain 1989): while the mean KV usage is below `kv_target`, requests do
not queue (at most `max_waiting` waiting on any engine on average) and no new preemption happened,
and the limit binds, the limit grows by one group per `interval_s`; when the cache is at or over
target, requests queue, or a request was preempted, the limit drops to `decrease` × itself (at most once per `interval_s`; the window, not the
groups running at that instant, as TCP cuts its congestion window: on short bursty rollouts the
running count between bursts is small, and cutting to it collapsed the limit to 1 on this machine). A group's
KV footprint grows for as long as its agents run, so the limit, not the instantaneous usage,
is what holds the cache near the target without a preemption storm. The usage and the queue it
decides on are time averages over the last window of >= `interval_s` when the engines report
their integrals (`LoadWindow`: a real vLLM replica, workers/inference/engine.py KvCacheUsage: short rollouts
fill and empty the cache within a second, and vLLM's per-step stats are taken after a step has
freed its finished requests and before the next one admits the waiting ones, so one step's
snapshot of either is noise: "a request waits" was true at nearly every burst and kept cutting the
window), else the snapshot (the simulator's replica, exact at every instant; its queue is a
whole number, so any waiting request exceeds the default `max_waiting` of 0.5).

The window sits under the async loop's staleness budget: the producer takes its staleness slot
first, then asks this gate, so a producer held by the staleness budget never makes the window
look full (it grows only while it binds). `ConcurrencyGate.blocked_s` (seconds refused) says
which bound holds: ~0 while the staleness budget does.

Invariant: `limit` is always >= `min_groups`; `may_admit` is True only while running < limit.
`ConcurrencyGate` is the thin async wrapper the async loop's producer awaits (one group slot per
admitted group, released when its rollouts end; a release is the throughput `adaptive` measures),
over either policy (`GroupLimit`). Callers: orchestrator/loop/async_loop.py,
orchestrator/wiring/training.py (product), orchestrator/planning/sim/parts.py (simulator): the same code in both.
"""

from __future__ import annotations

import asyncio
import math
from typing import Awaitable, Callable, Literal, Protocol, Sequence

from orchestrator.loop.throughput_concurrency import LoadWindow
from workers.core.types import EngineLoad

ConcurrencyPolicy = Literal["fixed", "adaptive", "aimd"]
CONCURRENCY_CHOICES: tuple[ConcurrencyPolicy, ...] = ("fixed", "adaptive", "aimd")
DEFAULT_KV_TARGET = 0.8  # fraction of the KV cache the adaptive policy fills
DEFAULT_INTERVAL_S = 2.0  # seconds between two limit changes (one group more, or one decrease)
DEFAULT_DECREASE = 0.9  # limit := decrease × limit when congested
DEFAULT_MAX_WAITING = 0.5  # requests queued on an engine (window mean) above which the engines are congested
POLL_S = 1.0  # seconds a refused producer waits before it asks the engines again


class GroupLimit(Protocol):
    """What `ConcurrencyGate` and the slot steering ask of a policy (`AimdConcurrency`,
    orchestrator/loop/throughput_concurrency.py `ThroughputConcurrency`)."""

    limit: int
    interval_s: float

    def observe(self, loads: Sequence[EngineLoad], now_s: float, running_groups: int) -> None: ...
    def on_group_done(self, now_s: float) -> None: ...
    def may_admit(self, running_groups: int) -> bool: ...
    def cancel_groups(self) -> int: ...
    def metrics(self) -> dict[str, float]: ...


class AimdConcurrency:
    """`rollout.concurrency=aimd`: AIMD limit on running groups from the engines' load; see the module docstring.

    Args: kv_target in (0, 1]; min_groups >= 1 (the starting limit too); interval_s > 0 seconds;
    decrease in (0, 1). Raises ValueError naming `rollout.adaptive.<key>` on a bad value.
    """

    def __init__(self, *, kv_target: float = DEFAULT_KV_TARGET, min_groups: int = 1,
                 interval_s: float = DEFAULT_INTERVAL_S, decrease: float = DEFAULT_DECREASE,
                 max_waiting: float = DEFAULT_MAX_WAITING) -> None:
        if not 0 < kv_target <= 1:
            raise ValueError(f"rollout.adaptive.kv_target must be in (0, 1], got {kv_target}")
        if min_groups < 1:
            raise ValueError(f"rollout.adaptive.min_groups must be >= 1, got {min_groups}")
        if interval_s <= 0:
            raise ValueError(f"rollout.adaptive.interval_s must be > 0, got {interval_s}")
        if not 0 < decrease < 1:
            raise ValueError(f"rollout.adaptive.decrease must be in (0, 1), got {decrease}")
        if not max_waiting >= 0:
            raise ValueError(f"rollout.adaptive.max_waiting must be >= 0, got {max_waiting}")
        self.max_waiting = max_waiting
        self.kv_target, self.min_groups, self.interval_s, self.decrease = kv_target, min_groups, interval_s, decrease
        self.limit = min_groups
        self._preempted: int | None = None
        self._last_change = -math.inf
        self._load = LoadWindow(interval_s)
        self.increases = self.decreases = 0
        self.usage = math.nan  # the mean KV usage of the last observation (the signal, 0..1)
        self.waiting = math.nan  # the longest engine queue (requests waiting) of the last observation

    def observe(self, loads: Sequence[EngineLoad], now_s: float, running_groups: int) -> None:
        """Update the limit from the engines' `loads` at time `now_s` (seconds, any origin) with
        `running_groups` groups generating."""
        if not loads:
            return
        preempted = sum(ld.num_preempted for ld in loads)
        new_preemption = self._preempted is not None and preempted > self._preempted
        self._preempted = preempted
        usage, waiting = self._load.means(loads)
        self.usage, self.waiting = usage, waiting
        congested = new_preemption or waiting > self.max_waiting or usage >= self.kv_target
        if now_s - self._last_change < self.interval_s:
            return
        if congested:
            target = max(self.min_groups, int(self.decrease * self.limit))
            if target < self.limit:
                self.limit, self._last_change = target, now_s
                self.decreases += 1
        elif running_groups >= self.limit:
            self.limit += 1
            self._last_change = now_s
            self.increases += 1

    def may_admit(self, running_groups: int) -> bool:
        return running_groups < self.limit

    def on_group_done(self, now_s: float) -> None:
        """AIMD decides on the engines' load only."""

    def cancel_groups(self) -> int:
        return 0  # AIMD never cancels running groups

    def metrics(self) -> dict[str, float]:
        return {"rollout/concurrency_limit": float(self.limit), "rollout/kv_usage_signal": self.usage,
                "rollout/waiting_signal": self.waiting}


LoadSource = Callable[[], Awaitable[Sequence[EngineLoad]]]


class ConcurrencyGate:
    """Async wrapper: `await acquire()` before dispatching a group, `release()` when its rollouts
    end. `clock`: seconds (the loop's clock); `loads`: the engines' stats, asked at each decision."""

    def __init__(self, policy: GroupLimit, loads: LoadSource, clock: Callable[[], float],
                 poll_s: float = POLL_S) -> None:
        self.policy, self.loads, self._clock, self._poll_s = policy, loads, clock, poll_s
        self.running = 0
        self.blocked_s = 0.0  # seconds producers spent refused, summed since start
        self.cancel_asked = 0  # groups the policy asked to cancel (youngest first), summed since start
        self._last: Sequence[EngineLoad] = ()

    async def acquire(self) -> None:
        t0 = None
        while True:
            self._last = await self.loads()
            now = self._clock()
            self.policy.observe(self._last, now, self.running)
            self.cancel_asked += self.policy.cancel_groups()
            if self.policy.may_admit(self.running):
                self.running += 1
                if t0 is not None:
                    self.blocked_s += now - t0
                return
            t0 = now if t0 is None else t0
            await asyncio.sleep(self._poll_s)

    def release(self) -> None:
        if self.running < 1:
            raise RuntimeError("ConcurrencyGate.release without a matching acquire")
        self.running -= 1
        self.policy.on_group_done(self._clock())

    def metrics(self) -> dict[str, float]:
        """The policy's own (`rollout/concurrency_limit`, `rollout/kv_usage_signal` and
        `rollout/waiting_signal`: the usage and the longest engine queue, requests waiting on
        average, that it last decided on; the adaptive policy's probe measurements and why it
        moved), `rollout/running_groups`, `rollout/concurrency_blocked_s` (seconds refused, summed
        since start: ~0 while another bound, e.g. the staleness budget, holds the producer),
        `rollout/concurrency_cancel_asked` (groups the policy asked to cancel), and from the
        engines' last stats `rollout/engine_preempted` (summed since start) and `rollout/engine_waiting`."""
        return {**self.policy.metrics(),
                "rollout/running_groups": float(self.running),
                "rollout/concurrency_blocked_s": self.blocked_s,
                "rollout/concurrency_cancel_asked": float(self.cancel_asked),
                "rollout/engine_preempted": float(sum(ld.num_preempted for ld in self._last)),
                "rollout/engine_waiting": float(sum(ld.num_waiting for ld in self._last))}
