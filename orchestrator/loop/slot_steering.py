"""`rollout.concurrency=adaptive` with the A2A contract's rollout slots: the adaptive window steers
the rollout-slot cap, not dispatch.

With `rollout.contract=a2a` and `rollout.rollout_slots`, a dispatched rollout first holds a
container slot and sets up (minutes, no inference), and only then takes a rollout slot and calls
the model. Gating dispatch on the engines' load, as `ConcurrencyGate` does, would count containers
setting up as load-free running groups and grow the window for them, and would hold back the
warm pool whenever the engines are busy. So here the same AIMD policy (`AimdConcurrency`,
orchestrator/loop/concurrency.py) decides how many rollouts may *run* (hold a rollout slot):
`RolloutSlotSteering.step()` reads the engines' load and the rollout-slot cap's use, lets the
policy update its limit in groups (the window binds when every rollout slot is taken), and sets
the cluster-wide cap to `limit x n` rollouts, at most `rollout.rollout_slots`. Dispatch stays
bounded by the staleness budget and the container slots; containers keep setting up ahead.

Invariant: the cap set is always in [min(min_groups x n, max_slots), max_slots]; a lowered cap takes
no slot from a running rollout (only fewer are granted until use falls under it). `step` is the
whole decision; `run` calls it every half interval until cancelled (supervise.run_watched).
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from orchestrator.loop.concurrency import GroupLimit, LoadSource


class RolloutSlotSteering:
    """The rollout-slot cap from the adaptive policy. `stats()`: awaits the cap's `LimitStats`
    (in_use, limit); `set_capacity(k)`: awaits the cap's new size in rollouts; `n`: rollouts per
    group; `max_slots`: `rollout.rollout_slots`, the ceiling. Raises ValueError for n or max_slots < 1."""

    def __init__(self, policy: GroupLimit, loads: LoadSource, clock: Callable[[], float], *,
                 stats: Callable[[], Awaitable[Any]], set_capacity: Callable[[int], Awaitable[None]],
                 n: int, max_slots: int) -> None:
        if n < 1 or max_slots < 1:
            raise ValueError(f"rollout slot steering needs n >= 1 and max_slots >= 1, got n={n}, max_slots={max_slots}")
        self.policy, self._loads, self._clock = policy, loads, clock
        self._stats, self._set_capacity = stats, set_capacity
        self.n, self.max_slots = n, max_slots
        self.capacity: int | None = None  # the cap last set (rollouts)
        self.in_use = 0

    def target(self) -> int:
        """The cap the policy's limit asks for, in rollouts."""
        return min(self.max_slots, self.policy.limit * self.n)

    async def step(self) -> int:
        """One decision; returns the cap now set (rollouts)."""
        loads, st = await asyncio.gather(self._loads(), self._stats())
        self.in_use = int(st.in_use)
        full = self.capacity is not None and self.in_use >= self.capacity
        running_groups = self.policy.limit if full else self.in_use // self.n  # binds only when every slot is taken
        self.policy.observe(loads, self._clock(), running_groups)
        if self.target() != self.capacity:
            await self._set_capacity(self.target())
            self.capacity = self.target()
        return self.capacity

    async def run(self) -> None:
        while True:
            await self.step()
            await asyncio.sleep(self.policy.interval_s / 2)

    async def metrics(self) -> dict[str, float]:
        """`rollout/rollout_slot_limit` (the cap set, rollouts), `rollout/concurrency_limit` (the
        policy's window, groups), `rollout/kv_usage_signal`, `rollout/waiting_signal`."""
        return {"rollout/rollout_slot_limit": float(self.capacity or 0),
                "rollout/concurrency_limit": float(self.policy.limit),
                "rollout/kv_usage_signal": self.policy.usage, "rollout/waiting_signal": self.policy.waiting}
