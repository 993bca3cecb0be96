"""One simulated run: the product's loop (orchestrator/loop/sync_loop.py or async_loop.py) on the
virtual clock, over simulated engines, agents, trainer and weight push, for `hours` of simulated time.

What runs unchanged: `run_sync` / `run_async` with everything they call (loop/common.py, the
staleness controller and admission gate, batching, filters and the rollout ledger), the prompt
cycle (`ResumablePrompts`), the rollout pool's spreading (`RolloutPool`), colocated sleep/wake
(`SleepingTrainer`), the metric logger, and with `policy=adaptive|aimd` the `ConcurrencyGate` and its
policy (orchestrator/loop/throughput_concurrency.py, the product's). What
is simulated: orchestrator/planning/sim/{engine,agent,parts}.py.

The run stops at the first step that ends after the horizon (`SimHorizon` raised by the step
logger, the way an interrupt stops a real run). Figures exclude the first `warmup_steps` steps.
Invariant: the same `Scenario`, workload and seed give the same figures.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from orchestrator.adapters.colocate import SleepingTrainer
from orchestrator.loop.concurrency import AimdConcurrency, ConcurrencyGate
from orchestrator.loop.throughput_concurrency import ThroughputConcurrency
from orchestrator.loop.slot_steering import RolloutSlotSteering
from orchestrator.loop.async_loop import AsyncLoopSettings, run_async
from orchestrator.loop.common import LoopParts
from orchestrator.loop.staleness import fixed_max_running
from orchestrator.loop.sync_loop import SyncLoopSettings, run_sync
from orchestrator.watch.metrics import JsonlSink, MetricLogger
from orchestrator.control.run_checkpoint import ResumablePrompts
from orchestrator.planning.sim.agent import SimAgents, SimRolloutActor, SimStore
from orchestrator.planning.sim.clock import VirtualLoop
from orchestrator.planning.sim.engine import EngineSpec, SimReplica
from orchestrator.planning.sim.machine import MachineSpec, SharedCpu
from orchestrator.planning.sim.parts import SimProbe, SimReplicaHandle, SimTrainer, SimWeightSync, Timeline, engine_loads
from orchestrator.planning.sim.workload import Workload
from workers.rollout.pool import RolloutPool

NUM_ROLLOUT_ACTORS = 4  # actors the RolloutPool spreads requests over (rollout.num_workers)
NUM_PROMPTS = 4096  # distinct dataset rows of a simulated task
TIMELINE_EVERY_S = 60.0  # simulated seconds between two timeline samples


POLICIES = ("fixed", "adaptive", "aimd")  # rollout.concurrency


class SimHorizon(Exception):
    """The simulated horizon was reached: the run stops after the step it just logged."""


@dataclass(frozen=True)
class Scenario:
    """One configuration to simulate. `trainer_gpus`: disaggregated only (None: half);
    `policy`: rollout.concurrency; η and `on_stale` apply to async mode. `container_slots`
    (rollout.acr.limits.max_open_sessions) and `rollout_slots` (rollout.rollout_slots, the A2A
    contract): the rollout lifecycle's two caps, None: no cap (orchestrator/planning/sim/agent.py)."""

    mode: str = "sync"  # sync | async
    sync_every: int = 1
    colocated: bool = True
    gpus: int = 64
    trainer_gpus: int | None = None
    max_staleness: int = 1
    on_stale: str = "drop"
    policy: str = "fixed"
    kv_target: float = 0.8  # aimd only
    sleeps: bool = True  # colocated engines sleep during updates (False: cluster=local, one CPU machine)
    container_slots: int | None = None
    rollout_slots: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("sync", "async") or self.policy not in POLICIES:
            raise ValueError(f"scenario: mode sync|async and policy {'|'.join(POLICIES)}, got {self.mode}/{self.policy}")
        if self.policy != "fixed" and self.mode != "async":
            raise ValueError(f"rollout.concurrency={self.policy} needs mode=async (the sync loop dispatches whole batches)")
        for key, v in (("container_slots", self.container_slots), ("rollout_slots", self.rollout_slots)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"scenario.{key} must be an integer >= 1 or None (no cap), got {v!r}")
        if None not in (self.container_slots, self.rollout_slots) and self.rollout_slots > self.container_slots:
            raise ValueError(f"scenario.rollout_slots={self.rollout_slots} > container_slots={self.container_slots}: "
                             "a rollout slot is held inside a container slot, so the extra ones could never be used")

    def overrides(self) -> list[str]:
        """The Hydra overrides of `python -m orchestrator.main` for this configuration."""
        out = [f"mode={self.mode}", f"mode.sync_every={self.sync_every}",
               f"cluster={'colocated' if self.colocated else 'disaggregated'}"]
        if self.mode == "async":
            out += [f"async.max_staleness={self.max_staleness}", f"rollout.concurrency={self.policy}"]
        if self.rollout_slots is not None:
            out += ["rollout.contract=a2a", f"rollout.rollout_slots={self.rollout_slots}"]
        if self.container_slots is not None:
            out.append(f"rollout.acr.limits.max_open_sessions={self.container_slots}")
        return out


CONFIGS = {  # the blog's four configurations
    "sync_1": Scenario("sync", 1, True),
    "sync_2": Scenario("sync", 2, True),
    "async_1": Scenario("async", 1, False),
    "async_2": Scenario("async", 2, False),
}


@dataclass
class Layout:
    replicas: int
    inference_gpus: int
    trainer_gpus: int
    groups_per_update: int


class SimulationTooShort(ValueError):
    """The simulated horizon held no step after the warm-up ones (a config error: more hours)."""


def layout(w: Workload, sc: Scenario) -> Layout:
    """GPUs per part and the mini-batch in groups (weak scaling: `batch.prompts_per_mini_batch`
    per `batch.reference_gpus`; or, with `batch.prompts_per_step`, the product's own rule for a
    fixed `rollout.batch_size`: that many groups per weight sync, split into `sync_every`
    mini-batches). Raises ValueError when the split leaves a part without GPUs."""
    gpr = int(w.engine["gpus_per_replica"])
    if sc.colocated:
        inf, trn = sc.gpus, sc.gpus
    else:
        trn = sc.trainer_gpus if sc.trainer_gpus is not None else sc.gpus // 2
        inf = sc.gpus - trn
    if inf < gpr or trn < 1:
        need = (f"colocated needs at least {gpr}" if sc.colocated else
                f"disaggregated: {trn} trainer, {inf} inference; it needs at least {gpr + 1} with the trainer "
                f"on 1 (--trainer-gpus), {2 * gpr} with an even split")
        raise ValueError(f"gpus={sc.gpus} leaves no inference replica of {gpr} GPUs (engine.gpus_per_replica; {need})")
    if "prompts_per_step" in w.batch:  # orchestrator/config/run.py: batch_size // sync_every
        b = max(1, round(w.batch["prompts_per_step"] * sc.gpus / w.batch["reference_gpus"]) // sc.sync_every)
    else:
        b = max(1, round(w.batch["prompts_per_mini_batch"] * sc.gpus / w.batch["reference_gpus"]))
    return Layout(inf // gpr, (inf // gpr) * gpr, trn, b)


def engine_spec(w: Workload) -> EngineSpec:
    e, k = w.engine, w.engine_time_scale
    return EngineSpec(kv_tokens=int(e["kv_tokens_per_replica"]), max_num_seqs=int(e["max_num_seqs"]),
                      step_base_s=e["step_base_s"] * k, step_per_seq_s=e["step_per_seq_s"] * k,
                      prefill_s_per_token=e["prefill_s_per_token"] * k, gpus=int(e["gpus_per_replica"]))


def trainer_tokens_per_s_per_gpu(w: Workload) -> float:
    """`trainer.tokens_per_s_per_gpu`, or with `match_inference_peak: true` the inference engine's
    peak per GPU in trained tokens (a full batch of `max_num_seqs` decoding, times trajectory
    tokens per generated token): "trainer and inference of about equal throughput per GPU"."""
    t = w.trainer
    if not t.get("match_inference_peak"):
        return float(t["tokens_per_s_per_gpu"])
    spec, a = engine_spec(w), w.agent
    n = spec.max_num_seqs
    gen_per_s = n / (spec.step_base_s + spec.step_per_seq_s * n) / spec.gpus
    turns, ag, env = a.turns.mean(), a.agent_tokens_per_turn.mean(), a.env_tokens_per_turn.mean()
    total = a.prompt_tokens.mean() + turns * ag + max(0.0, turns - 1) * env
    return gen_per_s * total / (turns * ag)


@dataclass
class _Recorder:
    """The step logger's sink: keeps the records and stops the run at the horizon."""

    loop: VirtualLoop
    horizon_s: float
    replicas: list
    trainer: SimTrainer
    warmup_steps: int
    agents: SimAgents
    records: list = field(default_factory=list)
    marks: dict = field(default_factory=dict)

    def log(self, step: int, metrics: dict) -> None:
        self.records.append({"step": step, "t_s": self.loop.now, **metrics})
        if step == self.warmup_steps or step == 0:
            self.marks["start"] = self._mark()
        if self.loop.now >= self.horizon_s:
            self.marks["end"] = self._mark()
            raise SimHorizon(step)

    def _mark(self) -> dict:
        for r in self.replicas:
            r.load()
        return {"t_s": self.loop.now, "tokens": self.trainer.trained_tokens, "generated": self.trainer.generated_tokens,
                "samples": self.trainer.trained_samples,
                "busy": sum(r.busy_integral for r in self.replicas), "kv": sum(r.kv_integral for r in self.replicas),
                "awake": sum(r.awake_s for r in self.replicas),
                "preempted": sum(r.preemptions for r in self.replicas), "lifecycle": self.agents.lifecycle_mark(),
                "trainer_busy": self.trainer.busy_s}

    def close(self) -> None:
        pass


def _concurrency(w: Workload, sc: Scenario, lay, loop: VirtualLoop, replicas: list, agents: SimAgents):
    """(dispatch gate, rollout-slot steering) of `sc`, as the product builds them
    (orchestrator/wiring/training.py): with `policy=adaptive` the throughput-seeking policy between
    one mini-batch and the staleness window (η + 1)·k·B, starting where fixed runs ((η + 1)·B), with
    `aimd` the AIMD window, each in a ConcurrencyGate on the replicas' loads; or, with rollout slots,
    the AIMD policy steering the rollout-slot cap instead of dispatch; (None, None) for fixed
    concurrency."""
    if sc.policy == "fixed":
        return None, None
    b = lay.groups_per_update
    if sc.policy == "adaptive" and sc.rollout_slots is None:
        start = fixed_max_running(max_staleness=sc.max_staleness, groups_per_update=b)
        policy = ThroughputConcurrency(min_groups=b, max_groups=(sc.max_staleness + 1) * sc.sync_every * b,
                                       start_groups=start)
    else:
        policy = AimdConcurrency(kv_target=sc.kv_target, min_groups=b)
    gate = ConcurrencyGate(policy, lambda: engine_loads(replicas), clock=loop.time)
    if sc.rollout_slots is None:
        return gate, None
    steering = RolloutSlotSteering(gate.policy, gate.loads, loop.time, stats=agents.rollout_slot_stats,
                                   set_capacity=agents.resize_rollout_slots, n=int(w.batch["n"]),
                                   max_slots=sc.rollout_slots)
    return None, steering


def _rows(w: Workload, seed: int) -> list[dict]:
    """NUM_PROMPTS prompt rows, each with its success probability (Beta(reward_beta)) and, with
    `constant_reward_fraction`, whether every rollout of it scores the same."""
    rng = random.Random(seed + 1)
    a_, b_ = w.agent.reward_beta
    rows = [{"input_id": f"p{i}", "p_success": rng.betavariate(a_, b_)} for i in range(NUM_PROMPTS)]
    if w.agent.constant_reward_fraction is not None:
        crng = random.Random(seed + 2)
        for row in rows:
            row["constant"] = crng.random() < w.agent.constant_reward_fraction
    return rows


def simulate(w: Workload, sc: Scenario, *, hours: float, seed: int = 0, warmup_steps: int = 1,
             out_dir: Path | None = None) -> dict:
    """Simulate `sc` on workload `w` for `hours`; returns the figures (see `_figures`). With
    `out_dir`, writes `metrics.jsonl`, `summary.json` and `timeline.jsonl` there."""
    t_wall, t_cpu = time.perf_counter(), time.process_time()
    lay = layout(w, sc)
    loop = VirtualLoop()
    replicas = [SimReplica(loop, engine_spec(w), i) for i in range(lay.replicas)]
    agents = SimAgents(loop, replicas, w.agent, seed=seed, env_scale=w.env_time_scale,
                       container_slots=sc.container_slots, rollout_slots=sc.rollout_slots)
    cpu = None
    if w.machine is not None:  # one shared CPU machine: every part's CPU work shares its cores
        cpu = SharedCpu(loop, MachineSpec(**{k: float(v) for k, v in w.machine.items()}), replicas)
        agents.cpu = cpu
        for r in replicas:
            r.on_busy_change = cpu.engines_changed
    store = SimStore(cpu.spec.store_rpc_s, cpu.spec.store_sample_s, cpu) if cpu else SimStore()
    pool = RolloutPool([SimRolloutActor(agents, store) for _ in range(NUM_ROLLOUT_ACTORS)])
    alg, ws = w.algorithm, w.weight_sync
    trainer = SimTrainer(agents, gpus=lay.trainer_gpus, tokens_per_s_per_gpu=trainer_tokens_per_s_per_gpu(w),
                         fixed_s=float(w.trainer["fixed_s"]), masked_base=float(alg.get("masked_fraction_base", 0.0)),
                         masked_per_staleness=float(alg.get("masked_fraction_per_staleness", 0.0)), cpu=cpu)
    push = SimWeightSync(replicas, trainer, transfer_s=ws["model_bytes"] / ws["bandwidth_bytes_per_s"], reload_s=ws["reload_s"])
    gate, steering = _concurrency(w, sc, lay, loop, replicas, agents)
    rows = _rows(w, seed)
    recorder = _Recorder(loop, hours * 3600.0, replicas, trainer, warmup_steps, agents)
    sinks: list = [recorder]
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "metrics.jsonl").unlink(missing_ok=True)
        sinks.append(JsonlSink(out_dir / "metrics.jsonl"))
    logger = MetricLogger(sinks)
    loop_trainer = (SleepingTrainer(trainer, [SimReplicaHandle(r, ws["sleep_s"], ws["wake_s"]) for r in replicas],
                                    clock=loop.time) if sc.colocated and sc.sleeps else trainer)
    parts = LoopParts(prompts=ResumablePrompts.restore(rows, seed, None), rollouts=pool, store=store,
                      trainer=loop_trainer, weights=push, logger=logger, clock=loop.time,
                      probe=SimProbe(replicas, gate), concurrency=gate)
    timeline = Timeline(loop, replicas, TIMELINE_EVERY_S)
    big = 10 ** 9
    max_running = None if sc.policy != "fixed" else fixed_max_running(  # what the product runs: config/run.py
        max_staleness=sc.max_staleness, groups_per_update=lay.groups_per_update)
    filt = bool(alg["filter_zero_variance"])
    n = int(w.batch["n"])

    async def main() -> None:
        side = asyncio.ensure_future(steering.run()) if steering is not None else None
        try:
            if sc.mode == "sync":
                await run_sync(parts, SyncLoopSettings(big, lay.groups_per_update * sc.sync_every, n, sc.sync_every,
                                                       filt))
            else:
                await run_async(parts, AsyncLoopSettings(big, lay.groups_per_update, n, sc.sync_every,
                                                         sc.max_staleness, sc.on_stale, filt, drain_timeout_s=0.0,
                                                         max_running_groups=max_running))
        except SimHorizon:
            pass
        finally:
            if side is not None:
                side.cancel()
                await asyncio.gather(side, return_exceptions=True)

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
        logger.close()
    figures = _figures(w, sc, lay, recorder, agents, replicas, hours, loop.events_run)
    figures["wall_s"] = time.perf_counter() - t_wall
    figures["cpu_s"] = time.process_time() - t_cpu  # the wall time on an idle core
    if out_dir:
        (out_dir / "summary.json").write_text(json.dumps(figures, indent=2, allow_nan=True) + "\n")
        with (out_dir / "timeline.jsonl").open("w") as f:
            for row in timeline.rows:
                f.write(json.dumps(row) + "\n")
    return figures


def finished_rollouts(metrics: dict) -> float:
    """Rollouts that reached a terminal state by a step's record (the ledger's cumulative counts)."""
    return sum(metrics.get(f"rollout/{k}", 0.0) for k in ("completed", "filtered", "failed", "expired", "truncated"))


def _hist(records: list[dict], prefix: str) -> dict[int, float]:
    """Samples per staleness k, summed over the step records' `{prefix}{k}` metrics."""
    hist: dict[int, float] = {}
    for r in records:
        for k, v in r.items():
            if k.startswith(prefix):
                hist[int(k[len(prefix):])] = hist.get(int(k[len(prefix):]), 0.0) + v
    return hist


def _figures(w: Workload, sc: Scenario, lay: Layout, rec: _Recorder, agents: SimAgents, replicas: list,
             hours: float, events: int) -> dict:
    a, b = rec.marks.get("start"), rec.marks.get("end")
    if a is None or b is None or b["t_s"] <= a["t_s"]:
        raise SimulationTooShort(f"hours={hours:g}: the simulation ended after {len(rec.records)} step(s); the figures need "
                         f"more than the {rec.warmup_steps} warm-up step(s) left out: simulate more hours")
    dt, awake = b["t_s"] - a["t_s"], b["awake"] - a["awake"]
    steps = [r for r in rec.records if r["step"] > rec.warmup_steps]
    hist, judged = _hist(steps, "staleness/trained_hist/"), _hist(steps, "staleness/hist/")
    total = sum(hist.values())
    masked = [r.get("rollout_corr/rollout_rs_masked_fraction", math.nan) for r in steps]
    last = rec.records[-1]
    first = next((r for r in rec.records if r["step"] == rec.warmup_steps), rec.records[0])
    return {
        "workload": w.name, "scenario": asdict(sc), "overrides": sc.overrides(),
        "replicas": lay.replicas, "inference_gpus": lay.inference_gpus, "trainer_gpus": lay.trainer_gpus,
        "groups_per_update": lay.groups_per_update, "n": int(w.batch["n"]),
        "sim_hours": rec.loop.now / 3600.0, "steps": len(rec.records),
        # trajectory tokens (prompt, tool and generated) trained per minute per GPU: the report's measure
        "tokens_per_min_per_gpu": (b["tokens"] - a["tokens"]) / dt * 60.0 / sc.gpus,
        "generated_tokens_per_min": (b["generated"] - a["generated"]) / dt * 60.0,  # the product's perf/trained_tokens
        "trained_samples_per_min": (b["samples"] - a["samples"]) / dt * 60.0,
        # rollouts that reached a terminal state (trained, filtered, failed or expired): the system's work
        "finished_rollouts_per_min": (finished_rollouts(last) - finished_rollouts(first)) / dt * 60.0,
        "inference_concurrency": (b["busy"] - a["busy"]) / awake if awake > 0 else math.nan,
        "kv_usage_mean": (b["kv"] - a["kv"]) / awake if awake > 0 else math.nan,
        # requests at an engine per replica over the whole time, asleep included (what a metric
        # scraped all run long averages to: the report's figure may be this one for colocated runs)
        "inference_concurrency_wall": (b["busy"] - a["busy"]) / (dt * len(replicas)),
        "awake_fraction": awake / (dt * len(replicas)),
        # the trainer's share of the time spent updating (1: the run is trainer-bound) and its rate
        "trainer_busy_fraction": (b["trainer_busy"] - a["trainer_busy"]) / dt,
        "trainer_tokens_per_min_per_gpu": trainer_tokens_per_s_per_gpu(w) * 60.0,
        "preemptions": b["preempted"] - a["preempted"],
        "staleness_mean": sum(k * v for k, v in hist.items()) / total if total else 0.0,
        "staleness_max": max(hist) if hist else 0,
        "staleness_hist": {str(k): hist[k] for k in sorted(hist)},
        # every judged sample, the ones dropped as too stale included (the loop's staleness/max)
        "staleness_judged_max": max(judged) if judged else 0,
        "staleness_judged_hist": {str(k): judged[k] for k in sorted(judged)},
        "eta": sc.max_staleness if sc.mode == "async" else 0,
        "masked_fraction": sum(masked) / len(masked) if masked else math.nan,
        "step_s_mean": dt / max(1, len(steps)),
        "rollout/dispatched": last.get("rollout/dispatched"), "rollout/expired": last.get("rollout/expired"),
        "rollout/filtered": last.get("rollout/filtered"),
        # share of the dispatched rollouts (each a paid ACR invocation) that expired as too stale
        "expired_fraction": (last.get("rollout/expired") or 0.0) / max(1.0, last.get("rollout/dispatched") or 0.0),
        "episodes": agents.episodes, "turns": agents.turns, "context_capped": agents.context_capped,
        "prefix_cache_hit": sum(r.cached_tokens for r in replicas) / max(1, sum(r.cached_tokens + r.prefill_tokens
                                                                              for r in replicas)),
        "events": events,
        # the rollout lifecycle: requests/min, rollout-slot utilisation and wait, setup p50/p90
        **agents.lifecycle_figures(a["lifecycle"], b["lifecycle"]),
    }
