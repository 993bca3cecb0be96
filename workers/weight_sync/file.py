"""The file backend of the weight sync: the trainer writes a safetensors file, every replica reloads it.

Protocol (workers/weight_sync/protocol.py `WeightSync`: any backend, so the loop does not care which one runs):
the loop calls `sync.sync(v)` once; the backend owns export and push:
  1. The trainer materializes the full weights for version v (file: `TrainerWorker.export_weights(
     path)` writes one safetensors file of the fp32 HF state dict under `weights_dir`; broadcast:
     the trainer's rank 0 gathers full tensors bucket by bucket).
  2. They reach every inference replica (file: `push(path, v)`); each replica handles its
     in-flight requests per `inference.in_flight` (drain, continue, abort_resume), loads the weights, resets its prefix cache and sets its policy version
     to v (`InferenceWorker.update_weights`). CPU: every replica reads the file. GPU (later, same
     interface): replicas join an NCCL group with the trainer once, then receive a broadcast per
     bucket into their model (`load_weights` per bucket), with the source naming the trainer.
  3. `sync` returns only when every replica confirmed; then the sync's version becomes v. The
     previous version's file is removed once superseded (the replicas have loaded the new one).

Invariant: versions only increase. `push` raises ValueError for v <= the current version (and a
replica raises too). If any replica fails, `push` raises RuntimeError naming the failed replicas
and the sync's version stays where it was: the replicas may then disagree, and the caller must
treat the run as broken (or push a newer version again), never continue silently.

A replica that DIED (its Ray actor is gone: `workers.core.calls.actor_died`) is not a failed
load: `FileWeightSync` marks it lost, leaves it out of later pushes and confirms the version with
the live ones (possibly none). `admit(i, replica)` puts a replacement in its place under the same
lock as `push`: the newcomer first loads the current version's file, so it never serves older
weights than the others and no push can slip between its load and its entry (the driver's
supervisor, orchestrator/control/supervise.py, calls it; the trainer keeps the newest file).

Replicas are either local objects with `async update_weights(path, version)` or Ray actor handles
of such a class (detected by `.remote`); this module does not import Ray.

The bucketed broadcast path (same protocol, `BroadcastWeightSync`): plan.py (which
tensors go in which bucket), transport.py (shared-memory / CUDA-IPC slots, gloo / NCCL
groups), broadcast.py (sender, receiver stream, the sync), receiver.py
(a receiver into plain tensors) and workers/inference/vllm_ext.py (the receiver inside vLLM). On CPU the file path
stays the run's default: scripts/bench_weight_sync.py measured it at 0.8-1.5 GB/s on a quiet
2-core box (page cache), the shm broadcast at 2-3.3 GB/s; for the tiny default model both take
milliseconds next to vLLM's reload. The run picks one by `trainer.weight_sync.backend` in
workers/weight_sync/setup.py; the replica side of the broadcast is `InferenceWorker.receive_weights`
(workers/inference/swap.py), under the same in-flight policy as `update_weights`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from workers.core.calls import actor_died
from workers.weight_sync.parts import WeightReceiverClient, WeightSenderClient
from workers.weight_sync.protocol import WeightSyncReport


class WeightExporter(Protocol):
    """The trainer as the file backend sees it (TrainerWorker, TrainerGroup, or an actor handle)."""

    async def export_weights(self, path: str) -> str: ...


class WeightReceiver(Protocol):
    """An inference replica as seen by the CPU sync (InferenceWorker satisfies it)."""

    async def update_weights(self, path: str, version: int) -> None: ...


class FileWeightSync:
    """Pushes a safetensors file written by the trainer to every replica; see the module docstring.
    `_load` loads a pushed source into one replica (`update_weights(path, version)`; the LoRA
    adapter sync, workers/weight_sync/adapter.py, pushes directories to `load_adapter`)."""

    def __init__(self, replicas: Sequence[Any], *, initial_version: int = 0, trainer: Any = None,
                 weights_dir: Path | None = None) -> None:
        """replicas: InferenceWorker-like objects or Ray actor handles of them (at least one);
        trainer (a `WeightExporter` or its actor handle) and weights_dir: where `sync` exports
        `policy-v{version}.safetensors` (both needed by `sync`, not by `push`)."""
        if not replicas:
            raise ValueError("FileWeightSync needs at least one inference replica")
        if initial_version < 0:
            raise ValueError(f"initial_version must be >= 0, got {initial_version}")
        self._replicas = list(replicas)
        self._version = initial_version
        self._source: str | None = None  # the file of `_version`; None: the weights the replicas started from
        self._lost: set[int] = set()  # indices of replicas that died, until admit() replaces them
        self._lock: asyncio.Lock | None = None  # push and admit, one at a time (made in the running loop)
        self._trainer, self._weights_dir = trainer, weights_dir

    def version(self) -> int:
        """Version every live replica confirmed last (initial_version before the first push)."""
        return self._version

    def lost(self) -> frozenset[int]:
        """Indices of replicas found dead and not replaced yet."""
        return frozenset(self._lost)

    async def metrics(self) -> dict[str, float]:
        """None of its own: the file backend's figures are the trainer's and the replicas'."""
        return {}

    def _guard(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    def _export_dir(self, version: int) -> Path:
        """The folder `sync(version)` exports into, created. Raises RuntimeError without a trainer
        and weights_dir, ValueError when `version` does not increase."""
        if self._trainer is None or self._weights_dir is None:
            raise RuntimeError(f"{type(self).__name__}.sync needs the trainer and weights_dir it exports with")
        if version <= self._version:
            raise ValueError(f"policy version must increase: current {self._version}, got {version}")
        self._weights_dir.mkdir(parents=True, exist_ok=True)
        return self._weights_dir

    async def sync(self, version: int) -> WeightSyncReport:
        """Export the trainer's weights as `version` into `weights_dir`, push them to every live
        replica, then remove the superseded file. Raises RuntimeError without a trainer and
        weights_dir, and what `push` raises (the new file is kept then, the old one too)."""
        weights_dir = self._export_dir(version)
        path = str(await WeightSenderClient(self._trainer).export_weights(str(weights_dir / f"policy-v{version}.safetensors")))
        previous = self._source
        report = await self.push(path, version)
        if previous is not None and previous != path and Path(previous).parent == self._weights_dir:
            Path(previous).unlink(missing_ok=True)
        return report

    async def push(self, source: str, version: int) -> WeightSyncReport:
        """Make every live replica load the weights file `source` as policy version `version`.

        A replica whose actor died is marked lost (see the module docstring), not an error.
        Raises ValueError if `version` does not increase, RuntimeError (chained to the first error)
        if a live replica failed to load; in both cases the sync's version is unchanged.
        """
        if version <= self._version:
            raise ValueError(f"policy version must increase: current {self._version}, got {version}")
        async with self._guard():
            t0 = time.perf_counter()
            live = [i for i in range(len(self._replicas)) if i not in self._lost]
            results = await asyncio.gather(
                *(self._load(self._replicas[i], source, version) for i in live), return_exceptions=True
            )
            self._lost.update(i for i, r in zip(live, results) if isinstance(r, BaseException) and actor_died(r))
            failed = [(i, r) for i, r in zip(live, results) if isinstance(r, BaseException) and i not in self._lost]
            if failed:
                detail = "; ".join(f"replica {i}: {type(e).__name__}: {e}" for i, e in failed)
                raise RuntimeError(
                    f"weight sync to version {version} failed on {len(failed)}/{len(self._replicas)} "
                    f"replicas ({detail}); replicas may now serve different versions"
                ) from failed[0][1]
            self._version, self._source = version, source
            return WeightSyncReport(version=version, num_replicas=len(self._replicas) - len(self._lost),
                                    elapsed_s=time.perf_counter() - t0)

    async def admit(self, index: int, replica: Any, *, loaded_version: int) -> None:
        """Replace replica `index` by `replica` (started, serving the weights of `loaded_version`):
        it loads the current version's file first when that is newer. Raises IndexError for a bad
        index, RuntimeError when the current weights are not in a file, what the load raised."""
        if not 0 <= index < len(self._replicas):
            raise IndexError(f"replica index {index} out of range (0..{len(self._replicas) - 1})")
        async with self._guard():
            if self._version > loaded_version:
                if self._source is None:
                    raise RuntimeError(f"no weights file of version {self._version} to load into replica {index}")
                await self._load(replica, self._source, self._version)
            self._replicas[index] = replica
            self._lost.discard(index)

    async def _load(self, replica: Any, source: str, version: int) -> None:
        """Make one replica serve the weights file `source` as `version`."""
        await WeightReceiverClient(replica).update_weights(source, version)
