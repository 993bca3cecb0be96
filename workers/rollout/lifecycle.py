"""The A2A contract's bounded lifecycle: setup under its own timeout, then a rollout slot, then the
run under its own timeout.

Invariant: a rollout slot (`rollout.rollout_slots`, the inference budget) is taken only once setup
has parked the task, and it is given back on every exit (result, timeout, error, cancellation)
before the caller tears the session down (CancelTask, StopRuntimeSession). A setup that fails or
runs past `setup_timeout_s` raises SetupFailed with its own reason and never held a rollout slot.
So with more container slots (the open-session cap, held by the caller from before the invoke to
the session stop) than rollout slots, containers set up while they wait: a warm pool.

The order and the two bounds are agentcore-rl-toolkit 0.2.0's `run_rollout_with_bounds`
(rollout_session/lifecycle.py: container slot, session rate, setup under container_setup_timeout,
rollout slot, run under agent_run_timeout). Pure asyncio: the session and the slot gate are
injected, the clock returns seconds.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable, Protocol

from workers.rollout.a2a import RolloutDump
from workers.rollout.contract import AgentFailed
from workers.rollout.failures import SetupFailed


class Phases(Protocol):
    """A rollout in two phases (workers/rollout/a2a.py A2ASession)."""

    async def setup(self, task_input: dict) -> None: ...
    async def run(self, task_input: dict) -> RolloutDump: ...


class SlotGate(Protocol):
    """A cluster-wide slot cap (workers.acr.limits.SessionSlots); `priority`: lower first."""

    async def acquire(self, priority: float = 0.0) -> None: ...
    def release_held(self) -> None: ...


@dataclass(frozen=True)
class Bounds:
    """setup_timeout_s / run_timeout_s: seconds each phase may take; rollout_slots: the gate a run
    holds a slot of (None: no cap)."""

    setup_timeout_s: float
    run_timeout_s: float
    rollout_slots: SlotGate | None = None


@dataclass
class Spans:
    """Seconds spent per phase of one rollout (None: the phase was not reached), and the metrics the
    agent's dump reported (its own spans, e.g. `grading_s`, and flags; set by the caller)."""

    setup_s: float | None = None
    rollout_slot_wait_s: float | None = None
    run_s: float | None = None
    agent_metrics: dict[str, float] = field(default_factory=dict)


async def run_bounded(session: Phases, task_input: dict, bounds: Bounds, spans: Spans,
                      clock: Callable[[], float], priority: float = 0.0) -> RolloutDump:
    """Set up, take a rollout slot (by `priority`, lower first: the rollout's group id, so an earlier
    group's rollout that is set up runs before a later one's), run; the run's dump. Raises SetupFailed (`setup_timeout`,
    `setup_failed`), TimeoutError (the run ran past `run_timeout_s`), or what the run raised;
    `spans` is filled as far as the rollout got."""
    t0 = clock()
    try:
        async with asyncio.timeout(bounds.setup_timeout_s):
            await session.setup(task_input)
    except TimeoutError:
        raise SetupFailed("setup_timeout", f"setup_timeout: the agent's setup ran past rollout.setup_timeout_s="
                          f"{bounds.setup_timeout_s:g}s") from None
    except AgentFailed as exc:
        raise SetupFailed("setup_failed", f"setup_failed: {exc}") from exc
    finally:
        spans.setup_s = clock() - t0
    t1 = clock()
    gate = bounds.rollout_slots
    if gate is not None:
        await gate.acquire(priority)  # a cancellation here holds nothing (SessionSlots gives an unused grant back)
    try:
        t2 = clock()
        spans.rollout_slot_wait_s = t2 - t1
        try:
            async with asyncio.timeout(bounds.run_timeout_s):
                return await session.run(task_input)
        finally:
            spans.run_s = clock() - t2
    finally:
        if gate is not None:
            gate.release_held()  # before the caller's teardown
