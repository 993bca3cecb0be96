"""Build a run's parts from its validated, pre-flighted config: the runtime (model weights, the
local stack, Ray), then the actors and the loop's parts.

`start_runtime` builds the tiny model only when `model.path` is unset and starts the local ACR
emulator + moto S3 only when `rollout=local` (workers/embedded is imported on those branches
only), then starts its own local Ray, or joins the cluster `cluster.address` (or `RAY_ADDRESS`,
set by `ray job submit`) names after checking that something answers there (`ray_address`,
`check_cluster_reachable`: a dead cluster is a config error, not a silent hang; a cluster merely
running on the machine is never joined unasked). `build_parts` places actors, starts the inference
replicas, trainer ranks, gateway, trajectory buffer, weight sync, rollout pool, metric logger and
checkpointer, and returns the loop's parts.

Invariant: everything started here is registered for stopping as soon as it starts: processes
and Ray itself on the caller's ExitStack (by PID / handle), actors' own shutdowns on the returned
AsyncExitStack `closing`; if building fails midway, what was already started is closed before the
error propagates. Callers: orchestrator/main.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

from orchestrator.checkpoint import Checkpoint
from orchestrator.config import (RunConfig, acr_client_config, buffer_config, gateway_config, inference_settings,
                                 rollout_settings, sampler_settings, trainer_class, trainer_settings)
from orchestrator.config import eval_rollout_settings, eval_settings
from orchestrator.config.rollout import local_fault_rates
from orchestrator.loop_common import LoopParts
from orchestrator.metrics import MetricLogger
from orchestrator.preflight import Preflight
from orchestrator.run_checkpoint import LoopPosition
from orchestrator.tasks import TASKS

RAY_PROBE_TIMEOUT_S = 5.0  # bound on reaching a joined cluster's GCS port before ray.init (seconds)
CLOSE_TIMEOUT_S = 5.0  # bound on each part's own shutdown at the end of a run (seconds)
# AWS settings a joined cluster's actors need from the driver (the local stack's endpoints, credentials)
AWS_ENV = ("AWS_ENDPOINT_URL_BEDROCK_AGENTCORE", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID",
           "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_REGION")
QUIET_VLLM = {"env_vars": {"VLLM_LOGGING_LEVEL": "ERROR"}}  # a reload warns per step about rotary buffers


@dataclass(frozen=True)
class Runtime:
    """What runs before any actor: the weights every part starts from, the local stack
    (`rollout=local`, else None) and where the run writes."""

    run_dir: Path
    model_path: str
    checkpoint: Checkpoint | None
    local: Any  # workers.embedded.local_stack.LocalStack | None


@dataclass
class BuiltRun:
    """The loop's parts, where the loop starts, and what must be closed (`closing`, last in first out)."""

    parts: LoopParts
    start: LoopPosition | None
    pool: Any  # workers.rollout.pool.RolloutPool
    logger: MetricLogger
    replicas: list
    closing: contextlib.AsyncExitStack


def agent_command(cfg: RunConfig) -> list[str]:
    """The agent process the local emulator runs: `rollout.acr.agent_cmd`, else the task's app."""
    if cfg.rollout.acr.agent_cmd:
        return shlex.split(cfg.rollout.acr.agent_cmd)
    return [sys.executable, str(TASKS[cfg.task.name].agent)]


def start_runtime(cfg: RunConfig, pre: Preflight, stack: contextlib.ExitStack) -> Runtime:
    """Model weights, the local stack (stopped by `stack`) and Ray (shut down by `stack`)."""
    if cfg.model.path:
        model_path = str(Path(cfg.model.path).resolve())
    else:
        from workers.embedded.tiny_model import ensure_tiny_model

        model_path = str(ensure_tiny_model())
    if pre.checkpoint is not None:  # trainer and inference replicas start from the checkpoint's weights
        model_path = str(pre.checkpoint.model_dir)
    local = _start_local_stack(cfg, pre.run_dir, stack) if cfg.rollout.name == "local" else None
    import ray

    os.environ.setdefault("TQ_LOGGING_LEVEL", "ERROR")  # TQ warns about thread counts on every op
    address = ray_address(cfg)
    joining = address != "local"
    if joining:
        check_cluster_reachable(address, "cluster.address" if cfg.cluster.address else "RAY_ADDRESS")
    ray.init(address=address, num_cpus=cfg.cluster.num_cpus, include_dashboard=False,
             num_gpus=None if joining else cfg.cluster.num_gpus,  # logical GPUs of a cluster we start
             log_to_driver=True, runtime_env={"env_vars": {k: os.environ[k] for k in AWS_ENV if k in os.environ}}
             if joining else None)
    stack.callback(ray.shutdown)
    return Runtime(run_dir=pre.run_dir, model_path=model_path, checkpoint=pre.checkpoint, local=local)


def ray_address(cfg: RunConfig) -> str:
    """The Ray cluster a run uses: `cluster.address`, else `RAY_ADDRESS` (set by `ray job submit`),
    else "local": a cluster of its own, even when another one runs on the machine (`ray start`
    leaves /tmp/ray/ray_current_cluster, which a plain `ray.init()` would join silently, without
    the local stack's endpoints)."""
    return cfg.cluster.address or os.environ.get("RAY_ADDRESS") or "local"


def check_cluster_reachable(address: str, key: str, timeout_s: float = RAY_PROBE_TIMEOUT_S) -> None:
    """Raise ConfigError naming `key` when no Ray cluster answers at `address` ("auto", "host:port"
    or "ray://host:port") within `timeout_s`: ray.init would wait for minutes without a word."""
    import socket

    from orchestrator.config import ConfigError

    target = address.removeprefix("ray://")
    try:
        if target == "auto":
            from ray._private.services import canonicalize_bootstrap_address_or_die

            target = canonicalize_bootstrap_address_or_die("auto")
        host, _, port = target.rpartition(":")
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError) as exc:  # ConnectionError is an OSError
        raise ConfigError(f"{key}: no Ray cluster answers at {address!r} ({exc}); start it (`ray start --head`) "
                          f"or unset {key} to let the run start its own") from None


def _start_local_stack(cfg: RunConfig, run_dir: Path, stack: contextlib.ExitStack) -> Any:
    from workers.embedded.local_stack import LocalStack

    acr = cfg.rollout.acr
    local = LocalStack(agent_command(cfg), num_agents=acr.num_agents, session_rate_per_s=acr.session_rate_per_s,
                       bucket=acr.s3_bucket, region=acr.region, agent_runtime_arn=acr.agent_runtime_arn,
                       log_dir=run_dir / "logs", agent_env={k: str(v) for k, v in acr.agent_env.items()},
                       faults=local_fault_rates(acr))
    stack.enter_context(local)
    started = {**local.pids(), **{f"agent-{i}": pid for i, pid in enumerate(local.stats().agent_pids)}}
    (run_dir / "pids.json").write_text(json.dumps(started, indent=2) + "\n")  # for audits/tests
    os.environ.update(local.env)  # boto3 everywhere (driver, Ray workers) reads these
    return local


async def build_parts(cfg: RunConfig, rt: Runtime, stack: contextlib.ExitStack) -> BuiltRun:
    """Start every actor of the run and return the loop's parts (see the module docstring)."""
    closing = contextlib.AsyncExitStack()
    try:
        return await _build(cfg, rt, stack, closing)
    except BaseException:
        await closing.aclose()
        raise


def _close_quietly(closing: contextlib.AsyncExitStack, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
    async def close() -> None:  # bounded: a part that hangs on the way out must not hold the run
        with contextlib.suppress(Exception):
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                await fn(*args)

    closing.push_async_callback(close)


async def _build(cfg: RunConfig, rt: Runtime, stack: contextlib.ExitStack,
                 closing: contextlib.AsyncExitStack) -> BuiltRun:
    import ray
    from transformers import AutoTokenizer

    from orchestrator.clients import BufferStore, GatewayProbe, TrainerClient
    from orchestrator.metrics import build_sinks
    from orchestrator.batching import RolloutLedger
    from orchestrator.run_checkpoint import ResumablePrompts, RunCheckpointer, trim_after
    from workers.buffer.store import TrajectoryBuffer
    from workers.placement_groups import place
    from workers.trainer.group import start_trainer_ranks
    from workers.weight_sync.setup import FILE_BACKEND, close_weight_sync, open_weight_sync

    ckpt, model_path, run_dir = rt.checkpoint, rt.model_path, rt.run_dir
    version = ckpt.state.policy_version if ckpt else 0
    tok = AutoTokenizer.from_pretrained(model_path)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    trainer_cls, trainer_kw = trainer_class(cfg.trainer, cluster=cfg.cluster)  # trainer=verl: fails here, before any actor, when it cannot run
    placed = place(cfg.cluster)  # GPUs checked and reserved before any actor starts (errors name the numbers)
    stack.callback(placed.remove)
    replicas = _start_replicas(cfg, placed, model_path, version)
    threads = {"env_vars": {"OMP_NUM_THREADS": str(cfg.cluster.torch_threads)}}
    trainer = await start_trainer_ranks(  # one actor, or N data-parallel ranks behind the same .remote surface
        ray.remote(num_cpus=0)(trainer_cls),
        trainer_settings(cfg.trainer, algorithm=cfg.algorithm, inference=cfg.inference, model_path=model_path),
        world_size=len(placed.plan.trainer) if placed.plan.groups else 1,
        rank_options=lambda r: {"runtime_env": threads, **placed.trainer_options(r)}, **trainer_kw)
    gateway = _gateway_actor(cfg, model_path)
    buffer = TrajectoryBuffer.start(buffer_config())
    stack.callback(buffer.stop)

    await asyncio.gather(*(r.start.remote() for r in replicas))
    if ckpt is not None:
        await trainer.load_optimizer.remote(str(ckpt.optimizer_path))
    backend = cfg.trainer.weight_sync.backend  # file, or a bucketed broadcast group formed here
    weights = await open_weight_sync(backend, trainer, replicas,
                                     ranks_per_replica=cfg.cluster.inference.tensor_parallel_size,
                                     initial_version=version)
    _close_quietly(closing, close_weight_sync, weights, trainer)  # the sender's /dev/shm slots, process groups
    _close_quietly(closing, lambda: gateway.stop.remote())
    await gateway.set_engines.remote(replicas)
    base_url = await gateway.start.remote()
    train_settings = _rollout_settings(cfg, rt, base_url)
    pool = _pool(cfg, train_settings, gateway, buffer, closing)

    history = trim_after(run_dir, ckpt.state.step) if ckpt else []  # steps the dead run logged after its checkpoint
    logger = MetricLogger(build_sinks(cfg.logger.sinks, run_dir, cfg.trainer.total_steps, cfg.logger.wandb_project,
                                      cfg.logger.wandb_mode, asdict(cfg)), history)
    closing.callback(logger.close)
    prompts = ResumablePrompts.restore(TASKS[cfg.task.name].rows(cfg.task, "train"), cfg.seed, ckpt.state if ckpt else None,
                                       sampler_settings(cfg.task))
    trainer_client = TrainerClient(trainer, pad_id=pad_id, norm_adv_by_std=cfg.algorithm.norm_adv_by_std,
                                   weights_dir=run_dir / "weights", export_file=backend == FILE_BACKEND)
    ledger = RolloutLedger()
    if ckpt is not None:
        ledger.restore(ckpt.state.counters)  # cumulative counters go on from the checkpoint's
    parts = LoopParts(
        prompts=prompts, rollouts=pool, ledger=ledger, store=BufferStore(buffer, cfg.rollout.n, cfg.rollout.timeout_s),
        trainer=_colocated(cfg, trainer_client, replicas), weights=weights, logger=logger,
        probe=GatewayProbe(gateway, replicas),
        checkpoint=RunCheckpointer(run_dir, trainer, prompts, save_freq=cfg.trainer.save_freq,
                                   keep_last=cfg.trainer.max_ckpt_to_keep, counters=ledger.settled_counts),
        validator=_validator(cfg, train_settings, gateway, buffer, closing))
    return BuiltRun(parts=parts, start=LoopPosition.of(ckpt.state) if ckpt else None, pool=pool, logger=logger,
                    replicas=replicas, closing=closing)


def _start_replicas(cfg: RunConfig, placed: Any, model_path: str, version: int) -> list:
    """The inference replicas (Ray actors, not started yet), placed by `placed`."""
    import ray

    from workers.inference.worker import InferenceWorker

    inference_cls = ray.remote(num_cpus=0, max_concurrency=1000)(InferenceWorker)
    return [inference_cls.options(runtime_env=QUIET_VLLM, **placed.inference_options(i)).remote(
        inference_settings(cfg.inference, mode=cfg.mode, async_=cfg.async_, cluster=cfg.cluster, seed=cfg.seed,
                           model_path=model_path, replica=i, initial_policy_version=version))
        for i in range(cfg.inference.replicas)]


def _gateway_actor(cfg: RunConfig, model_path: str) -> Any:
    import ray

    from workers.gateway.server import GatewayServer

    return ray.remote(num_cpus=0, max_concurrency=1000)(GatewayServer).remote(
        gateway_config(cfg.model, rollout=cfg.rollout, model_path=model_path))


def _rollout_settings(cfg: RunConfig, rt: Runtime, base_url: str) -> Any:
    arn = rt.local.agent_runtime_arn if rt.local else cfg.rollout.acr.agent_runtime_arn
    return rollout_settings(cfg.rollout, exp_id=f"exp-{rt.run_dir.name}", agent_runtime_arn=arn,
                            gateway_base_url=base_url, model_id=cfg.model.served_name)


def _pool(cfg: RunConfig, settings: Any, gateway: Any, buffer: Any, closing: contextlib.AsyncExitStack) -> Any:
    """A rollout pool under the cluster-wide ACR limits (named actors, shared by every pool)."""
    from workers.rollout.pool import start_rollout_pool

    pool = start_rollout_pool(settings, num_workers=cfg.rollout.num_workers, limits=cfg.rollout.acr.limits.typed(),
                              acr=acr_client_config(cfg.rollout), result_host=cfg.rollout.result_host,
                              gateway=gateway, buffer_handle=buffer.handle)
    _close_quietly(closing, pool.shutdown)
    return pool


def _validator(cfg: RunConfig, train_settings: Any, gateway: Any, buffer: Any,
               closing: contextlib.AsyncExitStack) -> Any:
    """Validation during training (`trainer.test_freq`, `trainer.val_before_train`) on its own pool
    with the `eval` group's sampling; None when neither is set."""
    t = cfg.trainer
    if t.test_freq <= 0 and not t.val_before_train:
        return None
    from orchestrator.clients import BufferStore
    from orchestrator.validation import Validator

    pool = _pool(cfg, eval_rollout_settings(cfg.eval, train_settings), gateway, buffer, closing)
    return Validator(pool=pool, store=BufferStore(buffer, cfg.eval.n, cfg.rollout.timeout_s),
                     rows=TASKS[cfg.task.name].rows(cfg.task, cfg.task.val_split), settings=eval_settings(cfg.eval),
                     test_freq=t.test_freq, val_before_train=t.val_before_train, clock=time.monotonic)


@dataclass
class BuiltEval:
    """mode=eval's parts: the evaluation pool and the trajectory buffer it stores into (`store`),
    the replicas (empty without a served model), what must be closed."""

    pool: Any
    store: Any
    replicas: list
    closing: contextlib.AsyncExitStack


async def build_eval(cfg: RunConfig, rt: Runtime, stack: contextlib.ExitStack) -> BuiltEval:
    """mode=eval: inference replicas, gateway, buffer and the evaluation pool, no trainer and no
    weight sync; with `eval.serve_model=false` no replicas and no gateway either."""
    closing = contextlib.AsyncExitStack()
    try:
        from orchestrator.clients import BufferStore
        from workers.buffer.store import TrajectoryBuffer

        replicas: list = []
        gateway, base_url = None, ""
        if cfg.eval.serve_model:
            from workers.placement_groups import place

            placed = place(cfg.cluster)
            stack.callback(placed.remove)
            replicas = _start_replicas(cfg, placed, rt.model_path, rt.checkpoint.state.policy_version
                                       if rt.checkpoint else 0)
            _close_quietly(closing, lambda: asyncio.gather(*(r.shutdown.remote() for r in replicas)))
            gateway = _gateway_actor(cfg, rt.model_path)
            _close_quietly(closing, lambda: gateway.stop.remote())
            await asyncio.gather(*(r.start.remote() for r in replicas))
            await gateway.set_engines.remote(replicas)
            base_url = await gateway.start.remote()
        buffer = TrajectoryBuffer.start(buffer_config())
        stack.callback(buffer.stop)
        pool = _pool(cfg, eval_rollout_settings(cfg.eval, _rollout_settings(cfg, rt, base_url)), gateway, buffer,
                     closing)
        return BuiltEval(pool=pool, store=BufferStore(buffer, cfg.eval.n, cfg.rollout.timeout_s), replicas=replicas,
                         closing=closing)
    except BaseException:
        await closing.aclose()
        raise


def _colocated(cfg: RunConfig, trainer_client: Any, replicas: list) -> Any:
    """cluster=colocated: the engines sleep while the trainer updates on their GPUs (orchestrator/colocate.py)."""
    if cfg.cluster.name != "colocated":
        return trainer_client
    from orchestrator.colocate import SleepingTrainer

    return SleepingTrainer(trainer_client, replicas)
