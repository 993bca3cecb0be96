"""Hold the simulator against the public report's four rows, one trainer throughput at a time.

The report (agentcore-rl-toolkit, "Async RL Performance Optimization", 2026-10-01: Qwen3-Coder-30B
on SWE-Gym, 16 GPUs: sync modes on 2 colocated 8-GPU replicas, async modes on 1 trainer node and 1
inference node) gives throughput (kilo-tokens/min/GPU) and inference concurrency per replica for
sync-1, sync-2, async-1 and async-2 (`REPORT`). Only sync-1 is fitted (the two time scales,
orchestrator/planning/sim/calibrate.py); the three others are the check.

The trainer's throughput is the one quantity the report does not give as a number ("inference and
training servers can have roughly the same throughput per GPU"), and it decides whether the async
gains are capped: at a 1:1 split an async run can never exceed half the trainer's per-GPU rate per
GPU of the cluster. `check` sets it (`trainer_tokens_per_min_per_gpu`; None: the workload's own,
`match_inference_peak`), re-fits the two scales to sync-1 under it, simulates the four
configurations and returns each with its error against the report. Invariant: nothing is fitted
to a row other than sync-1.

    python -m orchestrator.planning.sim.public_check --gpus 16 --hours 10 --trainer none,120000,80000
    python -m orchestrator.planning.sim.public_check --gpus 16 --hours 10 --trainer 80000 --container-slots 256

With an 80 k tokens/min/GPU trainer and a pool of 256 containers (one sync-1 step's sessions) the
three checked rows land within 4 % of the report (docs/simulator-validation.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from orchestrator.planning.sim.calibrate import Target, calibrate
from orchestrator.planning.sim.run import CONFIGS, Scenario, simulate
from orchestrator.planning.sim.workload import Workload, load_workload

# config: (throughput k tokens/min/GPU, speedup vs sync-1, inference concurrency per replica)
REPORT = {"sync_1": (27.82, 1.00, 11.03), "sync_2": (34.47, 1.24, 15.20),
          "async_1": (38.49, 1.38, 33.97), "async_2": (39.39, 1.42, 38.22)}
ROW_KEYS = ("tokens_per_min_per_gpu", "inference_concurrency", "inference_concurrency_wall", "awake_fraction",
            "trainer_busy_fraction", "trainer_tokens_per_min_per_gpu", "kv_usage_mean", "staleness_mean",
            "staleness_max", "expired_fraction", "container_slots_peak", "wall_s")  # each row's figures


def with_trainer(w: Workload, tokens_per_min_per_gpu: float | None) -> Workload:
    """`w` with a trainer of that many trajectory tokens per minute per GPU (None: unchanged)."""
    if tokens_per_min_per_gpu is None:
        return w
    return replace(w, trainer={**{k: v for k, v in w.trainer.items() if k != "match_inference_peak"},
                               "tokens_per_s_per_gpu": tokens_per_min_per_gpu / 60.0})


def check(w: Workload, *, gpus: int, hours: float, trainer_tokens_per_min_per_gpu: float | None,
          seed: int = 0, refit: bool = True, container_slots: int | None = None, log=print) -> dict:
    """Re-fit sync-1 under the given trainer, then simulate the four configurations; returns the
    fit and one row per configuration with the report's figures beside. `container_slots` caps the
    ACR sessions open at once in all four (rollout.acr.limits.max_open_sessions; None: no cap); the
    fit runs without it, so a cap at or above sync-1's rollouts per step leaves the fit as it is."""
    w = with_trainer(w, trainer_tokens_per_min_per_gpu)
    fit = None
    if refit:
        w, fit = calibrate(w, Target(), gpus=gpus, hours=min(hours, 4.0), seed=seed, log=log)
    rows = {}
    for name, sc in CONFIGS.items():
        f = simulate(w, Scenario(sc.mode, sc.sync_every, sc.colocated, gpus=gpus, container_slots=container_slots),
                     hours=hours, seed=seed)
        rows[name] = {k: f[k] for k in ROW_KEYS}
        log(f"{name}: {f['tokens_per_min_per_gpu']:.0f} tok/min/GPU, concurrency {f['inference_concurrency']:.1f} "
            f"(wall {f['inference_concurrency_wall']:.1f}), trainer busy {f['trainer_busy_fraction']:.2f}")
    base = rows["sync_1"]["tokens_per_min_per_gpu"]
    for name, r in rows.items():
        tput, speedup, conc = REPORT[name]
        r["speedup"] = r["tokens_per_min_per_gpu"] / base
        r["report"] = {"tokens_per_min_per_gpu": tput * 1000, "speedup": speedup, "inference_concurrency": conc}
        r["speedup_error"] = r["speedup"] / speedup - 1
    return {"trainer_tokens_per_min_per_gpu": trainer_tokens_per_min_per_gpu, "gpus": gpus, "hours": hours,
            "seed": seed, "container_slots": container_slots, "fit": fit, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="reference")
    ap.add_argument("--gpus", type=int, default=16, help="the report's cluster: 16 (2 nodes)")
    ap.add_argument("--hours", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trainer", default="none", help="comma-separated trainer throughputs, trajectory tokens per "
                    "minute per GPU; none: the workload's own (match_inference_peak)")
    ap.add_argument("--container-slots", type=int, help="ACR sessions open at once in every configuration "
                    "(a container pool); default: no cap")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    w = load_workload(args.workload)
    results = []
    for t in args.trainer.split(","):
        rate = None if t.strip() == "none" else float(t)
        results.append(check(w, gpus=args.gpus, hours=args.hours, trainer_tokens_per_min_per_gpu=rate, seed=args.seed,
                             container_slots=args.container_slots))
    print("\ntrainer tok/min/GPU | config | speedup (report) | concurrency awake / wall (report) | trainer busy")
    for res in results:
        for name, r in res["rows"].items():
            print(f"{res['trainer_tokens_per_min_per_gpu'] or r['trainer_tokens_per_min_per_gpu']:.0f} | {name} | "
                  f"{r['speedup']:.2f}x ({r['report']['speedup']:.2f}x) | {r['inference_concurrency']:.1f} / "
                  f"{r['inference_concurrency_wall']:.1f} ({r['report']['inference_concurrency']:.2f}) | "
                  f"{r['trainer_busy_fraction']:.2f}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
