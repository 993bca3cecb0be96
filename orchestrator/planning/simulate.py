"""The planner: simulate a workload on a cluster before renting it (orchestrator/planning/sim/).

    python -m orchestrator.planning.simulate workload=reference gpus=64 hours=10 --config sync_1
    python -m orchestrator.planning.simulate workload=reference gpus=64 --policy adaptive --out f.json
    python -m orchestrator.planning.simulate workload=reference gpus=64 --sweep [--staleness-bound 1]
    python -m orchestrator.planning.simulate workload=reference --calibrate   # refit the two free parameters

A run prints its figures (tokens/min/GPU, inference concurrency per replica, KV usage, staleness)
and with `run_dir=DIR` writes the real run's `metrics.jsonl` and `summary.json` plus
`timeline.jsonl` there. `--sweep` simulates every configuration of a grid (trainer : inference
split, η, `sync_every`, concurrency policy, and the sync modes), prints a table and the best
configuration whose staleness stays within η (max) and the bound (mean), as the Hydra overrides
of `python -m orchestrator.main`. `--policy adaptive` without further flags uses the workload's
`plan` section (the split, η and `sync_every` the sweep chose). `--rollout-slots` and
`--container-slots` cap the A2A rollout lifecycle (orchestrator/planning/sim/agent.py; a workload
with `agent.setup_s` sets up before its rollout slot); `--container-factors 1,1.5,2` with
`--rollout-slots` simulates the one configuration at each container : rollout ratio and picks the
fewest containers whose rollout-slot utilisation is within 0.01 of the best feasible one (a warm
pool only pays while the loop keeps more rollouts in flight than rollout slots).

    python -m orchestrator.planning.simulate workload=swe_gym gpus=16 hours=3 --config async_1 --eta 3 \
        --staleness-bound 2 --rollout-slots 128 --container-factors 1,1.5,2

Exit status: 0 done, 2 bad arguments or workload (the message names the key).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from orchestrator.planning.sim.run import CONFIGS, POLICIES, Scenario, SimulationTooShort, simulate
from orchestrator.planning.sim.workload import Workload, WorkloadError, load_workload
from orchestrator.watch.metrics import finite_json

KEYS = ("workload", "gpus", "hours", "seed", "run_dir")
COLUMNS = ("config", "tok/min/GPU", "ratio", "conc/replica", "kv_usage", "st_mean", "st_max", "expired", "cpu_s")


def plan_scenario(w: Workload, gpus: int, *, policy: str = "adaptive", trainer_gpus: int | None = None,
                  eta: int | None = None, sync_every: int | None = None) -> Scenario:
    """The async, disaggregated scenario of the workload's `plan` section, flags overriding it."""
    plan = dict(w.calibration.get("plan") or {})
    share = float(plan.get("trainer_share", 0.5))
    trn = trainer_gpus if trainer_gpus is not None else int(round(gpus * share))
    k = sync_every if sync_every is not None else int(plan.get("sync_every", 1))
    return Scenario("async", k, False, gpus=gpus, trainer_gpus=trn,
                    max_staleness=int(eta if eta is not None else plan.get("max_staleness", 1)), policy=policy)


GRIDS = {  # trainer shares, η, sync_every, policies
    "full": ((0.375, 0.5, 0.625), (1, 2), (1, 2, 4, 8), ("fixed", "adaptive")),
    "small": ((0.5, 0.625), (1, 2), (2, 4, 8), ("adaptive",)),
}


def sweep_grid(w: Workload, gpus: int, grid_name: str = "full") -> dict[str, Scenario]:
    """Sync modes (colocated) plus async (disaggregated) over split × η × sync_every × policy."""
    gpr = int(w.engine["gpus_per_replica"])
    shares, etas, ks, policies = GRIDS[grid_name]
    grid = {f"sync_{k}": Scenario("sync", k, True, gpus=gpus) for k in (1, 2)}
    grid |= {f"async_{k}": Scenario("async", k, False, gpus=gpus) for k in (1, 2)}
    for share in shares:
        inf = max(gpr, int(round(gpus * (1 - share) / gpr)) * gpr)
        if inf >= gpus:
            continue
        for eta in etas:
            for k in ks:
                for pol in policies:
                    grid[f"async_t{gpus - inf}_eta{eta}_k{k}_{pol}"] = Scenario(
                        "async", k, False, gpus=gpus, trainer_gpus=gpus - inf, max_staleness=eta, policy=pol)
    return grid


MAX_EXPIRED_FRACTION = 0.01  # a configuration that expires more of what it dispatched wastes ACR invocations


def feasible(f: dict, staleness_bound: float) -> bool:
    """Trained staleness within η, mean within the bound, and under 1 % of the dispatched rollouts
    expired as too stale (each is a paid invocation whose tokens are thrown away)."""
    return ("error" not in f and f["staleness_max"] <= max(f["eta"], 0) and f["staleness_mean"] <= staleness_bound
            and f.get("expired_fraction", 0.0) < MAX_EXPIRED_FRACTION)


def recommendation_reasons(rows: dict[str, dict], ok: dict[str, dict], best: str | None, bound: float) -> list[str]:
    """Why the sweep recommends `best` (or nothing): what it beat, what was ruled out and by which
    rule, and which of the four knobs (split, η, `sync_every`, concurrency policy) mattered, each
    as the best feasible throughput per value of that knob. Pure: figures in, sentences out."""
    def rate(name: str) -> float:
        return rows[name]["tokens_per_min_per_gpu"]

    out: list[str] = []
    failed = {k: f for k, f in rows.items() if "error" in f}
    stale = [k for k, f in rows.items() if k not in failed and f["staleness_max"] > max(f["eta"], 0)]
    drift = [k for k, f in rows.items() if k not in failed and f["staleness_mean"] > bound]
    waste = [k for k, f in rows.items() if k not in failed and f.get("expired_fraction", 0.0) >= MAX_EXPIRED_FRACTION]
    out.append(f"{len(ok)} of {len(rows)} configurations feasible; ruled out: {len(waste)} expired >= 1 % of "
               f"their rollouts, {len(drift)} mean staleness > {bound}, {len(stale)} trained staler than eta, "
               f"{len(failed)} too short to measure")
    if best is None:
        return out
    ranked = sorted(ok, key=rate, reverse=True)
    if len(ranked) > 1:
        out.append(f"{best} is {rate(best) / rate(ranked[1]):.2f}x the next feasible one ({ranked[1]})")
    if "sync_1" in rows and "error" not in rows["sync_1"]:
        out.append(f"{best} is {rate(best) / rate('sync_1'):.2f}x sync_1")
    for knob, pattern in (("trainer GPUs", r"_t(\d+)_"), ("eta", r"_eta(\d+)_"), ("sync_every", r"_k(\d+)_"),
                          ("policy", r"_(fixed|adaptive|aimd)$")):
        by: dict[str, float] = {}
        for name in ok:
            m = re.search(pattern, name)
            if m:
                by[m.group(1)] = max(by.get(m.group(1), 0.0), rate(name))
        if len(by) > 1:
            top = max(by.values())
            out.append(f"{knob}: " + ", ".join(f"{v} {by[v] / top:.2f}" for v in sorted(by, key=by.get, reverse=True))
                       + " (best feasible throughput per value, relative to the best)")
    return out


def _row(name: str, f: dict, base: float) -> str:
    cells = (name, f"{f['tokens_per_min_per_gpu']:.0f}", f"{f['tokens_per_min_per_gpu'] / base:.2f}x",
             f"{f['inference_concurrency']:.1f}", f"{f['kv_usage_mean']:.3f}", f"{f['staleness_mean']:.2f}",
             f"{f['staleness_max']}", f"{f.get('rollout/expired') or 0:.0f}", f"{f['cpu_s']:.1f}")
    return " | ".join(f"{c:>12}" for c in cells)


NODE_GPUS = 8  # GPUs per node the recommended layouts are for (the reference's 8-GPU nodes); --gpus-per-node


def trainer_layout(trainer_gpus: int, gpus_per_node: int) -> tuple[int, int]:
    """(`cluster.trainer.nodes`, `cluster.trainer.gpus_per_node`) for `trainer_gpus` ranks on nodes of
    `gpus_per_node` GPUs: the fewest nodes, as many ranks on each as divides the total (the product
    places the same number of ranks on every trainer node)."""
    per = max(d for d in range(1, min(trainer_gpus, gpus_per_node) + 1) if trainer_gpus % d == 0)
    return trainer_gpus // per, per


def not_accepted(w: Workload, sc: Scenario) -> str | None:
    """Why `python -m orchestrator.main` would refuse `sc`'s layout for workload `w` (None: it
    accepts it). cluster=colocated puts one single-GPU replica on each trainer rank's GPU, so a
    workload whose replicas span several GPUs (`engine.gpus_per_replica`) is simulated colocated as
    a baseline only, never recommended."""
    gpr = int(w.engine["gpus_per_replica"])
    if sc.colocated and gpr != 1:
        return (f"cluster=colocated takes single-GPU replicas (cluster.inference.tensor_parallel_size=1); this "
                f"workload's replicas span {gpr} GPUs (engine.gpus_per_replica)")
    return None


def overrides(w: Workload, sc: Scenario, f: dict, gpus_per_node: int = NODE_GPUS) -> list[str]:
    """Hydra overrides of `python -m orchestrator.main` for a simulated configuration, on nodes of
    `gpus_per_node` GPUs: the hardware (`cluster.nodes`, `cluster.gpus_per_node`) and a trainer
    layout the dry run accepts there (`cluster.trainer.gpus_per_node=32` was recommended for 8-GPU
    nodes, which `dry_run=true` refuses). tests/test_sim.py runs every grid layout through the dry run."""
    out = sc.overrides() + [f"rollout.batch_size={f['groups_per_update'] * sc.sync_every}",
                            f"rollout.n={f['n']}", f"inference.replicas={f['replicas']}",
                            f"cluster.inference.tensor_parallel_size={w.engine['gpus_per_replica']}",
                            f"cluster.nodes={-(-sc.gpus // gpus_per_node)}", f"cluster.gpus_per_node={gpus_per_node}"]
    if not sc.colocated:
        nodes, per = trainer_layout(int(f["trainer_gpus"]), gpus_per_node)
        out += [f"cluster.trainer.nodes={nodes}", f"cluster.trainer.gpus_per_node={per}"]
    return out


def _one(args: tuple) -> dict:
    w, sc, hours, seed = args
    try:
        return simulate(w, sc, hours=hours, seed=seed)
    except SimulationTooShort as exc:  # too few steps in the horizon: reported, not fatal to the sweep
        return {"error": str(exc)}


def run_sweep(w: Workload, gpus: int, hours: float, seed: int, bound: float, out: Path | None,
              grid_name: str = "full", jobs: int = 1, caps: dict | None = None, gpus_per_node: int = NODE_GPUS) -> dict:
    """Simulate every configuration of the grid (`jobs` processes), each with the lifecycle's
    `caps` (`container_slots`, `rollout_slots`; None: no cap); print the table and the best."""
    grid = {k: replace(sc, **(caps or {})) for k, sc in sweep_grid(w, gpus, grid_name).items()}
    baseline = _one((w, grid["sync_1"], hours, seed))  # first: every ratio is against it
    if "error" in baseline:  # so a horizon too short for it ends the sweep before the rest runs
        raise SimulationTooShort(f"--sweep: the sync_1 baseline could not be measured: {baseline['error']}")
    others = [k for k in grid if k != "sync_1"]
    work = [(w, grid[k], hours, seed) for k in others]
    if jobs > 1:
        from multiprocessing import Pool

        with Pool(jobs) as pool:
            results = pool.map(_one, work)
    else:
        results = [_one(x) for x in work]
    done = {"sync_1": baseline, **dict(zip(others, results))}
    rows = {k: done[k] for k in grid}  # the grid's order
    base = rows["sync_1"]["tokens_per_min_per_gpu"]
    print(" | ".join(f"{c:>12}" for c in COLUMNS), flush=True)
    for name, f in rows.items():
        print(_row(name, f, base) if "error" not in f else f"{name:>12} | {f['error']}", flush=True)
    refused = {k: why for k, sc in grid.items() if (why := not_accepted(w, sc)) is not None}
    ok = {k: f for k, f in rows.items() if feasible(f, bound) and k not in refused}
    best = max(ok, key=lambda k: ok[k]["tokens_per_min_per_gpu"]) if ok else None
    why = recommendation_reasons(rows, ok, best, bound)
    if refused:
        why.append(f"not recommended, layouts the product refuses: {', '.join(refused)} "
                   f"({next(iter(refused.values()))})")
    result = {"gpus": gpus, "hours": hours, "staleness_bound": bound, "results": rows, "best": best, "why": why}
    if best:
        sc = grid[best]
        result["best_overrides"] = overrides(w, sc, rows[best], gpus_per_node)
        print(f"\nbest within staleness max <= eta, mean <= {bound}, expired < 1 %: {best} "
              f"({rows[best]['tokens_per_min_per_gpu'] / base:.2f}x sync_1)\n  python -m orchestrator.main "
              + " ".join(result["best_overrides"]))
    else:
        print(f"\nno configuration keeps staleness within eta, mean <= {bound} and expired < 1 %")
    print("why:\n" + "\n".join(f"  - {line}" for line in result["why"]))
    if out:
        out.write_text(json.dumps(finite_json(result), indent=2, allow_nan=False) + "\n")
    return result


CONTAINER_TIE = 0.01  # rollout-slot utilisation within 1 point of the best: the fewest containers win


def run_container_sweep(w: Workload, sc: Scenario, factors: tuple[float, ...], *, hours: float, seed: int,
                        warmup_steps: int, bound: float, out: Path | None) -> dict:
    """`sc` with container slots = factor x its rollout slots, for each factor: the table
    (containers in use, throughput, inference requests/min, rollout-slot utilisation and wait) and
    the winner among the feasible ones: the fewest containers (each is paid while it waits warm)
    whose rollout-slot utilisation is within `CONTAINER_TIE` of the best. Utilisation, not
    tokens/min, decides: containers buy nothing else, and it is not quantised by steps as trained
    tokens are (the table shows both). ValueError when `sc` has no rollout slots or a run is too
    short to measure."""
    if sc.rollout_slots is None:
        raise ValueError("--container-factors needs --rollout-slots (container slots are sized against them)")
    rows = {}
    for f in factors:
        c = max(sc.rollout_slots, int(round(sc.rollout_slots * f)))
        rows[f"{f:g}"] = simulate(w, replace(sc, container_slots=c), hours=hours, seed=seed, warmup_steps=warmup_steps)
    cols = ("factor", "containers", "held (mean)", "tok/min/GPU", "requests/min", "slot util", "slot wait s",
            "st_mean", "expired")
    print(" | ".join(f"{c:>12}" for c in cols), flush=True)
    for k, r in rows.items():  # held: containers in use on average (the loop's rollouts in flight, capped)
        cells = (k, r["container_slots"], f"{r['container_slots_held_mean']:.1f}", f"{r['tokens_per_min_per_gpu']:.0f}",
                 f"{r['inference_requests_per_min']:.0f}", f"{r['rollout_slot_utilisation']:.3f}",
                 f"{r['rollout_slot_wait_s_mean']:.1f}",
                 f"{r['staleness_mean']:.2f}", f"{r.get('rollout/expired') or 0:.0f}")
        print(" | ".join(f"{c:>12}" for c in cells), flush=True)
    ok = {k: r for k, r in rows.items() if feasible(r, bound)}
    result: dict[str, Any] = {"rollout_slots": sc.rollout_slots, "results": rows, "best": None}
    if ok:
        top = max(r["rollout_slot_utilisation"] for r in ok.values())
        best = min((k for k, r in ok.items() if r["rollout_slot_utilisation"] >= top - CONTAINER_TIE),
                   key=lambda k: rows[k]["container_slots"])
        result |= {"best": best, "best_overrides": overrides(w, replace(sc, container_slots=rows[best]["container_slots"]),
                                                             rows[best])}
        print(f"\nbest: container factor {best} ({rows[best]['container_slots']} containers for {sc.rollout_slots} "
              f"rollout slots, utilisation {rows[best]['rollout_slot_utilisation']:.3f}): the fewest containers "
              f"within {CONTAINER_TIE:g} of the best feasible rollout-slot utilisation ({top:.3f})\n"
              "  python -m orchestrator.main " + " ".join(result["best_overrides"]))
    else:
        print(f"\nno container factor keeps staleness within eta, mean <= {bound} and expired < 1 %")
    if out:
        out.write_text(json.dumps(finite_json(result), indent=2, allow_nan=False) + "\n")
    return result


def _factors(text: str) -> tuple[float, ...]:
    """`--container-factors 1,1.5,2`: numbers >= 1 (argparse reports the ValueError's message)."""
    try:
        out = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of numbers, got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"each factor must be >= 1 (container slots >= rollout slots), got {text!r}")
    return out


def _number(kv: dict[str, str], key: str, default: float, kind: type) -> Any:
    """`kv[key]` as `kind` (int or float), or `default`; ValueError naming the key otherwise."""
    if key not in kv:
        return default
    try:
        return kind(kv[key])
    except ValueError:
        raise ValueError(f"{key} must be {'an integer' if kind is int else 'a number'}, got {kv[key]!r}") from None


def _check_flags(args: argparse.Namespace) -> None:
    """The scenario flags' ranges, and the ones a `--config` cannot take (ValueError names the flag)."""
    for flag, value, low in (("--eta", args.eta, 0), ("--sync-every", args.sync_every, 1),
                             ("--trainer-gpus", args.trainer_gpus, 1), ("--jobs", args.jobs, 1),
                             ("--warmup-steps", args.warmup_steps, 0), ("--rollout-slots", args.rollout_slots, 1),
                             ("--container-slots", args.container_slots, 1)):
        if value is not None and value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")
    if args.rollout_slots is not None and args.container_slots is not None and args.rollout_slots > args.container_slots:
        raise ValueError(f"--rollout-slots {args.rollout_slots} > --container-slots {args.container_slots}: a rollout "
                         "slot is held inside a container slot, so the extra ones could never be used")
    if args.container_factors and (args.container_slots is not None or args.sweep or args.rollout_slots is None):
        raise ValueError("--container-factors needs --rollout-slots and sizes the containers itself: "
                         "not with --container-slots or --sweep")
    if args.config and CONFIGS[args.config].mode == "sync":
        given = [f for f, v in (("--eta", args.eta), ("--trainer-gpus", args.trainer_gpus)) if v is not None]
        if given:
            raise ValueError(f"--config {args.config} is a sync configuration (colocated, no staleness): "
                             f"{', '.join(given)} do not apply to it")


def scenario_of(args: argparse.Namespace, w: Workload, gpus: int) -> Scenario:
    """The scenario the flags name: `--config` with the flags given on top of it, else the
    workload's plan (`plan_scenario`); `--local` makes it one shared machine. ValueError on a bad one."""
    if args.config:
        sc = replace(CONFIGS[args.config], gpus=gpus)
        given = {"policy": args.policy, "max_staleness": args.eta, "sync_every": args.sync_every,
                 "trainer_gpus": args.trainer_gpus}
        sc = replace(sc, **{k: v for k, v in given.items() if v is not None})
    else:
        sc = plan_scenario(w, gpus, policy=args.policy or "adaptive", trainer_gpus=args.trainer_gpus,
                           eta=args.eta, sync_every=args.sync_every)
    sc = replace(sc, container_slots=args.container_slots, rollout_slots=args.rollout_slots)
    return replace(sc, colocated=True, sleeps=False) if args.local else sc


def sync1_baseline(args: argparse.Namespace, w: Workload, sc: Scenario, f: dict, *, gpus: int, hours: float,
                   seed: int) -> float:
    """sync_1's tokens/min/GPU for the ratio (with this run's lifecycle caps): this run's when it is
    sync_1, the calibration's stored figure (uncapped: `--baseline stored`, or auto at the
    calibrated size), else simulated now."""
    base_sc = replace(CONFIGS["sync_1"], gpus=gpus, sleeps=not args.local, container_slots=sc.container_slots,
                      rollout_slots=sc.rollout_slots)
    if sc == base_sc:
        return f["tokens_per_min_per_gpu"]
    # auto: the stored figure is sync_1 uncapped, at the calibrated size
    stored_fits = (sc.container_slots is None and sc.rollout_slots is None
                   and int(w.calibration.get("gpus", -1)) == gpus)
    if args.baseline != "run" and "measured" in w.calibration and (args.baseline == "stored" or stored_fits):
        return float(w.calibration["measured"]["tokens_per_min_per_gpu"])
    return simulate(w, base_sc, hours=hours, seed=seed, warmup_steps=args.warmup_steps)["tokens_per_min_per_gpu"]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("settings", nargs="*", help="key=value: " + ", ".join(KEYS))
    ap.add_argument("--config", choices=sorted(CONFIGS), help="one of the blog's four configurations")
    ap.add_argument("--policy", choices=POLICIES, help="rollout.concurrency (async, planned split): adaptive "
                    "(probe for the best throughput), aimd (the earlier KV-target window), fixed")
    ap.add_argument("--trainer-gpus", type=int)
    ap.add_argument("--eta", type=int, help="async.max_staleness")
    ap.add_argument("--sync-every", type=int)
    ap.add_argument("--local", action="store_true",
                    help="cluster=local: trainer and engines share one machine, nothing sleeps (validation runs)")
    ap.add_argument("--warmup-steps", type=int, default=1, help="first steps left out of the figures")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--calibrate", action="store_true", help="refit the two free parameters to sync_1")
    ap.add_argument("--baseline", choices=("auto", "run", "stored"), default="auto",
                    help="sync_1 for the ratio: simulated now, or the calibration's stored figure "
                         "(auto: stored when the workload has one for this cluster size, else run)")
    ap.add_argument("--grid", choices=sorted(GRIDS), default="full", help="--sweep: the grid")
    ap.add_argument("--jobs", type=int, default=1, help="--sweep: simulations run in parallel")
    ap.add_argument("--staleness-bound", type=float, default=1.0, help="largest mean staleness the sweep accepts")
    ap.add_argument("--out", type=Path, help="write the figures as JSON")
    ap.add_argument("--gpus-per-node", type=int, default=NODE_GPUS,
                    help="GPUs per node of the cluster the printed overrides are for (cluster.gpus_per_node)")
    ap.add_argument("--rollout-slots", type=int, help="rollout.rollout_slots: rollouts running past their setup "
                    "at once (the A2A contract's inference budget; default: no cap)")
    ap.add_argument("--container-slots", type=int, help="rollout.acr.limits.max_open_sessions: containers "
                    "(ACR sessions) open at once (default: no cap)")
    ap.add_argument("--container-factors", type=_factors, help="with --rollout-slots: simulate container slots = "
                    "each factor x rollout slots (e.g. 1,1.5,2) and say which wins")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    kv = dict(s.split("=", 1) for s in args.settings if "=" in s)
    bad = [s for s in args.settings if "=" not in s] + sorted(set(kv) - set(KEYS))
    if bad:
        print(f"config error: unknown setting(s) {bad}; known: {list(KEYS)}", file=sys.stderr)
        return 2
    try:
        w = load_workload(kv.get("workload", "reference"))
        gpus, hours, seed = (_number(kv, "gpus", 64, int), _number(kv, "hours", 10.0, float),
                             _number(kv, "seed", 0, int))
        if args.gpus_per_node < 1:
            raise ValueError(f"--gpus-per-node must be >= 1, got {args.gpus_per_node}")
        if gpus < 1 or not hours > 0:
            raise ValueError(f"gpus must be >= 1 and hours > 0, got gpus={gpus}, hours={hours:g}")
        _check_flags(args)
        if args.out and not args.out.parent.is_dir():
            raise ValueError(f"--out {args.out}: no directory {args.out.parent}")
        if args.out and args.out.is_dir():
            raise ValueError(f"--out {args.out} is a directory; give a file name")
        if "run_dir" in kv and Path(kv["run_dir"]).exists() and not Path(kv["run_dir"]).is_dir():
            raise ValueError(f"run_dir={kv['run_dir']} is a file; give a directory (created if missing)")
    except (WorkloadError, ValueError) as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    run_dir = Path(kv["run_dir"]) if "run_dir" in kv else None
    t0 = time.perf_counter()
    if args.calibrate:
        from orchestrator.planning.sim.calibrate import Target, calibrate

        _, record = calibrate(w, Target(), gpus=gpus, hours=min(hours, 4.0), seed=seed)
        print(json.dumps(record, indent=2))
        return 0
    if args.container_factors:
        try:
            run_container_sweep(w, scenario_of(args, w, gpus), args.container_factors, hours=hours, seed=seed,
                                warmup_steps=args.warmup_steps, bound=args.staleness_bound, out=args.out)
        except ValueError as exc:
            print(f"config error: {exc}", file=sys.stderr)
            return 2
        return 0
    if args.sweep:
        try:
            run_sweep(w, gpus, hours, seed, args.staleness_bound, args.out, args.grid, args.jobs,
                      caps={"container_slots": args.container_slots, "rollout_slots": args.rollout_slots},
                      gpus_per_node=args.gpus_per_node)
        except SimulationTooShort as exc:
            print(f"config error: {exc}", file=sys.stderr)
            return 2
        return 0
    try:
        sc = scenario_of(args, w, gpus)
        f = simulate(w, sc, hours=hours, seed=seed, out_dir=run_dir, warmup_steps=args.warmup_steps)
    except ValueError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    base = sync1_baseline(args, w, sc, f, gpus=gpus, hours=hours, seed=seed)
    f["sync1_tokens_per_min_per_gpu"] = base
    f["throughput_ratio_vs_sync1"] = f["tokens_per_min_per_gpu"] / base if base else math.nan
    f["overrides"] = overrides(w, sc, f, args.gpus_per_node)
    if (refusal := not_accepted(w, sc)) is not None:  # simulated as a baseline; the product cannot run it
        f["overrides_refused"] = refusal
    f["wall_s"] = time.perf_counter() - t0
    text = json.dumps(finite_json(f), indent=2, allow_nan=False)  # standard JSON: NaN (not measured) is null
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
