"""Byte movers of the broadcast weight sync: rank 0 (trainer) to ranks 1..N (inference workers).

A transport moves a plan (a small object) and then flat buckets, in order, from rank 0 to every
other rank of a group made only for weight sync (never the trainer's FSDP group nor vLLM's own).
Two implementations behind one interface (`BucketTransport`):

- `CollectiveTransport`: a stateless torch ProcessGroup (TCPStore rendezvous, no global
  `init_process_group`, the recipe of vllm/distributed/utils.py
  `stateless_init_torch_distributed_process_group`), backend "gloo" (CPU, any node) or "nccl"
  (GPU). Buckets are `broadcast` collectives; the plan is a pickled uint8 tensor.
- `SlotTransport`, one node: buckets are copied into `num_slots` shared slots used round-robin,
  "shm" (CPU: files under /dev/shm) or "cuda_ipc" (one GPU shared by trainer and inference, the
  colocated case: CUDA buffers opened through IPC handles; NCCL refuses two ranks on one GPU).
  The TCPStore carries the plan and per-bucket ready/ack keys. Rank 0 reuses a slot only after
  every receiver acknowledged the bucket that was in it, so with 2 slots the sender fills bucket
  k+1 while receivers copy bucket k out.

Invariants: every rank calls `broadcast_obj` once and then send/recv once per bucket, in plan
order (collectives and store keys are matched by order); a receiver's tensor is a fresh buffer
it owns, unless it asked for `copy=False` (shm: a view of the slot, valid until it calls
`release(index)`, which is when the sender may reuse the slot); a timeout raises instead of
hanging forever.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, Protocol

import torch

from workers.weight_sync.rendezvous import StoreAddress, join_store, release_store

TransportBackend = Literal["shm", "cuda_ipc", "gloo", "nccl"]
SHM_DIR = "/dev/shm"  # tmpfs: a "file" here is memory, shared by every process of the node


@dataclass(frozen=True)
class WeightGroupInfo:
    """How to join a weight-sync group: its TCPStore listens on host:port, served by the sender's
    process since before the group was described (workers/weight_sync/rendezvous.py `host_store`).

    world_size: 1 + number of receiving processes. group_name: unique per group; prefixes store
    keys and shared-memory file names. timeout_s: bound on every wait.
    """

    backend: TransportBackend
    host: str
    port: int
    world_size: int
    group_name: str
    timeout_s: float = 300.0
    num_slots: int = 2

    def __post_init__(self) -> None:
        if self.backend not in ("shm", "cuda_ipc", "gloo", "nccl"):
            raise ValueError(f"weight sync backend must be shm, cuda_ipc, gloo or nccl, got {self.backend!r}")
        if self.world_size < 2:
            raise ValueError(f"a weight-sync group needs the sender and >= 1 receiver, world_size={self.world_size}")
        if self.num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {self.num_slots}")

    @property
    def address(self) -> StoreAddress:
        return StoreAddress(self.host, self.port)


class BucketTransport(Protocol):
    """What the sync protocol needs from a transport (see the module docstring)."""

    rank: int

    def broadcast_obj(self, obj: Any) -> Any: ...

    def send_buffer(self, index: int, numel: int, dtype: torch.dtype) -> torch.Tensor: ...

    def send(self, index: int, numel: int) -> None: ...

    def recv(self, index: int, numel: int, dtype: torch.dtype, *, copy: bool = True) -> torch.Tensor: ...

    def release(self, index: int) -> None: ...

    def finish(self) -> None: ...

    def close(self) -> None: ...


def _store(info: WeightGroupInfo) -> Any:
    """This rank's view of the group's store (hosted by the sender's process, `host_store`)."""
    from torch.distributed import PrefixStore

    store = join_store(info.address, timeout_s=info.timeout_s)
    return PrefixStore(f"weight_sync/{info.group_name}/", store)


def open_transport(info: WeightGroupInfo, rank: int, device: torch.device | None = None) -> BucketTransport:
    """Join the group as `rank` (0 = sender). Collective backends block until every rank joined.

    Raises ValueError for a rank outside [0, world_size), or "nccl" / "cuda_ipc" without a CUDA device.
    """
    if not 0 <= rank < info.world_size:
        raise ValueError(f"rank must be in [0, {info.world_size}), got {rank}")
    if info.backend in ("shm", "cuda_ipc"):
        return SlotTransport(info, rank, device)
    if info.backend == "nccl" and (device is None or device.type != "cuda"):
        raise ValueError(f"the nccl weight-sync backend needs a CUDA device, got {device}")
    return CollectiveTransport(info, rank, device or torch.device("cpu"))


class CollectiveTransport:
    """Broadcast over a stateless gloo / NCCL ProcessGroup (see the module docstring)."""

    def __init__(self, info: WeightGroupInfo, rank: int, device: torch.device) -> None:
        from torch.distributed import ProcessGroupGloo

        self.rank, self._info, self._device = rank, info, device
        self._store = _store(info)
        timeout = timedelta(seconds=info.timeout_s)
        if info.backend == "nccl":
            from torch.distributed import ProcessGroupNCCL

            torch.cuda.set_device(device)
            self._pg = ProcessGroupNCCL(self._store, rank, info.world_size, ProcessGroupNCCL.Options())
        else:
            self._pg = ProcessGroupGloo(self._store, rank, info.world_size, timeout)
        self._send_buf: torch.Tensor | None = None
        self._send_view: torch.Tensor | None = None  # uint8 view of the bucket being sent

    def _broadcast(self, t: torch.Tensor) -> None:
        from torch.distributed import BroadcastOptions

        opts = BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        self._pg.broadcast([t], opts).wait()

    def broadcast_obj(self, obj: Any) -> Any:
        """Rank 0's `obj` (pickled) on every rank; other ranks pass None."""
        if self.rank == 0:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self._device)
            size = torch.tensor([payload.numel()], dtype=torch.int64, device=self._device)
        else:
            size = torch.zeros(1, dtype=torch.int64, device=self._device)
        self._broadcast(size)
        if self.rank != 0:
            payload = torch.empty(int(size.item()), dtype=torch.uint8, device=self._device)
        self._broadcast(payload)
        return obj if self.rank == 0 else pickle.loads(payload.cpu().numpy().tobytes())

    def send_buffer(self, index: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D buffer of >= numel elements to flatten bucket `index` into (reused between buckets)."""
        nbytes = numel * dtype.itemsize
        if self._send_buf is None or self._send_buf.numel() < nbytes:
            self._send_buf = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
        self._send_view = self._send_buf[:nbytes]
        return self._send_view.view(dtype)

    def send(self, index: int, numel: int) -> None:
        if self._send_view is None:
            raise RuntimeError(f"send({index}) without send_buffer({index})")
        self._broadcast(self._send_view)
        self._send_view = None
        if self._device.type == "cuda":
            torch.cuda.current_stream(self._device).synchronize()

    def recv(self, index: int, numel: int, dtype: torch.dtype, *, copy: bool = True) -> torch.Tensor:
        """Bucket `index` in a fresh buffer (always owned: `copy` changes nothing here)."""
        buf = torch.empty(numel * dtype.itemsize, dtype=torch.uint8, device=self._device)
        self._broadcast(buf)
        return buf.view(dtype)

    def release(self, index: int) -> None:
        """Nothing to release: received buffers are owned by the caller."""

    def finish(self) -> None:
        """Collectives complete in order; nothing to wait for."""

    def close(self) -> None:
        shutdown = getattr(self._pg, "shutdown", None)
        if shutdown is not None:
            shutdown()
        if self.rank == 0:
            release_store(self._info.address)  # the sender's process stops serving the group's store


class SlotTransport:
    """Buckets through shared slots, control through the TCPStore (see the module docstring).

    "shm": the slots are files under /dev/shm. "cuda_ipc": the slots are CUDA buffers of the
    sender, opened by receivers on the same GPU through CUDA IPC handles (torch's reduce_tensor, as
    verl's colocated weight update); copies stay on the device, and each side synchronizes its
    stream before it signals (ready / ack), so a signal always follows the finished copy.
    """

    def __init__(self, info: WeightGroupInfo, rank: int, device: torch.device | None = None) -> None:
        self.rank, self._info = rank, info
        self._cuda = info.backend == "cuda_ipc"
        if self._cuda and (device is None or device.type != "cuda"):
            raise ValueError(f"the cuda_ipc weight-sync backend needs a CUDA device, got {device}")
        self._device = device
        self._store = _store(info)
        self._num_receivers = info.world_size - 1
        self._push = 0  # pushes begun by this rank; keys of push p start with f"{p}/"
        self._slot_bytes = 0
        self._slot_gen = 0  # bumped whenever rank 0 (re)allocates the slots
        self._slots: list[torch.Tensor] = []
        self._acked_below = 0  # sender: buckets < this are acknowledged by every receiver
        self._num_sent = 0
        self._pending_send: tuple[int, int] | None = None

    def _slot_path(self, j: int) -> str:
        return os.path.join(SHM_DIR, f"weight-sync-{self._info.group_name}-slot{j}")

    def _allocate_slots(self, nbytes: int) -> list:
        """Rank 0: create (or grow) the slots; returns what receivers need to open them.

        Raises RuntimeError when /dev/shm has too little room ("shm"): writing past its size would
        kill the process with SIGBUS instead (containers often mount a 64 MiB /dev/shm).
        """
        if not self._cuda:
            st = os.statvfs(SHM_DIR)
            free = st.f_bavail * st.f_frsize + self._slot_bytes * len(self._slots)
            if free < nbytes * self._info.num_slots:
                raise RuntimeError(
                    f"{SHM_DIR} has {free / 2**20:.0f} MiB free, the weight-sync slots need "
                    f"{self._info.num_slots} x {nbytes / 2**20:.0f} MiB: lower trainer.weight_sync.bucket_mb "
                    "or enlarge /dev/shm (docker: --shm-size)")
        self._slots, handles = [], []
        for j in range(self._info.num_slots):
            if self._cuda:
                from torch.multiprocessing.reductions import reduce_tensor

                slot = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
                handles.append(reduce_tensor(slot))
            else:
                path = self._slot_path(j)
                with open(path, "ab") as f:
                    f.truncate(nbytes)
                slot = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
            self._slots.append(slot)
        self._slot_bytes = nbytes
        self._slot_gen += 1
        return handles

    def _open_slots(self, nbytes: int, gen: int, handles: list) -> None:
        """Receiver: (re)open the sender's slots when they changed."""
        if gen == self._slot_gen:
            return
        if self._cuda:
            self._slots = [rebuild(*args) for rebuild, args in handles]
        else:
            self._slots = [torch.from_file(self._slot_path(j), shared=True, size=nbytes, dtype=torch.uint8)
                           for j in range(self._info.num_slots)]
        self._slot_bytes, self._slot_gen = nbytes, gen

    def _sync(self) -> None:
        if self._cuda:
            torch.cuda.current_stream(self._device).synchronize()

    def _key(self, *parts: object) -> str:
        return "/".join(str(p) for p in (self._push, *parts))

    def broadcast_obj(self, obj: Any) -> Any:
        """Start a push: rank 0 publishes `obj` (and the slots); others wait for it."""
        self._push += 1
        self._num_sent = self._acked_below = 0
        if self.rank == 0:
            nbytes = int(getattr(obj, "max_bucket_bytes", 0)) or 1
            handles = self._allocate_slots(nbytes) if nbytes > self._slot_bytes else None
            self._store.set(self._key("header"), pickle.dumps((self._slot_bytes, self._slot_gen, handles, obj)))
            return obj
        nbytes, gen, handles, obj = pickle.loads(self._store.get(self._key("header")))
        self._open_slots(nbytes, gen, handles)
        return obj

    def send_buffer(self, index: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The slot view bucket `index` is flattened into; waits until its last user was acked."""
        nbytes = numel * dtype.itemsize
        if nbytes > self._slot_bytes:
            raise ValueError(f"bucket {index} has {nbytes} bytes, slots hold {self._slot_bytes}")
        self._wait_acked(index - self._info.num_slots)
        self._pending_send = (index, nbytes)
        return self._slots[index % self._info.num_slots][:nbytes].view(dtype)

    def send(self, index: int, numel: int) -> None:
        if self._pending_send is None or self._pending_send[0] != index:
            raise RuntimeError(f"send({index}) without send_buffer({index})")
        self._pending_send = None
        self._sync()
        self._store.set(self._key("ready", index), b"1")
        self._num_sent = index + 1

    def recv(self, index: int, numel: int, dtype: torch.dtype, *, copy: bool = True) -> torch.Tensor:
        """Bucket `index`: a fresh copy out of its slot (acknowledged at once), or with copy=False
        the slot itself (acknowledged by `release(index)`; do not touch it after that)."""
        nbytes = numel * dtype.itemsize
        self._store.wait([self._key("ready", index)], timedelta(seconds=self._info.timeout_s))
        view = self._slots[index % self._info.num_slots][:nbytes]
        if not copy:
            return view.view(dtype)
        out = view.clone().view(dtype)
        self.release(index)
        return out

    def release(self, index: int) -> None:
        """Acknowledge bucket `index`: its slot may be refilled once every receiver did."""
        self._sync()  # the copies out of the slot are done before the sender may overwrite it
        if self._store.add(self._key("acks", index), 1) == self._num_receivers:
            self._store.set(self._key("acked", index), b"1")

    def _wait_acked(self, index: int) -> None:
        if index < self._acked_below:
            return
        self._store.wait([self._key("acked", index)], timedelta(seconds=self._info.timeout_s))
        self._acked_below = index + 1

    def finish(self) -> None:
        """Sender: wait until every receiver copied every bucket out, then drop this push's keys."""
        if self.rank != 0:
            return
        for i in range(max(0, self._num_sent - self._info.num_slots), self._num_sent):
            self._wait_acked(i)
        self._store.delete_key(self._key("header"))
        for i in range(self._num_sent):
            for name in ("ready", "acks", "acked"):
                self._store.delete_key(self._key(name, i))

    def close(self) -> None:
        """Drop the slots; rank 0 removes the shm files and stops serving the store."""
        self._slots = []
        if self.rank == 0:
            release_store(self._info.address)
        if self.rank == 0 and not self._cuda:
            for j in range(self._info.num_slots):
                try:
                    os.remove(self._slot_path(j))
                except FileNotFoundError:
                    pass
