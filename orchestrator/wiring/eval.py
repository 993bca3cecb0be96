"""Evaluation wiring (`mode=eval`): inference replicas, gateway, buffer and the evaluation pool;
no trainer and no weight sync. With `eval.serve_model=false` no replicas and no gateway either.

Invariant: as in training, each actor's shutdown is on `closing` as soon as the actor exists, and a
failure midway closes what already started before the error propagates. Callers:
orchestrator/evaluate.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.wiring.actors import close_quietly, gateway_actor, replica_spawner, run_rollout_settings, start_pool
from orchestrator.wiring.runtime import Runtime
from orchestrator.config import RunConfig, buffer_config, eval_rollout_settings
from orchestrator.watch.progress import phase
from workers.gateway.client import GatewayClient
from workers.inference.client import ReplicaClient

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


def adapter_rank(adapter_path: str | None) -> int | None:
    """The rank `r` of the PEFT adapter at `adapter_path` (its adapter_config.json), None without
    one. Raises ValueError naming eval.adapter_path when it is not a PEFT adapter directory."""
    if not adapter_path:
        return None
    config = Path(adapter_path) / "adapter_config.json"
    try:
        return int(json.loads(config.read_text())["r"])
    except (OSError, KeyError, ValueError) as e:
        raise ValueError(f"eval.adapter_path {adapter_path} is not a PEFT LoRA adapter directory ({e})") from e


async def serve_adapter(replicas: list, adapter_path: str, version: int) -> None:
    """Every replica (started with a LoRA rank >= the adapter's, `adapter_rank`) serves the PEFT
    adapter at `adapter_path` as its current policy `version`, so every evaluated request runs on the
    base + that adapter (eval.adapter_path, or the one pre-flight found in a LoRA checkpoint's model
    dir). Raises what a replica's `load_adapter` raises."""
    await asyncio.gather(*(ReplicaClient(r).load_adapter(adapter_path, version, initial=True) for r in replicas))


async def build_eval(cfg: RunConfig, rt: Runtime, stack: contextlib.ExitStack) -> BuiltEval:
    """Start mode=eval's parts (see the module docstring)."""
    closing = contextlib.AsyncExitStack()
    try:
        from orchestrator.adapters.clients import BufferStore
        from workers.buffer.store import TrajectoryBuffer

        replicas: list[ActorHandle] = []
        gateway, base_url = None, ""
        if cfg.eval.serve_model:
            from orchestrator.wiring.placement_groups import place

            phase(f"starting {cfg.inference.replicas} inference replica(s) (vLLM) and the gateway; the engines take "
                  "the longest")

            placed = place(cfg.cluster)
            stack.callback(placed.remove)
            version = rt.checkpoint.state.policy_version if rt.checkpoint else 0
            spawn = replica_spawner(cfg, placed, rt.model_path, version, lora_rank=adapter_rank(cfg.eval.adapter_path))
            replicas = [spawn(i) for i in range(cfg.inference.replicas)]
            engines_up = [asyncio.ensure_future(ReplicaClient(r).start()) for r in replicas]  # the longest: first
            close_quietly(closing, lambda: asyncio.gather(*(ReplicaClient(r).shutdown() for r in replicas)))
            gateway = gateway_actor(cfg, rt.model_path)
            close_quietly(closing, GatewayClient(gateway).stop, what="gateway")
        buffer = await TrajectoryBuffer.start_async(buffer_config())
        stack.callback(buffer.stop)
        if gateway is not None:
            await asyncio.gather(*engines_up)
            if cfg.eval.adapter_path:  # base + adapter
                await serve_adapter(replicas, cfg.eval.adapter_path, version)
            phase("engines ready; starting the gateway and the rollout pool")
            await GatewayClient(gateway).set_engines(replicas)
            base_url = await GatewayClient(gateway).start()
        settings = eval_rollout_settings(cfg.eval, run_rollout_settings(cfg, rt, base_url))
        pool = await start_pool(cfg, rt, settings, gateway, buffer, closing)
        return BuiltEval(pool=pool, store=BufferStore(buffer), replicas=replicas,
                         closing=closing)
    except BaseException:
        await closing.aclose()
        raise
