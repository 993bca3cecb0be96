"""PutBatcher: a rollout actor's puts into the sample store, gathered into one store write per batch.

Each put into the trajectory buffer pays a fixed cost whatever its size (a TransferQueue metadata
round trip, a TensorDict of nested tensors, the storage unit's schema pass: issue 44 measured it
at a quarter of a rollout actor's CPU). The rollout actor's concurrent rollouts hand their samples
to one `PutBatcher` instead, which writes them together: a partition's batch goes when it holds
`max_samples` samples or `max_delay_s` seconds after its first one arrived, whichever is first.

Invariant (exactly once, nothing lost): `put` returns only once its samples are in the store, written
by exactly one store write shared with the rest of its batch, or raises what that write raised (the
write is all or nothing: `TrajectoryBuffer.put`); a `put` cancelled before its batch was sent takes
its samples back (nothing of it is stored, as a cancelled rollout stores nothing); a `put` cancelled
while its batch is being written is stored with it. `close` sends every pending batch at once and
waits for every write in flight, so no sample handed over is dropped when the actor shuts down.

Pure asyncio: no Ray, TransferQueue or clock import (the delay is an `asyncio.sleep`). Callers:
workers/rollout/actor.py (around the buffer client), scripts/bench_rollout.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from workers.core.types import Sample

MAX_SAMPLES = 64  # a batch goes at once when it holds this many samples (bounds one TQ write's size)
MAX_DELAY_S = 0.02  # ... else this long after its first sample arrived (s): the completion-to-stored cost


class SampleSink(Protocol):
    async def put(self, samples: list[Sample], partition: str) -> None: ...


@dataclass(eq=False)
class _Batch:
    """The samples of one partition waiting for one write, and the future their callers await."""

    partition: str
    done: asyncio.Future
    parts: list[list[Sample]] = field(default_factory=list)
    sent: bool = False
    timer: asyncio.Task | None = None  # sends the batch once its delay is up

    @property
    def size(self) -> int:
        return sum(len(p) for p in self.parts)


class PutBatcher:
    """A `SampleSink` that writes concurrent puts to `sink` in batches (see the module docstring).

    max_samples: samples that send a batch at once (>= 1); max_delay_s: seconds a batch waits for
    more after its first sample (>= 0; 0 sends at the next turn of the event loop, gathering only
    the puts of that turn). Raises ValueError on a bad bound, RuntimeError on a put after `close`."""

    def __init__(self, sink: SampleSink, *, max_samples: int = MAX_SAMPLES, max_delay_s: float = MAX_DELAY_S) -> None:
        if max_samples < 1:
            raise ValueError(f"PutBatcher max_samples must be >= 1, got {max_samples}")
        if max_delay_s < 0:
            raise ValueError(f"PutBatcher max_delay_s must be >= 0, got {max_delay_s}")
        self._sink = sink
        self._max_samples, self._max_delay_s = max_samples, max_delay_s
        self._open: dict[str, _Batch] = {}  # partition -> the batch still taking samples
        self._writes: set[asyncio.Task] = set()  # timers and writes in flight
        self._closed = False
        self.writes = 0  # store writes made (batches sent)
        self.samples = 0  # samples those writes carried

    async def put(self, samples: Sequence[Sample], partition: str) -> None:
        """Store `samples` in `partition` with the batch they join; see the invariant."""
        if self._closed:
            raise RuntimeError("PutBatcher is closed: a rollout finished after its actor shut down")
        if not samples:
            return
        part = list(samples)
        batch = self._open.get(partition)
        if batch is None:
            batch = self._open[partition] = _Batch(partition, asyncio.get_running_loop().create_future())
            batch.done.add_done_callback(_retrieved)  # every caller may be gone: no "never retrieved" log
            batch.timer = self._spawn(self._send_after(batch, self._max_delay_s))
        batch.parts.append(part)
        if batch.size >= self._max_samples:
            self._send_now(batch)
        try:
            await asyncio.shield(batch.done)
        except asyncio.CancelledError:
            if not batch.sent:  # not written yet: take the samples back, the rest of the batch goes on
                batch.parts.remove(part)
            raise

    async def close(self) -> None:
        """Send every pending batch now and wait for every write (idempotent); later puts raise."""
        self._closed = True
        for batch in list(self._open.values()):
            self._send_now(batch)
        while self._writes:
            await asyncio.gather(*list(self._writes), return_exceptions=True)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)
        return task

    def _send_now(self, batch: _Batch) -> None:
        if self._open.get(batch.partition) is batch:
            del self._open[batch.partition]  # the next put to this partition starts a new batch
            self._spawn(self._write(batch))
            if batch.timer is not None and batch.timer is not asyncio.current_task():
                batch.timer.cancel()  # sent before its delay was up: the timer has nothing left to do

    async def _send_after(self, batch: _Batch, delay_s: float) -> None:
        try:
            await asyncio.sleep(delay_s)
        finally:  # cancelled too (the loop is shutting down): the batch is sent, never dropped
            self._send_now(batch)

    async def _write(self, batch: _Batch) -> None:
        batch.sent = True
        samples = [s for p in batch.parts for s in p]
        try:
            if samples:  # every caller may have been cancelled before the send
                await self._sink.put(samples, batch.partition)
                self.writes += 1
                self.samples += len(samples)
        except BaseException as exc:  # the callers get the write's error (a cancellation as one)
            if not batch.done.done():
                batch.done.set_exception(exc if isinstance(exc, Exception) else asyncio.CancelledError())
            if not isinstance(exc, Exception):
                raise
            return
        if not batch.done.done():
            batch.done.set_result(None)


def _retrieved(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()
