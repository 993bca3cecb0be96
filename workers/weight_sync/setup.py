"""The run's weight sync, chosen by `trainer.weight_sync.backend`, formed once and closed at the end.

- LoRA with `inference.lora_sync=adapter`: `AdapterWeightSync` (workers/weight_sync/adapter.py),
  the file backend sending the adapter alone as a PEFT directory.
- "file": `FileWeightSync` (workers/weight_sync/file.py). `sync(v)` has the trainer write a
  safetensors file for version v under `weights_dir`, every replica reloads it.
- "shm" | "cuda_ipc" | "gloo" | "nccl": `BroadcastWeightSync` (workers/weight_sync/broadcast.py).
  The trainer writes no file; `sync(v)` makes the trainer's rank 0 broadcast its weights in buckets while every replica receives them
  (`InferenceWorker.receive_weights`, pausing generation only for the swap), and bumps the version
  only after the trainer and every replica confirmed.

All satisfy workers/weight_sync/protocol.py `WeightSync` (`sync(version)`: export and push in one
call; `version`, `lost`, `metrics`), so the loops do not change with the backend; the file backends
are also a `ReplaceableWeightSync` (`admit`). Invariant: the broadcast group is formed here (`open_weight_sync`), before
the first push, at a TCPStore served by the trainer's rank-0 process on a port the OS bound for it
and kept bound (workers/weight_sync/rendezvous.py: no close-and-reuse race);
`close_weight_sync` releases the sender's side (its shared-memory slots: files under /dev/shm).

Trainer and replicas are plain objects or Ray actor handles (detected by `.remote`); Ray itself is
imported only inside the trainer's process, to learn its node's IP.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, Protocol, runtime_checkable

from workers.core import bounds
from workers.core.calls import PartClient, is_actor_method, within
from workers.weight_sync.file import FileWeightSync
from workers.weight_sync.parts import WeightSenderClient
from workers.weight_sync.protocol import WeightSync
from workers.weight_sync.rendezvous import StoreAddress, host_store_in

FILE_BACKEND = "file"
BROADCAST_BACKENDS = ("shm", "cuda_ipc", "gloo", "nccl")
CLOSE_TIMEOUT_S = 30.0


@runtime_checkable
class LeadRunner(Protocol):
    """A trainer of several ranks (workers/trainer/group.py `TrainerGroup`): runs a function inside rank 0."""

    async def run_on_lead(self, fn: Callable[..., Any], *args: Any) -> Any: ...


async def open_weight_sync(backend: str, trainer: Any, replicas: Sequence[Any], *, ranks_per_replica: int = 1,
                           initial_version: int = 0, timeout_s: float = 300.0,
                           weights_dir: Path | None = None, lora_adapter: bool = False,
                           keep_adapters: int = 2) -> WeightSync:
    """The WeightSync for `backend` (see the module docstring), ready to push.

    trainer: the sender (TrainerWorker-like: `open_weight_group`, `broadcast_weights`; one rank).
    replicas: InferenceWorker-like receivers; ranks_per_replica: each replica's tensor-parallel
    size (its workers take consecutive ranks). timeout_s: bound on every wait of the group.
    weights_dir: the file backend's folder of `policy-v{version}.safetensors`.
    lora_adapter: sync only the LoRA adapter (`AdapterWeightSync`, file backend only), keeping
    `keep_adapters` versions' directories on disk.
    Raises ValueError for an unknown backend or an adapter sync on another backend, RuntimeError
    (naming who failed) when the group cannot be formed, e.g. "nccl" / "cuda_ipc" without a CUDA device.
    """
    if lora_adapter:
        if backend != FILE_BACKEND:
            raise ValueError(f"the LoRA adapter sync runs on the {FILE_BACKEND} backend only, got {backend!r} "
                             "(use inference.lora_sync=merged with a broadcast backend)")
        from workers.weight_sync.adapter import AdapterWeightSync

        return AdapterWeightSync(replicas, initial_version=initial_version, trainer=trainer, weights_dir=weights_dir,
                                 keep=keep_adapters)
    if backend == FILE_BACKEND:
        return FileWeightSync(replicas, initial_version=initial_version, trainer=trainer, weights_dir=weights_dir)
    if backend not in BROADCAST_BACKENDS:
        raise ValueError(f"weight sync backend must be {FILE_BACKEND} or one of {BROADCAST_BACKENDS}, got {backend!r}")
    from workers.weight_sync.broadcast import BroadcastWeightSync, new_group_info

    address = await _host_in_sender(trainer)
    info = new_group_info(backend, ranks_per_replica * len(replicas), host=address.host,  # type: ignore[arg-type]
                          port=address.port, timeout_s=timeout_s)
    sync = BroadcastWeightSync([trainer], replicas, info, initial_version=initial_version,
                               ranks_per_receiver=[ranks_per_replica] * len(replicas))
    await sync.connect()
    return sync


async def close_weight_sync(sync: WeightSync, trainer: Any) -> None:
    """Release the broadcast group's sender side (`trainer.close()`: its slots and process groups;
    call at the end of the run). No-op for the file backend."""
    if isinstance(sync, FileWeightSync):
        return
    await asyncio.wait_for(WeightSenderClient(trainer).close(), CLOSE_TIMEOUT_S)


async def _host_in_sender(trainer: Any) -> StoreAddress:
    """Start the group's store in the trainer's (rank 0's) process, on its node's IP and a port
    the OS picked there (`host_store_in`, run in rank 0 by a TrainerGroup's `run_on_lead`, or
    through Ray's `__ray_call__` for an actor); in this process for a plain object."""
    bound = dict(part=PartClient(trainer).name, call="host_store_in")  # collective setup: bounds.WEIGHT_SYNC_S
    if isinstance(trainer, LeadRunner):  # a TrainerGroup
        return await within(bounds.WEIGHT_SYNC_S, trainer.run_on_lead(host_store_in), **bound)
    if is_actor_method(getattr(trainer, "__ray_call__", None)):
        return await within(bounds.WEIGHT_SYNC_S, trainer.__ray_call__.remote(host_store_in), **bound)
    return host_store_in(trainer)
