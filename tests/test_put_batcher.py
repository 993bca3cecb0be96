"""PutBatcher (workers/rollout/put_batcher.py): a rollout actor's puts gathered into batched store
writes, exactly once, nothing lost. Pure asyncio against a recording sink (no Ray, no TransferQueue)."""

from __future__ import annotations

import asyncio
import random

import pytest

from stand_ins import make_sample
from workers.rollout.put_batcher import PutBatcher

AWAIT_S = 5.0  # bound on every wait in this file (s)
LONG_S = 60.0  # a delay no test waits for: a batch that goes sooner went for another reason


class RecordingSink:
    """The store seam: keeps each write (partition, session ids); `hold` keeps a write in flight
    until set; `fail` makes the next write raise."""

    def __init__(self) -> None:
        self.writes: list[tuple[str, list[str]]] = []
        self.hold: asyncio.Event | None = None
        self.fail: Exception | None = None

    async def put(self, samples, partition):
        if self.hold is not None:
            await self.hold.wait()
        if self.fail is not None:
            exc, self.fail = self.fail, None
            raise exc
        self.writes.append((partition, [s.session_id for s in samples]))

    def stored(self) -> list[str]:
        return [sid for _, ids in self.writes for sid in ids]


async def test_concurrent_puts_within_the_delay_are_one_write_and_each_returns_once_stored():
    sink = RecordingSink()
    batcher = PutBatcher(sink, max_samples=64, max_delay_s=0.05)

    async def one(i: int) -> bool:
        await batcher.put([make_sample(0, i)], "p")
        return make_sample(0, i).session_id in sink.stored()  # stored by the time put returned

    assert await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(5))), AWAIT_S) == [True] * 5
    assert sink.writes == [("p", [f"s-0-{i}" for i in range(5)])]
    assert (batcher.writes, batcher.samples) == (1, 5)


async def test_a_full_batch_goes_at_once_and_partitions_never_share_a_write():
    sink = RecordingSink()
    batcher = PutBatcher(sink, max_samples=3, max_delay_s=LONG_S)
    # 3 samples fill partition a's batch: it goes without waiting for the delay; b's waits for close
    a = asyncio.gather(*(batcher.put([make_sample(1, i)], "a") for i in range(3)))
    b = asyncio.ensure_future(batcher.put([make_sample(2, 0)], "b"))
    await asyncio.wait_for(a, AWAIT_S)
    assert sink.writes == [("a", ["s-1-0", "s-1-1", "s-1-2"])] and not b.done()
    await asyncio.wait_for(batcher.close(), AWAIT_S)  # shutdown: the pending batch is sent, not dropped
    await asyncio.wait_for(b, AWAIT_S)
    assert sink.writes[1:] == [("b", ["s-2-0"])]
    with pytest.raises(RuntimeError, match="closed"):
        await batcher.put([make_sample(3, 0)], "a")


async def test_a_failed_write_raises_in_every_caller_of_its_batch_and_the_next_batch_goes_on():
    sink = RecordingSink()
    sink.fail = RuntimeError("Storage capacity exceeded")
    batcher = PutBatcher(sink, max_samples=2, max_delay_s=LONG_S)
    got = await asyncio.wait_for(asyncio.gather(*(batcher.put([make_sample(0, i)], "p") for i in range(2)),
                                                return_exceptions=True), AWAIT_S)
    assert [str(g) for g in got] == ["Storage capacity exceeded"] * 2 and sink.writes == []
    await asyncio.wait_for(asyncio.gather(*(batcher.put([make_sample(1, i)], "p") for i in range(2))), AWAIT_S)
    assert sink.writes == [("p", ["s-1-0", "s-1-1"])]


async def test_a_put_cancelled_before_its_batch_goes_stores_nothing_one_cancelled_during_the_write_is_stored():
    sink = RecordingSink()
    batcher = PutBatcher(sink, max_samples=64, max_delay_s=LONG_S)
    gone = asyncio.ensure_future(batcher.put([make_sample(0, 0)], "p"))
    kept = asyncio.ensure_future(batcher.put([make_sample(0, 1)], "p"))
    await asyncio.sleep(0)
    gone.cancel()  # a rollout cancelled while its sample waited: it takes the sample back
    await asyncio.gather(gone, return_exceptions=True)
    sink.hold = asyncio.Event()
    closing = asyncio.ensure_future(batcher.close())
    await asyncio.sleep(0.01)  # the write is in flight, held
    kept.cancel()  # too late to take back: the write goes on and stores it
    sink.hold.set()
    await asyncio.wait_for(closing, AWAIT_S)
    assert gone.cancelled() and kept.cancelled()
    assert sink.writes == [("p", ["s-0-1"])]


@pytest.mark.parametrize("seed", range(5))
async def test_randomized_puts_and_cancellations_store_every_sample_handed_over_exactly_once(seed):
    """Seeded: 200 puts at random moments, a random fifth of them cancelled at a random moment.
    Every put that returned is stored exactly once; a cancelled one at most once; nothing else."""
    rng = random.Random(seed)
    sink = RecordingSink()
    batcher = PutBatcher(sink, max_samples=rng.choice([1, 4, 16]), max_delay_s=rng.choice([0.0, 0.002, 0.01]))

    async def one(i: int) -> None:
        await asyncio.sleep(rng.random() * 0.05)
        await batcher.put([make_sample(i // 4, i % 4)], rng.choice(["a", "b"]))

    tasks = [asyncio.ensure_future(one(i)) for i in range(200)]
    for i in rng.sample(range(200), 40):
        asyncio.get_running_loop().call_later(rng.random() * 0.06, tasks[i].cancel)
    await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), AWAIT_S)
    await asyncio.wait_for(batcher.close(), AWAIT_S)
    stored = sink.stored()
    assert len(stored) == len(set(stored))  # exactly once
    returned = {make_sample(i // 4, i % 4).session_id for i, t in enumerate(tasks) if not t.cancelled()}
    assert returned <= set(stored)  # nothing lost
    assert set(stored) <= {make_sample(i // 4, i % 4).session_id for i in range(200)}


def test_bad_bounds_are_refused_naming_them():
    with pytest.raises(ValueError, match="max_samples"):
        PutBatcher(RecordingSink(), max_samples=0)
    with pytest.raises(ValueError, match="max_delay_s"):
        PutBatcher(RecordingSink(), max_delay_s=-1)
