"""The per-step probe of slot utilisation: how busy the cluster-wide container and rollout slots were.

`rollout/container_slot_utilisation` and (under `rollout.rollout_slots`) `rollout/rollout_slot_utilisation`:
the slot-seconds held during the step over (slots x the step's seconds), from the caps' `held_s`
(workers/acr/limits/services.py `SessionCapService`). A warm pool shows as rollout slots near 1 while
container slots also hold containers setting up; rollout slots well under 1 with containers
at their cap say setup, not inference, bounds the run (the toolkit's warm-pool argument).

Invariant: the probe never fails a step; a figure that cannot be read within `READ_WAIT_S` is left
out of that step's record (and the next step measures from the last reading it did get).
`utilisation` is pure: (held_s, at) before and after, and the cap, in; a fraction in [0, 1] out.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

READ_WAIT_S = 5.0  # bound on one step's read of the caps (seconds)


def utilisation(held_before_s: float, held_after_s: float, slots: float, interval_s: float) -> float | None:
    """Slot-seconds held in the interval / (slots x interval_s), clamped to [0, 1]; None for an
    empty interval or no slots."""
    if interval_s <= 0 or slots <= 0:
        return None
    return min(1.0, max(0.0, (held_after_s - held_before_s) / (slots * interval_s)))


class SlotProbe:
    """`await probe()` -> the step's slot utilisation metrics. `stats()`: awaits the caps'
    `LimitStats` by kind ("container", "rollout"; `RolloutPool.slot_stats`)."""

    def __init__(self, stats: Callable[[], Any], clock: Callable[[], float] = time.monotonic) -> None:
        self._stats = stats
        self._clock = clock
        self._last: dict[str, tuple[float, float]] = {}  # kind -> (held_s, at)

    async def __call__(self) -> dict[str, float]:
        try:
            async with asyncio.timeout(READ_WAIT_S):
                stats = await self._stats()
        except TimeoutError:
            return {}
        now, out = self._clock(), {}
        for kind, st in stats.items():
            held, at = self._last.get(kind, (0.0, now - st.age_s))  # first reading: since the cap started
            u = utilisation(held, st.held_s, st.limit, now - at)
            if u is not None:
                out[f"rollout/{kind}_slot_utilisation"] = u
            self._last[kind] = (st.held_s, now)
        return out
