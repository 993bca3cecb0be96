"""Fit a simulator workload (orchestrator/sim/workload.py) from a real run's directory.

    python scripts/workload_from_run.py RUN_DIR [--out workload.yaml] [--prompt-tokens 40]

Reads `config.yaml` (batch, group size, sync_every, ACR session rate, filtering), `metrics.jsonl`
(per step: rollouts, gateway turns, generated tokens, timings, latency p50/max, inference
concurrency) and `summary.json`. What it fits, and from what:

- turns per rollout: gateway turns served / rollouts dispatched (a constant);
- agent tokens per turn: trained (loss-mask) tokens / trained samples / turns (a constant);
  (trained samples: `rollout/step_completed`, filtered groups excluded)
- environment time per rollout: a log-normal whose median is the rollout latency p50 minus the
  rollout's engine time, and whose shape puts the step's slowest rollout at its expected rank
  (max / p50 = exp(σ·z), z the normal quantile of 1 - 1/(n+1)); spread over the turns' gaps, or
  all at the end for one-turn agents;
- engine step time: Little's law at the gateway (concurrency × generation time / turns = seconds a
  turn spends at the engine), divided by its tokens; per-sequence growth set to 1/16 of it
  (a batch of 16 doubles a CPU step, assumed, not fitted);
- trainer: update seconds = fixed + per-sample slope (least squares over steps);
- weight sync: its mean seconds (model_bytes / bandwidth gives exactly that);
- reward: Beta(2p, 2(1-p)) with p the run's mean reward (the share of groups filtered follows).

Not in a run's files, so given as flags: prompt tokens (`--prompt-tokens`) and KV capacity
(`--kv-tokens`; the tiny model never binds it). The first `--warmup-steps` steps are skipped.
The result is a workload with no calibration (scales 1).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from orchestrator.sim.workload import parse_workload  # noqa: E402

CPU_BATCH_DOUBLING = 16  # running sequences that double a CPU engine step (assumed)


def _normal_quantile(p: float) -> float:
    return statistics.NormalDist().inv_cdf(p)


def fit(run_dir: Path, *, prompt_tokens: float, kv_tokens: int, warmup_steps: int) -> dict:
    """The workload mapping fitted from `run_dir` (see the module docstring). Raises ValueError
    when the run has too few steps or lacks a metric the fit needs (the message names it)."""
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if "timing_s/step" in r]
    if len(rows) <= warmup_steps + 1:
        raise ValueError(f"{run_dir}: {len(rows)} steps; need more than {warmup_steps + 1}")
    for key in ("gateway/turns_served", "rollout/dispatched", "actor/num_tokens", "rollout/latency_s_p50",
                "perf/inference_concurrency"):
        if not any(key in r for r in rows):
            raise ValueError(f"{run_dir}/metrics.jsonl: no {key!r} (a run of this product logs it)")
    use = rows[warmup_steps:]
    prev = rows[warmup_steps - 1] if warmup_steps else {}
    dispatched = use[-1]["rollout/dispatched"] - prev.get("rollout/dispatched", 0.0)
    completed = use[-1]["rollout/completed"] - prev.get("rollout/completed", 0.0)
    turns_total = use[-1]["gateway/turns_served"] - prev.get("gateway/turns_served", 0.0)  # cumulative count
    turns = max(1.0, turns_total / max(1.0, dispatched))
    trained = sum(r.get("rollout/step_completed", 0.0) for r in use) or completed  # samples trained (sync)
    gen_per_turn = max(1.0, sum(r.get("actor/num_tokens", 0.0) for r in use) / max(1.0, trained) / turns)
    gen_s = sum(r.get("timing_s/wait_for_batch", r.get("timing_s/gen", 0.0)) for r in use)
    conc = statistics.fmean(r["perf/inference_concurrency"] for r in use)
    turn_s = conc * gen_s / max(1.0, turns_total)  # seconds a turn spends at the engine
    step_base = turn_s / gen_per_turn / (1 + conc / CPU_BATCH_DOUBLING)
    per_rollout = max(1.0, dispatched / len(use))
    p50 = statistics.median(r["rollout/latency_s_p50"] for r in use if "rollout/latency_s_p50" in r)
    mx = statistics.median(r["rollout/latency_s_max"] for r in use if "rollout/latency_s_max" in r)
    env_median = max(1e-3, p50 - turns * turn_s)
    z = _normal_quantile(1 - 1 / (per_rollout + 1))
    sigma = max(0.0, math.log(max(mx - turns * turn_s, env_median) / env_median) / z) if z > 0 else 0.0
    upd = [(r.get("rollout/step_completed", completed / len(use)), r["timing_s/update_actor"]) for r in use
           if "timing_s/update_actor" in r]
    xs, ys = [u[0] for u in upd], [u[1] for u in upd]
    if len(set(xs)) > 1:
        slope, fixed = statistics.linear_regression(xs, ys)
    else:
        slope, fixed = statistics.fmean(ys) / max(1.0, statistics.fmean(xs)), 0.0
    slope, fixed = max(slope, 1e-6), max(fixed, 0.0)
    env_tokens = 0.0
    traj = prompt_tokens + turns * gen_per_turn + (turns - 1) * env_tokens
    sync_s = statistics.fmean(r.get("timing_s/update_weights", 0.0) for r in use)
    roll, mode = cfg["rollout"], cfg["mode"]
    reward = statistics.fmean(r["reward/mean"] for r in use if not math.isnan(r.get("reward/mean", math.nan)))
    p = min(0.95, max(0.05, reward))
    one_turn = turns <= 1.5
    env = {"dist": "lognormal", "median": env_median / (1 if one_turn else turns - 1), "sigma": round(sigma, 4)}
    return {
        "name": f"fitted_{run_dir.name}",
        "engine": {"kv_tokens_per_replica": kv_tokens, "gpus_per_replica": 1,
                   "max_num_seqs": int(cfg.get("inference", {}).get("max_num_seqs", 64)),
                   "step_base_s": step_base, "step_per_seq_s": step_base / CPU_BATCH_DOUBLING,
                   "prefill_s_per_token": 0.0},
        "agent": {"prompt_tokens": {"dist": "const", "value": prompt_tokens},
                  "turns": {"dist": "const", "value": round(turns, 3)},
                  "agent_tokens_per_turn": {"dist": "const", "value": round(gen_per_turn, 3)},
                  "env_tokens_per_turn": {"dist": "const", "value": env_tokens},
                  "env_time_s": {"dist": "const", "value": 0.0} if one_turn else env,
                  "final_time_s": env if one_turn else {"dist": "const", "value": 0.0},
                  "cold_start_s": {"dist": "const", "value": 0.0},
                  "max_context_tokens": int(roll.get("max_context_tokens", 512)),
                  "session_rate_per_s": float(roll.get("acr", {}).get("session_rate_per_s", 25.0)),
                  "reward_beta": [2 * p, 2 * (1 - p)]},
        "trainer": {"tokens_per_s_per_gpu": traj / slope, "fixed_s": fixed},
        "weight_sync": {"model_bytes": 1.0, "bandwidth_bytes_per_s": 1.0 / max(sync_s, 1e-6), "reload_s": 0.0,
                        "sleep_s": 0.0, "wake_s": 0.0},
        "batch": {"prompts_per_mini_batch": int(roll["batch_size"]) // int(mode.get("sync_every", 1)),
                  "n": int(roll["n"]), "reference_gpus": 1},
        "algorithm": {"filter_zero_variance": bool(cfg.get("algorithm", {}).get("filter_zero_variance", True))},
        "calibration": {"engine_time_scale": 1.0, "env_time_scale": 1.0, "fitted_from": str(run_dir),
                        "measured": {"inference_concurrency": conc, "rollout_latency_p50_s": p50,
                                     "turns_per_rollout": turns}},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--out", type=Path, help="write the workload YAML here (default: print it)")
    ap.add_argument("--prompt-tokens", type=float, default=40.0, help="prompt tokens per rollout (not logged)")
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
    text = yaml.safe_dump(raw, sort_keys=False)
    if args.out:
        args.out.write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
