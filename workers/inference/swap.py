"""How an InferenceWorker swaps its weights: the pause around a load, the broadcast receiver, and
the gate that keeps requests and updates apart in "drain" mode (`WeightsGate`).

`WeightSwap` is a mixin of `InferenceWorker` (workers/inference/worker.py), split out to keep that file
small; it uses the worker's state (`_settings`, `_gate`, `_swap_lock`, the swap counters,
`_version`, `_require_engine`, `_reload`) and adds no state of its own.

Invariant: every weight load, from a file (`update_weights`) or from the trainer's broadcast
(`receive_weights`), runs inside `_swap`, so the in-flight policy (`InferenceSettings.in_flight`:
drain | continue | abort_resume) is the same for both: generation pauses only for the swap, and
the policy version label changes only together with the weights.

Broadcast path (workers/weight_sync/broadcast.py, `BroadcastWeightSync`): `join_weight_group`
once, then per push `receive_weights(version)`, which runs the engine workers'
`receive_weights_broadcast` (workers/inference/vllm_ext.py) inside the swap. A stale version is still
received (and dropped) so that the sender, which waits for every receiver, never hangs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

logger = logging.getLogger("workers.inference.worker")

JOIN_RPC = "join_weight_sync_group"  # workers.inference.vllm_ext.WeightReloadExtension method names
BROADCAST_RPC = "receive_weights_broadcast"
_PAUSE_MODE = {"continue": "keep", "abort_resume": "abort"}  # in_flight -> vLLM PauseMode


class WeightsGate:
    """Admission control that keeps requests and weight updates apart (asyncio, one event loop).

    Invariant: while an update holds the gate, no request is in flight; a waiting update blocks new
    requests (writer preference), so an update waits at most for the requests already running.
    """

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._in_flight = 0
        self._updating = False
        self._updates_waiting = 0

    def num_in_flight(self) -> int:
        return self._in_flight

    def update_pending(self) -> bool:
        """True while an update waits for the gate or holds it."""
        return self._updating or self._updates_waiting > 0

    @asynccontextmanager
    async def request(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self.update_pending())
            self._in_flight += 1
        try:
            yield
        finally:
            async with self._cond:
                self._in_flight -= 1
                self._cond.notify_all()

    @asynccontextmanager
    async def update(self) -> AsyncIterator[None]:
        async with self._cond:
            self._updates_waiting += 1
            try:
                await self._cond.wait_for(lambda: not self._updating and self._in_flight == 0)
            finally:
                self._updates_waiting -= 1
                self._cond.notify_all()
            self._updating = True
        try:
            yield
        finally:
            async with self._cond:
                self._updating = False
                self._cond.notify_all()


class WeightSwap:
    """Mixin: `_swap` (used by `update_weights`), `join_weight_group`, `receive_weights`."""

    async def join_weight_group(self, info: Any, rank: int) -> list[int]:
        """Join the trainer's weight-sync group `info` (a `WeightGroupInfo`): this replica's
        tensor-parallel workers become ranks rank .. rank + tp - 1. Blocks until every rank joined
        (gloo / nccl). Returns the ranks taken. Raises if this replica already joined a group."""
        return list(await self._require_engine().collective_rpc(JOIN_RPC, args=(info, rank)))  # type: ignore[attr-defined]

    async def leave_weight_group(self) -> None:
        """Close this replica's side of the weight-sync group (no-op if it never joined)."""
        await self._require_engine().collective_rpc("leave_weight_sync_group")  # type: ignore[attr-defined]

    async def receive_weights(self, version: int) -> None:
        """Receive the trainer's broadcast push of `version` into the running model and make
        `version` current; requests in flight are handled per `settings.in_flight`, exactly as in
        `update_weights`. A version not newer than the current one is still taken off the wire
        (the sender and the other replicas wait for every receiver), without pausing anything, and
        then refused with ValueError. RuntimeError when the engine reports a failure (the replica
        may hold partly loaded weights: treat it as broken).
        """
        engine = self._require_engine()  # type: ignore[attr-defined]
        if version <= self._version:  # type: ignore[attr-defined]
            await self._receive(engine, version)  # drains the push, then raises ValueError
        await self._swap(version, lambda eng: self._receive(eng, version), "by broadcast")

    async def _receive(self, engine: Any, version: int) -> None:
        current = self._version  # type: ignore[attr-defined]
        try:
            counts = await engine.collective_rpc(BROADCAST_RPC, args=(version, current))
        except Exception as e:  # vLLM re-raises a worker's error as a bare Exception with its message
            if version <= current:
                raise ValueError(f"policy version must increase: current {current}, got {version} "
                                 "(the push was received and dropped)") from e
            raise RuntimeError(f"receiving the weights of version {version} failed: {e}") from e
        if version <= current or not counts or min(counts) <= 0:
            raise RuntimeError(f"broadcast of version {version} (current {current}): {counts} tensors per worker")

    async def _swap(self, version: int, load: Callable[[Any], Awaitable[None]], source: str,
                    check: Callable[[], None] = lambda: None) -> None:
        """Make `version` current. Once the swap holds the engine (drained, or next in line to
        pause it), `check()` may still refuse (nothing is touched yet); then, while nothing is
        scheduled, `load(engine)` loads the weights into every engine worker and `_reload` resets
        the prefix cache and relabels the outputs."""
        engine = self._require_engine()  # type: ignore[attr-defined]
        t0 = time.perf_counter()
        mode = self._settings.in_flight  # type: ignore[attr-defined]
        if mode == "drain":
            async with self._gate.update():  # type: ignore[attr-defined]
                check()
                await self._reload(engine, load, version)  # type: ignore[attr-defined]
        else:
            self._swaps_waiting += 1  # type: ignore[attr-defined]
            try:
                await self._swap_lock.acquire()  # type: ignore[attr-defined]
            finally:
                self._swaps_waiting -= 1  # type: ignore[attr-defined]
            try:
                check()
                self._swaps_begun += 1  # type: ignore[attr-defined]  # before the pause: a request aborted by it must see this
                try:
                    await engine.pause_generation(mode=_PAUSE_MODE[mode], clear_cache=False)
                    try:
                        await self._reload(engine, load, version)  # type: ignore[attr-defined]
                    finally:
                        await engine.resume_generation()
                finally:
                    self._swaps_done += 1  # type: ignore[attr-defined]
            finally:
                self._swap_lock.release()  # type: ignore[attr-defined]
        logger.info("weights v%d loaded %s (%s) in %.2f s", version, source, mode, time.perf_counter() - t0)
