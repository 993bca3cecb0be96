"""What a warm pool of containers buys a long coding agent: the A2A lifecycle on the simulator.

Runs the A2A contract's bounded lifecycle (container slot, session rate, cold start and setup,
rollout slot, the agent's turns, rollout slot back, teardown, container slot back; the real one is
workers/rollout/lifecycle.py) model-free on the simulator's engines and virtual clock
(orchestrator/planning/sim/lifecycle.py: a saturated pool of rollouts, no training loop, so only
the rollout side is measured), on a SWE-Gym-like workload (orchestrator/planning/sim/workloads/
swe_gym.yaml: ~20-turn episodes up to 64 K tokens; setup lognormal, median 30 s, p90 ~ 108 s, p99 ~
5 min), twice: **cold**, container slots = rollout slots (every rollout sets up while holding its
container and nothing else is ready), and **warm**, container slots = factor x rollout slots
(containers beyond the rollout slots set up while they wait: a warm pool). agentcore-rl-toolkit
reports 1.20x inference requests/min from 256 containers against 128 rollout slots on SWE-Gym.

Printed and written (`--out FILE.json`) for both: inference requests (model turns) per minute,
rollout-slot utilisation (slot-seconds held / (slots x seconds)), mean wait for a rollout slot (s),
setup p50 / p90 (s, session creation to setup done), rollouts finished per minute, requests at an
engine per replica; and warm / cold for requests/min and utilisation. The figures leave out the
first quarter of the horizon (the pool filling). Simulated time; a few seconds of wall time.

    python scripts/bench_swe.py --out bench_swe.json
    python scripts/bench_swe.py --rollout-slots 128 --container-slots-factor 2 --hours 4 --seed 0 [--replicas 2]

Exit status: 0 done, 2 bad arguments (the message names the flag).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from orchestrator.planning.sim.lifecycle import simulate_lifecycle  # noqa: E402
from orchestrator.planning.sim.workload import WorkloadError, load_workload  # noqa: E402

SHOWN = (("inference_requests_per_min", "requests/min", ".1f"), ("rollout_slot_utilisation", "slot util", ".3f"),
         ("rollout_slot_wait_s_mean", "slot wait s", ".1f"), ("setup_s_p50", "setup p50 s", ".1f"),
         ("setup_s_p90", "setup p90 s", ".1f"), ("rollouts_finished_per_min", "rollouts/min", ".2f"),
         ("inference_concurrency", "conc/replica", ".1f"), ("wall_s", "wall s", ".1f"))


def container_slots(rollout_slots: int, factor: float) -> int:
    """The warm pool's container slots: factor x rollout slots, rounded (at least the rollout slots)."""
    return max(rollout_slots, int(round(rollout_slots * factor)))


def compare(cold: dict, warm: dict) -> dict:
    """warm / cold of the throughput and utilisation figures (NaN where cold is 0)."""
    keys = ("inference_requests_per_min", "rollout_slot_utilisation", "rollouts_finished_per_min")
    return {k: warm[k] / cold[k] if cold[k] else math.nan for k in keys}


def _check(args: argparse.Namespace) -> None:
    if args.rollout_slots < 1:
        raise ValueError(f"--rollout-slots must be >= 1, got {args.rollout_slots}")
    if not args.container_slots_factor >= 1:
        raise ValueError(f"--container-slots-factor must be >= 1 (container slots >= rollout slots), "
                         f"got {args.container_slots_factor}")
    if not args.hours > 0 or args.replicas < 1:
        raise ValueError(f"--hours must be > 0 and --replicas >= 1, got {args.hours} and {args.replicas}")
    if args.out and not args.out.parent.is_dir():
        raise ValueError(f"--out {args.out}: no directory {args.out.parent}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="swe_gym", help="a shipped workload name or a YAML path")
    ap.add_argument("--rollout-slots", type=int, default=128, help="rollout.rollout_slots (both runs)")
    ap.add_argument("--container-slots-factor", type=float, default=2.0,
                    help="warm run: container slots = factor x rollout slots (the cold run: 1)")
    ap.add_argument("--hours", type=float, default=4.0, help="simulated hours per run")
    ap.add_argument("--replicas", type=int, default=2, help="inference replicas (engine.gpus_per_replica GPUs each)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="write the figures as JSON")
    args = ap.parse_args(argv)
    try:
        _check(args)
        w = load_workload(args.workload)
    except (ValueError, WorkloadError) as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    r = args.rollout_slots
    runs = {name: simulate_lifecycle(w, rollout_slots=r, container_slots=c, replicas=args.replicas,
                                     hours=args.hours, seed=args.seed)
            for name, c in (("cold", r), ("warm", container_slots(r, args.container_slots_factor)))}
    result = {"workload": w.name, "rollout_slots": r, "container_slots_factor": args.container_slots_factor,
              "hours": args.hours, "seed": args.seed, "replicas": args.replicas, **runs,
              "warm_over_cold": compare(runs["cold"], runs["warm"])}
    print(f"{w.name}: {r} rollout slots, {args.replicas} replicas, {args.hours:g} simulated h, seed {args.seed}")
    print(f"{'':>6} {'containers':>10} " + " ".join(f"{label:>12}" for _, label, _ in SHOWN))
    for name, f in runs.items():
        print(f"{name:>6} {f['container_slots']:>10} " + " ".join(f"{f[k]:>12{fmt}}" for k, _, fmt in SHOWN))
    ratio = result["warm_over_cold"]
    print(f"warm / cold: requests/min {ratio['inference_requests_per_min']:.3f}x, rollout-slot utilisation "
          f"{ratio['rollout_slot_utilisation']:.3f}x (agentcore-rl-toolkit, SWE-Gym 256 vs 128: 1.20x requests/min)")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2, allow_nan=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
