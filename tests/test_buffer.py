"""TrajectoryBuffer on a real TransferQueue: codec round trips (pure), then a Ray cluster where a
producer actor puts samples and the driver reads them back bit-exact, waits for groups, clears."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import struct
import sys
import time

import pytest

from stand_ins import own_ray
from workers.core.types import PROMPT_VERSION, Sample, TrajectoryRow
from workers.buffer.store import BufferConfig, TrajectoryBuffer
from workers.buffer.codec import BufferCorruptError, complete_sessions, decode_samples, encode_sample, sample_info

AWAIT_TIMEOUT_S = 60.0  # bound on every await in this file


# ---------------------------------------------------------------- builders


def make_row(rng: random.Random, prompt_len: int, gen_lens: list[int], version: int) -> TrajectoryRow:
    """A row: a prompt, then alternating generated turns (mask 1) and tool tokens (mask 0)."""
    ids, mask, lps, vers = [], [], [], []
    ids += [rng.randrange(50_000) for _ in range(prompt_len)]
    mask += [0] * prompt_len
    lps += [0.0] * prompt_len
    vers += [PROMPT_VERSION] * prompt_len
    for turn, n in enumerate(gen_lens):
        ids += [rng.randrange(50_000) for _ in range(n)]
        mask += [1] * n
        lps += [math.log(rng.random() + 1e-12) for _ in range(n)]
        vers += [version + turn] * n
        tool = rng.randrange(0, 4)
        ids += [rng.randrange(50_000) for _ in range(tool)]
        mask += [0] * tool
        lps += [0.0] * tool
        vers += [PROMPT_VERSION] * tool
    return TrajectoryRow(tuple(ids), tuple(mask), tuple(lps), tuple(vers))


def make_sample(
    rng: random.Random, group_id: int, sample_index: int, *, num_rows: int = 1, status: str = "completed",
    tokens: int = 64,
) -> Sample:
    rows = tuple(
        make_row(rng, prompt_len=rng.randrange(4, tokens // 2), gen_lens=[rng.randrange(1, tokens // 2)] * 2,
                 version=rng.randrange(0, 5))
        for _ in range(num_rows)
    )
    return Sample(
        session_id=f"sess-{group_id:04d}-{sample_index:02d}-{'x' * 30}",
        group_id=group_id,
        input_id=f"input-{group_id}",
        sample_index=sample_index,
        rows=rows,
        reward=rng.uniform(-1, 1) if status == "completed" else None,
        status=status,  # type: ignore[arg-type]
        latency_s=rng.uniform(0.1, 30),
        error=None if status == "completed" else f"{status}: agent crashed",
    )


def edge_row() -> TrajectoryRow:
    """Log-probs whose bits a float32 or a decimal round trip would change."""
    lps = (0.0, -0.0, -1e-300, 5e-324, -745.1332191019411, -0.1 - 0.2, -1.0 / 3.0)
    return TrajectoryRow(
        token_ids=(1, 2**40, 3, 4, 5, 6, 7),
        loss_mask=(0, 1, 1, 1, 1, 1, 1),
        rollout_logprobs=lps,
        versions=(PROMPT_VERSION, 0, 1, 2, 3, 2**33, 7),
    )


def bits(xs: tuple[float, ...]) -> list[bytes]:
    return [struct.pack("<d", x) for x in xs]


# ---------------------------------------------------------------- codec (no Ray)


def test_codec_round_trip_multi_row_and_empty_samples():
    rng = random.Random(0)
    samples = [
        make_sample(rng, 1, 0, num_rows=3),
        make_sample(rng, 1, 1, num_rows=1),
        Sample("sess-empty-" + "y" * 30, 2, "input-2", 0, (), None, "failed", 1.5, "no model call"),
        # the A2A contract's spans travel with the sample (step metrics rollout/setup_s_p50, ...)
        dataclasses.replace(make_sample(rng, 4, 0, num_rows=1), setup_s=1.25, rollout_slot_wait_s=0.5),
        Sample("sess-setup-" + "z" * 30, 5, "input-5", 0, (), None, "failed", 3.0, "setup_timeout", setup_s=3.0),
        # the agent's own metrics (a clean-sandbox grader's span and flags) travel too (agent/... step metrics)
        dataclasses.replace(make_sample(rng, 6, 0, num_rows=2),
                            agent_metrics=(("grading_s", 1.5), ("hacking/episode_vs_graded", 1.0))),
    ]
    stored = [r for s in samples for r in encode_sample(s)]
    assert len(stored) == 3 + 1 + 1 + 1 + 1 + 2  # one TQ row per trajectory row, one placeholder per empty sample
    rng.shuffle(stored)
    assert decode_samples(stored) == samples
    listing = {r.key: r.tags for r in stored}
    assert sorted(complete_sessions(listing)) == sorted(s.session_id for s in samples)
    assert [sample_info(listing, keys) for keys in complete_sessions(listing).values()] == [
        s.info() for s in sorted(samples, key=lambda s: [k for k in complete_sessions(listing)].index(s.session_id))]


def test_complete_sessions_skips_partial_and_untagged_rows():
    rng = random.Random(1)
    s = make_sample(rng, 3, 0, num_rows=2)
    r0, r1 = encode_sample(s)
    assert complete_sessions({r0.key: r0.tags}) == {}  # row 1 not tagged yet: sample not complete
    assert complete_sessions({r0.key: r0.tags, r1.key: {}}) == {}  # key created by a put in flight
    assert complete_sessions({r0.key: r0.tags, r1.key: r1.tags}) == {s.session_id: [r0.key, r1.key]}


def test_session_overwritten_with_fewer_rows_raises_instead_of_mixing():
    """A session put twice (3 rows, then 1) leaves rows 1, 2 of the first put behind; reading must
    not glue them to the second sample."""
    rng = random.Random(2)
    first = encode_sample(make_sample(rng, 4, 0, num_rows=3))
    second = encode_sample(make_sample(rng, 4, 0, num_rows=1))
    listing = {r.key: r.tags for r in first} | {second[0].key: second[0].tags}
    with pytest.raises(BufferCorruptError, match="num_rows"):
        complete_sessions(listing)


def test_config_rejects_bad_values_naming_the_key():
    with pytest.raises(ValueError, match="buffer.num_storage_units"):
        BufferConfig(num_storage_units=0)
    with pytest.raises(ValueError, match="buffer.capacity_rows"):
        BufferConfig(capacity_rows=0)


# ---------------------------------------------------------------- real TransferQueue on Ray


@pytest.fixture(scope="module")
def buffer():
    pytest.importorskip("ray")
    # The producer class below lives in this test module, which Ray workers cannot import by name
    # (pytest's importlib mode; `tests` is also transferqueue's package): ship it by value.
    with own_ray(ship=[sys.modules[__name__]], configure_logging=False):
        buf = TrajectoryBuffer.start(BufferConfig(num_storage_units=1, op_timeout_s=AWAIT_TIMEOUT_S))
        try:
            yield buf
        finally:
            buf.stop()


class Producer:
    """A rollout-worker stand-in: an async Ray actor that connects with the handle and puts."""

    def __init__(self, handle) -> None:
        self.buf = TrajectoryBuffer.connect(handle)

    async def put(self, samples: list[Sample], partition: str, delay_s: float = 0.0) -> None:
        await asyncio.sleep(delay_s)
        await self.buf.put(samples, partition)

    def close(self) -> None:
        self.buf.close()


@pytest.fixture(scope="module")
def producer(buffer):
    import ray

    actor = ray.remote(num_cpus=0)(Producer).remote(buffer.handle)
    yield actor
    ray.get(actor.close.remote(), timeout=AWAIT_TIMEOUT_S)
    ray.kill(actor)


async def remote(ref):
    return await asyncio.wait_for(ref, timeout=AWAIT_TIMEOUT_S)


async def bounded(aw):
    return await asyncio.wait_for(aw, timeout=AWAIT_TIMEOUT_S)


def mixed_batch() -> list[Sample]:
    rng = random.Random(7)
    edge = Sample("sess-edge-" + "e" * 30, 10, "input-10", 2, (edge_row(), edge_row()), 0.1 + 0.2, "completed", 0.5,
                  agent_metrics=(("grading_s", 0.1 + 0.2), ("hacking/protected_paths", 1.0)))  # issue 42
    return [
        make_sample(rng, 10, 0, num_rows=3),
        make_sample(rng, 10, 1, num_rows=1),
        edge,
        make_sample(rng, 11, 0, num_rows=2, status="failed"),  # failed with rows recorded
        Sample("sess-empty-" + "f" * 30, 11, "input-11", 1, (), None, "failed", 2.0, "invoke: 500"),
        make_sample(rng, 11, 2, num_rows=1, status="expired"),
    ]


async def test_put_from_actor_get_in_driver_is_bit_exact(buffer, producer):
    samples = mixed_batch()
    await remote(producer.put.remote(samples, "step-0"))

    got = await bounded(buffer.get_groups("step-0", [10, 11]))

    assert got == sorted(samples, key=lambda s: (s.group_id, s.sample_index))
    for a, b in zip(got, sorted(samples, key=lambda s: (s.group_id, s.sample_index))):
        for ra, rb in zip(a.rows, b.rows, strict=True):
            assert bits(ra.rollout_logprobs) == bits(rb.rollout_logprobs)  # -0.0 vs 0.0 counts
    failed = [s for s in got if s.status == "failed"]
    assert {s.reward for s in failed} == {None} and all(s.error for s in failed)
    assert await bounded(buffer.get_groups("step-0", [11])) == [s for s in got if s.group_id == 11]
    await bounded(buffer.clear("step-0"))


async def test_tags_are_listed_without_fetching_tokens(buffer, producer):
    samples = mixed_batch()
    await remote(producer.put.remote(samples, "step-tags"))

    infos = {i.session_id: i for i in await bounded(buffer.sample_infos("step-tags"))}

    for s in samples:
        vr = s.version_range()
        info = infos[s.session_id]
        assert info == s.info()  # the buffer's listing is the sample's metadata, exactly
        assert (info.status, info.reward, info.latency_s, info.error, info.num_generated_tokens) == (
            s.status, s.reward, s.latency_s, s.error, s.num_generated_tokens)
        assert info.version_range() == vr and info.num_rows == len(s.rows)
        assert info.row_lens == tuple(len(r.token_ids) for r in s.rows)
        assert info.row_generated == tuple(r.num_generated for r in s.rows)
    assert [i.session_id for i in await bounded(buffer.sample_infos("step-tags", [11]))] == [
        s.session_id for s in sorted(samples, key=lambda s: s.sample_index) if s.group_id == 11]
    assert await bounded(buffer.group_counts("step-tags")) == {10: 3, 11: 3}
    await bounded(buffer.clear("step-tags"))


async def test_read_rows_returns_the_rows_asked_in_order_and_a_missing_key_raises(buffer, producer):
    """What a trainer rank reads: the rows under the keys of its order, in the order asked, equal
    to those put; a key that is not stored is an error naming the read, not a wait."""
    rng = random.Random(3)
    group = [make_sample(rng, 20, i, num_rows=2) for i in range(3)]
    await remote(producer.put.remote(group, "step-rows"))
    keys = [k for s in reversed(group) for k in reversed(s.info().row_keys)]
    rows = await bounded(buffer.read_rows("step-rows", keys))
    assert rows == [r for s in reversed(group) for r in reversed(s.rows)]
    with pytest.raises(BufferCorruptError, match="vanished"):
        await bounded(buffer.read_rows("step-rows", [keys[0], "no-such-session/0"]))
    await bounded(buffer.clear("step-rows"))


async def test_clear_empties_groups_then_the_partition(buffer, producer):
    rng = random.Random(5)
    samples = [make_sample(rng, g, i, num_rows=1 + i % 2) for g in (40, 41) for i in range(2)]
    await remote(producer.put.remote(samples, "step-clear"))
    await remote(producer.put.remote([make_sample(rng, 99, 0)], "other"))
    assert await bounded(buffer.group_counts("step-clear")) == {40: 2, 41: 2}

    await bounded(buffer.clear("step-clear", [40]))
    assert await bounded(buffer.group_counts("step-clear")) == {41: 2}
    assert await bounded(buffer.get_groups("step-clear", [40])) == []
    assert await bounded(buffer.get_groups("step-clear", [41])) == samples[2:]

    await bounded(buffer.clear("step-clear"))
    assert await bounded(buffer.group_counts("step-clear")) == {}
    assert "step-clear" not in await bounded(buffer.partitions())
    assert await bounded(buffer.group_counts("other")) == {99: 1}  # other partitions untouched
    await bounded(buffer.clear("other"))


async def test_clear_keys_frees_exactly_the_samples_named_with_no_listing_and_the_answers_are_metered(buffer,
                                                                                                       producer):
    """What the loops do with the results the rollout pool returned: clear those samples by the keys
    they carry (a sample without rows by its placeholder), one request for their metadata, none to
    list the partition; every answer TransferQueue gives the client is counted in its meter."""
    from workers.buffer.codec import stored_keys
    from workers.core.calls import ByteMeter

    samples = mixed_batch()
    await remote(producer.put.remote(samples, "step-keys"))
    done = [s for s in samples if s.group_id == 11]  # the empty one among them: its placeholder key
    meter = ByteMeter()
    buffer.meter_received(meter)
    listed = 0
    real_list = buffer._client.async_kv_list

    async def counting_list(*a, **k):
        nonlocal listed
        listed += 1
        return await real_list(*a, **k)

    buffer._client.async_kv_list = counting_list
    try:
        await bounded(buffer.clear_keys("step-keys", [k for s in done for k in stored_keys(s.info())]))
        got_bytes, answers = meter.take()
        assert listed == 0 and answers == 1 and got_bytes > 0  # the keys' metadata, nothing else
        await bounded(buffer.clear_keys("step-keys", stored_keys(done[0].info())))  # gone already: nothing to do
    finally:
        buffer._client.async_kv_list = real_list
        buffer.meter_received(None)
    assert await bounded(buffer.group_counts("step-keys")) == {10: 3}
    assert await bounded(buffer.row_count("step-keys")) == sum(len(s.rows) for s in samples if s.group_id == 10)
    await bounded(buffer.clear("step-keys"))


async def test_put_get_latency_32_samples_of_64_tokens(buffer, producer):
    rng = random.Random(6)
    samples = [make_sample(rng, 50 + i // 8, i % 8, tokens=64) for i in range(32)]
    groups = sorted({s.group_id for s in samples})
    timings = []
    for rep in range(3):
        part = f"lat-{rep}"
        t0 = time.perf_counter()
        await bounded(buffer.put(samples, part))
        t1 = time.perf_counter()
        got = await bounded(buffer.get_groups(part, groups))
        t2 = time.perf_counter()
        await remote(producer.put.remote(samples, part + "-actor"))
        t3 = time.perf_counter()
        assert got == samples
        await bounded(buffer.clear(part))
        await bounded(buffer.clear(part + "-actor"))
        timings.append((t1 - t0, t2 - t1, t3 - t2))
    put_s, get_s, actor_put_s = (min(t[i] for t in timings) for i in range(3))
    print(f"\nbuffer latency, 32 samples x ~64 tokens (best of 3): driver put {put_s * 1e3:.1f} ms, "
          f"get_groups {get_s * 1e3:.1f} ms, actor put incl. Ray call {actor_put_s * 1e3:.1f} ms")
    assert put_s + get_s < 2.0  # loose bound on a shared 2-CPU box; the figures are printed above


def test_sync_wrappers_round_trip(buffer):
    rng = random.Random(8)
    samples = [make_sample(rng, 60, i, num_rows=2) for i in range(2)]
    buffer.put_sync(samples, "step-sync")
    assert buffer.get_groups_sync("step-sync", [60]) == samples
    buffer.clear_sync("step-sync")
    assert buffer.get_groups_sync("step-sync", [60]) == []


async def test_two_storage_units_round_trip_and_stop_kills_the_actors(buffer, producer):
    """TQ's default of 1 CPU per actor hangs a 2-CPU cluster with 2 units; ours reserve none."""
    import ray

    second = TrajectoryBuffer.start(BufferConfig(num_storage_units=2, op_timeout_s=AWAIT_TIMEOUT_S))
    try:
        assert len(second.handle.storage_infos) == 2
        samples = mixed_batch()
        await bounded(second.put(samples, "two-units"))
        got = await bounded(second.get_groups("two-units", [10, 11]))
        assert got == sorted(samples, key=lambda s: (s.group_id, s.sample_index))
        assert await bounded(buffer.group_counts("two-units")) == {}  # a separate TQ instance
        names = second.handle.actor_names
        assert len(names) == 3 and all(ray.get_actor(n) is not None for n in names)
    finally:
        second.stop()
    deadline = time.monotonic() + AWAIT_TIMEOUT_S
    alive = list(names)
    while alive and time.monotonic() < deadline:  # ray.kill is asynchronous: poll, bounded
        alive = [n for n in alive if _actor_exists(ray, n)]
        await asyncio.sleep(0.1)
    assert alive == []
    with pytest.raises(RuntimeError, match="closed"):
        await second.put(samples, "two-units")


def _actor_exists(ray, name: str) -> bool:
    try:
        ray.get_actor(name)
    except ValueError:
        return False
    return True


async def test_put_past_capacity_raises_and_leaves_nothing_behind(buffer):
    small = TrajectoryBuffer.start(BufferConfig(capacity_rows=4, op_timeout_s=AWAIT_TIMEOUT_S))
    try:
        rng = random.Random(9)
        kept = [make_sample(rng, 70, i) for i in range(3)]  # 3 of 4 rows
        await bounded(small.put(kept, "cap"))
        with pytest.raises(RuntimeError, match="capacity exceeded"):
            await bounded(small.put([make_sample(rng, 71, i) for i in range(2)], "cap"))
        assert await bounded(small.group_counts("cap")) == {70: 3}
        assert await bounded(small.row_count("cap")) == 3  # the failed put's keys were released
        await bounded(small.clear("cap", [70]))
        assert await bounded(small.row_count("cap")) == 0
        refill = [make_sample(rng, 72, i) for i in range(4)]  # clearing freed the storage
        await bounded(small.put(refill, "cap"))
        assert await bounded(small.get_groups("cap", [72])) == refill
    finally:
        small.stop()
