"""Build a run's parts from its validated, pre-flighted config: the runtime (model weights, the
local stack, Ray), then the actors and the loop's parts.

`start_runtime` builds the tiny model only when `model.path` is unset and starts the local ACR
emulator + moto S3 only when `rollout=local` (workers/embedded is imported on those branches
only), then starts its own local Ray, or joins the cluster `cluster.address` (or `RAY_ADDRESS`,
set by `ray job submit`) names after checking that something answers there (`ray_address`,
`check_cluster_reachable` in orchestrator/ray_cluster.py: a dead cluster is a config error, not a silent hang; a cluster merely
running on the machine is never joined unasked). `build_parts` places actors, starts the inference
replicas, trainer ranks, gateway, trajectory buffer, rollout pool, weight sync, metric logger and
checkpointer, and returns the loop's parts. What does not need a running engine (the trainer, the
gateway's tokenizer, the buffer, the rollout actors) starts while the engines start, the longest
part of a start on a small machine.

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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

from orchestrator.checkpoint import Checkpoint
from orchestrator.config import (RunConfig, acr_client_config, buffer_config, gateway_config, inference_settings,
                                 rollout_settings, sampler_settings, trainer_class, trainer_settings)
from orchestrator.config import ConfigError, eval_rollout_settings, eval_settings
from orchestrator.config.rollout import local_fault_rates
from orchestrator.loop_common import LoopParts
from orchestrator.metrics import MetricLogger
from orchestrator.preflight import Preflight, check_kv_cache
from orchestrator.preflight_aws import forwarded_aws_env
from orchestrator.progress import phase
from orchestrator.ray_cluster import check_cluster_reachable, ray_address
from orchestrator.run_checkpoint import LoopPosition
from orchestrator.stopping import interrupt_from, mark
from orchestrator.tasks import TASKS

CLOSE_TIMEOUT_S = 5.0  # bound on each part's own shutdown at the end of a run (seconds)
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
    watchers: list = field(default_factory=list)  # run beside the loop (orchestrator/supervise.py run_watched)
    trainer_ranks: list = field(default_factory=list)  # rank actors in rank order (to name a dead one)


def agent_command(cfg: RunConfig) -> list[str]:
    """The agent process the local emulator runs: `rollout.acr.agent_cmd`, else the task's app."""
    if cfg.rollout.acr.agent_cmd:
        return shlex.split(cfg.rollout.acr.agent_cmd)
    agent = TASKS[cfg.task.name].agent
    assert agent is not None, "config validation requires rollout.acr.agent_cmd for a task without an agent"
    return [sys.executable, str(agent)]


def start_runtime(cfg: RunConfig, pre: Preflight, stack: contextlib.ExitStack) -> Runtime:
    """Model weights, the local stack (stopped by `stack`) and Ray (shut down by `stack`). Joining a
    cluster, the driver's AWS configuration (every AWS_* variable) goes to the actors in the job's
    runtime_env; without any, they use their node's own credential chain (its instance role)."""
    from orchestrator.console_log import link_ray_logs, ray_init_options

    if cfg.model.path:
        model_path = str(Path(cfg.model.path).resolve())
    else:
        from workers.embedded.qwen3_random import embedded_model_built, ensure_embedded_model

        built = embedded_model_built(cfg.model.name)
        phase(f"model: the {cfg.model.name} model " + ("(cached)" if built else "(built on first use, under a minute; cached after)"))
        model_path = str(ensure_embedded_model(cfg.model.name))  # tiny or qwen3_random, built once
    if pre.checkpoint is not None:  # trainer and inference replicas start from the checkpoint's weights
        model_path = str(pre.checkpoint.model_dir)
    check_kv_cache(cfg, model_path)  # before any engine: names inference.kv_cache_gib and the minimum
    if cfg.rollout.name == "local":
        phase(f"starting the local ACR emulator, moto S3 and {cfg.rollout.acr.num_agents} agent process(es)")
    local = _start_local_stack(cfg, pre.run_dir, stack) if cfg.rollout.name == "local" else None
    phase("starting Ray")
    import ray

    os.environ.setdefault("TQ_LOGGING_LEVEL", "ERROR")  # TQ warns about thread counts on every op
    address = ray_address(cfg)
    joining = address != "local"
    if joining:
        check_cluster_reachable(address, "cluster.address" if cfg.cluster.address else "RAY_ADDRESS")
    stack.callback(mark, "ray shut down")
    stack.callback(ray.shutdown)  # before ray.init: an init interrupted midway still stops what it started
    try:
        ray.init(address=address, num_cpus=cfg.cluster.num_cpus, include_dashboard=False,
                 num_gpus=None if joining else cfg.cluster.num_gpus,  # logical GPUs of a cluster we start
                 runtime_env={"env_vars": forwarded_aws_env(os.environ)} if joining else None,
                 **ray_init_options(cfg.logger.console_level))  # actors' output: RUN_DIR/logs/ray unless loud
    except SystemExit as exc:  # ray.init's own SIGTERM handler (sys.exit(15)) is in place while it runs
        interrupt_from(exc)
    if local is not None:  # on the way out its servers stop while Ray shuts down (ACR sessions are stopped by then)
        stack.callback(local.terminate)
    link_ray_logs(pre.run_dir)
    # build_parts' slow imports (torch, transformers, TransferQueue: seconds) here, where a Ctrl-C stops them at once
    import orchestrator.clients, transfer_queue.controller, transformers  # noqa: F401, E401
    return Runtime(run_dir=pre.run_dir, model_path=model_path, checkpoint=pre.checkpoint, local=local)


def _start_local_stack(cfg: RunConfig, run_dir: Path, stack: contextlib.ExitStack) -> Any:
    from workers.embedded.local_stack import LocalStack, LocalStackError

    acr = cfg.rollout.acr
    local = LocalStack(agent_command(cfg), num_agents=acr.num_agents, session_rate_per_s=acr.session_rate_per_s,
                       bucket=acr.s3_bucket, region=acr.region, agent_runtime_arn=acr.agent_runtime_arn,
                       log_dir=run_dir / "logs", agent_env={k: str(v) for k, v in acr.agent_env.items()},
                       faults=local_fault_rates(acr))
    try:
        stack.enter_context(local)
    except LocalStackError as exc:
        why = agent_start_failure(str(exc), run_dir / "logs" / "emulator.log")
        if why is None:
            raise
        raise ConfigError(f"rollout.acr.agent_cmd {shlex.join(agent_command(cfg))!r}: {why}") from None
    started = {**local.pids(), **{f"agent-{i}": pid for i, pid in enumerate(local.stats().agent_pids)}}
    (run_dir / "pids.json").write_text(json.dumps(started, indent=2) + "\n")  # for audits/tests
    os.environ.update(local.env)  # boto3 everywhere (driver, Ray workers) reads these
    return local


AGENT_OUTPUT_LINES = 20  # of the agent's own output quoted when it does not start


def agent_start_failure(error: str, emulator_log: Path) -> str | None:
    """When the local emulator failed because an agent did not start: what happened and the agent's
    own output (the emulator's log before the emulator's traceback); None for any other failure."""
    text = emulator_log.read_text(errors="replace") if emulator_log.is_file() else ""
    last = next((ln for ln in reversed(text.splitlines()) if ln.startswith("RuntimeError: agent ")), None)
    if last is None or "agent " not in error + text:
        return None
    before = text.rsplit("Traceback (most recent call last):", 1)[0].splitlines()
    ends = [i for i, ln in enumerate(before) if ln.startswith("RuntimeError: ")]  # an earlier run's traceback
    own = [ln for ln in before[ends[-1] + 1 if ends else 0:] if ln.strip()][-AGENT_OUTPUT_LINES:]
    shown = "\n".join(f"  | {ln}" for ln in own) if own else "  (it printed nothing)"
    return (f"the agent did not start ({last.removeprefix('RuntimeError: ')}); its output:\n{shown}\n"
            f"(full log: {emulator_log})")


async def build_parts(cfg: RunConfig, rt: Runtime, stack: contextlib.ExitStack) -> BuiltRun:
    """Start every actor of the run and return the loop's parts (see the module docstring)."""
    closing = contextlib.AsyncExitStack()
    try:
        return await _build(cfg, rt, stack, closing)
    except BaseException:
        await closing.aclose()
        raise


def _close_quietly(closing: contextlib.AsyncExitStack, fn: Callable[..., Awaitable[Any]], *args: Any,
                   what: str = "") -> None:
    async def close() -> None:  # bounded: a part that hangs on the way out must not hold the run
        with contextlib.suppress(Exception):
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                await fn(*args)
        mark(f"closed {what or fn.__qualname__}")  # the stop timeline (after a signal only)

    closing.push_async_callback(close)


async def _build(cfg: RunConfig, rt: Runtime, stack: contextlib.ExitStack,
                 closing: contextlib.AsyncExitStack) -> BuiltRun:
    import ray
    from transformers import AutoTokenizer

    from orchestrator.clients import BufferStore, GatewayProbe, TrainerClient
    from orchestrator.cpu_usage import CpuProbe
    from orchestrator.metrics import build_sinks
    from orchestrator.batching import RolloutLedger
    from orchestrator.run_checkpoint import ResumablePrompts, RunCheckpointer, trim_after
    from orchestrator.supervise import ActorDirectory
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
    phase(f"starting {cfg.inference.replicas} inference replica(s) (vLLM) and the trainer")
    spawn_replica = _replica_spawner(cfg, placed, model_path, version)
    replicas = [spawn_replica(i) for i in range(cfg.inference.replicas)]
    engines_up = [r.start.remote() for r in replicas]  # the longest start (vLLM import, engine build): first
    threads = {"env_vars": {"OMP_NUM_THREADS": str(cfg.cluster.torch_threads)}}
    trainer = await start_trainer_ranks(  # one actor, or N data-parallel ranks behind the same .remote surface
        ray.remote(num_cpus=0)(trainer_cls),
        trainer_settings(cfg.trainer, algorithm=cfg.algorithm, inference=cfg.inference, model_path=model_path,
                         sampling=(cfg.rollout.temperature, cfg.rollout.top_p)),
        world_size=len(placed.plan.trainer) if placed.plan.groups else 1,
        rank_options=lambda r: {"runtime_env": threads, **placed.trainer_options(r)}, **trainer_kw)
    gateway = _gateway_actor(cfg, model_path)
    _close_quietly(closing, lambda: gateway.stop.remote(), what="gateway")
    gateway_up = gateway.start.remote()  # loads the tokenizer and chat template while the engines start
    buffer = await TrajectoryBuffer.start_async(buffer_config())  # awaited: a Ctrl-C meanwhile is seen at once
    stack.callback(buffer.stop)
    train_settings = _rollout_settings(cfg, rt, await gateway_up)
    pool = await _pool(cfg, train_settings, gateway, buffer, closing)  # its actors start while the engines do

    await asyncio.gather(*engines_up, pool.prepare())  # the rollout actors build their clients meanwhile
    phase("engines ready; starting the weight sync")
    if ckpt is not None:
        await trainer.load_optimizer.remote(str(ckpt.optimizer_path))
    backend = cfg.trainer.weight_sync.backend  # file, or a bucketed broadcast group formed here
    weights = await open_weight_sync(backend, trainer, replicas,
                                     ranks_per_replica=cfg.cluster.inference.tensor_parallel_size,
                                     initial_version=version)
    _close_quietly(closing, close_weight_sync, weights, trainer)  # the sender's /dev/shm slots, process groups
    await gateway.set_engines.remote(replicas)  # no turn reaches the gateway before the loop starts

    history = trim_after(run_dir, ckpt.state.step) if ckpt else []  # steps the dead run logged after its checkpoint
    logger = MetricLogger(build_sinks(cfg.logger.sinks, run_dir, cfg.trainer.total_steps, cfg.logger.wandb_project,
                                      cfg.logger.wandb_mode, asdict(cfg)), history)
    closing.callback(logger.close)
    prompts = ResumablePrompts.restore(TASKS[cfg.task.name].rows(cfg.task, "train"), cfg.seed, ckpt.state if ckpt else None,
                                       sampler_settings(cfg.task))
    supervisor = _supervisor(cfg, replicas, spawn_replica, weights, gateway, version)
    watchers = [w for w in (supervisor, _server_watch(rt)) if w is not None]
    ranks = list(getattr(trainer, "ranks", [trainer]))
    directory = ActorDirectory(run_dir / "actors.json", lambda: {
        **{f"inference-{i}": r for i, r in enumerate(replicas)}, **{f"trainer-rank-{i}": r for i, r in enumerate(ranks)},
        "gateway": gateway, **pool.named_actors()})
    await directory.refresh()
    cpu = CpuProbe(lambda: {**directory.pids(), **(rt.local.pids() if rt.local is not None else {})})
    trainer_client = TrainerClient(trainer, pad_id=pad_id, norm_adv_by_std=cfg.algorithm.norm_adv_by_std,
                                   weights_dir=run_dir / "weights", export_file=backend == FILE_BACKEND)
    concurrency = _concurrency(cfg, replicas)  # rollout.concurrency=adaptive, else None
    ledger = RolloutLedger()
    if ckpt is not None:
        ledger.restore(ckpt.state.counters)  # cumulative counters go on from the checkpoint's
    parts = LoopParts(
        prompts=prompts, rollouts=pool, ledger=ledger, store=BufferStore(buffer, cfg.rollout.n, cfg.rollout.timeout_s),
        trainer=_colocated(cfg, trainer_client, replicas), weights=weights, logger=logger,
        probe=_probes(_with_gate(GatewayProbe(gateway, replicas), concurrency), *(w.metrics for w in watchers),
                      lambda: _pool_recovery_metrics(pool), directory.refresh, cpu),
        checkpoint=RunCheckpointer(run_dir, trainer, prompts, save_freq=cfg.trainer.save_freq,
                                   keep_last=cfg.trainer.max_ckpt_to_keep, counters=ledger.settled_counts),
        validator=await _validator(cfg, train_settings, gateway, buffer, closing), concurrency=concurrency)
    return BuiltRun(parts=parts, start=LoopPosition.of(ckpt.state) if ckpt else None, pool=pool, logger=logger,
                    replicas=replicas, closing=closing, watchers=[w.run for w in watchers],
                    trainer_ranks=ranks)


def _replica_spawner(cfg: RunConfig, placed: Any, model_path: str, version: int) -> Callable[[int], Any]:
    """`spawn(i)`: inference replica i (a Ray actor, not started yet) on the weights of `model_path`
    (policy `version`), placed by `placed`; also how a dead replica's replacement is made."""
    import ray

    from workers.inference.worker import InferenceWorker

    inference_cls = ray.remote(num_cpus=0, max_concurrency=1000)(InferenceWorker)
    return lambda i: inference_cls.options(runtime_env=QUIET_VLLM, **placed.inference_options(i)).remote(
        inference_settings(cfg.inference, mode=cfg.mode, async_=cfg.async_, cluster=cfg.cluster, seed=cfg.seed,
                           model_path=model_path, replica=i, initial_policy_version=version))


def _supervisor(cfg: RunConfig, replicas: list, spawn: Callable[[int], Any], weights: Any, gateway: Any,
                version: int) -> Any:
    """The replica supervisor (orchestrator/supervise.py), on the file weight sync only: a broadcast
    group cannot take a new member, so there a dead replica fails the next push and stops the run."""
    from orchestrator.supervise import ReplicaSupervisor
    from workers.weight_sync.file import CpuWeightSync

    if not isinstance(weights, CpuWeightSync) or cfg.cluster.name == "colocated":
        return None
    return ReplicaSupervisor(replicas, spawn=spawn, weights=weights, gateway=gateway, loaded_version=version,
                             max_restarts=cfg.inference.max_restarts, check_every_s=cfg.inference.health_check_s)


def _server_watch(rt: Runtime) -> Any:
    """`rollout=local`: restart a local server that died (orchestrator/supervise.py ServerWatch)."""
    if rt.local is None:
        return None
    from orchestrator.supervise import ServerWatch

    return ServerWatch(rt.local)


def _probes(*probes: Callable[[], Awaitable[dict[str, float]]]) -> Callable[[], Awaitable[dict[str, float]]]:
    async def merged() -> dict[str, float]:
        out: dict[str, float] = {}
        for p in probes:
            out.update(await p())
        return out

    return merged


async def _pool_recovery_metrics(pool: Any) -> dict[str, float]:
    """`rollout/actors_lost`, `rollout/redispatched` of the training pool so far (step metrics)."""
    return {f"rollout/{k}": float(pool.counts[f"rollout/{k}"]) for k in ("actors_lost", "redispatched")}


def _gateway_actor(cfg: RunConfig, model_path: str) -> Any:
    import ray

    from workers.gateway.server import GatewayServer

    return ray.remote(num_cpus=0, max_concurrency=1000)(GatewayServer).remote(
        gateway_config(cfg.model, rollout=cfg.rollout, model_path=model_path, net=cfg.gateway,
                       replica_wait_s=cfg.inference.replica_wait_s))


def _rollout_settings(cfg: RunConfig, rt: Runtime, base_url: str) -> Any:
    arn = rt.local.agent_runtime_arn if rt.local else cfg.rollout.acr.agent_runtime_arn
    return rollout_settings(cfg.rollout, exp_id=f"exp-{rt.run_dir.name}", agent_runtime_arn=arn,
                            gateway_base_url=base_url, model_id=cfg.model.served_name, seed=cfg.seed)


async def _pool(cfg: RunConfig, settings: Any, gateway: Any, buffer: Any, closing: contextlib.AsyncExitStack) -> Any:
    """A rollout pool under the cluster-wide ACR limits (named actors, shared by every pool)."""
    from workers.rollout.pool import start_rollout_pool

    r = cfg.rollout
    pool = await start_rollout_pool(settings, num_workers=r.num_workers, limits=r.acr.limits.typed(),
                                    acr=acr_client_config(r), result_host=r.result_host, gateway=gateway,
                                    buffer_handle=buffer.handle, store=buffer, redispatch_lost=r.redispatch_lost)
    _close_quietly(closing, pool.shutdown, what="rollout pool")
    return pool


async def _validator(cfg: RunConfig, train_settings: Any, gateway: Any, buffer: Any,
                     closing: contextlib.AsyncExitStack) -> Any:
    """Validation during training (`trainer.test_freq`, `trainer.val_before_train`) on its own pool
    with the `eval` group's sampling; None when neither is set."""
    t = cfg.trainer
    if t.test_freq <= 0 and not t.val_before_train:
        return None
    from orchestrator.clients import BufferStore
    from orchestrator.validation import Validator

    pool = await _pool(cfg, eval_rollout_settings(cfg.eval, train_settings), gateway, buffer, closing)
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
            spawn = _replica_spawner(cfg, placed, rt.model_path, rt.checkpoint.state.policy_version
                                     if rt.checkpoint else 0)
            replicas = [spawn(i) for i in range(cfg.inference.replicas)]
            engines_up = [r.start.remote() for r in replicas]  # the longest start: first, the buffer meanwhile
            _close_quietly(closing, lambda: asyncio.gather(*(r.shutdown.remote() for r in replicas)))
            gateway = _gateway_actor(cfg, rt.model_path)
            _close_quietly(closing, lambda: gateway.stop.remote())
        buffer = await TrajectoryBuffer.start_async(buffer_config())
        stack.callback(buffer.stop)
        if gateway is not None:
            await asyncio.gather(*engines_up)
            await gateway.set_engines.remote(replicas)
            base_url = await gateway.start.remote()
        pool = await _pool(cfg, eval_rollout_settings(cfg.eval, _rollout_settings(cfg, rt, base_url)), gateway, buffer,
                     closing)
        return BuiltEval(pool=pool, store=BufferStore(buffer, cfg.eval.n, cfg.rollout.timeout_s), replicas=replicas,
                         closing=closing)
    except BaseException:
        await closing.aclose()
        raise


def _concurrency(cfg: RunConfig, replicas: list) -> Any:
    """`rollout.concurrency=adaptive`: the group limit from the replicas' vLLM stats
    (orchestrator/concurrency.py, the same gate the simulator runs); None when fixed."""
    if cfg.rollout.concurrency != "adaptive":
        return None
    from orchestrator.clients import EngineLoads
    from orchestrator.concurrency import ConcurrencyGate
    from orchestrator.config.rollout import concurrency_policy

    return ConcurrencyGate(concurrency_policy(cfg.rollout), EngineLoads(replicas), clock=time.monotonic)


def _with_gate(probe: Callable[[], Awaitable[dict]], gate: Any) -> Callable[[], Awaitable[dict]]:
    """The per-step probe, plus the adaptive gate's metrics when there is one."""
    if gate is None:
        return probe

    async def both() -> dict:
        return {**gate.metrics(), **await probe()}  # the probe's engine stats are the fresher

    return both


def _colocated(cfg: RunConfig, trainer_client: Any, replicas: list) -> Any:
    """cluster=colocated: the engines sleep while the trainer updates on their GPUs (orchestrator/colocate.py)."""
    if cfg.cluster.name != "colocated":
        return trainer_client
    from orchestrator.colocate import SleepingTrainer

    return SleepingTrainer(trainer_client, replicas)
