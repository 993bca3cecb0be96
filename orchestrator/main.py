"""Hydra entry point: `python -m orchestrator.main key=value ...`.

Validates the config (a bad value exits with status 2 and a message naming the key, before Ray
or any server starts), starts the local ACR emulator + moto S3 when `rollout=local`, starts Ray
and the actors (trainer, inference replicas, gateway, trajectory buffer, rollout pool), runs the
loop, and writes `RUN_DIR/metrics.jsonl` and `RUN_DIR/summary.json`.

Invariant: everything this process starts is stopped on every exit path (normal end, error,
Ctrl-C, SIGTERM), servers by PID and actors through Ray; nothing is stopped by name.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import hydra
from omegaconf import DictConfig, OmegaConf

from orchestrator.config import ConfigError, RunConfig, TaskConfig, register, to_run_config

REPO_ROOT = Path(__file__).resolve().parent.parent
AGENTS_DIR = REPO_ROOT / "examples" / "agents"


@dataclass(frozen=True)
class TaskEntry:
    """A task: its row loader (task config -> dataset rows) and its agent app (run with this Python
    by the local ACR emulator unless `rollout.acr.agent_cmd` names another command)."""

    rows: Callable[[TaskConfig], list[dict]]
    agent: Path


def _letters_rows(t: TaskConfig) -> list[dict]:
    from workers.core.tasks import letters

    return letters.make_rows(t.num_prompts, t.seed)


def _gsm8k_rows(t: TaskConfig) -> list[dict]:
    from workers.core.tasks import gsm8k

    return gsm8k.load_rows(t.data_path, t.num_prompts, t.seed, t.max_turns)


# task.name -> (rows, agent); orchestrator.config.TASK_NAMES lists the same names (a test checks)
TASKS: dict[str, TaskEntry] = {
    "letters": TaskEntry(_letters_rows, AGENTS_DIR / "letters_agent" / "app.py"),
    "gsm8k": TaskEntry(_gsm8k_rows, AGENTS_DIR / "gsm8k_agent" / "app.py"),
}
DEFAULT_AGENT = TASKS["letters"].agent

register()


def _raise_interrupt(signum, frame):  # SIGTERM behaves like Ctrl-C: unwind and clean up
    raise KeyboardInterrupt(f"signal {signum}")


def _agent_cmd(cfg: RunConfig) -> list[str]:
    if cfg.rollout.acr.agent_cmd:
        import shlex

        return shlex.split(cfg.rollout.acr.agent_cmd)
    return [sys.executable, str(TASKS[cfg.task.name].agent)]


def _task_rows(cfg: RunConfig) -> list[dict]:
    return TASKS[cfg.task.name].rows(cfg.task)


def run(cfg: RunConfig) -> dict:
    """Run the whole job described by `cfg`; return the summary (also written to summary.json)."""
    t_start = time.monotonic()
    run_dir = Path(cfg.run_dir).resolve()
    from orchestrator.checkpoint import CheckpointError
    from orchestrator.run_checkpoint import find_resume_checkpoint

    ckpt = find_resume_checkpoint(run_dir, cfg.trainer.resume_mode, cfg.trainer.resume_from_path)
    if ckpt is not None and ckpt.state.step >= cfg.trainer.total_steps:
        raise CheckpointError(f"{ckpt.path} is at step {ckpt.state.step}; trainer.total_steps={cfg.trainer.total_steps} "
                              f"leaves nothing to train (total_steps counts the steps before the resume too)")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"run_dir: cannot create {run_dir}: {exc}") from None
    if ckpt is not None:
        print(f"resuming from {ckpt.path} (step {ckpt.state.step}, policy version {ckpt.state.policy_version})",
              flush=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    resolved = OmegaConf.to_container(OmegaConf.structured(cfg))
    resolved["async"] = resolved.pop("async_")  # the attribute's config key
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(resolved))
    print(f"run_dir: {run_dir}", flush=True)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    with contextlib.ExitStack() as stack:
        from workers.embedded.tiny_model import ensure_tiny_model

        model_path = str(Path(cfg.model.path).resolve()) if cfg.model.path else str(ensure_tiny_model())
        if ckpt is not None:  # trainer and inference replicas start from the checkpoint's weights
            model_path = str(ckpt.model_dir)
        local = None
        if cfg.rollout.name == "local":
            from workers.embedded.local_stack import LocalStack

            local = LocalStack(_agent_cmd(cfg), num_agents=cfg.rollout.acr.num_agents,
                               session_rate_per_s=cfg.rollout.acr.session_rate_per_s,
                               bucket=cfg.rollout.acr.s3_bucket, region=cfg.rollout.acr.region,
                               agent_runtime_arn=cfg.rollout.acr.agent_runtime_arn,
                               log_dir=run_dir / "logs",
                               agent_env={k: str(v) for k, v in cfg.rollout.acr.agent_env.items()})
            stack.enter_context(local)
            started = {**local.pids(), **{f"agent-{i}": pid for i, pid in enumerate(local.stats().agent_pids)}}
            (run_dir / "pids.json").write_text(json.dumps(started, indent=2) + "\n")  # for audits/tests
            os.environ.update(local.env)  # boto3 everywhere (driver, Ray workers) reads these
        import ray

        os.environ.setdefault("TQ_LOGGING_LEVEL", "ERROR")  # TQ warns about thread counts on every op
        joining = bool(cfg.cluster.address or os.environ.get("RAY_ADDRESS"))  # RAY_ADDRESS: under `ray job submit`
        ray.init(address=cfg.cluster.address, num_cpus=cfg.cluster.num_cpus, include_dashboard=False,
                 num_gpus=None if joining else cfg.cluster.num_gpus,  # logical GPUs of a cluster we start
                 log_to_driver=True, runtime_env={"env_vars": {k: os.environ[k] for k in _AWS_ENV if k in os.environ}}
                 if joining else None)
        stack.callback(ray.shutdown)
        signal.signal(signal.SIGTERM, _raise_interrupt)  # ray.init installed its own; ours unwinds cleanly
        summary = asyncio.run(_run_parts(cfg, model_path, run_dir, local, stack, ckpt))
    summary["wall_s"] = time.monotonic() - t_start
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, allow_nan=True) + "\n")
    print(json.dumps(summary, indent=2, allow_nan=True), flush=True)
    print(f"run_dir: {run_dir}", flush=True)
    return summary


_AWS_ENV = ("AWS_ENDPOINT_URL_BEDROCK_AGENTCORE", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_REGION")


async def _run_parts(cfg: RunConfig, model_path: str, run_dir: Path, local, stack: contextlib.ExitStack,
                     ckpt=None) -> dict:
    import ray
    from transformers import AutoTokenizer

    from orchestrator.batching import RolloutLedger
    from orchestrator.loop_sync import SyncLoopParts, SyncLoopSettings, run_sync
    from orchestrator.metrics import MetricLogger, build_sinks, reward_initial_final
    from orchestrator.clients import BufferStore, GatewayProbe, TrainerClient
    from orchestrator.run_checkpoint import LoopPosition, ResumablePrompts, RunCheckpointer
    from workers.buffer.store import BufferConfig, TrajectoryBuffer
    from workers.gateway.config import GatewayConfig
    from workers.gateway.server import GatewayServer
    from workers.inference.worker import InferenceSettings, InferenceWorker
    from workers.rollout.pool import pool_from_config
    from workers.trainer.worker import TrainerSettings
    from workers.weight_sync.setup import FILE_BACKEND, close_weight_sync, open_weight_sync

    tok = AutoTokenizer.from_pretrained(model_path)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    from workers.placement_groups import place

    trainer_cls, trainer_kw = _trainer_class(cfg)  # trainer=verl: fails here, before any actor, when it cannot run
    placed = place(cfg.cluster)  # GPUs checked and reserved before any actor starts (errors name the numbers)
    stack.callback(placed.remove)
    quiet_vllm = {"env_vars": {"VLLM_LOGGING_LEVEL": "ERROR"}}  # a reload warns per step about rotary buffers
    inference_cls = ray.remote(num_cpus=0, max_concurrency=1000)(InferenceWorker)
    replicas = [inference_cls.options(runtime_env=quiet_vllm, **placed.inference_options(i)).remote(InferenceSettings(
        model_path=model_path, dtype=cfg.inference.dtype, max_model_len=cfg.inference.max_model_len,
        kv_cache_bytes=int(cfg.inference.kv_cache_gib * 2**30), max_num_seqs=cfg.inference.max_num_seqs, seed=cfg.seed + i,
        # sync mode never updates weights under a running request; async keeps generating
        in_flight=cfg.async_.in_flight if cfg.mode.name == "async" else "drain",
        resume_aborted=cfg.async_.resume_aborted, tensor_parallel_size=cfg.cluster.inference.tensor_parallel_size,
        enable_sleep_mode=cfg.cluster.name == "colocated",
        initial_policy_version=ckpt.state.policy_version if ckpt else 0))
        for i in range(cfg.inference.replicas)]
    threads = {"env_vars": {"OMP_NUM_THREADS": str(cfg.cluster.torch_threads)}}
    from workers.trainer.group import start_trainer_ranks  # world size > 1: a TrainerGroup of rank actors

    trainer = await start_trainer_ranks(  # one actor, or N data-parallel ranks behind the same .remote surface
        ray.remote(num_cpus=0)(trainer_cls), TrainerSettings(
        model_path=model_path, lr=cfg.trainer.lr, weight_decay=cfg.trainer.weight_decay,
        grad_clip=cfg.trainer.grad_clip, clip_ratio_low=cfg.algorithm.clip_ratio_low,
        clip_ratio_high=cfg.algorithm.clip_ratio_high, rollout_correction=cfg.algorithm.rollout_correction.typed(),
        seed=cfg.trainer.seed, micro_batch_size=cfg.trainer.micro_batch_size,
        max_tokens_per_micro_batch=cfg.trainer.max_tokens_per_micro_batch, mixed_precision=cfg.trainer.mixed_precision,
        activation_checkpointing=cfg.trainer.activation_checkpointing, weight_sync_dtype=cfg.inference.dtype,
        weight_sync_bucket_mb=cfg.trainer.weight_sync.bucket_mb),
        world_size=len(placed.plan.trainer) if placed.plan.groups else 1,
        rank_options=lambda r: {"runtime_env": threads, **placed.trainer_options(r)}, **trainer_kw)
    gateway = ray.remote(num_cpus=0, max_concurrency=1000)(GatewayServer).remote(GatewayConfig(
        model_path=model_path, served_model_name=cfg.model.served_name,
        chat_template=cfg.model.chat_template, tool_call_parser=cfg.model.tool_call_parser,
        max_context_tokens=cfg.rollout.max_context_tokens, max_tokens=cfg.rollout.max_tokens,
        temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p))
    buffer = TrajectoryBuffer.start(BufferConfig(num_storage_units=1))
    stack.callback(buffer.stop)

    await asyncio.gather(*(r.start.remote() for r in replicas))
    if ckpt is not None:
        await trainer.load_optimizer.remote(str(ckpt.optimizer_path))
    ws_backend = cfg.trainer.weight_sync.backend  # file, or a bucketed broadcast group formed here
    weights = await open_weight_sync(ws_backend, trainer, replicas,
                                     ranks_per_replica=cfg.cluster.inference.tensor_parallel_size,
                                     initial_version=ckpt.state.policy_version if ckpt else 0)
    await gateway.set_engines.remote(replicas)
    base_url = await gateway.start.remote()
    pool = pool_from_config(  # also starts the named cluster-wide ACR limit actors
        cfg.rollout, exp_id=f"exp-{run_dir.name}", gateway_base_url=base_url, model_id=cfg.model.served_name,
        agent_runtime_arn=local.agent_runtime_arn if local else cfg.rollout.acr.agent_runtime_arn,
        gateway=gateway, buffer_handle=buffer.handle)

    sinks = build_sinks(cfg.logger.sinks, run_dir, cfg.trainer.total_steps, cfg.logger.wandb_project,
                        cfg.logger.wandb_mode, asdict(cfg))
    logger = MetricLogger(sinks)
    ledger = RolloutLedger()
    prompts = ResumablePrompts.restore(_task_rows(cfg), cfg.seed, ckpt.state if ckpt else None)
    start = LoopPosition.of(ckpt.state) if ckpt else None
    parts = SyncLoopParts(
        prompts=prompts, rollouts=pool,
        store=BufferStore(buffer, cfg.rollout.n, cfg.rollout.timeout_s),
        trainer=_colocated(cfg, TrainerClient(trainer, pad_id=pad_id, norm_adv_by_std=cfg.algorithm.norm_adv_by_std,
                                              weights_dir=run_dir / "weights",
                                              export_file=ws_backend == FILE_BACKEND), replicas),
        weights=weights, logger=logger, ledger=ledger, probe=GatewayProbe(gateway, replicas),
        checkpoint=RunCheckpointer(run_dir, trainer, prompts, save_freq=cfg.trainer.save_freq,
                                   keep_last=cfg.trainer.max_ckpt_to_keep))
    try:
        if cfg.mode.name == "async":
            from orchestrator.loop_async import AsyncLoopSettings, run_async

            report = await run_async(parts, AsyncLoopSettings(
                total_steps=cfg.trainer.total_steps, groups_per_update=cfg.rollout.batch_size // cfg.mode.sync_every,
                n=cfg.rollout.n, sync_every=cfg.mode.sync_every, max_staleness=cfg.async_.max_staleness,
                on_stale=cfg.async_.on_stale, filter_zero_variance=cfg.algorithm.filter_zero_variance), start=start)
        else:
            report = await run_sync(parts, SyncLoopSettings(
                total_steps=cfg.trainer.total_steps, batch_size=cfg.rollout.batch_size, n=cfg.rollout.n,
                sync_every=cfg.mode.sync_every, filter_zero_variance=cfg.algorithm.filter_zero_variance), start=start)
    finally:
        logger.close()
        with contextlib.suppress(Exception):
            await pool.shutdown()
        with contextlib.suppress(Exception):
            await gateway.stop.remote()
        with contextlib.suppress(Exception):
            await close_weight_sync(weights, trainer)  # the sender's /dev/shm slots, process groups
    initial, final = reward_initial_final(logger.rewards)
    counts = report.counts
    acr_stats = await pool.acr_stats()
    pool_counts = await pool.rollout_counts()  # rollout/failed/{reason}, acr/stop_failed
    summary = {
        "steps": report.steps,
        "policy_version": report.policy_version,
        "reward/initial": initial,
        "reward/final": final,
        **{k: counts[k] for k in sorted(counts)},
        # the emulator's own count when local (the server's view), else what the workers left open
        "acr/sessions_open_at_exit": local.stats().sessions_open if local else acr_stats.get("sessions_open", 0),
        "acr/throttled": local.stats().throttled if local else acr_stats.get("throttled", 0),
        "acr/retries": acr_stats.get("retries", 0),
        "acr/requests": acr_stats.get("requests", 0),
        **{k: pool_counts[k] for k in sorted(pool_counts) if k.startswith(("rollout/failed/", "acr/"))},
    }
    with contextlib.suppress(Exception):
        await asyncio.gather(*(r.shutdown.remote() for r in replicas))
    return summary


def _trainer_class(cfg: RunConfig) -> tuple[type, dict]:
    """The trainer actor class for `trainer.name` and its extra constructor kwargs. trainer=verl
    checks here that verl's engine can run (raises RuntimeError naming what is missing)."""
    from workers.trainer.worker import TrainerWorker

    if cfg.trainer.name != "verl":
        return TrainerWorker, {}
    from workers.trainer.verl_worker import VerlSettings, VerlTrainerWorker, check_verl_available

    v = cfg.trainer.verl
    settings = VerlSettings(strategy=v.strategy, use_remove_padding=v.use_remove_padding,  # type: ignore[arg-type]
                            attn_implementation=v.attn_implementation,
                            tensor_model_parallel_size=v.tensor_model_parallel_size,
                            pipeline_model_parallel_size=v.pipeline_model_parallel_size)
    check_verl_available(settings, cuda=cfg.cluster.trainer.gpus_per_node > 0)
    return VerlTrainerWorker, {"verl": settings}


def _colocated(cfg: RunConfig, trainer_client, replicas: list):
    """cluster=colocated: the engines sleep while the trainer updates on their GPUs (orchestrator/colocate.py)."""
    if cfg.cluster.name != "colocated":
        return trainer_client
    from orchestrator.colocate import SleepingTrainer

    return SleepingTrainer(trainer_client, replicas)


@hydra.main(version_base="1.3", config_path="../configs", config_name="config")
def main(dcfg: DictConfig) -> None:
    try:
        cfg = to_run_config(dcfg)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    from orchestrator.checkpoint import CheckpointError
    from workers.core.placement import InsufficientGpusError

    try:
        summary = run(cfg)
        if summary.get("rollout/completed", 0) == 0 and summary.get("rollout/failed", 0) > 0:
            print(f"run failed: no rollout completed ({summary['rollout/failed']} failed; see summary.json and "
                  f"logs/)", file=sys.stderr, flush=True)
            sys.exit(1)
    except CheckpointError as exc:
        print(f"checkpoint error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    except InsufficientGpusError as exc:  # raised before any actor starts
        print(f"config error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted: stopped every process this run started", file=sys.stderr, flush=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
