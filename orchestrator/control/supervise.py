"""Keep the inference replicas serving while the loop runs, and stop the run when a watcher fails.

`ReplicaSupervisor` asks every replica for its policy version each `inference.health_check_s`
seconds. A replica whose actor died (SIGKILL, OOM, node loss: `workers.core.calls.actor_died`) is
replaced by a new actor started from the run's initial weights (`spawn(i)`), which then loads the
current version's weights file through the weight sync (`FileWeightSync.admit`, under the push
lock, so it serves exactly the version the others serve), and only then is handed to the gateway
(`set_engines`). Meanwhile the gateway retries the dead replica's turns on another replica, or
holds them until the replacement comes (`inference.replica_wait_s`), or fails them `engine_lost`
(workers/gateway/turns.py). Replacements are counted (`inference/restarts`, logged every step);
past `inference.max_restarts` the supervisor raises `ReplicasExhausted`, which stops the run.

To kill a replica from outside (scripts/chaos.py): `run_dir/actors.json` (`ActorDirectory`)
maps `inference-{i}` to its PID; kill it with SIGKILL.

`run_watched(main, watchers)` runs the loop next to such watchers: a watcher that raises cancels
the loop and its error propagates; the loop's end cancels the watchers.

Invariant: a replica is in the gateway's list only once it serves the weight sync's current
version; the replica list given here is replaced in place (the same list the driver shuts down).
Callers: orchestrator/wiring/training.py (wiring), orchestrator/main.py (run_watched).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from workers.core.calls import PartClient, actor_died
from workers.gateway.client import GatewayClient
from workers.inference.client import ReplicaClient
from workers.weight_sync.protocol import ReplaceableWeightSync

log = logging.getLogger(__name__)
T = TypeVar("T")


class ReplicasExhausted(RuntimeError):
    """An inference replica died and `inference.max_restarts` replacements are used up."""


class ReplicaSupervisor:
    """Replaces dead inference replicas (see the module docstring).

    replicas: the run's replica handles (replaced in place); spawn(i): a new, not yet started
    replica for slot i, loaded with the weights of `loaded_version`; weights: the run's weight sync, one that
    admits replacements (workers/weight_sync/protocol.py `ReplaceableWeightSync`: the file backends); gateway: the GatewayServer (`set_engines`); max_restarts: replacements allowed
    over the run; check_every_s: seconds between health checks.
    """

    def __init__(self, replicas: list[Any], *, spawn: Callable[[int], Any], weights: ReplaceableWeightSync, gateway: Any,
                 loaded_version: int, max_restarts: int, check_every_s: float) -> None:
        if max_restarts < 0 or check_every_s <= 0:
            raise ValueError(f"need max_restarts >= 0 and check_every_s > 0, got {max_restarts}, {check_every_s}")
        self._replicas = replicas
        self._spawn = spawn
        self._weights = weights
        self._gateway = gateway
        self._loaded_version = loaded_version
        self._max_restarts = max_restarts
        self._every_s = check_every_s
        self.restarts = 0

    async def run(self) -> None:
        """Check, replace, sleep; forever (cancel to stop). Raises ReplicasExhausted."""
        while True:
            await asyncio.sleep(self._every_s)
            await self.check()

    async def check(self) -> list[int]:
        """Replace every replica found dead now; returns their indices. Raises ReplicasExhausted,
        or what a replica's health call raised other than its death."""
        got = await asyncio.gather(*(ReplicaClient(r).policy_version() for r in self._replicas), return_exceptions=True)
        dead = []
        for i, g in enumerate(got):
            if isinstance(g, BaseException):
                if not actor_died(g):
                    raise g
                dead.append(i)
        for i in dead:
            await self._replace(i)
        return dead

    async def _replace(self, i: int) -> None:
        if self.restarts >= self._max_restarts:
            raise ReplicasExhausted(f"inference replica {i} died and inference.max_restarts={self._max_restarts} "
                                    f"replacements are used up ({self.restarts} done); stopping the run")
        self.restarts += 1
        log.warning("inference replica %d died; starting a replacement (%d/%d)", i, self.restarts, self._max_restarts)
        new = self._spawn(i)
        await ReplicaClient(new).start()
        await self._weights.admit(i, new, loaded_version=self._loaded_version)
        self._replicas[i] = new
        await GatewayClient(self._gateway).set_engines(self._replicas)
        log.warning("inference replica %d replaced; serving policy version %d", i,
                    await ReplicaClient(new).policy_version())

    async def metrics(self) -> dict[str, float]:
        """`inference/restarts`: replacements so far (a step metric)."""
        return {"inference/restarts": float(self.restarts)}


async def run_watched(main: Awaitable[T], watchers: Sequence[Callable[[], Awaitable[None]]]) -> T:
    """Await `main` while the `watchers` run beside it; the first watcher to raise cancels `main`
    and its error propagates. A watcher that returns just stops watching. Everything still
    running is cancelled on the way out."""
    task = asyncio.ensure_future(main)
    side = {asyncio.ensure_future(w()) for w in watchers}
    try:
        while True:
            done, _ = await asyncio.wait({task, *side}, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                return task.result()
            for w in done:
                w.result()  # raises: the finally below cancels the loop
            side -= done
    finally:
        for t in (task, *side):
            t.cancel()
        await asyncio.gather(task, *side, return_exceptions=True)


class ServerWatch:
    """`rollout=local`: a local server (ACR emulator, moto S3) whose process died is started again
    on its port (`LocalStack.restart_exited`), so the run goes on once it is back; rollouts that
    needed it meanwhile fail `acr_unavailable` / `s3_unavailable`. Counted: `local/server_restarts`."""

    def __init__(self, local: Any, *, check_every_s: float = 1.0) -> None:
        self._local = local
        self._every_s = check_every_s
        self.restarts = 0

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._every_s)
            for name in await asyncio.to_thread(self._local.restart_exited):  # blocks while it starts
                self.restarts += 1
                log.warning("local server %s had exited; started again on its port", name)

    async def metrics(self) -> dict[str, float]:
        return {"local/server_restarts": float(self.restarts)}


class ActorDirectory:
    """Keeps `run_dir/actors.json` = {name: pid} of the run's actors (`inference-{i}`,
    `trainer-rank-{r}`, `gateway`, the rollout actors' Ray names), for fault tests and scripts/chaos.py:
    `os.kill(pid, SIGKILL)` kills one. Rewritten (atomically) whenever the set of actors changed:
    `refresh` runs after build and as a step probe, so a replacement shows from the next step."""

    def __init__(self, path: Any, actors: Callable[[], dict[str, Any]]) -> None:
        self._path = path
        self._actors = actors
        self._seen: tuple[int, ...] = ()
        self._pids: dict[str, int] = {}

    def pids(self) -> dict[str, int]:
        """Name -> PID of the actors as last written (orchestrator/watch/cpu_usage.py reads it)."""
        return dict(self._pids)

    async def refresh(self) -> dict[str, float]:
        """Rewrite the file if the actors changed; returns no metrics (a probe)."""
        import json
        import os

        named = self._actors()
        key = tuple(id(h) for h in named.values())
        if key == self._seen:
            return {}
        pids = await asyncio.gather(*(PartClient(h).pid() for h in named.values()), return_exceptions=True)
        self._pids = {n: p for n, p in zip(named, pids) if isinstance(p, int)}
        tmp = self._path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self._pids, indent=2) + "\n")
        os.replace(tmp, self._path)
        self._seen = key
        return {}


class TrainerLost(RuntimeError):
    """A trainer rank died and the run stopped; the message names the rank and the checkpoint
    `trainer.resume_mode=auto` continues from."""


PING_TIMEOUT_S = 5.0  # a live rank answers a no-op call within this (s); one busy in a collective may not


async def explain_trainer_loss(exc: BaseException, ranks: Sequence[Any], run_dir: Any) -> TrainerLost | None:
    """The run's error when `exc` came from a dead trainer rank, else None (`exc` stands).

    `exc` is a TrainerRankLost (a TrainerGroup names the rank), or any dead-actor error, in which
    case each rank gets a no-op call and the first whose call fails with its death is named
    (ranks that do not answer within PING_TIMEOUT_S count as alive). ranks: the rank actor
    handles in rank order; run_dir: where `checkpoints/latest` names the last checkpoint.
    """
    rank = getattr(exc, "rank", None) if type(exc).__name__ == "TrainerRankLost" else None
    if rank is None and actor_died(exc):
        rank = await _dead_rank(ranks)
    if rank is None:
        return None
    from orchestrator.control.checkpoint import CheckpointError, latest_checkpoint_dir

    try:
        last = latest_checkpoint_dir(run_dir)
    except CheckpointError:  # a pointer that names nothing: no checkpoint to continue from
        last = None
    resume = (f"last checkpoint: {last}; rerun with trainer.resume_mode=auto (same run_dir) to continue from it"
              if last else "no checkpoint was written yet (trainer.save_freq); a rerun starts from step 0")
    return TrainerLost(f"trainer rank {rank} of {len(ranks)} died ({type(exc).__name__}); the run stopped; {resume}")


async def _dead_rank(ranks: Sequence[Any]) -> int | None:
    pings = [asyncio.ensure_future(PartClient(r).ping()) for r in ranks]
    try:
        await asyncio.wait(pings, timeout=PING_TIMEOUT_S)
        for i, p in enumerate(pings):
            if p.done() and not p.cancelled() and p.exception() is not None and actor_died(p.exception()):
                return i
        return None
    finally:
        for p in pings:
            p.cancel()
