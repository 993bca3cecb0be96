"""Evaluation wiring (`mode=eval`): inference replicas, gateway, buffer and the evaluation pool;
no trainer and no weight sync. With `eval.serve_model=false` no replicas and no gateway either.

Invariant: as in training, each actor's shutdown is on `closing` as soon as the actor exists, and a
failure midway closes what already started before the error propagates. Callers:
orchestrator/evaluate.py.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from orchestrator.build.actors import close_quietly, gateway_actor, replica_spawner, run_rollout_settings, start_pool
from orchestrator.build.runtime import Runtime
from orchestrator.config import RunConfig, buffer_config, eval_rollout_settings
from orchestrator.watch.progress import phase

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from orchestrator.adapters.clients import BufferStore
    from workers.rollout.pool import RolloutPool


@dataclass
class BuiltEval:
    """mode=eval's parts: the evaluation pool and the trajectory buffer it stores into (`store`),
    the replicas (empty without a served model), what must be closed."""

    pool: RolloutPool
    store: BufferStore
    replicas: list[ActorHandle]
    closing: contextlib.AsyncExitStack


async def build_eval(cfg: RunConfig, rt: Runtime, stack: contextlib.ExitStack) -> BuiltEval:
    """Start mode=eval's parts (see the module docstring)."""
    closing = contextlib.AsyncExitStack()
    try:
        from orchestrator.adapters.clients import BufferStore
        from workers.buffer.store import TrajectoryBuffer

        replicas: list[ActorHandle] = []
        gateway, base_url = None, ""
        if cfg.eval.serve_model:
            from workers.placement_groups import place

            phase(f"starting {cfg.inference.replicas} inference replica(s) (vLLM) and the gateway; the engines take "
                  "the longest")

            placed = place(cfg.cluster)
            stack.callback(placed.remove)
            spawn = replica_spawner(cfg, placed, rt.model_path, rt.checkpoint.state.policy_version
                                    if rt.checkpoint else 0)
            replicas = [spawn(i) for i in range(cfg.inference.replicas)]
            engines_up = [r.start.remote() for r in replicas]  # the longest start: first, the buffer meanwhile
            close_quietly(closing, lambda: asyncio.gather(*(r.shutdown.remote() for r in replicas)))
            gateway = gateway_actor(cfg, rt.model_path)
            close_quietly(closing, lambda: gateway.stop.remote())
        buffer = await TrajectoryBuffer.start_async(buffer_config())
        stack.callback(buffer.stop)
        if gateway is not None:
            await asyncio.gather(*engines_up)
            phase("engines ready; starting the gateway and the rollout pool")
            await gateway.set_engines.remote(replicas)
            base_url = await gateway.start.remote()
        settings = eval_rollout_settings(cfg.eval, run_rollout_settings(cfg, rt, base_url))
        pool = await start_pool(cfg, rt, settings, gateway, buffer, closing)
        return BuiltEval(pool=pool, store=BufferStore(buffer, cfg.eval.n, cfg.rollout.timeout_s), replicas=replicas,
                         closing=closing)
    except BaseException:
        await closing.aclose()
        raise
