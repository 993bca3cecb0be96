"""Simulate the product at cluster scale (a thin wrapper over `python -m orchestrator.planning.simulate`).

    python scripts/simulate.py --workload reference --gpus 64 --hours 10 --policy adaptive --out F.json
    python scripts/simulate.py --workload reference --gpus 64 --hours 10 --policy fixed --config sync_1
    python scripts/simulate.py --workload reference --gpus 64 --sweep --hours 3

Writes (with --out) at least: kv_usage_mean, throughput_ratio_vs_sync1, staleness_max,
staleness_mean, eta, sim_hours, wall_s. Extra flags go to the planner (--eta, --sync-every,
--trainer-gpus, --baseline, --staleness-bound, --run-dir DIR for metrics.jsonl/summary.json/timeline.jsonl;
--rollout-slots, --container-slots and --container-factors for the A2A lifecycle's caps:

    python scripts/simulate.py --workload swe_gym --gpus 16 --hours 3 --config async_1 --eta 3 \
        --rollout-slots 128 --container-factors 1,1.5,2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from orchestrator.planning.simulate import main as planner  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="reference")
    ap.add_argument("--gpus", type=int, default=64)
    ap.add_argument("--hours", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--run-dir")
    args, rest = ap.parse_known_args()
    settings = [f"workload={args.workload}", f"gpus={args.gpus}", f"hours={args.hours}", f"seed={args.seed}"]
    if args.run_dir:
        settings.append(f"run_dir={args.run_dir}")
    return planner(settings + rest)


if __name__ == "__main__":
    sys.exit(main())
