"""Colocated training (cluster=colocated): the inference engines sleep while the trainer updates.

`SleepingTrainer` wraps the loop's Trainer (orchestrator/loop/sync_loop.py protocol), so neither loop
changes: `update` puts every inference replica to sleep, runs the trainer's update, then wakes
every replica; the weight export and push that follow find the engines awake (a reload needs the
weights resident: vLLM's level-1 sleep keeps them in host memory until `wake_up`). On GPU the
sleep frees the engine's weights and KV cache for the trainer; on vLLM's CPU build there is no
sleep mode, the engines only pause scheduling and nothing is released. Which one happened is
reported, never assumed: `perf/inference_sleep_level` (0 or 1), `perf/inference_released_memory`
(0 or 1), and `perf/inference_sleep_s` (seconds the engines were asleep around this update).

Invariant: when `update` returns or raises, every replica it put to sleep has been woken (a
failed wake raises RuntimeError naming the replicas: the run must stop, never continue with an
engine that does not generate). Replicas are InferenceWorker-like objects or Ray actor handles
of one, called through their one adapter (workers/inference/client.py `ReplicaClient`); this
module does not import Ray. The wrapped trainer is reached only through the loop's `Trainer`
protocol (orchestrator/loop/common.py): `SleepingTrainer` delegates each of its methods
explicitly, and nothing else passes through.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable, Sequence

from orchestrator.loop.common import Trainer
from workers.inference.client import ReplicaClient
from workers.core.types import TrainOrder


class SleepingTrainer:
    """A Trainer whose `update` runs while the co-located inference replicas sleep."""

    def __init__(self, trainer: Trainer, replicas: Sequence[Any], *, clock: Callable[[], float] = time.monotonic) -> None:
        """trainer: the loop's Trainer; replicas: at least one engine (awake again when `update`
        returns, so the weight sync that follows finds them serving)."""
        if not replicas:
            raise ValueError("SleepingTrainer needs at least one inference replica")
        self._trainer = trainer
        self._replicas = [ReplicaClient(r) for r in replicas]
        self._clock = clock

    async def update(self, order: TrainOrder) -> dict[str, float]:
        """Sleep every replica, run `trainer.update(order)`, wake every replica; see the module
        docstring for the metrics added to the trainer's. Raises RuntimeError if a replica fails
        to sleep or to wake (after trying to wake the others)."""
        t0 = self._clock()
        slept = await _each(r.sleep() for r in self._replicas)
        asleep = [r for r, rep in zip(self._replicas, slept) if not isinstance(rep, BaseException)]
        try:
            _raise_failed("sleep", slept)
            metrics = await self._trainer.update(order)
        finally:
            _raise_failed("wake_up", await _each(r.wake_up() for r in asleep))
        reports = [r for r in slept if not isinstance(r, BaseException)]
        return {**metrics,
                "perf/inference_sleep_s": self._clock() - t0,
                "perf/inference_sleep_level": float(max(r.level for r in reports)),
                "perf/inference_released_memory": float(all(r.released_memory for r in reports))}


async def _each(calls: Any) -> list[Any]:
    """Every call's result, or the exception it raised, in order."""
    aws: list[Awaitable[Any]] = list(calls)
    return list(await asyncio.gather(*aws, return_exceptions=True))


def _raise_failed(what: str, results: list[Any]) -> None:
    failed = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
    if failed:
        detail = "; ".join(f"replica {i}: {type(e).__name__}: {e}" for i, e in failed)
        raise RuntimeError(f"colocated inference {what} failed on {len(failed)}/{len(results)} replicas ({detail})") \
            from failed[0][1]
