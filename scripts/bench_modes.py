"""Benchmark the blog's four configurations (sync/async × 1/2 mini-batches per weight sync).

The async ones run twice: with partial rollouts (the default `async.in_flight=continue`: a weight
sync swaps the weights under the requests in flight, which go on with the new policy) and without
(`async_k_no_partial`: `async.in_flight=drain`, the sync waits for the requests in flight and holds
new ones), so the share of the async gain that partial rollouts give is a figure (verl and ROLL
attribute most of theirs to it).

Each configuration runs the real main job (`python -m orchestrator.main +experiment=blog_<mode>_<k>`)
on the same seed, prompts and model, with the example agent adding environment time drawn from a
log-normal distribution (median `--env-median-s`, shape `--env-sigma`, seeded by the rollout's
group and sample, so every configuration draws the same delays for the same rollouts), and
the table compares them: trained tokens per minute of loop time (startup and the first
`--warmup-steps` steps excluded: they hold engine warm-up and, in async mode, the pipeline fill),
optimizer steps per minute, time-average inference concurrency (Little's law at the gateway),
KV-cache usage when the engine reports it, mean staleness, masked fraction, the share of the
dispatched rollouts that expired, final reward, reward gain per CPU-hour (the report's reward gain
per GPU-hour on this machine: its cores times the run's loop time, as GPU-hours count the GPUs
held times the hours), speedup
over sync-1 (in trained tokens per minute; tokens per sample change as the policy learns, so the
step-rate speedup is printed beside it).

The workload is bound by environment time, as the blog's SWE-Gym agent is, not by ACR's request
quota: by default every configuration runs with a raised quota (`--acr-rate`: the emulator's
session-creation rate and the cluster-wide limiter), which a user asks AWS for at this scale.

    python scripts/bench_modes.py --out bench_modes.json [--steps 20] [--env-median-s 0.2] \
        [--runs-dir DIR] [--report docs/img/bench_modes]

On the real model (SmolLM2-135M-Instruct learning one-digit addition, docs/real-model.md): the
configuration's mode, mini-batches per sync and batch size applied to `+experiment=smollm2_local`
(its mini-batch of 8 groups; two of them per sync for sync-2 / async-2), validated on the held-out
prompts before the first update and after the last (`val_*` figures, the gain per CPU-hour):

    python scripts/bench_modes.py --model-experiment smollm2_local --configs sync_1,sync_2,async_1,async_2 \
        --steps 12 --warmup-steps 1 --env-median-s 0 --out bench_modes_smollm2.json

`--report` overlays the four runs in one set of plots (orchestrator/watch/report.py) with a table of
their headline figures; docs/benchmarks.md shows the images of the committed run.

`--validate` checks the simulator (orchestrator/planning/sim/) against this run of the bench: it fits a
workload from ONE of its runs (`--fit-from`, default sync_1) with scripts/workload_from_run.py,
simulates the four configurations on that workload (one shared CPU machine, `cluster=local`, the
same steps left out) without refitting, and prints measured against predicted, per minute:
throughput (every token of the trained samples, verl's `perf/total_num_tokens`, the measure of
the simulator's reference row), generated tokens trained (the policy's answer length, which
changes as it learns and differs between configurations: not the system's to predict), trained
samples, and rollouts finished (trained, filtered, failed or expired: the system's work, which
does not move with the share of groups the filter drops as the policy learns), with the error
of each.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "scripts")]  # the product's modules and workload_from_run, imported where used
NO_PARTIAL = "_no_partial"  # async with partial rollouts off: async.in_flight=drain
CONFIGS = ("sync_1", "sync_2", "async_1", "async_2", f"async_1{NO_PARTIAL}", f"async_2{NO_PARTIAL}")


def sync_every(name: str) -> int:
    """Mini-batches per weight sync of a configuration (`sync_2`, `async_2_no_partial` -> 2)."""
    return int(name.removesuffix(NO_PARTIAL).rsplit("_", 1)[1])


def syncs(name: str, updates: int) -> int:
    """Weight syncs (the main job's steps) that make `updates` optimizer updates in `name`: every
    configuration trains the same mini-batches, so reward gain per CPU-hour compares like with like."""
    return max(1, updates // sync_every(name))


def experiment_overrides(name: str, model_experiment: str | None) -> list[str]:
    """The Hydra overrides of configuration `name`: its blog preset (`+experiment=blog_sync_2`), or with
    `model_experiment` that preset's choices (mode, mini-batches per sync, a batch of that many
    mini-batches) on `+experiment=<model_experiment>`, whose rollout.batch_size is one mini-batch."""
    base = name.removesuffix(NO_PARTIAL)
    if model_experiment is None:
        return [f"+experiment=blog_{base}"]
    from hydra import compose, initialize_config_dir

    from orchestrator.config import register
    from orchestrator.config.hydra_errors import CONFIG_DIR

    register()  # the schema groups the configs' defaults name
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):  # as the entry point composes it
        mini_batch = int(compose("config", overrides=[f"+experiment={model_experiment}"]).rollout.batch_size)
    mode, k = base.rsplit("_", 1)
    return [f"+experiment={model_experiment}", f"mode={mode}", f"mode.sync_every={k}",
            f"rollout.batch_size={int(k) * mini_batch}", "trainer.val_before_train=true",
            f"trainer.test_freq={10**6}"]  # validated before the first update; the last step validates too (below)


def _mean(values: list[float]) -> float:
    vals = [v for v in values if isinstance(v, (int, float)) and not math.isnan(v)]
    return sum(vals) / len(vals) if vals else math.nan


def run_config(name: str, args: argparse.Namespace, work: Path) -> dict:
    """Run one configuration as a subprocess; return its figures (raises on a failed run)."""
    run_dir = work / name
    if (run_dir / "summary.json").is_file():  # kept from an earlier invocation with the same --runs-dir
        print(f"{name}: reusing {run_dir}", flush=True)
        return _figures(name, args, run_dir, wall_s=math.nan)
    no_partial = ["async.in_flight=drain"] if name.endswith(NO_PARTIAL) else []
    cmd = [sys.executable, "-m", "orchestrator.main", *experiment_overrides(name, args.model_experiment), *no_partial,
           f"trainer.total_steps={syncs(name, args.steps)}", f"seed={args.seed}", "logger=console", f"run_dir={run_dir}",
           f"+rollout.acr.agent_env.LETTERS_ENV_TIME_MEDIAN_S={args.env_median_s}",
           f"+rollout.acr.agent_env.LETTERS_ENV_TIME_SIGMA={args.env_sigma}",
           f"rollout.acr.session_rate_per_s={args.acr_rate}", f"rollout.acr.limits.requests_per_s={2 * args.acr_rate}",
           *args.overrides]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.timeout_s)
    wall_s = time.monotonic() - t0
    if proc.returncode == 2:  # the main job refused its config: say why, no traceback
        errors = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("config error")]
        sys.exit(f"{name}: {errors[-1] if errors else proc.stderr.strip()[-500:]}")
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return _figures(name, args, run_dir, wall_s)


def _figures(name: str, args: argparse.Namespace, run_dir: Path, wall_s: float) -> dict:
    all_steps = [s for s in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
                 if "timing_s/step" in s]  # the step records (validation before training logs one of its own, step 0)
    warmup = syncs(name, args.warmup_steps) if args.warmup_steps else 0
    steps = all_steps[warmup:]
    from orchestrator.watch.metrics import read_summary
    summary = read_summary(run_dir / "summary.json")  # null (not measured) read as NaN
    loop_s = sum(s["timing_s/step"] for s in steps)
    tokens = sum(s.get("perf/trained_tokens", 0.0) for s in steps)
    total_tokens = sum(s.get("perf/total_num_tokens", math.nan) for s in steps)  # NaN: a run before it was logged
    n = _group_size(run_dir)
    base = all_steps[warmup - 1] if warmup else {}
    samples = n * (all_steps[-1].get("rollout/trained_groups", 0.0) - base.get("rollout/trained_groups", 0.0))
    from orchestrator.planning.sim.run import finished_rollouts  # the simulator's count, so both sides count alike

    finished = finished_rollouts(all_steps[-1]) - finished_rollouts(base)
    masked = [s.get("rollout_corr/rollout_rs_masked_fraction", 0.0) for s in steps]
    # the report's final measure, reward gain per GPU-hour, here per CPU-hour: as GPU-hours count
    # the GPUs held times the hours, the machine's cores times the run's loop time (every step);
    # the CPU its processes actually used (perf/cpu_s/total) is reported beside it
    cpu_hours = os.cpu_count() * sum(s["timing_s/step"] for s in all_steps) / 3600.0
    cpu_s = sum(s.get("perf/cpu_s/total", 0.0) for s in all_steps)
    gain = summary["reward/final"] - summary["reward/initial"]
    val_gain = summary.get("val/reward/final", math.nan) - summary.get("val/reward/initial", math.nan)
    return {
        "config": name,
        "trained_tokens_per_min": 60.0 * tokens / loop_s if loop_s > 0 else 0.0,
        "total_tokens_per_min": 60.0 * total_tokens / loop_s if loop_s > 0 else 0.0,
        "steps_per_min": 60.0 * len(steps) / loop_s if loop_s > 0 else 0.0,
        "trained_samples_per_min": 60.0 * samples / loop_s if loop_s > 0 else 0.0,
        "finished_rollouts_per_min": 60.0 * finished / loop_s if loop_s > 0 else 0.0,
        "tokens_per_sample": tokens / samples if samples else math.nan,
        "step_s_mean": loop_s / len(steps) if steps else math.nan,
        "wait_for_batch_s_mean": _mean([s.get("timing_s/wait_for_batch", s.get("timing_s/gen", math.nan)) for s in steps]),
        "update_s_mean": _mean([s.get("timing_s/update_actor", math.nan) for s in steps]),
        "inference_concurrency": _mean([s.get("perf/inference_concurrency", math.nan) for s in steps]),
        "kv_cache_usage": _mean([s.get("perf/kv_cache_usage", math.nan) for s in steps]),
        "staleness_mean": _mean([s.get("staleness/mean", 0.0) for s in steps]),
        "masked_fraction": _mean(masked),
        "reward_initial": summary["reward/initial"],
        "reward_final": summary["reward/final"],
        "cpu_hours": cpu_hours,
        "cpu_s_used": cpu_s,
        "reward_gain_per_cpu_hour": gain / cpu_hours if cpu_hours > 0 else math.nan,
        # held-out validation before the first update and after the last (--model-experiment; NaN without)
        "val_initial": summary.get("val/reward/initial", math.nan), "val_final": summary.get("val/reward/final", math.nan),
        "val_gain_per_cpu_hour": val_gain / cpu_hours if cpu_hours > 0 else math.nan,
        "val_gain_per_cpu_hour_used": val_gain / (cpu_s / 3600.0) if cpu_s > 0 else math.nan,
        "expired_fraction": summary.get("rollout/expired", 0.0) / max(1.0, summary["rollout/dispatched"]),
        "loop_s": loop_s,
        "wall_s": wall_s,
        "rollouts": summary["rollout/dispatched"],
    }


def _group_size(run_dir: Path) -> int:
    import yaml

    return int(yaml.safe_load((run_dir / "config.yaml").read_text())["rollout"]["n"])


def validate(rows: list[dict], work: Path, args: argparse.Namespace) -> list[dict]:
    """Fit a workload from the `--fit-from` run, simulate every configuration of `rows` on it (one
    shared CPU machine, as cluster=local), return measured vs predicted per configuration."""
    import yaml
    from dataclasses import replace

    from orchestrator.planning.sim.run import CONFIGS as SIM_CONFIGS, simulate
    from orchestrator.planning.sim.workload import parse_workload
    from workload_from_run import fit, fit_warnings

    raw = fit(work / args.fit_from, prompt_tokens=args.prompt_tokens, kv_tokens=1_000_000,
              warmup_steps=args.warmup_steps)
    (work / "fitted_workload.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    for warning in fit_warnings(raw):
        print(f"warning: {warning}", flush=True)
    w = parse_workload(raw, str(work / "fitted_workload.yaml"))
    out = []
    for r in rows:
        if r["config"] not in SIM_CONFIGS:  # the simulator's engine keeps generating across a swap (continue)
            continue
        sc = replace(SIM_CONFIGS[r["config"]], gpus=1, colocated=True, sleeps=False)
        f = simulate(w, sc, hours=args.sim_hours, seed=args.seed,
                     warmup_steps=syncs(r["config"], args.warmup_steps) if args.warmup_steps else 0)
        row = {"config": r["config"], "fitted_from": args.fit_from}
        for key, sim_key in (("total_tokens_per_min", "tokens_per_min_per_gpu"),  # gpus=1
                             ("trained_tokens_per_min", "generated_tokens_per_min"),
                             ("trained_samples_per_min", "trained_samples_per_min"),
                             ("finished_rollouts_per_min", "finished_rollouts_per_min")):
            row[f"measured_{key}"], row[f"predicted_{key}"] = r[key], f[sim_key]
            row[f"error_{key}"] = f[sim_key] / r[key] - 1 if r[key] else math.nan
        row |= {"measured_step_s": r["step_s_mean"], "predicted_step_s": f["step_s_mean"],
                "measured_concurrency": r["inference_concurrency"], "predicted_concurrency": f["inference_concurrency"],
                "measured_tokens_per_sample": r["tokens_per_sample"]}
        out.append(row)
    return out


def print_validation(out: list[dict], args: argparse.Namespace) -> None:
    print(f"\nvalidation: workload fitted from the {args.fit_from} run (fitted_workload.yaml in the runs dir), "
          f"simulated {args.sim_hours} h per configuration")
    head = ("config", "tok/min meas", "tok/min sim", "error", "gen/min meas", "gen/min sim", "error",
            "samp/min meas", "samp/min sim", "error", "roll/min meas", "roll/min sim", "error", "step_s meas",
            "step_s sim")
    print(" | ".join(f"{h:>13}" for h in head))
    for v in out:
        cells = [v["config"]]
        for key in ("total_tokens_per_min", "trained_tokens_per_min", "trained_samples_per_min",
                    "finished_rollouts_per_min"):
            cells += [f"{v['measured_' + key]:.0f}", f"{v['predicted_' + key]:.0f}", f"{100 * v['error_' + key]:+.1f} %"]
        cells += [f"{v['measured_step_s']:.2f}", f"{v['predicted_step_s']:.2f}"]
        print(" | ".join(f"{c:>13}" for c in cells))


def partial_share(rows: list[dict]) -> dict[str, float]:
    """async_k -> the share of its trained-tokens/min gain over sync-1 that partial rollouts give:
    (async_k - async_k_no_partial) / (async_k - sync_1), for each k whose three rows ran."""
    by = {r["config"]: r["trained_tokens_per_min"] for r in rows}
    out = {}
    for k in ("async_1", "async_2"):
        if {k, k + NO_PARTIAL, "sync_1"} <= by.keys() and by[k] != by["sync_1"]:
            out[k] = (by[k] - by[k + NO_PARTIAL]) / (by[k] - by["sync_1"])
    return out


def print_partial_share(rows: list[dict]) -> None:
    for k, share in partial_share(rows).items():
        print(f"{k}: partial rollouts (in-flight weight update, async.in_flight=continue) give {100 * share:.0f} % "
              f"of its gain over sync_1 ({k}{NO_PARTIAL}: a weight sync waits for the requests in flight)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20,
                    help="optimizer updates (mini-batches) per configuration: steps / sync_every weight syncs")
    ap.add_argument("--env-median-s", type=float, default=0.2, help="median environment time per rollout (s)")
    ap.add_argument("--env-sigma", type=float, default=1.0, help="log-normal shape of the environment time")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup-steps", type=int, default=2,
                    help="first optimizer updates left out of the figures (in whole weight syncs)")
    ap.add_argument("--acr-rate", type=float, default=200.0,
                    help="ACR session creations per second (emulator); the limiter gets twice this (invoke + stop)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of " + ",".join(CONFIGS))
    ap.add_argument("--timeout-s", type=float, default=600.0, help="bound on one configuration's run")
    ap.add_argument("--out", type=Path, help="write the figures as JSON")
    ap.add_argument("--runs-dir", "--keep-runs", type=Path, help="keep each configuration's run dir here (for "
                    "scripts/workload_from_run.py; default: a temporary dir); a configuration whose run dir there holds a summary.json is not run again")
    ap.add_argument("--report", type=Path, help="write the comparison report (PNG plots + report.html) here")
    ap.add_argument("--validate", action="store_true",
                    help="fit a workload from one run and compare the simulator's predictions with all four")
    ap.add_argument("--fit-from", default="sync_1", choices=CONFIGS,
                    help="--validate: the run the workload is fitted from")
    ap.add_argument("--prompt-tokens", type=float,
                    help="--validate: prompt tokens per sample (default: measured from the fit run's perf/total_num_tokens)")
    ap.add_argument("--sim-hours", type=float, default=0.1, help="--validate: simulated hours per configuration")
    ap.add_argument("--model-experiment", help="run the configurations on this experiment preset (e.g. smollm2_local, "
                    "the real model) instead of the blog presets on the embedded default")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for every configuration")
    args = ap.parse_args()
    names = [c for c in args.configs.split(",") if c]
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        ap.error(f"unknown configuration(s) {unknown}; choose from {list(CONFIGS)}")
    if args.validate and args.fit_from not in names:
        ap.error(f"--fit-from {args.fit_from} is not among --configs {names}")
    rows, checks = [], []
    with tempfile.TemporaryDirectory(prefix="bench-modes-") as tmp:
        work = args.runs_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for name in names:
            print(f"running {name} ...", flush=True)
            rows.append(run_config(name, args, work))
        if args.report:
            from orchestrator.watch.report import build_report

            html, plots = build_report([work / n for n in names], args.report, warmup_steps=args.warmup_steps)
            print(f"report: {html} ({len(plots)} plots)")
        if args.validate:
            checks = validate(rows, work, args)
    base = next((r for r in rows if r["config"] == "sync_1"), rows[0])
    for r in rows:
        r["speedup"] = r["trained_tokens_per_min"] / base["trained_tokens_per_min"] if base["trained_tokens_per_min"] else math.nan
        r["speedup_steps"] = r["steps_per_min"] / base["steps_per_min"] if base["steps_per_min"] else math.nan
    header = ("config", "tok/min", "steps/min", "concurrency", "kv_usage", "staleness", "masked", "expired",
              "reward 0->T", "reward/CPU-h", "val 0->T", "val/CPU-h", "speedup", "step speedup")
    print("\n" + " | ".join(f"{h:>12}" for h in header))
    for r in rows:
        cells = (r["config"], f"{r['trained_tokens_per_min']:.0f}", f"{r['steps_per_min']:.1f}",
                 f"{r['inference_concurrency']:.2f}",
                 f"{r['kv_cache_usage']:.3f}", f"{r['staleness_mean']:.2f}", f"{r['masked_fraction']:.3f}",
                 f"{100 * r['expired_fraction']:.1f}%", f"{r['reward_initial']:.2f}->{r['reward_final']:.2f}",
                 f"{r['reward_gain_per_cpu_hour']:.2f}", f"{r['val_initial']:.2f}->{r['val_final']:.2f}",
                 f"{r['val_gain_per_cpu_hour']:.2f}", f"{r['speedup']:.2f}x",
                 f"{r['speedup_steps']:.2f}x")
        print(" | ".join(f"{c:>12}" for c in cells))
    print_partial_share(rows)
    if checks:
        print_validation(checks, args)
    if args.out:
        args.out.write_text(json.dumps({"settings": {k: v for k, v in vars(args).items() if k != "out"}
                                        | {"out": str(args.out)}, "results": rows, "validation": checks,
                                        "partial_rollout_share": partial_share(rows)},
                                       indent=2, default=str) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
