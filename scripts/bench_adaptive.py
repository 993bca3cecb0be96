"""Benchmark `rollout.concurrency=adaptive` against `fixed` on this machine with the KV cache binding.

Each policy runs the real main job in async mode (`python -m orchestrator.main mode=async
rollout.concurrency=<policy> ...`) on the same seed, prompts and model. The default workload makes
the engine's KV cache the binding limit of the letters task, whose rollout is one short model call
(19 prompt tokens, ~5 generated) inside ~1 s of agent, ACR and S3 work, so an engine holds only
a few requests at a time on average:

- `inference.kv_cache_gib=0.0015`: vLLM's CPU backend allocates blocks of 128 tokens (256 KiB of
  the tiny model's KV), and a letters rollout (< 40 tokens) takes one, so this cache of 6 blocks
  holds 6 requests at once and its usage is the requests running / 6 (the default 1 GiB holds
  4 096 blocks and is never 0.1 % used); `inference.max_model_len=128` and
  `rollout.max_context_tokens=128` let a cache of under 8 blocks start (it must hold one
  max_model_len sequence);
- `async.max_staleness=4`: at η = 2 the staleness budget ((η + 1) × 8 groups, less the 8 accepted
  for the next update: 64 rollouts) held the producer before the cache filled;
- a raised ACR quota (`--acr-rate`: the emulator's session rate, the limiter gets twice it), as
  scripts/bench_modes.py does: at the default 50 requests/s the limiter paces rollouts first.

Printed per policy, over the steps after `--warmup-steps`: the engine's KV usage time average
(`perf/kv_cache_usage` is a time average over each step's interval, idle time included; the
run's figure weights each step by its length) against the target, the share of steps within 10
points of it, preemptions (vLLM's count, and per 100 rollouts), requests waiting at the engine
(mean of the per-step samples), the adaptive limit's trajectory (first, min, mean, max, last;
groups running), seconds the producer was refused by the adaptive gate (~0: another bound held
it), rollouts in flight against the staleness budget, and reward first -> last (the summary's).

    python scripts/bench_adaptive.py --out bench_adaptive.json [--steps 40] [--runs-dir DIR] [OVERRIDES ...]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the product's modules, imported where used
POLICIES = ("fixed", "adaptive")
FINISHED = ("rollout/completed", "rollout/failed", "rollout/expired", "rollout/filtered")
KV_BINDING = ("inference.max_model_len=128", "rollout.max_context_tokens=128")


def _num(v: object) -> bool:
    return isinstance(v, (int, float)) and not math.isnan(v)


def _mean(values: list) -> float:
    vals = [v for v in values if _num(v)]
    return sum(vals) / len(vals) if vals else math.nan


def figures(steps: list[dict], summary: dict, *, target: float, warmup_steps: int, in_flight_budget: int) -> dict:
    """The comparison's figures from a run's per-step records (metrics.jsonl) and summary.json."""
    before = steps[warmup_steps - 1] if 0 < warmup_steps <= len(steps) else {}
    steps = steps[warmup_steps:]
    kv = [(s["perf/kv_cache_usage"], s["timing_s/step"]) for s in steps if _num(s.get("perf/kv_cache_usage"))]
    span = sum(dt for _, dt in kv)
    preempted = (steps[-1].get("rollout/engine_preempted", math.nan) - before.get("rollout/engine_preempted", 0.0)
                 if steps else math.nan)
    dispatched = (steps[-1].get("rollout/dispatched", 0.0) - before.get("rollout/dispatched", 0.0)) if steps else 0.0
    limit = [s["rollout/concurrency_limit"] for s in steps if _num(s.get("rollout/concurrency_limit"))]
    in_flight = [s.get("rollout/dispatched", 0.0) - sum(s.get(k, 0.0) for k in FINISHED) for s in steps]
    return {
        "kv_usage_time_avg": sum(u * dt for u, dt in kv) / span if span > 0 else math.nan,
        "kv_target": target,
        "kv_steps_within_10_points": sum(abs(u - target) <= 0.1 for u, _ in kv) / len(kv) if kv else math.nan,
        "kv_step_min": min((u for u, _ in kv), default=math.nan),
        "kv_step_max": max((u for u, _ in kv), default=math.nan),
        "preemptions": preempted,
        "preemptions_per_100_rollouts": 100.0 * preempted / dispatched if dispatched else math.nan,
        "engine_waiting_mean": _mean([s.get("rollout/engine_waiting") for s in steps]),
        "engine_running_mean": _mean([s.get("rollout/engine_running") for s in steps]),
        "inference_concurrency": _mean([s.get("perf/inference_concurrency") for s in steps]),
        "limit": ({"first": limit[0], "min": min(limit), "mean": sum(limit) / len(limit), "max": max(limit),
                   "last": limit[-1]} if limit else None),
        "running_groups_mean": _mean([s.get("rollout/running_groups") for s in steps]),
        "gate_blocked_s": steps[-1].get("rollout/concurrency_blocked_s", math.nan) if steps else math.nan,
        "in_flight_mean": _mean(in_flight),
        "in_flight_max": max(in_flight, default=math.nan),
        "in_flight_budget": in_flight_budget,
        "staleness_mean": _mean([s.get("staleness/mean") for s in steps]),
        "step_s_mean": _mean([s.get("timing_s/step") for s in steps]),
        "rollouts": summary.get("rollout/dispatched"),
        "reward_initial": summary.get("reward/initial"),
        "reward_final": summary.get("reward/final"),
        "acr_throttled": summary.get("acr/emulator_throttled"),
    }


def run_policy(policy: str, args: argparse.Namespace, work: Path) -> dict:
    """Run one policy as a subprocess (or reuse its finished run dir); return its figures."""
    run_dir = work / policy
    cmd = [sys.executable, "-m", "orchestrator.main", "mode=async", f"rollout.concurrency={policy}",
           f"async.max_staleness={args.max_staleness}", f"trainer.total_steps={args.steps}", f"seed={args.seed}",
           "logger=console", f"run_dir={run_dir}", f"rollout.acr.session_rate_per_s={args.acr_rate}",
           f"rollout.acr.limits.requests_per_s={2 * args.acr_rate}", f"rollout.adaptive.kv_target={args.kv_target}",
           *(() if args.no_kv_binding else (f"inference.kv_cache_gib={args.kv_cache_gib}", *KV_BINDING)),
           *args.overrides]
    wall_s = math.nan
    if (run_dir / "summary.json").is_file():
        print(f"{policy}: reusing {run_dir}", flush=True)
    else:
        print(f"{policy}: {' '.join(cmd[2:])}", flush=True)
        t0 = time.monotonic()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.timeout_s)
        wall_s = time.monotonic() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"{policy} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    from orchestrator.watch.metrics import read_summary  # the product's reader
    summary = read_summary(run_dir / "summary.json")  # null (not measured) read as NaN
    cfg = summary_budget(run_dir, args.max_staleness)
    return {"policy": policy, "wall_s": wall_s, "overrides": cmd[3:],
            **figures(steps, summary, target=args.kv_target, warmup_steps=args.warmup_steps, in_flight_budget=cfg)}


def summary_budget(run_dir: Path, eta: int) -> int:
    """Rollouts the staleness budget lets run while the next update's groups wait: η × groups per
    version × n (the (η + 1)-th version's share is the accepted groups), from the run's config."""
    import yaml

    c = yaml.safe_load((run_dir / "config.yaml").read_text())
    return eta * c["rollout"]["batch_size"] * c["trainer"].get("sync_every", 1) * c["rollout"]["n"]


def _f(v: object, spec: str = ".3f") -> str:
    return format(v, spec) if _num(v) else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40, help="weight syncs per policy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-staleness", type=int, default=4, help="async.max_staleness (η) of both runs")
    ap.add_argument("--kv-target", type=float, default=0.8, help="rollout.adaptive.kv_target (and the figure's target)")
    ap.add_argument("--warmup-steps", type=int, default=2, help="first steps left out of the figures")
    ap.add_argument("--acr-rate", type=float, default=200.0,
                    help="ACR session creations per second (emulator); the limiter gets twice this (invoke + stop)")
    ap.add_argument("--kv-cache-gib", type=float, default=0.0015,
                    help="inference.kv_cache_gib: 256 KiB (0.000244 GiB) per 128-token block of the tiny model")
    ap.add_argument("--no-kv-binding", action="store_true", help="leave out the small-cache overrides "
                    "(--kv-cache-gib, " + " ".join(KV_BINDING) + ")")
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma-separated subset of " + ",".join(POLICIES))
    ap.add_argument("--timeout-s", type=float, default=900.0, help="bound on one policy's run")
    ap.add_argument("--out", type=Path, help="write the figures as JSON")
    ap.add_argument("--runs-dir", type=Path, help="keep each policy's run dir here (default: a temporary dir); a "
                    "policy whose run dir there holds a summary.json is not run again")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for both runs")
    args = ap.parse_args()
    names = [p for p in args.policies.split(",") if p]
    if sorted(set(names) - set(POLICIES)):
        ap.error(f"unknown policy in {names}; choose from {list(POLICIES)}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-adaptive-") as tmp:
        work = args.runs_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for name in names:
            rows.append(run_policy(name, args, work))
    header = ("policy", "KV avg", "target", "KV±0.1", "preempt", "/100", "waiting", "limit min/mean/max/last",
              "groups", "gate s", "in flight/budget", "reward 0->T", "step s")
    print("\n" + " | ".join(header))
    for r in rows:
        lim = r["limit"]
        cells = (r["policy"], _f(r["kv_usage_time_avg"]), _f(r["kv_target"], ".2f"),
                 _f(r["kv_steps_within_10_points"], ".0%"), _f(r["preemptions"], ".0f"),
                 _f(r["preemptions_per_100_rollouts"], ".2f"), _f(r["engine_waiting_mean"], ".2f"),
                 "/".join(_f(lim[k], ".0f" if k != "mean" else ".1f") for k in ("min", "mean", "max", "last"))
                 if lim else "-", _f(r["running_groups_mean"], ".1f"), _f(r["gate_blocked_s"], ".0f"),
                 f"{_f(r['in_flight_mean'], '.0f')} (max {_f(r['in_flight_max'], '.0f')})/{r['in_flight_budget']}",
                 f"{_f(r['reward_initial'], '.2f')}->{_f(r['reward_final'], '.2f')}", _f(r["step_s_mean"], ".2f"))
        print(" | ".join(cells))
    if args.out:
        args.out.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()}, "results": rows},
                                       indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
