"""Benchmark `rollout.concurrency=adaptive` against a sweep of fixed caps, side by side, in one run.

Each run is the real main job in async mode (`python -m orchestrator.main mode=async ...`) on the
same seed, prompts and model: first one run per fixed cap (`--caps`, in groups:
`async.max_concurrent_rollouts` = cap x `rollout.n`), which traces the throughput curve, then one
run per policy (`--policies`: `adaptive`, the throughput-seeking one, and optionally `aimd`, the
earlier KV-target window), which is not told the sweep: `adaptive` starts where fixed concurrency
runs by default ((η + 1)·B groups: the staleness window at `mode.sync_every=1`), `aimd` at one
mini-batch. The table prints each run's throughput (trained tokens per minute of loop time, and rollouts finished
per minute: the system's work), the policy's settled cap (`rollout/concurrency_best_cap` at the
end, the cap it keeps between probes) and its throughput against the best fixed cap's.
`--max-staleness 1,4` repeats the whole comparison per η: 1 is the sync-like load (at most one
mini-batch of look-ahead), 4 the async one.

Workloads:

- the tiny model (default): the letters task with the engine's KV cache made the binding limit:
  `inference.kv_cache_gib=0.0015`: vLLM's CPU backend allocates blocks of 128 tokens (256 KiB of
  the tiny model's KV), and a letters rollout (< 40 tokens) takes one, so this cache of 6 blocks
  holds 6 requests at once (the default 1 GiB holds 4 096 blocks and is never 0.1 % used);
  `inference.max_model_len=128` and `rollout.max_context_tokens=128` let a cache of under 8
  blocks start; a raised ACR quota (`--acr-rate`, as scripts/bench_modes.py does);
- `--experiment smollm2_local` (the real model, SmolLM2-135M: `+experiment=smollm2_local`), whose
  engine, not the agent, is the bottleneck; the small-cache overrides are left out (pass
  `--kv-cache-gib` to set one).

Also printed per run, over the steps after `--warmup-steps`: the engine's KV usage time average,
preemptions, requests waiting, the limit's trajectory, and reward first -> last.

    python scripts/bench_adaptive.py --out F.json [--caps 8,16,24,32,40] [--steps 60] [--runs-dir DIR] [OVERRIDES ...]
    python scripts/bench_adaptive.py --experiment smollm2_local --max-staleness 1,4 --caps 8,12,16,24,32,40 \
        --steps 30 --runs-dir DIR --out F.json trainer.test_freq=0 trainer.val_before_train=false \
        rollout.adaptive.min_window_s=10

A cap above the staleness window ((η + 1) x rollout.batch_size groups) runs as the window: at
η = 1 with the real model's 8 groups per step, caps 16 and up are one configuration.
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
POLICIES = ("adaptive", "aimd")
FINISHED = ("rollout/completed", "rollout/failed", "rollout/expired", "rollout/filtered", "rollout/truncated")
KV_BINDING = ("inference.max_model_len=128", "rollout.max_context_tokens=128")
WITHIN = 0.10  # the policy's throughput must be within 10 % of the best fixed cap's (issue 45)


def _num(v: object) -> bool:
    return isinstance(v, (int, float)) and not math.isnan(v)


def _mean(values: list) -> float:
    vals = [v for v in values if _num(v)]
    return sum(vals) / len(vals) if vals else math.nan


def figures(steps: list[dict], summary: dict, *, warmup_steps: int, in_flight_budget: int) -> dict:
    """The comparison's figures from a run's per-step records (metrics.jsonl) and summary.json,
    over the steps after `warmup_steps`: throughput per minute of loop time (the steps' summed
    `timing_s/step`), KV usage, queue, the limit's trajectory and the policy's last decision."""
    before = steps[warmup_steps - 1] if 0 < warmup_steps <= len(steps) else {}
    steps = steps[warmup_steps:]
    span = sum(s.get("timing_s/step", 0.0) for s in steps)
    kv = [(s["perf/kv_cache_usage"], s["timing_s/step"]) for s in steps if _num(s.get("perf/kv_cache_usage"))]
    kv_span = sum(dt for _, dt in kv)
    last = steps[-1] if steps else {}
    preempted = last.get("rollout/engine_preempted", math.nan) - before.get("rollout/engine_preempted", 0.0)
    dispatched = last.get("rollout/dispatched", 0.0) - before.get("rollout/dispatched", 0.0)
    finished = sum(last.get(k, 0.0) - before.get(k, 0.0) for k in FINISHED)
    tokens = sum(s.get("perf/total_num_tokens", 0.0) for s in steps)
    limit = [s["rollout/concurrency_limit"] for s in steps if _num(s.get("rollout/concurrency_limit"))]
    in_flight = [s.get("rollout/dispatched", 0.0) - sum(s.get(k, 0.0) for k in FINISHED) for s in steps]
    return {
        "tokens_per_min": 60.0 * tokens / span if span > 0 else math.nan,
        "rollouts_per_min": 60.0 * finished / span if span > 0 else math.nan,
        "kv_usage_time_avg": sum(u * dt for u, dt in kv) / kv_span if kv_span > 0 else math.nan,
        "preemptions": preempted,
        "preemptions_per_100_rollouts": 100.0 * preempted / dispatched if dispatched else math.nan,
        "engine_waiting_mean": _mean([s.get("rollout/engine_waiting") for s in steps]),
        "inference_concurrency": _mean([s.get("perf/inference_concurrency") for s in steps]),
        "limit": ({"first": limit[0], "min": min(limit), "mean": sum(limit) / len(limit), "max": max(limit),
                   "last": limit[-1]} if limit else None),
        "settled_cap": last.get("rollout/concurrency_best_cap", math.nan),
        "probes": {k: last.get(f"rollout/concurrency_{k}") for k in ("probe_up", "probe_down", "trim_kv",
                                                                       "cancel_kv", "cut_waiting")},
        "running_groups_mean": _mean([s.get("rollout/running_groups") for s in steps]),
        "gate_blocked_s": last.get("rollout/concurrency_blocked_s", math.nan),
        "in_flight_mean": _mean(in_flight),
        "in_flight_budget": in_flight_budget,
        "staleness_mean": _mean([s.get("staleness/mean") for s in steps]),
        "step_s_mean": _mean([s.get("timing_s/step") for s in steps]),
        "rollouts": summary.get("rollout/dispatched"),
        "reward_initial": summary.get("reward/initial"),
        "reward_final": summary.get("reward/final"),
    }


def run_one(name: str, settings: list[str], args: argparse.Namespace, eta: int, work: Path) -> dict:
    """Run one configuration as a subprocess (or reuse its finished run dir); return its figures."""
    run_dir = work / f"eta{eta}_{name}"
    base = [f"+experiment={args.experiment}"] if args.experiment else []
    kv = () if (args.experiment and args.kv_cache_gib is None) or args.no_kv_binding else (
        f"inference.kv_cache_gib={args.kv_cache_gib or 0.0015}", *KV_BINDING)
    cmd = [sys.executable, "-m", "orchestrator.main", *base, "mode=async", *settings,
           f"async.max_staleness={eta}", f"trainer.total_steps={args.steps}", f"seed={args.seed}",
           "logger=console", f"run_dir={run_dir}", f"rollout.acr.session_rate_per_s={args.acr_rate}",
           f"rollout.acr.limits.requests_per_s={2 * args.acr_rate}", *kv, *args.overrides]
    wall_s = math.nan
    if (run_dir / "summary.json").is_file():
        print(f"{name} (eta {eta}): reusing {run_dir}", flush=True)
    else:
        print(f"{name} (eta {eta}): {' '.join(cmd[3:])}", flush=True)
        t0 = time.monotonic()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.timeout_s)
        wall_s = time.monotonic() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"{name} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    from orchestrator.watch.metrics import read_summary  # the product's reader

    summary = read_summary(run_dir / "summary.json")  # null (not measured) read as NaN
    return {"name": name, "eta": eta, "wall_s": wall_s, "overrides": cmd[3:],
            **figures(steps, summary, warmup_steps=args.warmup_steps, in_flight_budget=in_flight_budget(run_dir, eta))}


def in_flight_budget(run_dir: Path, eta: int) -> int:
    """Rollouts the staleness budget lets be in flight, (η + 1) × groups per version × n."""
    import yaml

    c = yaml.safe_load((run_dir / "config.yaml").read_text())
    return (eta + 1) * c["rollout"]["batch_size"] * c["rollout"]["n"]


def verdicts(rows: list[dict]) -> list[str]:
    """Per η: the best fixed cap and each policy's throughput against it (within `WITHIN`?)."""
    out = []
    for eta in sorted({r["eta"] for r in rows}):
        fixed = [r for r in rows if r["eta"] == eta and r["name"].startswith("cap")]
        best = max(fixed, key=lambda r: r["tokens_per_min"] if _num(r["tokens_per_min"]) else -1, default=None)
        for r in (r for r in rows if r["eta"] == eta and not r["name"].startswith("cap")):
            if best is None or not _num(best["tokens_per_min"]):
                out.append(f"eta {eta}: {r['name']}: no fixed cap to compare with")
                continue
            ratio = r["tokens_per_min"] / best["tokens_per_min"]
            rr = r["rollouts_per_min"] / best["rollouts_per_min"] if best["rollouts_per_min"] else math.nan
            out.append(f"eta {eta}: {r['name']} settled at cap {_f(r['settled_cap'], '.0f')} groups, "
                       f"{ratio:.2f}x the best fixed cap ({best['name']}) in tokens/min, {_f(rr, '.2f')}x in "
                       f"rollouts/min: {'within' if ratio >= 1 - WITHIN else 'NOT within'} {WITHIN:.0%}")
    return out


def _f(v: object, spec: str = ".3f") -> str:
    return format(v, spec) if _num(v) else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experiment", help="a Hydra experiment for every run, e.g. smollm2_local (the real model)")
    ap.add_argument("--caps", default="8,16,24,32,40",
                    help="fixed caps to sweep, in groups (async.max_concurrent_rollouts = cap x rollout.n; each "
                    "at least one mini-batch); empty: no sweep")
    ap.add_argument("--policies", default="adaptive", help="comma-separated subset of " + ",".join(POLICIES))
    ap.add_argument("--steps", type=int, default=60, help="weight syncs per run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-staleness", default="4", help="async.max_staleness (η), comma-separated: 0 is the "
                    "sync-like load, larger the async one; the comparison runs once per value")
    ap.add_argument("--n", type=int, default=4, help="rollout.n of the runs (to turn caps into rollouts)")
    ap.add_argument("--warmup-steps", type=int, default=2, help="first steps left out of the figures")
    ap.add_argument("--acr-rate", type=float, default=200.0,
                    help="ACR session creations per second (emulator); the limiter gets twice this (invoke + stop)")
    ap.add_argument("--kv-cache-gib", type=float, default=None,
                    help="inference.kv_cache_gib (default 0.0015 on the tiny model: 6 blocks; none with --experiment)")
    ap.add_argument("--no-kv-binding", action="store_true", help="leave out the small-cache overrides "
                    "(inference.kv_cache_gib, " + " ".join(KV_BINDING) + ")")
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="bound on one run")
    ap.add_argument("--out", type=Path, help="write the figures as JSON")
    ap.add_argument("--runs-dir", type=Path, help="keep each run dir here (default: a temporary dir); a run "
                    "whose dir there holds a summary.json is not run again")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = ap.parse_args()
    names = [p for p in args.policies.split(",") if p]
    if sorted(set(names) - set(POLICIES)):
        ap.error(f"unknown policy in {names}; choose from {list(POLICIES)}")
    caps = [int(c) for c in args.caps.split(",") if c]
    etas = [int(e) for e in args.max_staleness.split(",") if e]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-adaptive-") as tmp:
        work = args.runs_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for eta in etas:
            for cap in caps:
                rows.append(run_one(f"cap{cap}", ["rollout.concurrency=fixed", f"rollout.n={args.n}",
                                                  f"async.max_concurrent_rollouts={cap * args.n}"], args, eta, work))
            for name in names:
                rows.append(run_one(name, [f"rollout.concurrency={name}", f"rollout.n={args.n}"], args, eta, work))
    header = ("eta", "run", "tok/min", "rollouts/min", "settled cap", "limit min/mean/max/last", "KV avg",
              "preempt", "waiting", "in flight/budget", "reward 0->T", "step s")
    print("\n" + " | ".join(header))
    for r in rows:
        lim = r["limit"]
        cells = (str(r["eta"]), r["name"], _f(r["tokens_per_min"], ".0f"), _f(r["rollouts_per_min"], ".1f"),
                 _f(r["settled_cap"], ".0f"),
                 "/".join(_f(lim[k], ".0f" if k != "mean" else ".1f") for k in ("min", "mean", "max", "last"))
                 if lim else "-", _f(r["kv_usage_time_avg"]), _f(r["preemptions"], ".0f"),
                 _f(r["engine_waiting_mean"], ".2f"), f"{_f(r['in_flight_mean'], '.0f')}/{r['in_flight_budget']}",
                 f"{_f(r['reward_initial'], '.2f')}->{_f(r['reward_final'], '.2f')}", _f(r["step_s_mean"], ".2f"))
        print(" | ".join(cells))
    lines = verdicts(rows)
    print("\n" + "\n".join(lines))
    if args.out:
        args.out.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()}, "results": rows,
                                        "verdicts": lines}, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
