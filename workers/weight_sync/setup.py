"""The run's weight sync, chosen by `trainer.weight_sync.backend`, formed once and closed at the end.

- "file": `CpuWeightSync` (workers/weight_sync/file.py). The trainer writes a safetensors file per
  version (`TrainerClient.export_weights`), every replica reloads it.
- "shm" | "cuda_ipc" | "gloo" | "nccl": `BroadcastWeightSync` (workers/weight_sync/broadcast.py).
  The trainer writes no file (the loop's `export_weights` returns only a label); `push` makes the
  trainer's rank 0 broadcast its weights in buckets while every replica receives them
  (`InferenceWorker.receive_weights`, pausing generation only for the swap), and bumps the version
  only after the trainer and every replica confirmed.

Both satisfy the loop's `WeightPush` protocol (`push(source, version)`), so the loops do not
change with the backend. Invariant: the broadcast group is formed here (`open_weight_sync`), before
the first push, with the rendezvous (TCPStore) on the trainer's node at a port that was free there;
`close_weight_sync` releases the sender's side (its shared-memory slots: files under /dev/shm).

Trainer and replicas are plain objects or Ray actor handles (detected by `.remote`); Ray itself is
imported only inside the trainer's process, to learn its node's IP.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Sequence
from typing import Any

from workers.weight_sync.file import CpuWeightSync, WeightSync

FILE_BACKEND = "file"
BROADCAST_BACKENDS = ("shm", "cuda_ipc", "gloo", "nccl")
CLOSE_TIMEOUT_S = 30.0


def broadcast_label(version: int) -> str:
    """What `TrainerClient.export_weights` returns instead of a file path on a broadcast backend
    (`BroadcastWeightSync.push` takes it as a label only)."""
    return f"broadcast:v{version}"


def sender_address(_actor: Any = None, host: str | None = None) -> tuple[str, int]:
    """(host, port) for the group's rendezvous, computed in the process that will host it: `host`,
    else this node's IP as Ray sees it (inside a Ray worker) or 127.0.0.1; a port free on it now.
    `_actor` lets Ray's `__ray_call__` run it inside the trainer actor."""
    if host is None:
        host = "127.0.0.1"
        try:
            import ray

            if ray.is_initialized():
                host = ray.util.get_node_ip_address()
        except ImportError:
            pass
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return host, s.getsockname()[1]


async def open_weight_sync(backend: str, trainer: Any, replicas: Sequence[Any], *, ranks_per_replica: int = 1,
                           initial_version: int = 0, timeout_s: float = 300.0) -> WeightSync:
    """The WeightSync for `backend` (see the module docstring), ready to push.

    trainer: the sender (TrainerWorker-like: `open_weight_group`, `broadcast_weights`; one rank).
    replicas: InferenceWorker-like receivers; ranks_per_replica: each replica's tensor-parallel
    size (its workers take consecutive ranks). timeout_s: bound on every wait of the group.
    Raises ValueError for an unknown backend, RuntimeError (naming who failed) when the group
    cannot be formed, e.g. "nccl" / "cuda_ipc" without a CUDA device.
    """
    if backend == FILE_BACKEND:
        return CpuWeightSync(replicas, initial_version=initial_version)
    if backend not in BROADCAST_BACKENDS:
        raise ValueError(f"weight sync backend must be {FILE_BACKEND} or one of {BROADCAST_BACKENDS}, got {backend!r}")
    from workers.weight_sync.broadcast import BroadcastWeightSync, new_group_info

    call = getattr(getattr(trainer, "__ray_call__", None), "remote", None)
    host, port = await call(sender_address) if call is not None else sender_address()
    info = new_group_info(backend, ranks_per_replica * len(replicas), host=host, port=port,  # type: ignore[arg-type]
                          timeout_s=timeout_s)
    sync = BroadcastWeightSync([trainer], replicas, info, initial_version=initial_version,
                               ranks_per_receiver=[ranks_per_replica] * len(replicas))
    await sync.connect()
    return sync


async def close_weight_sync(sync: WeightSync, trainer: Any) -> None:
    """Release the broadcast group's sender side (`trainer.close()`: its slots and process groups;
    call at the end of the run). No-op for the file backend."""
    if isinstance(sync, CpuWeightSync):
        return
    method = trainer.close
    remote = getattr(method, "remote", None)
    out = remote() if remote is not None else method()
    if remote is not None or asyncio.iscoroutine(out):
        await asyncio.wait_for(out, CLOSE_TIMEOUT_S)
