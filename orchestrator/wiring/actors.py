"""Starting the actors that training and evaluation both run: inference replicas, the gateway, a
rollout pool under the cluster-wide ACR limits; and the bounded close of each part at the end.

Invariant: every actor started here has its shutdown pushed on the `closing` stack it was given
before the call returns, and each shutdown is bounded by `CLOSE_TIMEOUT_S` (a part that hangs on
the way out cannot hold the run). Callers: orchestrator/wiring/training.py, orchestrator/wiring/eval.py.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from orchestrator.wiring.runtime import Runtime
from orchestrator.config import (RunConfig, acr_client_config, gateway_config, inference_settings, pool_limits,
                                 rollout_settings)
from orchestrator.control.stopping import mark

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from workers.buffer.store import TrajectoryBuffer
    from orchestrator.wiring.placement_groups import PlacedGroups
    from workers.rollout.pool import RolloutPool
    from workers.rollout.settings import RolloutSettings

CLOSE_TIMEOUT_S = 5.0  # bound on each part's own shutdown at the end of a run (seconds)
QUIET_VLLM = {"env_vars": {"VLLM_LOGGING_LEVEL": "ERROR"}}  # a reload warns per step about rotary buffers


def close_quietly(closing: contextlib.AsyncExitStack, fn: Callable[..., Awaitable[Any]], *args: Any,
                  what: str = "") -> None:
    """Push `fn(*args)` on `closing`, bounded by CLOSE_TIMEOUT_S and its errors suppressed."""
    async def close() -> None:  # bounded: a part that hangs on the way out must not hold the run
        with contextlib.suppress(Exception):
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                await fn(*args)
        mark(f"closed {what or fn.__qualname__}")  # the stop timeline (after a signal only)

    closing.push_async_callback(close)


def replica_spawner(cfg: RunConfig, placed: PlacedGroups, model_path: str, version: int,
                    lora_rank: int | None = None) -> Callable[[int], ActorHandle]:
    """`spawn(i)`: inference replica i (a Ray actor, not started yet) on the weights of `model_path`
    (policy `version`), placed by `placed`; also how a dead replica's replacement is made.
    `lora_rank`: the LoRA rank it serves (None: `model.lora.rank`)."""
    import ray

    from workers.inference.worker import InferenceWorker

    inference_cls = ray.remote(num_cpus=0, max_concurrency=1000)(InferenceWorker)
    return lambda i: inference_cls.options(runtime_env=QUIET_VLLM, **placed.inference_options(i)).remote(
        inference_settings(cfg.inference, mode=cfg.mode, async_=cfg.async_, cluster=cfg.cluster, seed=cfg.seed,
                           model_path=model_path, replica=i, initial_policy_version=version,
                           lora_rank=(cfg.model.lora.rank or 0) if lora_rank is None else lora_rank))


def gateway_actor(cfg: RunConfig, model_path: str) -> ActorHandle:
    """The gateway actor (not started yet: its `start` returns the base URL agents call)."""
    import ray

    from workers.gateway.server import GatewayServer

    return ray.remote(num_cpus=0, max_concurrency=1000)(GatewayServer).remote(
        gateway_config(cfg.model, rollout=cfg.rollout, model_path=model_path, net=cfg.gateway,
                       replica_wait_s=cfg.inference.replica_wait_s))


def run_rollout_settings(cfg: RunConfig, rt: Runtime, base_url: str) -> RolloutSettings:
    """The rollout workers' settings of this run, with the gateway at `base_url`."""
    arn = rt.local.agent_runtime_arn if rt.local else cfg.rollout.acr.agent_runtime_arn
    return rollout_settings(cfg.rollout, exp_id=f"exp-{rt.run_dir.name}", agent_runtime_arn=arn,
                            gateway_base_url=base_url, model_id=cfg.model.served_name, seed=cfg.seed)


async def start_pool(cfg: RunConfig, rt: Runtime, settings: RolloutSettings, gateway: ActorHandle | None,
                     buffer: TrajectoryBuffer, closing: contextlib.AsyncExitStack) -> RolloutPool:
    """A rollout pool under the cluster-wide ACR limits (named actors, shared by every pool of the
    attempt: `Runtime.limits_suffix`) that records its sessions in the run's open-session journal
    (workers/acr/journal.py)."""
    from workers.acr.journal import JournalWriter, SessionJournal
    from workers.rollout.pool import start_rollout_pool

    r = cfg.rollout
    journal = JournalWriter(SessionJournal(rt.run_dir), settings.agent_runtime_arn, settings.qualifier,
                            local=rt.local is not None)
    pool = await start_rollout_pool(settings, num_workers=r.num_workers, limits=pool_limits(r),
                                    acr=acr_client_config(r), result_host=r.result_host, gateway=gateway,
                                    buffer_handle=buffer.handle, store=buffer, redispatch_lost=r.redispatch_lost,
                                    journal=journal, limits_suffix=rt.limits_suffix)
    close_quietly(closing, pool.shutdown, what="rollout pool")
    return pool
