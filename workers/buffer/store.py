"""Trajectory buffer: finished rollouts stored in TransferQueue until the loop trains on them.

The orchestrator's one entry point to TransferQueue (TQ, the `transferqueue` package). The driver
starts the TQ controller and storage units as Ray actors with `TrajectoryBuffer.start`, hands the
picklable `BufferHandle` to rollout workers and trainer ranks, and each builds its own client with
`TrajectoryBuffer.connect(handle)` inside its actor. Rollout workers `put` samples (and return
their metadata to the driver: workers/core/types.py `RolloutResult`); the loop frees them with
`clear_keys` (the keys the results carry: no listing) or `clear` (a whole partition); each trainer
rank reads the rows of its share of a train order (`read_rows`, workers/trainer/rows.py).
`sample_infos` lists a partition's tags (a rollout pool recovering from a dead actor, tools).

Layout (one TQ row per trajectory row, TQ's key-value interface):
  key    `{session_id}/{row_index}`; a sample with no rows is stored as one placeholder row
         `{session_id}/empty` (row_index -1, zero-length columns) so that it is still counted.
  fields 1-D jagged tensors per TQ row: token_ids int64, loss_mask int8, rollout_logprobs
         float64 (a Python float is a float64, so the round trip is bit-exact), versions int64.
  tags   (TQ custom_meta, one dict per TQ row) the sample's scalars, repeated on each of its rows:
         session_id, group_id, input_id, sample_index, reward, status, latency_s, error,
         min_version, max_version (None when nothing was generated), num_generated_tokens,
         plus row_index, num_rows, seq_len and row_generated (generated tokens) of this row.

Invariant: `get_groups` returns Samples equal (`==`) to those put (`sample_infos` their
`Sample.info()`, `read_rows` their rows), and only complete ones: a
sample's rows are written by one TQ put whose tags reach the controller in one message after the
data is stored, and a reader keeps a sample only when its tagged rows are exactly
0..num_rows-1; rows that contradict their sample (a session put twice with different rows)
raise `BufferCorruptError` rather than yield a mixed sample.

Callers: orchestrator main (start/stop), rollout workers (connect, put), the training loops
(clear_keys, clear), trainer ranks (connect, read_rows). Ray and TQ are imported inside functions, so importing this
module (for `BufferConfig`, `BufferHandle`) needs neither; the pure layout code is in
`workers.buffer.codec`.
"""

from __future__ import annotations

import array
import asyncio
import logging
import os
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from workers.core.types import Sample, SampleInfo, TrajectoryRow, row_key
from workers.buffer.codec import FIELDS, BufferCorruptError, StoredRow, complete_sessions, decode_samples, encode_sample, sample_info
from workers.core.calls import ByteMeter

T = TypeVar("T")
logger = logging.getLogger(__name__)

_TQ_BACKEND = "SimpleStorage"  # TQ's in-memory ZMQ storage; needs nothing outside Ray


@dataclass(frozen=True)
class BufferConfig:
    """How the TQ actors are started.

    num_storage_units: SimpleStorage units (Ray actors); samples are spread over them by index.
    capacity_rows: TQ rows (trajectory rows, see the module docstring) held at most across all
        units; None for unbounded. A put past capacity raises from TQ.
    actor_num_cpus: logical CPUs each TQ actor reserves. TQ's own default is 1 per actor, which
        on a 2-CPU cluster leaves nothing for the rollout workers; the actors are I/O servers
        with their own threads, so 0 is the default here.
    start_timeout_s: bound on each Ray call made while starting or stopping the actors.
    op_timeout_s: bound on each TQ request (put, list, get, clear) made through the buffer.
    """

    num_storage_units: int = 1
    capacity_rows: int | None = None
    actor_num_cpus: float = 0.0
    start_timeout_s: float = 120.0
    op_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.num_storage_units < 1:
            raise ValueError(f"buffer.num_storage_units must be >= 1, got {self.num_storage_units}")
        if self.capacity_rows is not None and self.capacity_rows < 1:
            raise ValueError(f"buffer.capacity_rows must be >= 1 or None, got {self.capacity_rows}")
        if self.actor_num_cpus < 0:
            raise ValueError(f"buffer.actor_num_cpus must be >= 0, got {self.actor_num_cpus}")
        if self.start_timeout_s <= 0 or self.op_timeout_s <= 0:
            raise ValueError("buffer.start_timeout_s and buffer.op_timeout_s must be > 0")


@dataclass(frozen=True)
class BufferHandle:
    """What a process needs to build a TQ client: picklable, pass it to Ray actors.

    controller_info: TQ `ZMQServerInfo` of the controller.
    storage_infos: unit name -> TQ `ZMQServerInfo` of each SimpleStorage unit.
    op_timeout_s: see `BufferConfig.op_timeout_s`.
    actor_names: Ray names of the controller and units (`trajectory-buffer-<id>-...`), for
        debugging and `ray.get_actor`; clients connect through the ZMQ infos, not these.
    """

    controller_info: Any
    storage_infos: dict[str, Any]
    op_timeout_s: float
    actor_names: tuple[str, ...] = ()


# ---------------------------------------------------------------- TQ-backed buffer


@dataclass
class _Owned:
    """Actors this process created (only the starting buffer owns any)."""

    controller: Any
    storage_units: list[Any] = field(default_factory=list)
    start_timeout_s: float = 120.0
    names: tuple[str, ...] = ()
    op_timeout_s: float = 60.0


class TrajectoryBuffer:
    """Client of the TransferQueue that holds finished samples, by partition.

    Build with `start` (driver: creates the TQ actors) or `connect` (any process: client only).
    All data methods are coroutines bounded by `op_timeout_s`; use one buffer per event loop
    (TQ pools sockets per loop). `close` releases the client; `stop` also kills the actors.
    """

    def __init__(self, handle: BufferHandle, client: Any, owned: _Owned | None) -> None:
        self._handle = handle
        self._client = client
        self._owned = owned
        self._meter: ByteMeter | None = None

    def meter_received(self, meter: ByteMeter | None) -> None:
        """From now on add the pickled size of every answer TransferQueue gives this client to
        `meter` (the driver's `driver/bytes_from_buffer`); None stops."""
        self._meter = meter

    # ---- lifecycle

    @classmethod
    def start(cls, config: BufferConfig | None = None) -> TrajectoryBuffer:
        """Create the TQ controller and storage units in the current Ray cluster (`ray.init` first);
        return an owning buffer. Raises TimeoutError when one is not up within `config.start_timeout_s`."""
        import ray

        owned, ready = _launch(config or BufferConfig())
        try:
            return cls._owning(owned, ray.get(ready, timeout=owned.start_timeout_s))
        except BaseException:
            _kill_owned(owned)
            raise

    @classmethod
    async def start_async(cls, config: BufferConfig | None = None) -> TrajectoryBuffer:
        """`start` that awaits the actors instead of blocking the thread, so a driver's event loop
        handles a Ctrl-C while they come up (seconds beside starting engines); cancelled, it kills
        them. Raises TimeoutError after `config.start_timeout_s`."""
        owned, ready = _launch(config or BufferConfig())
        try:
            async with asyncio.timeout(owned.start_timeout_s):
                return cls._owning(owned, await asyncio.gather(*ready))
        except BaseException:
            _kill_owned(owned, graceful=False)  # the units may still be starting: no shutdown call to wait on
            raise

    @classmethod
    def _owning(cls, owned: _Owned, infos: Sequence[Any]) -> TrajectoryBuffer:
        """The owning buffer once the actors answered (`infos`: the controller's ZMQ info, then each unit's)."""
        handle = BufferHandle(infos[0], {f"unit-{i}": info for i, info in enumerate(infos[1:])}, owned.op_timeout_s,
                              owned.names)
        return cls(handle, _make_client(handle), owned)

    @classmethod
    def connect(cls, handle: BufferHandle) -> TrajectoryBuffer:
        """A client-only buffer on the TQ actors named by `handle` (call inside the actor that uses it)."""
        return cls(handle, _make_client(handle), None)

    @property
    def handle(self) -> BufferHandle:
        """Picklable description of this buffer's actors; pass it to `connect` in other processes."""
        return self._handle

    def close(self) -> None:
        """Release this client's sockets and threads; the TQ actors keep running."""
        if self._client is not None:
            self._client.close()
            self._client = None

    def stop(self) -> None:
        """Close the client and kill the TQ actors this buffer started (a connected buffer only closes)."""
        self.close()
        if self._owned is not None:
            _kill_owned(self._owned)
            self._owned = None

    # ---- data

    async def put(self, samples: Sequence[Sample], partition: str) -> None:
        """Store `samples` in `partition` (created on first use), all in one TQ write.

        A failed put (e.g. TQ's RuntimeError "Storage capacity exceeded" past
        `BufferConfig.capacity_rows`) raises and leaves none of its rows in the partition.
        A session id already in the partition is overwritten row by row; if the new sample has
        fewer rows, the next read of that session raises BufferCorruptError.
        """
        if not samples:
            return
        import torch
        from tensordict import TensorDict

        rows = [r for s in samples for r in encode_sample(s)]
        keys = [r.key for r in rows]
        if len(set(keys)) != len(keys):
            raise ValueError("put got the same session id twice in one call")

        data = TensorDict(
            {
                "token_ids": _jagged([r.token_ids for r in rows], "q", torch.int64),
                "loss_mask": _jagged([r.loss_mask for r in rows], "b", torch.int8),
                "rollout_logprobs": _jagged([r.rollout_logprobs for r in rows], "d", torch.float64),
                "versions": _jagged([r.versions for r in rows], "q", torch.int64),
            },
            batch_size=len(rows),
        )
        client = self._live_client()

        async def write() -> None:
            meta = self._got(await client.async_kv_retrieve_meta(keys=keys, partition_id=partition, create=True))
            if meta.size != len(keys):
                raise RuntimeError(f"TQ registered {meta.size} of {len(keys)} keys in partition {partition!r}")
            meta.update_custom_meta([r.tags for r in rows])
            try:
                await client.async_put(data, meta)  # stores data, then sends the tags to the controller
            except Exception:
                await client.async_clear_samples(meta)  # leave no half-registered keys behind
                raise

        await self._bounded(write(), f"put of {len(samples)} samples to {partition!r}")

    async def sample_infos(self, partition: str, group_ids: Sequence[int] | None = None) -> list[SampleInfo]:
        """Metadata of the complete samples in `partition` (of `group_ids` only, when given), sorted by
        (group_id, sample_index, session_id); one controller request, no token data moved. Empty if
        the partition does not exist. The loops read a group's samples this way, once, after the
        rollout pool said they are stored (a worker puts its sample before it returns its outcome)."""
        listing = await self._list(partition)
        wanted = None if group_ids is None else set(group_ids)
        infos = [sample_info(listing, keys) for keys in complete_sessions(listing).values()
                 if wanted is None or listing[keys[0]]["group_id"] in wanted]
        return sorted(infos, key=lambda i: (i.group_id, i.sample_index, i.session_id))

    async def row_count(self, partition: str) -> int:
        """TQ rows (keys) in `partition`, including those of puts still in flight: its occupancy."""
        return len(await self._list(partition))

    async def group_counts(self, partition: str) -> dict[int, int]:
        """group_id -> number of complete samples stored in `partition` (empty if it does not exist)."""
        counts: dict[int, int] = defaultdict(int)
        for info in await self.sample_infos(partition):
            counts[info.group_id] += 1
        return dict(counts)

    async def read_rows(self, partition: str, keys: Sequence[str]) -> list[TrajectoryRow]:
        """The trajectory rows stored under `keys` (`SampleInfo.row_keys`), in the order asked: what
        a trainer rank reads for its share of a train order. Raises BufferCorruptError when a key
        is missing or not fully written."""
        rows = await self._read_rows(partition, list(keys))
        for r in rows:
            if row_key(r.tags["session_id"], r.tags["row_index"]) != r.key:
                raise BufferCorruptError(f"row {r.key} of {partition!r} came back tagged as row {r.tags['row_index']} "
                                         f"of {r.tags['session_id']}")
        return [TrajectoryRow(r.token_ids, r.loss_mask, r.rollout_logprobs, r.versions) for r in rows]

    async def get_groups(self, partition: str, group_ids: Sequence[int]) -> list[Sample]:
        """The complete samples of `group_ids` in `partition` with their tokens, sorted by
        (group_id, sample_index); no wait. For tests and tools: the loops hold the rollout results,
        the trainer ranks `read_rows`. The data stays in the buffer until `clear`."""
        listing = await self._list(partition)
        wanted = set(group_ids)
        keys = [k for ks in complete_sessions(listing).values() if listing[ks[0]]["group_id"] in wanted for k in ks]
        return decode_samples(await self._read_rows(partition, keys))

    async def clear(self, partition: str, group_ids: Sequence[int] | None = None) -> None:
        """Delete `group_ids` from `partition` (all its TQ rows, complete or not), or the whole
        partition when `group_ids` is None. Clearing what is not there does nothing."""
        client = self._live_client()
        if group_ids is None:
            await self._bounded(client.async_clear_partition(partition), f"clear of {partition!r}")
            return
        wanted = set(group_ids)
        listing = await self._list(partition)
        keys = [k for k, tags in listing.items() if tags and tags.get("group_id") in wanted]
        if not keys:
            return

        async def drop() -> None:
            meta = self._got(await client.async_kv_retrieve_meta(keys=keys, partition_id=partition, create=False))
            if meta.size > 0:
                await client.async_clear_samples(meta)

        await self._bounded(drop(), f"clear of {len(keys)} rows from {partition!r}")

    async def clear_keys(self, partition: str, keys: Sequence[str]) -> None:
        """Delete the TQ rows under `keys` from `partition` (`codec.stored_keys` of the samples a
        loop is done with): one request for their metadata and one to clear, no listing. Keys not
        there (cleared already) are skipped."""
        if not keys:
            return
        client = self._live_client()

        async def drop() -> None:
            meta = self._got(await client.async_kv_retrieve_meta(keys=list(keys), partition_id=partition, create=False))
            if meta.size > 0:
                await client.async_clear_samples(meta)

        await self._bounded(drop(), f"clear of {len(keys)} rows from {partition!r}")

    async def partitions(self) -> list[str]:
        """Ids of the partitions that exist now."""
        client = self._live_client()
        return list(self._got(await self._bounded(client.async_get_partition_list(), "partition list")))

    # ---- sync wrappers (for code without an event loop: scripts, tests, the sync driver)

    def put_sync(self, samples: Sequence[Sample], partition: str) -> None:
        """`put` from code that has no running event loop."""
        _run_sync(self.put(samples, partition))

    def get_groups_sync(self, partition: str, group_ids: Sequence[int]) -> list[Sample]:
        """`get_groups` from code that has no running event loop."""
        return _run_sync(self.get_groups(partition, group_ids))

    def clear_sync(self, partition: str, group_ids: Sequence[int] | None = None) -> None:
        """`clear` from code that has no running event loop."""
        _run_sync(self.clear(partition, group_ids))

    # ---- internals

    def _live_client(self) -> Any:
        if self._client is None:
            raise RuntimeError("TrajectoryBuffer is closed")
        return self._client

    async def _bounded(self, aw: Awaitable[T], what: str) -> T:
        try:
            return await asyncio.wait_for(aw, timeout=self._handle.op_timeout_s)
        except TimeoutError as e:
            raise TimeoutError(f"TransferQueue {what} took longer than {self._handle.op_timeout_s}s") from e

    def _got(self, answer: T) -> T:
        """`answer`, received from TransferQueue, counted by the meter if any (`meter_received`)."""
        if self._meter is not None:
            self._meter.add(answer)
        return answer

    async def _list(self, partition: str) -> dict[str, dict[str, Any]]:
        info = self._got(await self._bounded(self._live_client().async_kv_list(partition), f"listing of {partition!r}"))
        return info.get(partition, {})

    async def _read_rows(self, partition: str, keys: list[str]) -> list[StoredRow]:
        if not keys:
            return []
        client = self._live_client()

        async def read() -> tuple[Any, Any]:
            meta = self._got(await client.async_kv_retrieve_meta(keys=keys, partition_id=partition, create=False))
            if meta.size != len(keys):
                raise BufferCorruptError(
                    f"{len(keys) - meta.size} of {len(keys)} rows vanished from {partition!r} while reading "
                    "(cleared concurrently?)"
                )
            meta = meta.select_fields(list(FIELDS))
            if not meta.is_ready:
                raise BufferCorruptError(f"rows in {partition!r} are tagged but their fields are not ready")
            return meta, self._got(await client.async_get_data(meta))

        meta, data = await self._bounded(read(), f"read of {len(keys)} rows from {partition!r}")
        cols = {f: [t.tolist() for t in data[f].unbind()] for f in FIELDS}
        return [
            StoredRow(
                key=key,
                tags=tags,
                token_ids=tuple(cols["token_ids"][i]),
                loss_mask=tuple(cols["loss_mask"][i]),
                rollout_logprobs=tuple(cols["rollout_logprobs"][i]),
                versions=tuple(cols["versions"][i]),
            )
            for i, (key, tags) in enumerate(zip(keys, meta.get_all_custom_meta(), strict=True))
        ]


def _jagged(values: list[tuple], typecode: str, dtype: Any) -> Any:
    """A jagged nested tensor [rows, (len)] of `values` (one tuple per row), built from one flat
    buffer and its offsets: the values go through `array.array` (C, per element) instead of one
    `torch.tensor` per row, half the CPU of a put of long rows (issue 44). `typecode`: the array
    code of `dtype` ("q" int64, "b" int8, "d" float64: a Python float's exact bits)."""
    import torch

    flat = array.array(typecode)
    offsets = [0]
    for v in values:
        flat.extend(v)
        offsets.append(len(flat))
    # frombuffer shares the array's memory and keeps a reference to it
    data = torch.frombuffer(flat, dtype=dtype) if flat else torch.empty(0, dtype=dtype)
    return torch.nested.nested_tensor_from_jagged(data, torch.tensor(offsets, dtype=torch.int64))


def _make_client(handle: BufferHandle) -> Any:
    """A TQ async client bound to the handle's controller and storage units (blocking handshake)."""
    from transfer_queue.client import AsyncTransferQueueClient

    client = AsyncTransferQueueClient(
        client_id=f"TrajectoryBuffer_{os.getpid()}_{uuid.uuid4().hex[:6]}",
        controller_info=handle.controller_info,
    )
    client.initialize_storage_manager(manager_type=_TQ_BACKEND, config={"zmq_info": dict(handle.storage_infos)})
    return client


SHUTDOWN_TIMEOUT_S = 5.0  # a storage unit gets this long to stop cleanly (s), then it is killed


def _launch(cfg: BufferConfig) -> tuple[_Owned, list[Any]]:
    """Create the TQ actors (not waited for); return them and the refs of their ZMQ infos
    (controller first). Raises RuntimeError without a Ray cluster."""
    import ray
    from transfer_queue.controller import TransferQueueController
    from transfer_queue.sampler import SequentialSampler
    from transfer_queue.storage.simple_storage import SimpleStorageUnit

    if not ray.is_initialized():
        raise RuntimeError("TrajectoryBuffer.start needs a Ray cluster: call ray.init first")
    prefix = f"trajectory-buffer-{uuid.uuid4().hex[:8]}"
    names = (f"{prefix}-controller", *(f"{prefix}-storage-{i}" for i in range(cfg.num_storage_units)))
    controller = TransferQueueController.options(name=names[0], num_cpus=cfg.actor_num_cpus).remote(
        sampler=SequentialSampler, polling_mode=True)
    owned = _Owned(controller, [], cfg.start_timeout_s, names, cfg.op_timeout_s)
    unit_cfg = {"total_storage_size": cfg.capacity_rows, "num_data_storage_units": cfg.num_storage_units,
                "_run_id": uuid.uuid4().hex}
    try:
        owned.storage_units = [SimpleStorageUnit.options(name=n, num_cpus=cfg.actor_num_cpus).remote(config=unit_cfg)
                               for n in names[1:]]
    except BaseException:
        _kill_owned(owned, graceful=False)
        raise
    return owned, [a.get_zmq_server_info.remote() for a in (controller, *owned.storage_units)]


def _kill_owned(owned: _Owned, *, graceful: bool = True) -> None:
    """Shut the storage units down (bounded; `graceful` only), then kill every actor we created."""
    import ray

    try:
        if graceful:
            ray.get([u.shutdown.remote() for u in owned.storage_units], timeout=SHUTDOWN_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - a unit that will not shut down cleanly is killed below anyway
        logger.warning("TransferQueue storage units did not shut down cleanly (%s); killing them", e)
    for actor in [*owned.storage_units, owned.controller]:
        ray.kill(actor)


def _run_sync(aw: Awaitable[T]) -> T:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(aw)  # type: ignore[arg-type]
    aw.close()  # type: ignore[attr-defined]  # never awaited: close it to avoid a warning
    raise RuntimeError("sync buffer call made inside a running event loop; await the async method instead")
