"""Issue 25: `rollout.concurrency=adaptive` with the A2A contract steers the rollout-slot cap
(orchestrator/loop/slot_steering.py) over the real cap service (workers/acr/limits/): the
window grows while every rollout slot is taken and the engines have room, shrinks when they are
congested, never passes `rollout.rollout_slots`, and a lowered cap takes no slot back."""

from __future__ import annotations

import asyncio

from orchestrator.loop.concurrency import AimdConcurrency
from orchestrator.loop.slot_steering import RolloutSlotSteering
from workers.acr.limits import SessionCapService
from workers.core.types import EngineLoad


class Rig:
    def __init__(self, max_slots: int = 8, n: int = 2) -> None:
        self.t = 0.0
        self.usage = 0.1
        self.cap = SessionCapService(max_slots)
        self.policy = AimdConcurrency(kv_target=0.8, min_groups=1, interval_s=1.0)

        async def loads():
            return [EngineLoad(kv_cache_usage=self.usage, num_running=0, num_waiting=0, num_preempted=0)]

        async def stats():
            return self.cap.stats()

        self.steer = RolloutSlotSteering(self.policy, loads, lambda: self.t, stats=stats,
                                         set_capacity=self.cap.set_capacity, n=n, max_slots=max_slots)

    async def fill(self) -> None:
        """Rollouts take every rollout slot the cap grants now."""
        st = self.cap.stats()
        if st.limit > st.in_use:
            assert await self.cap.acquire(int(st.limit - st.in_use)) == st.limit - st.in_use


async def test_the_window_grows_only_while_every_rollout_slot_is_taken():
    r = Rig()
    assert await r.steer.step() == 2  # min_groups x n
    for _ in range(3):  # slots idle (rollouts still setting up): no growth, whatever the KV room
        r.t += 2
        assert await r.steer.step() == 2
    assert await r.cap.acquire(2) == 2  # both slots run
    r.t += 2
    assert await r.steer.step() == 4
    assert r.cap.stats().limit == 4
    for _ in range(5):  # full and room on the engines: one group more per interval, up to the ceiling
        await r.fill()  # the new slots are grantable at once
        r.t += 2
        await r.steer.step()
    assert r.steer.capacity == 8 and r.cap.stats().limit == 8  # rollout.rollout_slots, never more


async def test_congestion_lowers_the_cap_without_taking_a_slot_back():
    r = Rig()
    await r.steer.step()
    for _ in range(3):
        await r.fill()
        r.t += 2
        await r.steer.step()
    await r.fill()
    assert r.steer.capacity == 8 and r.cap.stats().in_use == 8
    r.usage = 0.95  # over kv_target: the window decreases (0.9 x 4 groups -> 3)
    r.t += 2
    assert await r.steer.step() == 6
    assert r.cap.stats().in_use == 8  # nobody lost a slot
    blocked = asyncio.ensure_future(r.cap.acquire(1))
    await r.cap.release(2)  # 6 in use: still at the lowered cap
    await asyncio.sleep(0.01)
    assert not blocked.done()
    await r.cap.release(1)  # under it: granted again
    assert await asyncio.wait_for(blocked, 5) == 1 and r.cap.stats().in_use == 6
    assert (await r.steer.metrics())["rollout/rollout_slot_limit"] == 6.0
