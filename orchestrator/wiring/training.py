"""Training wiring: start every actor of a training run and hand the loop its parts.

`build_parts` places actors, starts the inference replicas, trainer ranks, gateway, trajectory
buffer, rollout pool, weight sync, metric logger and checkpointer, and returns the loop's parts
(`LoopParts`). What does not need a running engine (the trainer, the gateway's tokenizer, the
buffer, the rollout actors) starts while the engines start, the longest part of a start on a
small machine.

Invariant: every actor started here is registered for stopping as soon as it starts (processes
and placement groups on the caller's ExitStack, actors' own shutdowns on the returned
AsyncExitStack `closing`); if building fails midway, what was already started is closed before
the error propagates. Callers: orchestrator/main.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from orchestrator.wiring.actors import close_quietly, gateway_actor, replica_spawner, run_rollout_settings, start_pool
from orchestrator.wiring.runtime import Runtime
from orchestrator.config import (RunConfig, buffer_config, lora_settings, eval_rollout_settings, eval_settings, sampler_settings,
                                 trainer_class, trainer_settings)
from orchestrator.loop.common import LoopParts, LoopPosition, Trainer
from orchestrator.tasks import TASKS
from orchestrator.watch.metrics import MetricLogger
from orchestrator.watch.progress import phase
from workers.gateway.client import GatewayClient
from workers.inference.client import ReplicaClient

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from orchestrator.adapters.clients import DriverBytes
    from orchestrator.control.supervise import ReplicaSupervisor, ServerWatch
    from orchestrator.loop.concurrency import ConcurrencyGate
    from orchestrator.loop.validation import Validator
    from workers.buffer.store import TrajectoryBuffer
    from workers.rollout.pool import RolloutPool
    from workers.rollout.settings import RolloutSettings
    from workers.weight_sync.protocol import WeightSync

Probe = Callable[[], Awaitable[dict[str, float]]]


@dataclass
class BuiltRun:
    """The loop's parts, where the loop starts, and what must be closed (`closing`, last in first out)."""

    parts: LoopParts
    start: LoopPosition | None
    pool: RolloutPool
    logger: MetricLogger
    replicas: list[ActorHandle]
    closing: contextlib.AsyncExitStack
    watchers: list[Callable[[], Awaitable[None]]] = field(default_factory=list)  # run beside the loop (supervise.run_watched)
    trainer_ranks: list[ActorHandle] = field(default_factory=list)  # rank actors in rank order (to name a dead one)
    acr_totals: Callable[[], Awaitable[dict[str, int]]] | None = None  # the run's acr/*, rollout/failed/* counters, resumed runs included
    actors: Callable[[], list[ActorHandle]] = list  # every actor of this build, replacements included (to discard it)


@dataclass
class _Actors:
    """What `_start_actors` started: the parts the loop's wiring is made of."""

    replicas: list[ActorHandle]
    spawn_replica: Callable[[int], ActorHandle]
    trainer: ActorHandle
    gateway: ActorHandle
    buffer: TrajectoryBuffer
    pool: RolloutPool
    weights: WeightSync
    settings: RolloutSettings
    pad_id: int


async def build_parts(cfg: RunConfig, rt: Runtime, stack: contextlib.ExitStack) -> BuiltRun:
    """Start every actor of the run and return the loop's parts (see the module docstring)."""
    closing = contextlib.AsyncExitStack()
    try:
        actors = await _start_actors(cfg, rt, stack, closing)
        return await _wire(cfg, rt, actors, closing)
    except BaseException:
        await closing.aclose()
        raise


async def _start_actors(cfg: RunConfig, rt: Runtime, stack: contextlib.ExitStack,
                        closing: contextlib.AsyncExitStack) -> _Actors:
    """Placement, engines, trainer ranks, gateway, buffer, rollout pool and the weight sync, each
    started as early as what it waits for allows."""
    import ray
    from transformers import AutoTokenizer

    from workers.buffer.store import TrajectoryBuffer
    from orchestrator.wiring.placement_groups import place
    from workers.trainer.group import start_trainer_ranks
    from workers.weight_sync.lora import directories_kept
    from workers.weight_sync.setup import close_weight_sync, open_weight_sync

    ckpt, model_path = rt.checkpoint, rt.model_path
    version = ckpt.state.policy_version if ckpt else 0
    tok = AutoTokenizer.from_pretrained(model_path)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    trainer_cls, trainer_kw = trainer_class(cfg.trainer, cluster=cfg.cluster)  # trainer=verl: fails here, before any actor, when it cannot run
    placed = place(cfg.cluster)  # GPUs checked and reserved before any actor starts (errors name the numbers)
    stack.callback(placed.remove)
    phase(f"starting {cfg.inference.replicas} inference replica(s) (vLLM) and the trainer")
    spawn_replica = replica_spawner(cfg, placed, model_path, version)
    replicas = [spawn_replica(i) for i in range(cfg.inference.replicas)]
    engines_up = [asyncio.ensure_future(ReplicaClient(r).start()) for r in replicas]  # the longest start: first
    threads = {"env_vars": {"OMP_NUM_THREADS": str(cfg.cluster.torch_threads)}}
    trainer = await start_trainer_ranks(  # a TrainerGroup of one rank actor or N data-parallel ranks
        ray.remote(num_cpus=0)(trainer_cls),
        trainer_settings(cfg.trainer, algorithm=cfg.algorithm, inference=cfg.inference, model_path=model_path,
                         sampling=(cfg.rollout.temperature, cfg.rollout.top_p), lora=lora_settings(cfg.model.lora),
                         lora_adapter_path=_checkpoint_adapter(cfg, rt)),
        world_size=len(placed.plan.trainer) if placed.plan.groups else 1,
        rank_options=lambda r: {"runtime_env": threads, **placed.trainer_options(r)}, **trainer_kw)
    gateway = gateway_actor(cfg, model_path)
    close_quietly(closing, GatewayClient(gateway).stop, what="gateway")
    gateway_up = asyncio.ensure_future(GatewayClient(gateway).start())  # the tokenizer and chat template meanwhile
    buffer = await TrajectoryBuffer.start_async(buffer_config())  # awaited: a Ctrl-C meanwhile is seen at once
    stack.callback(buffer.stop)
    settings = run_rollout_settings(cfg, rt, await gateway_up)
    pool = await start_pool(cfg, rt, settings, gateway, buffer, closing)  # its actors start while the engines do

    await asyncio.gather(*engines_up, pool.prepare())  # the rollout actors build their clients meanwhile
    phase("engines ready; starting the weight sync")
    if ckpt is not None:
        await trainer.load_optimizer(str(ckpt.optimizer_path))
    adapter_sync = cfg.model.lora.enabled and cfg.inference.lora_sync == "adapter"
    weights = await open_weight_sync(cfg.trainer.weight_sync.backend, trainer, replicas,  # file, or a broadcast group
                                     ranks_per_replica=cfg.cluster.inference.tensor_parallel_size,
                                     initial_version=version, weights_dir=rt.run_dir / "weights",
                                     lora_adapter=adapter_sync,
                                     keep_adapters=directories_kept(async_mode=cfg.mode.name == "async",
                                                                    max_staleness=cfg.async_.max_staleness))
    close_quietly(closing, close_weight_sync, weights, trainer)  # the sender's /dev/shm slots, process groups
    await _restore_policy(cfg, rt, weights, version)
    await GatewayClient(gateway).set_engines(replicas)  # no turn reaches the gateway before the loop starts
    return _Actors(replicas, spawn_replica, trainer, gateway, buffer, pool, weights, settings, pad_id)


async def _wire(cfg: RunConfig, rt: Runtime, a: _Actors, closing: contextlib.AsyncExitStack) -> BuiltRun:
    """The loop's parts over the started actors: prompts, ledger, store, trainer, probes, checkpointer."""
    from orchestrator.adapters.clients import BufferStore, DriverBytes, GatewayProbe, MeteredRollouts, TrainerClient
    from orchestrator.control.run_checkpoint import ResumablePrompts, RunCheckpointer, position_of, trim_after
    from orchestrator.control.supervise import ActorDirectory
    from orchestrator.loop.batching import RolloutLedger
    from orchestrator.loop.early_stop import FIRST_ROLLOUTS, FirstRollouts
    from orchestrator.watch.cpu_usage import CpuProbe
    from orchestrator.watch.metrics import build_sinks
    from orchestrator.watch.resources import ResourceProbe
    from orchestrator.watch.slots import SlotProbe
    from workers.core.calls import meter_ray_results
    from workers.core.types import OrderData

    ckpt, run_dir = rt.checkpoint, rt.run_dir
    version = ckpt.state.policy_version if ckpt else 0
    history = trim_after(run_dir, ckpt.state.step) if ckpt else []  # steps the dead run logged after its checkpoint
    logger = MetricLogger(build_sinks(cfg.logger.sinks, run_dir, cfg.trainer.total_steps, cfg.logger.wandb_project,
                                      cfg.logger.wandb_mode, asdict(cfg)), history)
    closing.callback(logger.close)
    prompts = ResumablePrompts.restore(TASKS[cfg.task.name].rows(cfg.task, "train"), cfg.seed, ckpt.state if ckpt else None,
                                       sampler_settings(cfg.task))
    supervisor = _supervisor(cfg, a, version)
    watchers = [w for w in (supervisor, _server_watch(rt)) if w is not None]
    ranks = list(a.trainer.ranks)
    directory = ActorDirectory(run_dir / "actors.json", lambda: {
        **{f"inference-{i}": r for i, r in enumerate(a.replicas)}, **{f"trainer-rank-{i}": r for i, r in enumerate(ranks)},
        "gateway": a.gateway, **a.pool.named_actors()})
    await directory.refresh()
    cpu = CpuProbe(lambda: {**directory.pids(), **(rt.local.pids() if rt.local is not None else {})})
    await a.trainer.open_data(OrderData(a.buffer.handle, a.pad_id, cfg.algorithm.norm_adv_by_std))  # once, not per order
    trainer_client = TrainerClient(a.trainer)
    driver_bytes = DriverBytes()  # all the driver receives per step, metered at its Ray and TransferQueue clients
    meter_ray_results(driver_bytes.ray)
    a.buffer.meter_received(driver_bytes.buffer)
    concurrency = _concurrency(cfg, a.replicas)  # rollout.concurrency=adaptive|aimd, else None
    if concurrency is not None and cfg.rollout.contract == "a2a" and cfg.rollout.rollout_slots:
        watchers.append(_slot_steering(cfg, concurrency, a.pool))  # the window steers rollout slots
        concurrency = None  # dispatch: the staleness budget and the container slots only
    ledger = RolloutLedger()
    weights = _probed(cfg, rt, a)
    if ckpt is not None:
        ledger.restore(ckpt.state.counters)  # cumulative counters go on from the checkpoint's
    acr_totals = _acr_totals(a.pool, ckpt.state.counters if ckpt else {})
    parts = LoopParts(
        prompts=prompts, rollouts=MeteredRollouts(a.pool, driver_bytes), ledger=ledger,
        store=BufferStore(a.buffer),
        trainer=_colocated(cfg, trainer_client, a.replicas), weights=weights, logger=logger,
        probe=_probes(_with_gate(GatewayProbe(a.gateway, a.replicas), concurrency), *(w.metrics for w in watchers),
                      weights.metrics,
                      lambda: _pool_recovery_metrics(a.pool), directory.refresh, cpu, ResourceProbe(a.buffer),
                      SlotProbe(a.pool.slot_stats), driver_bytes),
        checkpoint=RunCheckpointer(run_dir, a.trainer, prompts, save_freq=cfg.trainer.save_freq,
                                   keep_last=cfg.trainer.max_ckpt_to_keep, counters=ledger.settled_counts,
                                   acr_counters=acr_totals),
        validator=await _validator(cfg, rt, a, closing, driver_bytes), concurrency=concurrency,
        first_rollouts=None if ckpt else FirstRollouts(min(FIRST_ROLLOUTS, cfg.samples_per_step), cfg.rollout.contract))
    return BuiltRun(parts=parts, start=position_of(ckpt.state) if ckpt else None, pool=a.pool, logger=logger,
                    replicas=a.replicas, closing=closing, watchers=[w.run for w in watchers], trainer_ranks=ranks,
                    acr_totals=acr_totals, actors=lambda: [*a.replicas, *ranks, a.gateway, *a.pool.named_actors().values()])


def _acr_totals(pool: RolloutPool, restored: dict[str, int]) -> Callable[[], Awaitable[dict[str, int]]]:
    """The run's cumulative `acr/*` and `rollout/failed/{reason}` counters: the checkpoint's
    (`restored`, the processes before a resume, up to their last checkpoint) plus this process's
    (bounded: an actor may be stuck)."""
    carried = {k: int(v) for k, v in restored.items() if k.startswith(("acr/", "rollout/failed/"))}

    async def totals() -> dict[str, int]:
        now: dict[str, int] = {}
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(ACR_STATS_WAIT_S):
                now = await pool.acr_counts()
        return {k: carried.get(k, 0) + now.get(k, 0) for k in sorted({*carried, *now})}

    return totals


def _probed(cfg: RunConfig, rt: Runtime, a: _Actors) -> WeightSync:
    """The run's weight sync with the proof of arrival after every sync
    (workers/weight_sync/probe.py; `trainer.weight_sync.probe`), or as built. Off with
    cluster=colocated (the engines sleep around the update) and trainer=verl (its engine exposes
    no HF model to score the probe with)."""
    from transformers import AutoConfig

    from workers.weight_sync.probe import ProbedWeightSync, probe_tokens

    ws = cfg.trainer.weight_sync
    if not ws.probe or cfg.cluster.name == "colocated" or cfg.trainer.name != "fsdp":
        return a.weights
    atol = ws.probe_atol if ws.probe_atol is not None else (1e-3 if cfg.inference.dtype == "float32" else 5e-2)
    vocab = int(AutoConfig.from_pretrained(rt.model_path).vocab_size)
    return ProbedWeightSync(a.weights, a.trainer, a.replicas, probe_tokens(vocab), atol=atol)


def _checkpoint_adapter(cfg: RunConfig, rt: Runtime) -> str | None:
    """The LoRA adapter directory of the checkpoint a run resumes from (`lora_adapter/` beside the
    base weights, workers/trainer/shell.py `save_hf`), None on a fresh start or without LoRA."""
    from workers.weight_sync.lora import LORA_ADAPTER_DIR

    if not cfg.model.lora.enabled or rt.checkpoint is None:
        return None
    path = Path(rt.model_path) / LORA_ADAPTER_DIR
    return str(path) if path.is_dir() else None


async def _restore_policy(cfg: RunConfig, rt: Runtime, weights: WeightSync, version: int) -> None:
    """A resumed LoRA run's engines start on the checkpoint's base weights: serve its adapter as
    `version` before the loop starts (adapter sync). Raises RuntimeError when a LoRA checkpoint
    has no adapter, or with the merged sync (not supported on resume)."""
    adapter = _checkpoint_adapter(cfg, rt)
    if not cfg.model.lora.enabled or rt.checkpoint is None:
        return
    if adapter is None:
        raise RuntimeError(f"checkpoint {rt.model_path} has no LoRA adapter to resume model.lora from")
    from workers.weight_sync.adapter import AdapterWeightSync

    if not isinstance(weights, AdapterWeightSync):
        raise RuntimeError("resuming model.lora with inference.lora_sync=merged is not supported (the engines would "
                           "start on the base weights); resume with inference.lora_sync=adapter")
    await weights.open_adapter(adapter)


def _supervisor(cfg: RunConfig, a: _Actors, version: int) -> ReplicaSupervisor | None:
    """The replica supervisor (orchestrator/control/supervise.py), on the file weight sync only: a
    broadcast group cannot take a new member, so there a dead replica fails the next push and stops the run."""
    from orchestrator.control.supervise import ReplicaSupervisor
    from workers.weight_sync.protocol import ReplaceableWeightSync

    if not cfg.replica_replaceable:
        return None
    if not isinstance(a.weights, ReplaceableWeightSync):
        raise RuntimeError(f"replica supervision needs a weight sync that admits replacements (the file backends), "
                           f"got {type(a.weights).__name__}")
    return ReplicaSupervisor(a.replicas, spawn=a.spawn_replica, weights=a.weights, gateway=a.gateway,
                             loaded_version=version, max_restarts=cfg.replica_restarts,
                             check_every_s=cfg.inference.health_check_s)


def _server_watch(rt: Runtime) -> ServerWatch | None:
    """`rollout=local`: restart a local server that died (orchestrator/control/supervise.py ServerWatch)."""
    if rt.local is None:
        return None
    from orchestrator.control.supervise import ServerWatch

    return ServerWatch(rt.local)


def _probes(*probes: Probe) -> Probe:
    async def merged() -> dict[str, float]:
        out: dict[str, float] = {}
        for p in probes:
            out.update(await p())
        return out

    return merged


ACR_STATS_WAIT_S = 5.0  # a step's probe waits this long for the actors' ACR counts, then goes without


async def _pool_recovery_metrics(pool: RolloutPool) -> dict[str, float]:
    """`rollout/actors_lost`, `rollout/redispatched` of the training pool so far, and `acr/throttled`
    (ACR requests throttled so far, summed over the actors: the console warns on a step that adds
    some, orchestrator/watch/run_watch.py); step metrics."""
    out = {f"rollout/{k}": float(pool.counts[f"rollout/{k}"]) for k in ("actors_lost", "redispatched")}
    try:  # an actor stuck in a call must not hold the step's record
        async with asyncio.timeout(ACR_STATS_WAIT_S):
            out["acr/throttled"] = float((await pool.acr_stats()).get("throttled", 0))
    except TimeoutError:
        pass
    return out


async def _validator(cfg: RunConfig, rt: Runtime, a: _Actors, closing: contextlib.AsyncExitStack,
                     driver_bytes: DriverBytes) -> Validator | None:
    """Validation during training (`trainer.test_freq`, `trainer.val_before_train`) on its own pool
    with the `eval` group's sampling (its results counted in `driver_bytes`); None when neither is set."""
    t = cfg.trainer
    if t.test_freq <= 0 and not t.val_before_train:
        return None
    from orchestrator.adapters.clients import BufferStore, MeteredRollouts
    from orchestrator.loop.validation import Validator

    pool = await start_pool(cfg, rt, eval_rollout_settings(cfg.eval, a.settings), a.gateway, a.buffer, closing)
    return Validator(pool=MeteredRollouts(pool, driver_bytes), store=BufferStore(a.buffer),
                     rows=TASKS[cfg.task.name].rows(cfg.task, cfg.task.val_split),
                     settings=eval_settings(cfg.eval, step_rollouts=cfg.samples_per_step),
                     test_freq=t.test_freq, val_before_train=t.val_before_train, clock=time.monotonic)


class _Steering:
    """A RolloutSlotSteering as a watcher of the loop: `run` beside it, `metrics` in its probe."""

    def __init__(self, steering: Any) -> None:
        self.run, self.metrics = steering.run, steering.metrics


def _slot_steering(cfg: RunConfig, gate: ConcurrencyGate, pool: RolloutPool) -> _Steering:
    """rollout.concurrency=adaptive with contract=a2a and rollout slots: the adaptive policy sets
    the rollout-slot cap (orchestrator/loop/slot_steering.py) instead of gating dispatch."""
    from orchestrator.loop.slot_steering import RolloutSlotSteering

    async def rollout_stats() -> Any:
        return (await pool.slot_stats())["rollout"]

    return _Steering(RolloutSlotSteering(gate.policy, gate.loads, time.monotonic, stats=rollout_stats,
                                         set_capacity=pool.resize_rollout_slots, n=cfg.rollout.n,
                                         max_slots=cfg.rollout.rollout_slots))


def _concurrency(cfg: RunConfig, replicas: list[ActorHandle]) -> ConcurrencyGate | None:
    """`rollout.concurrency=adaptive|aimd`: the group limit from the replicas' vLLM stats
    (orchestrator/loop/concurrency.py, the same gate the simulator runs), between one mini-batch and
    the staleness window, the adaptive one from the fixed policy's cap; None when fixed. Steering A2A rollout slots takes the AIMD policy (no release counts there)."""
    if cfg.rollout.concurrency == "fixed":
        return None
    from dataclasses import replace

    from orchestrator.adapters.clients import EngineLoads
    from orchestrator.config.rollout import concurrency_policy
    from orchestrator.config.run import fixed_running_groups, staleness_window_groups
    from orchestrator.loop.concurrency import ConcurrencyGate

    r = cfg.rollout
    if r.contract == "a2a" and r.rollout_slots:
        r = replace(r, concurrency="aimd")
    b = r.batch_size // cfg.mode.sync_every if r.concurrency == "adaptive" else 1  # the floor (AIMD's cold start)
    policy = concurrency_policy(r, min_groups=b, max_groups=staleness_window_groups(cfg),
                                start_groups=fixed_running_groups(cfg))
    return ConcurrencyGate(policy, EngineLoads(replicas), clock=time.monotonic)


def _with_gate(probe: Probe, gate: ConcurrencyGate | None) -> Probe:
    """The per-step probe, plus the adaptive gate's metrics when there is one."""
    if gate is None:
        return probe

    async def both() -> dict[str, float]:
        return {**gate.metrics(), **await probe()}  # the probe's engine stats are the fresher

    return both


def _colocated(cfg: RunConfig, trainer_client: Trainer, replicas: list[ActorHandle]) -> Trainer:
    """cluster=colocated: the engines sleep while the trainer updates on their GPUs (orchestrator/adapters/colocate.py)."""
    if cfg.cluster.name != "colocated":
        return trainer_client
    from orchestrator.adapters.colocate import SleepingTrainer

    return SleepingTrainer(trainer_client, replicas)
