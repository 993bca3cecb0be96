"""Bucketed, versioned weight broadcast: trainer rank 0 -> every inference worker.

Protocol of one push of version v (both ends in this module, the bytes in transport.py):
  1. The sender plans buckets (`plan_buckets`, `bucket_mb`) from the tensor specs, broadcasts the
     plan (it carries v), then per bucket: flattens its tensors into the transport's buffer and
     broadcasts it; finally waits until every receiver has the last bucket (`finish`).
  2. A receiver reads the plan, then yields (name, tensor) bucket by bucket (`WeightStream`) into
     its model's loader (vLLM: `reload_weights(weights_iterator=...)`, workers/inference/vllm_ext.py), and
     returns a `ReceiveReport`. A receiver that refuses v (not newer than its version) still
     drains every bucket before raising, so the sender and the other receivers never hang.
  3. `BroadcastWeightSync.push` runs 1 and 2 concurrently and bumps its version to v only after
     the sender and every receiver returned; any failure raises RuntimeError naming who failed and
     leaves the version unchanged (the replicas may then disagree: the run is broken).
Generation pauses only around step 2 on each replica (the replica's own in-flight policy).

Trainer and receivers are plain objects or Ray actor handles (detected by `.remote`); this module
imports neither Ray nor vLLM.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from workers.weight_sync.parts import WeightReceiverClient, WeightSenderClient
from workers.weight_sync.protocol import WeightSyncReport
from workers.weight_sync.plan import MIB, BucketPlan, TensorSpec, dtype_from_name, flatten_into, plan_buckets, unflatten
from workers.weight_sync.rendezvous import host_store
from workers.weight_sync.transport import BucketTransport, TransportBackend, WeightGroupInfo


@dataclass(frozen=True)
class SendReport:
    """One push as seen by the sender. bytes_per_s = total_bytes / elapsed_s."""

    version: int
    num_buckets: int
    num_tensors: int
    total_bytes: int
    elapsed_s: float


@dataclass(frozen=True)
class ReceiveReport:
    """One push as seen by a receiver (elapsed_s includes loading into its model)."""

    version: int
    num_tensors: int
    total_bytes: int
    elapsed_s: float


def send_weights(
    transport: BucketTransport,
    specs: Sequence[TensorSpec],
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    version: int,
    bucket_bytes: int,
) -> SendReport:
    """Broadcast `tensors` (yielded in `specs` order, any device / dtype: they are converted to the
    spec's dtype while flattening) as policy version `version`. Blocks until all receivers have the
    last bucket. Raises ValueError when the tensors do not match the specs (name, order, shape).
    """
    t0 = time.perf_counter()
    plan = plan_buckets(specs, bucket_bytes=bucket_bytes, version=version)
    transport.broadcast_obj(plan)
    it = iter(tensors)
    for bucket in plan.buckets:
        chunk: dict[str, torch.Tensor] = {}
        for slot in bucket.slots:
            try:
                name, t = next(it)
            except StopIteration:
                raise ValueError(f"tensors ended before {slot.spec.name!r} (bucket {bucket.index})") from None
            if name != slot.spec.name:
                raise ValueError(f"tensor order differs from the specs: got {name!r}, expected {slot.spec.name!r}")
            chunk[name] = t
        buf = transport.send_buffer(bucket.index, bucket.numel, dtype_from_name(bucket.dtype))
        flatten_into(bucket, chunk, buf)
        transport.send(bucket.index, bucket.numel)
    transport.finish()
    return SendReport(version, len(plan.buckets), plan.num_tensors, plan.total_bytes, time.perf_counter() - t0)


class WeightStream:
    """Receiver side of one push: `plan` on construction, then iterate for (name, tensor) pairs.

    keep=True: each tensor is a view of a freshly received bucket buffer (safe to keep; vLLM's
    layer-wise reload keeps tensors until their layer is complete). keep=False: tensors may be views
    of the transport's shared slot, valid only until the consumer asks for the tensor after the
    bucket's last one (saves one copy when the consumer copies each tensor at once). The stream must
    be consumed to the end (or `drain()`ed): the sender waits for every bucket to be taken.
    """

    def __init__(self, transport: BucketTransport, *, keep: bool = True) -> None:
        self._transport = transport
        self._keep = keep
        self.plan: BucketPlan = transport.broadcast_obj(None)
        self._next_bucket = 0
        self._held: int | None = None  # keep=False: bucket whose slot the consumer may still read
        self.num_tensors = 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        self._release_held()  # a consumer that stopped mid-bucket: that bucket is done with
        while self._next_bucket < len(self.plan.buckets):
            bucket = self.plan.buckets[self._next_bucket]
            flat = self._transport.recv(bucket.index, bucket.numel, dtype_from_name(bucket.dtype), copy=self._keep)
            self._next_bucket += 1
            self._held = None if self._keep else bucket.index
            for name, t in unflatten(bucket, flat):
                self.num_tensors += 1
                yield name, t
            self._release_held()

    def _release_held(self) -> None:
        if self._held is not None:
            self._transport.release(self._held)
            self._held = None

    def drain(self) -> None:
        """Receive and drop every bucket not yet taken."""
        for _ in self:
            pass


def receive_weights(
    transport: BucketTransport, load: Callable[[Iterator[tuple[str, torch.Tensor]]], None], *, current_version: int,
    keep: bool = True,
) -> ReceiveReport:
    """Receive one push and hand its tensors to `load` (which must consume the iterator); `keep`:
    see WeightStream (False only when `load` copies every tensor before taking the next).

    Raises ValueError (after draining every bucket) when the pushed version is not newer than
    `current_version`; RuntimeError when `load` returned without taking every tensor.
    """
    t0 = time.perf_counter()
    stream = WeightStream(transport, keep=keep)
    version = stream.plan.version
    if version <= current_version:
        stream.drain()
        raise ValueError(f"policy version must increase: current {current_version}, got {version}")
    try:
        load(iter(stream))
    except BaseException:
        stream.drain()  # the sender and the other receivers finish this push instead of hanging
        raise
    if stream.num_tensors != stream.plan.num_tensors:
        stream.drain()
        raise RuntimeError(f"the loader took {stream.num_tensors} of {stream.plan.num_tensors} tensors")
    return ReceiveReport(version, stream.num_tensors, stream.plan.total_bytes, time.perf_counter() - t0)


def new_group_info(
    backend: TransportBackend, num_receivers: int, *, host: str = "127.0.0.1", port: int | None = None,
    timeout_s: float = 300.0,
) -> WeightGroupInfo:
    """A WeightGroupInfo for rank 0 + `num_receivers` receiving ranks, with a fresh group name.

    port None: this process hosts the group's store now (`host_store` on `host`, a port the OS
    picked and keeps bound), so call it in the sender's process. A given port must already be
    served (`host_store` in the process that sends)."""
    if port is None:
        port = host_store(host).port
    return WeightGroupInfo(backend=backend, host=host, port=port, world_size=1 + num_receivers,
                           group_name=uuid.uuid4().hex[:12], timeout_s=timeout_s)


class BroadcastWeightSync:
    """`WeightSync` over a broadcast group (see the module docstring).

    sender: has `open_weight_group(info, rank)` and `broadcast_weights(version) -> SendReport`
        (TrainerWorker; every trainer rank gets both calls, rank 0 sends).
    receivers: each has `join_weight_group(info, rank)` and `receive_weights(version)`.
    ranks_per_receiver: group ranks each receiver brings (an inference replica with tensor
        parallelism t has t worker processes: ranks rank .. rank + t - 1); default 1 each.
    """

    def __init__(self, senders: Sequence[Any], receivers: Sequence[Any], info: WeightGroupInfo,
                 *, initial_version: int = 0, ranks_per_receiver: Sequence[int] | None = None) -> None:
        if not senders or not receivers:
            raise ValueError("BroadcastWeightSync needs at least one sender (trainer rank) and one receiver")
        widths = list(ranks_per_receiver) if ranks_per_receiver is not None else [1] * len(receivers)
        if len(widths) != len(receivers) or min(widths) < 1:
            raise ValueError(f"ranks_per_receiver must give >= 1 rank for each of the {len(receivers)} receivers")
        if info.world_size != 1 + sum(widths):
            raise ValueError(f"group world_size {info.world_size} != 1 + {sum(widths)} receiver ranks")
        self._first_ranks = [1 + sum(widths[:i]) for i in range(len(widths))]
        self._senders = [WeightSenderClient(s) for s in senders]
        self._receivers = [WeightReceiverClient(r) for r in receivers]
        self._info = info
        self._version = initial_version
        self._connected = False
        self.last_send: SendReport | None = None

    def version(self) -> int:
        return self._version

    def lost(self) -> frozenset[int]:
        """Always empty: a broadcast group cannot go on without a member, so a dead replica fails
        the next push (which raises) instead of being marked lost."""
        return frozenset()

    async def metrics(self) -> dict[str, float]:
        """None of its own (the trainer reports the bytes it sent)."""
        return {}

    async def connect(self) -> None:
        """Form the group: trainer ranks and receivers join concurrently (rendezvous)."""
        calls = [s.open_weight_group(self._info) for s in self._senders]
        calls += [r.join_weight_group(self._info, rank) for r, rank in zip(self._receivers, self._first_ranks)]
        await self._gather(calls, what="joining the weight-sync group")
        self._connected = True

    async def sync(self, version: int) -> WeightSyncReport:
        """Broadcast the trainer's current weights as `version` to every receiver.

        Raises ValueError for a version that does not increase, RuntimeError if any party failed.
        """
        if version <= self._version:
            raise ValueError(f"policy version must increase: current {self._version}, got {version}")
        if not self._connected:
            await self.connect()
        t0 = time.perf_counter()
        calls = [s.broadcast_weights(version) for s in self._senders]
        calls += [r.receive_weights(version) for r in self._receivers]
        results = await self._gather(calls, what=f"weight sync to version {version}")
        self.last_send = next((r for r in results[: len(self._senders)] if isinstance(r, SendReport)), None)
        self._version = version
        return WeightSyncReport(version=version, num_replicas=len(self._receivers), elapsed_s=time.perf_counter() - t0)

    async def _gather(self, calls: list, *, what: str) -> list:
        results = await asyncio.gather(*calls, return_exceptions=True)
        n = len(self._senders)
        failed = [(("trainer rank" if i < n else "receiver"), i if i < n else i - n, r)
                  for i, r in enumerate(results) if isinstance(r, BaseException)]
        if failed:
            detail = "; ".join(f"{who} {i}: {type(e).__name__}: {e}" for who, i, e in failed)
            raise RuntimeError(f"{what} failed on {len(failed)} parties ({detail}); "
                               "replicas may now serve different versions") from failed[0][2]
        return results


def bucket_bytes_of(bucket_mb: float) -> int:
    """`weight_sync.bucket_mb` (MiB) in bytes; raises ValueError when not > 0."""
    if not bucket_mb > 0:
        raise ValueError(f"weight_sync.bucket_mb must be > 0, got {bucket_mb}")
    return int(bucket_mb * MIB)
