"""Cluster-wide ACR limits (workers/acr/limits/): pure logic with an injected clock, then the
async services and the per-process coalescing clients, in one process (the Ray actors wrap the
same classes; tests/test_acr_faults.py runs them as named actors)."""

from __future__ import annotations

import asyncio
import random

import pytest

from workers.acr.limits import (
    MAX_BATCH,
    AcrLimitsConfig,
    Coalescer,
    RateLimiterService,
    SessionCapService,
    SessionSlots,
    SlotPool,
    TokenBucket,
    limit_clients,
    limit_stats,
    local_limits,
)

TIMEOUT_S = 10


# ----------------------------------------------------------------------------- TokenBucket


def test_bucket_starts_full_then_refills_at_rate():
    b = TokenBucket(rate_per_s=10, burst=5, now_s=0.0)
    assert b.take(8, 0.0) == 5  # the burst, no more
    assert b.take(1, 0.0) == 0
    assert b.wait_s(0.0) == pytest.approx(0.1)  # one token per 1/10 s
    assert b.take(3, 0.25) == 2  # 0.25 s x 10/s = 2.5 tokens: 2 whole ones
    assert b.take(1, 0.3) == 1  # the half left + 0.05 s x 10 = 1
    assert b.take(100, 100.0) == 5  # refill caps at burst
    assert b.granted == 13


def test_bucket_refuses_bad_arguments_and_backwards_time():
    with pytest.raises(ValueError, match="rate_per_s"):
        TokenBucket(0, 1, 0.0)
    with pytest.raises(ValueError, match="burst"):
        TokenBucket(1, 0, 0.0)
    b = TokenBucket(1, 1, 5.0)
    with pytest.raises(ValueError, match="backwards"):
        b.take(1, 4.0)
    with pytest.raises(ValueError, match="n >= 1"):
        b.take(0, 6.0)


def test_bucket_never_grants_more_than_burst_plus_rate_times_window_randomized():
    rng = random.Random(7)
    rate, burst = 50.0, 10
    b = TokenBucket(rate, burst, 0.0)
    t, grants = 0.0, []
    for _ in range(5000):
        t += rng.expovariate(200.0)
        got = b.take(rng.randint(1, 20), t)
        grants.extend([t] * got)
    for i, t0 in enumerate(grants):  # every window [t0, t0 + 1 s]
        j = i
        while j < len(grants) and grants[j] <= t0 + 1.0:
            j += 1
        assert j - i <= burst + rate * 1.0 + 1e-9


# ----------------------------------------------------------------------------- SlotPool


def test_slot_pool_hands_out_at_most_capacity_and_tracks_peak():
    p = SlotPool(3)
    assert p.take(2) == 2 and p.take(5) == 1 and p.take(1) == 0
    assert (p.in_use, p.free, p.peak) == (3, 0, 3)
    p.give(2)
    assert (p.in_use, p.peak) == (1, 3)
    with pytest.raises(ValueError, match=r"give\(2\) with 1 slots in use"):
        p.give(2)  # a double release is a bug


# ----------------------------------------------------------------------------- services + clients


async def test_rate_service_waits_for_tokens_on_the_injected_clock(fake_clock):
    clock = fake_clock
    svc = RateLimiterService(rate_per_s=4, burst=2, clock=clock)
    assert await svc.acquire(5) == 2  # burst at once
    assert await svc.acquire(5) == 1  # waited 0.25 s of virtual time for one token
    assert clock.slept == [pytest.approx(0.25)]
    assert svc.stats().granted == 3


async def test_coalescer_serves_many_waiters_in_few_round_trips_within_the_rate(fake_clock):
    """200 concurrent callers, rate 100/s burst 10: all served, FIFO, in far fewer than 200
    round trips, and virtual time shows the rate held: (200 - 10) tokens need >= 1.9 s."""
    clock = fake_clock
    svc = RateLimiterService(rate_per_s=100, burst=10, clock=clock)
    calls: list[int] = []

    async def acquire_many(n: int) -> int:
        calls.append(n)
        return await svc.acquire(n)

    c = Coalescer(acquire_many)
    t0 = clock.now()
    order: list[int] = []

    async def caller(i: int) -> None:
        await c.acquire()
        order.append(i)

    await asyncio.wait_for(asyncio.gather(*(caller(i) for i in range(200))), TIMEOUT_S)
    assert sorted(order) == list(range(200)) and order[:10] == list(range(10))  # FIFO
    assert svc.stats().granted == 200
    assert clock.now() - t0 >= (200 - 10) / 100 - 1e-9
    assert c.round_trips == len(calls) < 200
    assert max(calls) <= MAX_BATCH


async def test_coalescer_cancelled_waiter_gives_its_unit_back():
    granted = asyncio.Event()
    release = asyncio.Event()
    unused: list[int] = []

    async def acquire_many(n: int) -> int:
        granted.set()
        await release.wait()
        return n

    c = Coalescer(acquire_many, on_unused=unused.append)
    task = asyncio.ensure_future(c.acquire())
    other = asyncio.ensure_future(c.acquire())
    await asyncio.wait_for(granted.wait(), TIMEOUT_S)
    task.cancel()  # cancelled while its unit is being fetched
    release.set()
    await asyncio.wait_for(other, TIMEOUT_S)
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sum(unused) == 1  # the cancelled caller's unit went back, the other one was used


async def test_session_slots_never_exceed_the_cap_and_all_come_back():
    cap = SessionCapService(max_open=5)
    slots = SessionSlots(cap.acquire, cap.release)
    held, peak = 0, 0

    async def session(i: int) -> None:
        nonlocal held, peak
        async with slots.slot():
            held += 1
            peak = max(peak, held)
            await asyncio.sleep(0.001 * (i % 3))
            held -= 1

    await asyncio.wait_for(asyncio.gather(*(session(i) for i in range(60))), TIMEOUT_S)
    await slots.drain()
    st = cap.stats()
    assert peak == 5 and st.peak_in_use == 5  # the cap was reached, never passed
    assert st.in_use == 0 and st.granted == 60 and slots.held == 0


async def test_session_slot_of_a_cancelled_session_is_released():
    cap = SessionCapService(max_open=1)
    slots = SessionSlots(cap.acquire, cap.release)
    inside = asyncio.Event()

    async def hold_forever() -> None:
        async with slots.slot():
            inside.set()
            await asyncio.Event().wait()

    t = asyncio.ensure_future(hold_forever())
    await asyncio.wait_for(inside.wait(), TIMEOUT_S)
    waiter = asyncio.ensure_future(slots.acquire())  # blocked: the cap is 1
    await asyncio.sleep(0.01)
    assert not waiter.done()
    t.cancel()
    await asyncio.wait_for(waiter, TIMEOUT_S)  # the cancelled holder's slot went to the waiter
    slots.release_held()
    await slots.drain()
    assert cap.stats().in_use == 0


async def test_local_limits_bundle_and_stats():
    cfg = AcrLimitsConfig(requests_per_s=1000, max_open_sessions=2, headroom=0.2)
    assert (cfg.bucket_rate_per_s, cfg.bucket_burst) == (800.0, 100)  # 0.8 L; 0.2 L / 2
    handles = local_limits(cfg)
    clients = limit_clients(handles)
    for _ in range(7):
        await asyncio.wait_for(clients.requests.acquire(), TIMEOUT_S)
    async with clients.sessions.slot():
        rate, sessions = await limit_stats(handles)
        assert (rate.granted, sessions.in_use, sessions.limit) == (7, 1, 2)


@pytest.mark.parametrize("kwargs, key", [
    ({"requests_per_s": 0}, "requests_per_s"), ({"headroom": 1.0}, "headroom"),
    ({"max_open_sessions": 0}, "max_open_sessions"),
])
def test_limits_config_names_the_bad_key(kwargs, key):
    with pytest.raises(ValueError, match=f"rollout.acr.limits.{key}"):
        AcrLimitsConfig(**kwargs)


class StepClock:
    """A clock moved by hand (seconds)."""

    def __init__(self) -> None:
        self.t = 100.0

    def now(self) -> float:
        return self.t

    async def sleep(self, dt_s: float) -> None:
        self.t += dt_s


async def test_a_slot_cap_counts_the_slot_seconds_it_holds():
    """`held_s` is the integral of slots in use over time: 2 slots for 3 s, then 1 for 2 s = 8."""
    clock = StepClock()
    cap = SessionCapService(max_open=4, clock=clock)
    assert await cap.acquire(2, owner="a") == 2
    clock.t += 3
    await cap.release(1, owner="a")
    clock.t += 2
    st = cap.stats()
    assert (st.held_s, st.age_s, st.in_use) == (8.0, 5.0, 1)
    await cap.release_owner("a")
    clock.t += 10  # nothing held: nothing counted
    assert cap.stats().held_s == 8.0 and cap.stats().age_s == 15.0


async def test_the_slot_probe_reports_each_steps_utilisation():
    from orchestrator.watch.slots import SlotProbe

    clock = StepClock()
    caps = {"container": SessionCapService(4, clock=clock), "rollout": SessionCapService(2, clock=clock)}

    async def stats():
        return {k: c.stats() for k, c in caps.items()}

    probe = SlotProbe(stats, clock=clock.now)
    await caps["container"].acquire(4)
    await caps["rollout"].acquire(1)
    clock.t += 10
    first = await probe()  # since the caps started: containers full, rollout slots half busy
    assert first == {"rollout/container_slot_utilisation": 1.0, "rollout/rollout_slot_utilisation": 0.5}
    await caps["container"].release(3)
    await caps["rollout"].acquire(1)
    clock.t += 10
    assert await probe() == {"rollout/container_slot_utilisation": 0.25, "rollout/rollout_slot_utilisation": 1.0}


async def test_container_slots_go_to_waiters_in_arrival_order_across_processes():
    """Issue 25: container slots by group arrival order. The pool dispatches groups in order and
    the cap grants strictly first come, first served, also across the per-process clients (two
    rollout actors here): a later group's rollout never takes a slot before an earlier one's."""
    cap = SessionCapService(max_open=1)
    actors = [SessionSlots(cap.acquire, cap.release) for _ in range(2)]
    await actors[0].acquire()  # the one slot is held
    order: list[int] = []

    async def rollout(group: int) -> None:
        slots = actors[group % 2]
        await slots.acquire()
        order.append(group)
        slots.release_held()

    waiting = []
    for group in range(6):  # arrive one after the other, alternating between the two actors
        waiting.append(asyncio.ensure_future(rollout(group)))
        await asyncio.sleep(0.01)
    actors[0].release_held()
    await asyncio.wait_for(asyncio.gather(*waiting), TIMEOUT_S)
    assert order == list(range(6))
