"""Fit a simulator workload (orchestrator/planning/sim/workload.py) from a real run's directory.

    python scripts/workload_from_run.py RUN_DIR [--out workload.yaml] [--prompt-tokens N]

Reads `config.yaml` (batch, group size, sync_every, ACR session rate, filtering), `metrics.jsonl`
(per step: rollouts, gateway turns, generated tokens, timings, latency p50/max, inference
concurrency) and the ACR task records (`logs/emulator.log`, when the run used the emulator).
Best fitted from a sync run: its phases do not overlap, so each time below is seen alone, and it
leaves cores idle, so the environment's time shows in its step time. A run that kept every core
busy does not determine the environment (its calibration stops at a bound, and the fit warns). What it
fits, and from what (the first `--warmup-steps` steps, engine warm-up, are skipped):

- turns per rollout: gateway turns served / rollouts dispatched (a constant);
- agent tokens per turn: trained (loss-mask) tokens / trained samples / turns, drawn uniform on
  [g, g + 1) so that whole tokens average g;
- engine step time: Little's law at the gateway (concurrency × generation time / turns = seconds a
  turn spends at the gateway), divided by its tokens; per-sequence growth set to 1/16 of it
  (a batch of 16 doubles a CPU step, assumed, not fitted);
- a constant time per rollout: with a CPU record, the rollout's own CPU work (below); without one
  (one-turn agents): the rollout latency p50 less the agent's task time p50 (ACR's invoke and
  result pickup), plus the agent's own time outside its model call (its 5 % fastest tasks less
  their gateway time);
- environment time: a log-normal whose median is the latency p50 less the engine and constant
  times, and whose shape puts a step's slowest rollout (mean over steps) at the expected maximum
  of its n rollouts (Blom's z); before the model call for one-turn agents, between turns else;
- trainer: update seconds = fixed + per-token slope (least squares over updates; all fixed
  when the slope is not significant);
- weight sync: its mean seconds (model_bytes / bandwidth gives exactly that);
- filtering: the share of zero-variance groups (`agent.constant_reward_fraction`), as measured;
- the machine (`machine:`, orchestrator/planning/sim/machine.py: every part's CPU work shares the cores),
  from the run's CPU record (`perf/cpu_s/<part>`, orchestrator/watch/cpu_usage.py):
  - `cores`: `cluster.num_cpus`, else this machine's (given);
  - `rollout_start_cpu_s` + `agent.overhead_s` (the rollout's own CPU work when it starts and after
    its last turn): the CPU seconds of every part but the trainer (driver, engines, gateway,
    rollout actors, emulator + agents + moto, Ray's own) per rollout dispatched, background
    included (`background_cores: 0`; `fit_cpu` says why it is not split off); the engines' CPU is
    counted in the rollouts' work (`engine_cores: 0`; the engines still slow down when the cores
    are short); half of the work at the start, half at the end (`START_SHARE`, assumed: the split
    is not in the record);
  - `trainer_cores`: the trainer's CPU seconds over its update and weight-sync seconds (fitted);
  - the sample store's calls: a sync step's time outside generation, update and weight sync (one
    `clear`) and its generation after its slowest rollout, per sample (one read) (fitted);
  - then the engine's and the environment's scales (`calibration.machine_fit`): the rollouts'
    latency and their time at the gateway hold time spent waiting for the cores, which the
    simulator adds by itself, so the fitted engine and environment times are scaled until
    simulating the run's own configuration gives its mean step time and its inference
    concurrency (orchestrator/planning/sim/calibrate.py `calibrate_fitted`; written into the engine's step
    times and the environment's distribution);
  - without a CPU record (older runs): the engine taken to keep every core busy while it decodes
    (assumed), the constant part of a rollout a delay after its last turn, no calibration.

- prompt tokens per sample: every token of the trained samples (`perf/total_num_tokens`) less
  their generated tokens (a multi-turn agent's environment tokens count as prompt); a run that did
  not log it needs `--prompt-tokens`.

Not in a run's files, so given as a flag: KV capacity (`--kv-tokens`; the tiny model never binds it). `batch.prompts_per_step` keeps the run's
`rollout.batch_size` per weight sync for every `sync_every`, as the product's configurations do.
The result's scales (`calibration.engine_time_scale`, `env_time_scale`) are 1: the environment's
calibration is written into its distribution.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from orchestrator.planning.sim.workload import parse_workload  # noqa: E402

CPU_BATCH_DOUBLING = 16  # running sequences that double a CPU engine step (assumed)
START_SHARE = 0.5  # share of a rollout's CPU work done when it starts, the rest after its last turn (assumed)
ROLLOUT_SIDE_PARTS = ("driver", "inference", "gateway", "rollout", "local_stack", "other")  # perf/cpu_s/<part>


def _normal_quantile(p: float) -> float:
    return statistics.NormalDist().inv_cdf(p)


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q * (len(xs) - 1)))))]


def agent_durations(run_dir: Path) -> dict[str, tuple[int, float]]:
    """session id -> (group id, seconds the agent's task ran), from the ACR emulator's log
    (`logs/emulator.log`: the runtime's "Async task completed ... Duration: Xs" records). Empty
    when the run has no such log (a run on AWS)."""
    log = run_dir / "logs" / "emulator.log"
    out: dict[str, tuple[int, float]] = {}
    if not log.is_file():
        return out
    for line in log.read_text(errors="replace").splitlines():
        if not line.startswith("{") or "Async task completed" not in line:
            continue
        try:
            rec = json.loads(line)
            sid = rec["sessionId"]
            dur = float(re.search(r"Duration: ([0-9.]+)s", rec["message"]).group(1))  # type: ignore[union-attr]
            gid = int(re.search(r"-g(\d+)-s\d+-", sid).group(1))  # type: ignore[union-attr]
        except (ValueError, KeyError, AttributeError):
            continue
        out[sid] = (gid, dur)
    return out


def fit_env(p50: float, mx: float, n: float, engine_s: float, const_s: float) -> tuple[float, float]:
    """(median, sigma) of the log-normal environment time of rollouts whose latency is
    `const_s + engine_s + env`: the median rollout's latency is `p50`, and the slowest of the `n`
    rollouts of a step (mean latency `mx` over steps) sits at the expected maximum of n normal
    draws, z = Φ⁻¹((n - 0.375) / (n + 0.25)) (Blom): mx - const - engine = median · exp(σ·z)."""
    median = max(1e-3, p50 - engine_s - const_s)
    z = _normal_quantile((n - 0.375) / (n + 0.25))
    return median, max(0.0, math.log(max(mx - engine_s - const_s, median) / median) / z) if z > 0 else 0.0


def fit_update(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(fixed_s, seconds per trained token) of update time = fixed + slope · tokens, by least
    squares over updates. A per-token part only where the data show one: when the slope is not
    significant (below 2 standard errors, or not positive) the time is all fixed (its mean);
    when the intercept comes out negative the line goes through 0."""
    mean_y = statistics.fmean(ys)
    if len(set(xs)) < 2 or len(xs) < 3:
        return mean_y, 0.0
    slope, fixed = statistics.linear_regression(xs, ys)
    mx = statistics.fmean(xs)
    resid = sum((y - fixed - slope * x) ** 2 for x, y in zip(xs, ys)) / (len(xs) - 2)
    se = math.sqrt(resid / sum((x - mx) ** 2 for x in xs))
    if slope <= 2 * se:
        return mean_y, 0.0
    if fixed < 0:
        return 0.0, mean_y / mx
    return fixed, slope


def fit_cpu(use: list[dict], prev: dict) -> dict | None:
    """The machine's CPU figures from `perf/cpu_s/*` (orchestrator/watch/cpu_usage.py), or None when the
    run did not log them. `rollout_cpu_s`: the CPU seconds of every part but the trainer (driver,
    engines, gateway, rollout actors, emulator + agents + moto, Ray's own) per rollout dispatched,
    all of it (`background_cores` 0). Why not split it into work per rollout and cores kept busy
    per second, by least squares over the steps: a sync step dispatches the same number of
    rollouts every time, so that split rests on how the CPU follows the step's length alone,
    which the slowest rollout's environment time sets; and on a run that kept every core busy
    the CPU a step used is its length times the cores whatever it did. What runs in the background (Ray's
    loops, engines and actors polling) grows with the work: measured on this project's bench
    (docs/simulator.md), the rollout side's CPU per rollout dispatched of a saturated
    async run matched its sync run's total per rollout within the run's noise, while a split
    sync fit left 0.27-0.34 cores of background that the simulator then kept from the rollouts
    at saturation (async over-predicted by 11-56 %).
    `trainer_cores`: the trainer's CPU seconds over its update and weight-sync seconds."""
    keys = [f"perf/cpu_s/{p}" for p in (*ROLLOUT_SIDE_PARTS, "trainer")]
    if not all(k in r for r in use for k in keys):
        return None
    dispatched = use[-1].get("rollout/dispatched", 0.0) - prev.get("rollout/dispatched", 0.0)
    rollout_side = sum(r[f"perf/cpu_s/{p}"] for r in use for p in ROLLOUT_SIDE_PARTS)
    trainer_s = sum(r.get("timing_s/update_actor", 0.0) + r.get("timing_s/update_weights", 0.0) for r in use)
    trainer_cpu = sum(r["perf/cpu_s/trainer"] for r in use)
    return {"rollout_cpu_s": rollout_side / dispatched if dispatched > 0 else 0.0, "background_cores": 0.0,
            "trainer_cores": max(0.05, trainer_cpu / trainer_s) if trainer_s > 0 else 1.0}


def fit(run_dir: Path, *, prompt_tokens: float | None = None, kv_tokens: int, warmup_steps: int, calibrate_hours: float = 0.1) -> dict:
    """The workload mapping fitted from `run_dir` (see the module docstring); with the run's CPU
    record, its environment scale calibrated on `calibrate_hours` simulated hours of the run's own
    configuration (0: not). `prompt_tokens` per sample: None measures it (every token of the trained
    samples, `perf/total_num_tokens`, less their generated tokens; for a multi-turn agent the
    environment's tokens count as prompt). Raises ValueError when the run has too few steps or lacks
    a metric the fit needs (the message names it)."""
    raw, cfg, use = _fit(run_dir, prompt_tokens=prompt_tokens, kv_tokens=kv_tokens, warmup_steps=warmup_steps)
    if calibrate_hours > 0 and raw["machine"].get("engine_cores") == 0.0:  # the CPU model was fitted
        from orchestrator.planning.sim.calibrate import calibrate_fitted

        record = calibrate_fitted(lambda ke, kv: parse_workload(_scaled(raw, ke, kv)), run_scenario(cfg),
                                  step_s=statistics.fmean(r["timing_s/step"] for r in use),
                                  concurrency=raw["calibration"]["measured"]["inference_concurrency"],
                                  hours=calibrate_hours, warmup_steps=warmup_steps)
        raw = _scaled(raw, record["engine_scale"], record["env_scale"])
        raw["calibration"]["machine_fit"] = record
    return raw


def fit_warnings(raw: dict) -> list[str]:
    """What the fit of `raw` could not determine from its run (empty: nothing)."""
    record = raw.get("calibration", {}).get("machine_fit", {})
    return [f"calibration.machine_fit.{name} stopped at its bound ({record[name]:g}): the run's step time and "
            "concurrency do not determine it (a run that kept every core busy: its steps took what the cores "
            "allowed, whatever the environment's time); fit from a run that leaves cores idle (a sync run)"
            for name in record.get("at_bound", ())]


def _scaled(raw: dict, engine: float, env: float) -> dict:
    """`raw` with its engine step times times `engine` and its fitted environment time (the
    log-normal: before the model call for one-turn agents, between turns else) times `env`."""
    agent = dict(raw["agent"])
    for key in ("cold_start_s", "env_time_s"):
        if agent[key]["dist"] == "lognormal":
            agent[key] = agent[key] | {"median": agent[key]["median"] * env}
    eng = raw["engine"] | {k: raw["engine"][k] * engine for k in ("step_base_s", "step_per_seq_s", "prefill_s_per_token")}
    return raw | {"agent": agent, "engine": eng}


def run_scenario(cfg: dict):
    """The simulator's Scenario of a run's config on one shared machine (cluster=local)."""
    from orchestrator.planning.sim.run import Scenario

    a = cfg.get("async") or {}
    return Scenario(cfg["mode"]["name"], int(cfg["mode"].get("sync_every", 1)), True, gpus=1,
                    max_staleness=int(a.get("max_staleness", 1)), on_stale=str(a.get("on_stale", "drop")), sleeps=False)


def _fit(run_dir: Path, *, prompt_tokens: float | None, kv_tokens: int, warmup_steps: int) -> tuple[dict, dict, list[dict]]:
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if "timing_s/step" in r]
    if len(rows) <= warmup_steps + 1:
        raise ValueError(f"{run_dir}: {len(rows)} steps; need more than {warmup_steps + 1}")
    for key in ("gateway/turns_served", "rollout/dispatched", "actor/num_tokens", "rollout/latency_s_p50",
                "perf/inference_concurrency"):
        if not any(key in r for r in rows):
            raise ValueError(f"{run_dir}/metrics.jsonl: no {key!r} (a run of this product logs it)")
    roll, mode = cfg["rollout"], cfg["mode"]
    sync = mode.get("name") == "sync"
    use = rows[warmup_steps:]
    prev = rows[warmup_steps - 1] if warmup_steps else {}

    def grown(key: str) -> float:  # a cumulative counter's growth over the steps used
        return use[-1].get(key, 0.0) - prev.get(key, 0.0)

    dispatched, completed, filtered = grown("rollout/dispatched"), grown("rollout/completed"), grown("rollout/filtered")
    turns_total = grown("gateway/turns_served")
    turns = max(1.0, turns_total / max(1.0, dispatched))
    n = int(roll["n"])
    trained = (sum(r.get("rollout/step_completed", 0.0) for r in use)  # samples trained (sync logs it)
               or n * grown("rollout/trained_groups") or completed)
    gen_per_turn = max(1.0, sum(r.get("actor/num_tokens", 0.0) for r in use) / max(1.0, trained) / turns)
    # the interval the engines' concurrency was seen over: a sync step's generation; an async run
    # generates through the whole step
    gen_s = sum(r.get("timing_s/gen", 0.0) if sync else r["timing_s/step"] for r in use)
    conc = statistics.fmean(r["perf/inference_concurrency"] for r in use)
    turn_s = conc * gen_s / max(1.0, turns_total)  # seconds a turn spends at the gateway (Little's law)
    step_base = turn_s / gen_per_turn / (1 + conc / CPU_BATCH_DOUBLING)
    p50 = statistics.median(r["rollout/latency_s_p50"] for r in use if "rollout/latency_s_p50" in r)
    mx = statistics.fmean(r["rollout/latency_s_max"] for r in use if "rollout/latency_s_max" in r)
    one_turn = turns <= 1.5
    # constant per rollout: ACR's invoke and result pickup (latency outside the agent's task, from
    # the ACR records) and the agent's own work besides its model call (its fastest tasks, the 5th
    # percentile, less their time at the gateway); the rest of the latency is the environment
    first_gid = warmup_steps * int(roll["batch_size"]) if sync else 0
    durations = sorted(d for g, d in agent_durations(run_dir).values() if g >= first_gid)
    const_s = 0.0
    cores = float(cfg.get("cluster", {}).get("num_cpus") or os.cpu_count() or 1)
    cpu = fit_cpu(use, prev)
    if cpu is not None:  # the rollout's own CPU work, measured; its latency outside is the environment
        const_s = cpu["rollout_cpu_s"]
        env_source = "rollout latency p50 / max per step less the rollout's CPU work (perf/cpu_s/*)"
    elif one_turn and len(durations) >= 20:
        const_s = max(0.0, p50 - statistics.median(durations)) + max(0.0, _quantile(durations, 0.05) - turn_s)
        env_source = f"rollout latency p50 / max per step; constant part from {len(durations)} ACR task records"
    else:
        env_source = "rollout latency p50 / max per step"
    env_median, sigma = fit_env(p50, mx, max(1.0, dispatched / len(use)), turns * turn_s, const_s)
    total = sum(r.get("perf/total_num_tokens", 0.0) for r in use)  # every token of the trained samples
    if prompt_tokens is None:  # measured: what the trained samples hold beyond their generated tokens
        if total <= 0:
            raise ValueError(f"{run_dir}/metrics.jsonl: no 'perf/total_num_tokens' (a run before it was "
                             "logged): give the prompt tokens per sample (--prompt-tokens)")
        prompt_tokens = max(0.0, total / max(1.0, trained) - turns * gen_per_turn)
        prompt_source = "perf/total_num_tokens less the generated tokens, per trained sample"
    else:
        prompt_source = "given (--prompt-tokens)"
    traj_per_sample = prompt_tokens + turns * gen_per_turn
    k = int(mode.get("sync_every", 1))  # optimizer updates per step, each of 1 / k of its samples
    samples_per_step = trained / len(use)
    upd = [((r.get("perf/total_num_tokens")
             or r.get("rollout/step_completed", samples_per_step) * prompt_tokens + r["actor/num_tokens"]) / k,
            r["timing_s/update_actor"] / k) for r in use if "timing_s/update_actor" in r and "actor/num_tokens" in r]
    fixed, per_token = fit_update([u[0] for u in upd], [u[1] for u in upd])
    sync_s = statistics.fmean(r.get("timing_s/update_weights", 0.0) for r in use)
    # the sample store (a Ray actor): a sync step's time outside generation, update and weight sync
    # is one `clear` (a round trip); its generation ends with one read of the step's samples after
    # the slowest rollout (read time less a round trip, per sample)
    rpc_s = sample_s = 0.0
    if sync:
        rpc_s = max(0.0, statistics.median(r["timing_s/step"] - r.get("timing_s/gen", 0.0)
                                           - r.get("timing_s/update_actor", 0.0)
                                           - r.get("timing_s/update_weights", 0.0) for r in use))
        per_step = dispatched / len(use)
        sample_s = max(0.0, statistics.median(r.get("timing_s/gen", 0.0) - r["rollout/latency_s_max"] - rpc_s
                                              for r in use if "rollout/latency_s_max" in r) / per_step)
    constant = filtered / max(1.0, completed + filtered)  # zero-variance groups' share
    reward = statistics.fmean(r["reward/mean"] for r in use if not math.isnan(r.get("reward/mean", math.nan)))
    p = min(0.95, max(0.05, reward))
    env = {"dist": "lognormal", "median": env_median / (1 if one_turn else turns - 1), "sigma": round(sigma, 4)}
    const0 = {"dist": "const", "value": 0.0}
    end_cpu_s, final_s = 0.0, const_s
    if cpu is None:  # no CPU record: the engine keeps every core busy while it decodes (assumed), the
        # constant part of a rollout is a delay after its last turn
        machine = {"cores": cores, "engine_cores": cores, "trainer_cores": 1.0}
    else:
        machine = {"cores": cores, "engine_cores": 0.0,  # the engines' CPU is in the rollouts' work
                   "trainer_cores": min(cores, cpu["trainer_cores"]), "background_cores": cpu["background_cores"],
                   "rollout_start_cpu_s": START_SHARE * cpu["rollout_cpu_s"]}
        end_cpu_s, final_s = (1 - START_SHARE) * cpu["rollout_cpu_s"], 0.0
    return {
        "name": f"fitted_{run_dir.name}",
        "engine": {"kv_tokens_per_replica": kv_tokens, "gpus_per_replica": 1,
                   "max_num_seqs": int(cfg.get("inference", {}).get("max_num_seqs", 64)),
                   "step_base_s": step_base, "step_per_seq_s": step_base / CPU_BATCH_DOUBLING,
                   "prefill_s_per_token": 0.0},
        "agent": {"prompt_tokens": {"dist": "const", "value": prompt_tokens},
                  "turns": {"dist": "const", "value": round(turns, 3)},
                  # the agent truncates a draw to whole tokens: uniform on [g, g + 1) has mean g after it
                  "agent_tokens_per_turn": {"dist": "uniform", "low": round(gen_per_turn, 3),
                                            "high": round(gen_per_turn + 1, 3)},
                  "env_tokens_per_turn": {"dist": "const", "value": 0.0},
                  # one turn: the environment before the model call (as the cold start); more
                  # turns: between them. The constant part is CPU work (slowed on a shared machine)
                  "env_time_s": const0 if one_turn else env,
                  "final_time_s": {"dist": "const", "value": final_s},
                  "cold_start_s": env if one_turn else const0,
                  "overhead_s": {"dist": "const", "value": end_cpu_s},
                  "max_context_tokens": int(roll.get("max_context_tokens", 512)),
                  "session_rate_per_s": float(roll.get("acr", {}).get("session_rate_per_s", 25.0)),
                  "reward_beta": [2 * p, 2 * (1 - p)],
                  "constant_reward_fraction": round(constant, 4)},
        "trainer": {"tokens_per_s_per_gpu": 1.0 / per_token if per_token > 0 else 1e12, "fixed_s": fixed},
        "weight_sync": {"model_bytes": 1.0, "bandwidth_bytes_per_s": 1.0 / max(sync_s, 1e-6), "reload_s": 0.0,
                        "sleep_s": 0.0, "wake_s": 0.0},
        "batch": {"prompts_per_mini_batch": int(roll["batch_size"]) // int(mode.get("sync_every", 1)),
                  "prompts_per_step": int(roll["batch_size"]),  # rollout.batch_size: per weight sync
                  "n": n, "reference_gpus": 1},
        "algorithm": {"filter_zero_variance": bool(cfg.get("algorithm", {}).get("filter_zero_variance", True))},
        "machine": machine | {"store_rpc_s": rpc_s, "store_sample_s": sample_s},
        "calibration": {"engine_time_scale": 1.0, "env_time_scale": 1.0, "fitted_from": str(run_dir),
                        "env_source": env_source, "prompt_tokens_source": prompt_source,
                        "measured": {"inference_concurrency": conc, "rollout_latency_p50_s": p50,
                                     "turns_per_rollout": turns, "gateway_s_per_turn": turn_s,
                                     "trajectory_tokens_per_sample": traj_per_sample}},
    }, cfg, use


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--out", type=Path, help="write the workload YAML here (default: print it)")
    ap.add_argument("--prompt-tokens", type=float, help="prompt tokens per sample (default: from the run's "
                    "perf/total_num_tokens; needed for a run that did not log it)")
    ap.add_argument("--kv-tokens", type=int, default=1_000_000, help="KV capacity per replica in tokens")
    ap.add_argument("--warmup-steps", type=int, default=2)
    args = ap.parse_args()
    try:
        raw = fit(args.run_dir, prompt_tokens=args.prompt_tokens, kv_tokens=args.kv_tokens,
                  warmup_steps=args.warmup_steps)
        parse_workload(raw)  # what we write must load
    except (OSError, ValueError, KeyError) as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    for warning in fit_warnings(raw):
        print(f"warning: {warning}", file=sys.stderr)
    text = yaml.safe_dump(raw, sort_keys=False)
    if args.out:
        args.out.write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
