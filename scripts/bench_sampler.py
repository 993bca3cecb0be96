"""Benchmark the prompt samplers: `task.sampler=uniform` vs `difficulty`, in sync and async mode.

Each of the four points runs the real main job (`python -m orchestrator.main`, the `make run`
defaults plus `mode=...` and `task.sampler=...`) on the same seed, one after the other, and the
JSON written to `--out` has the shape `{"sync": {"uniform": {...}, "difficulty": {...}}, "async": {...}}`.
Each leaf holds:

- `filtered_fraction`: rollouts filtered as zero-variance groups / rollouts dispatched;
- `dispatched`: rollouts dispatched (each is one ACR invocation); `trained_groups`;
  `dispatched_per_trained_group`;
- `reward_initial`, `reward_final`: summary.json's mean reward of the first / last 10 % of steps,
  over the prompts *drawn* (the difficulty sampler draws harder prompts, which lowers this figure
  without the policy being worse);
- `reward_final_uniform`: the last 10 % of steps' `sampler/reward_uniform` (importance-weighted to
  uniform prompt draws, orchestrator/loop/sampler.py); equal to `reward_final` for `uniform`;
- `acr_invocations_per_reward_point`: dispatched / (100 · (reward_final − reward_initial)), i.e.
  ACR invocations per percentage point of training-reward gain (NaN when there is no gain);
- `val_reward_initial`, `val_reward_final`, `val_reward_final_sem`: mean reward on the held-out
  split (`task.val_split`, every prompt × `eval.n`) before the first step and after the last
  (`trainer.val_before_train=true trainer.test_freq=<steps>`; validation rollouts are not in the
  ledger, so they change no other figure); `acr_invocations_per_val_point`: dispatched per
  percentage point of held-out reward gain.

With `--parallel`, the samplers of one mode run at the same time (the pair compared shares the
machine's load; the modes still run one after the other).

    python scripts/bench_sampler.py --out bench_sampler.json [--steps 60] [--modes sync async] \
        [--samplers uniform difficulty] [--parallel] [Hydra overrides for every run, e.g. task.sampler_floor=0.1]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the product's modules, imported where used
SAMPLERS = ("uniform", "difficulty")


def _tail_mean(values: list[float], fraction: float = 0.1) -> float:
    vals = [v for v in values if isinstance(v, (int, float)) and not math.isnan(v)]
    if not vals:
        return math.nan
    k = max(1, int(len(vals) * fraction))
    return sum(vals[-k:]) / k


def run_point(mode: str, sampler: str, args: argparse.Namespace, work: Path) -> dict:
    """Run one (mode, sampler) point as a subprocess; return its figures (raises on a failed run)."""
    run_dir = work / f"{mode}_{sampler}"
    total_steps = args.steps or 60
    cmd = [sys.executable, "-m", "orchestrator.main", f"mode={mode}", f"task.sampler={sampler}", f"seed={args.seed}",
           f"run_dir={run_dir}", f"trainer.total_steps={total_steps}", "trainer.val_before_train=true",
           f"trainer.test_freq={total_steps}", *args.overrides]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode}/{sampler} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    from orchestrator.watch.metrics import read_summary  # the product's reader
    summary = read_summary(run_dir / "summary.json")  # null (not measured) read as NaN
    dispatched = summary["rollout/dispatched"]
    gain = summary["reward/final"] - summary["reward/initial"]
    val_gain = summary.get("val/reward/final", math.nan) - summary.get("val/reward/initial", math.nan)
    reward_uniform = (_tail_mean([s.get("sampler/reward_uniform", math.nan) for s in steps])
                      if sampler == "difficulty" else summary["reward/final"])
    return {
        "filtered_fraction": summary["rollout/filtered"] / dispatched if dispatched else math.nan,
        "reward_initial": summary["reward/initial"],
        "reward_final": summary["reward/final"],
        "reward_final_uniform": reward_uniform,
        "dispatched": dispatched,
        "trained_groups": summary.get("rollout/trained_groups"),
        "dispatched_per_trained_group": summary.get("rollout/dispatched_per_trained_group"),
        "acr_invocations_per_reward_point": dispatched / (100.0 * gain) if gain > 0 else math.nan,
        "val_reward_initial": summary.get("val/reward/initial", math.nan),
        "val_reward_final": summary.get("val/reward/final", math.nan),
        "val_reward_final_sem": _tail_mean([s.get("val/reward/sem", math.nan) for s in steps], 0.0),
        "acr_invocations_per_val_point": (dispatched / (100.0 * val_gain) if val_gain > 0 else math.nan),
        "acr_requests": summary.get("acr/requests"),
        "sampler_entropy_final": _tail_mean([s.get("sampler/entropy", math.nan) for s in steps], 0.0),
        "steps": summary["steps"],
        "wall_s": time.monotonic() - t0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--modes", nargs="+", default=["sync", "async"], choices=["sync", "async"])
    ap.add_argument("--samplers", nargs="+", default=list(SAMPLERS), choices=list(SAMPLERS))
    ap.add_argument("--steps", type=int, default=60, help="trainer.total_steps (the make run default: 60)")
    ap.add_argument("--parallel", action="store_true", help="run the samplers of one mode at the same time")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=2700.0, help="per run (seconds)")
    ap.add_argument("--work-dir", default=None, help="where the runs go (default: a temporary directory)")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = ap.parse_args()
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="bench_sampler_"))
    out: dict[str, dict[str, dict]] = {}
    for mode in args.modes:
        with ThreadPoolExecutor(max_workers=len(args.samplers) if args.parallel else 1) as pool:
            points = list(pool.map(lambda sampler: run_point(mode, sampler, args, work), args.samplers))
        for sampler, point in zip(args.samplers, points):
            out.setdefault(mode, {})[sampler] = point
            print(f"{mode:5s} {sampler:10s} filtered {point['filtered_fraction']:.3f} "
                  f"reward {point['reward_final']:.3f} (uniform-weighted {point['reward_final_uniform']:.3f}) "
                  f"dispatched {point['dispatched']} per trained group {point['dispatched_per_trained_group']} "
                  f"val {point['val_reward_initial']:.3f} -> {point['val_reward_final']:.3f}", flush=True)
            Path(args.out).write_text(json.dumps(out, indent=2, allow_nan=True) + "\n")  # partial results survive
    print(f"wrote {args.out} (runs under {work})")


if __name__ == "__main__":
    main()
