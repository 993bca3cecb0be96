"""Soak run of the main job: does anything grow without bound over a long run?

    python scripts/soak.py --steps 500 --out soak.json

Starts `python -m orchestrator.main mode=async` on the embedded default for `--steps` steps with
`--faults` (default 5 %) of its sessions given an injected ACR fault, spread evenly over ACR's own
kinds (429 ThrottlingException, 500, 424: workers/embedded/faults.py `EMULATOR_FAULTS`), and every
`--every` steps samples:

- RSS (bytes) and open file descriptors of each part, summed over its processes: the driver, each
  named actor (`run_dir/actors.json`: inference-0, trainer-rank-0, gateway, the rollout actors),
  the emulator and its agents, moto (`run_dir/pids.json`), and every other process of the driver's
  tree grouped by its title (`ray::<Class>` for Ray actors: the buffer's controller and storage
  units; `raylet`, `gcs_server`, ...);
- /dev/shm bytes used (Ray's plasma store lives there);
- the run's own probes from metrics.jsonl (orchestrator/watch/resources.py): `buffer/rows_held`
  (TransferQueue rows held) and `ray/object_store_bytes`.

Growth test, per series: split the samples into quarters; the series is bounded when the last
quarter's mean is within `--tolerance` (10 %) of the second quarter's, or the absolute rise is under
`FLOOR` of its kind (allocator noise: 32 MiB of RSS, 8 descriptors, 16 rows, 32 MiB of shm or object
store). The first quarter is warm-up (compilation caches, allocator arenas). The slope
(least-squares, units per 100 steps) is reported beside it.

Writes `--out` (JSON): {"args", "steps", "samples": [...], "series": {name: {"slope_per_100_steps",
"q2_mean", "q4_mean", "bounded"}}, "unbounded": [...], "run": summary.json}. Exit status 0 when
the run finished every step and no series grew without bound, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from workers.embedded.faults import EMULATOR_FAULTS  # noqa: E402  (the repo on sys.path first)

FLOOR = {"rss": 32 << 20, "fds": 8, "rows": 16, "bytes": 32 << 20}  # rises smaller than this are noise
PROBES = {"buffer/rows_held": "rows", "ray/object_store_bytes": "bytes"}  # metrics.jsonl keys sampled


def job_args(args: argparse.Namespace, run_dir: Path) -> list[str]:
    # ACR's own faults (429 throttling, 500, 424), answered by the emulator whatever the agent: the
    # example agent ignores the agent-side kinds (workers/embedded/faults.py)
    faults = {k: args.faults / len(EMULATOR_FAULTS) for k in EMULATOR_FAULTS} if args.faults > 0 else {}
    faults = {**faults, "seed": args.seed} if faults else {}
    fault_arg = "{" + ",".join(f"{k}:{v}" for k, v in faults.items()) + "}"
    return [sys.executable, "-m", "orchestrator.main", "mode=async", f"trainer.total_steps={args.steps}",
            f"rollout.batch_size={args.batch_size}", f"rollout.n={args.n}", f"rollout.timeout_s={args.timeout_s}",
            f"++rollout.acr.faults={fault_arg}", "task.num_prompts=100000", "logger=console", f"run_dir={run_dir}",
            # every group trains: the letters policy solves its task within ~200 steps, after which
            # filtered groups would stop the run at algorithm.max_gen_batches (the soak measures
            # memory over a fixed rollout count per step, not learning)
            "algorithm.filter_zero_variance=false",
            *args.overrides]


def named_roots(run_dir: Path) -> dict[int, str]:
    """PID -> name of the run's named processes (actors.json is rewritten when an actor is replaced)."""
    out: dict[int, str] = {}
    for name in ("pids.json", "actors.json"):
        try:
            out.update({int(pid): key for key, pid in json.loads((run_dir / name).read_text()).items()})
        except (OSError, ValueError):
            continue
    return out


def _title(p: psutil.Process) -> str:
    cmd = p.cmdline()
    if not cmd:
        return p.name()
    if cmd[0].startswith("ray::"):
        return cmd[0].split()[0]
    if "-m" in cmd[:-1]:
        return cmd[cmd.index("-m") + 1]
    return Path(cmd[0]).name


def sample_processes(driver: psutil.Process, run_dir: Path) -> dict[str, dict[str, int]]:
    """part -> {"rss": bytes, "fds": count, "procs": count}: each process counted in its nearest named
    ancestor-or-self (so vLLM's engine core counts in inference-0), else under its own title."""
    roots = named_roots(run_dir)
    try:
        procs = [driver, *driver.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    by_pid = {p.pid: p for p in procs}
    parts: dict[str, dict[str, int]] = defaultdict(lambda: {"rss": 0, "fds": 0, "procs": 0})
    for p in procs:
        try:
            name, q = None, p
            while q is not None and q.pid != driver.pid:
                if q.pid in roots:
                    name = roots[q.pid]
                    break
                q = by_pid.get(q.ppid())
            rec = parts[name or ("driver" if p.pid == driver.pid else _title(p))]
            rec["rss"] += p.memory_info().rss
            rec["fds"] += p.num_fds()
            rec["procs"] += 1
        except psutil.Error:
            continue
    return dict(parts)


def last_metrics(path: Path) -> dict:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    for line in reversed(lines):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return {}


def slope(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def judge(steps: list[int], values: list[float], kind: str, tolerance: float) -> dict:
    """Growth test of one series (see the module docstring); needs >= 4 samples."""
    q = len(values) // 4
    q2, q4 = values[q:2 * q], values[3 * q:]
    m2, m4 = sum(q2) / len(q2), sum(q4) / len(q4)
    bounded = m4 <= m2 * (1 + tolerance) or m4 - m2 < FLOOR[kind]
    return {"slope_per_100_steps": round(100 * slope(steps, values), 1), "q2_mean": round(m2, 1),
            "q4_mean": round(m4, 1), "first": values[0], "last": values[-1], "bounded": bounded}


def series_of(samples: list[dict], tolerance: float) -> dict[str, dict]:
    keys: dict[str, str] = {}
    for s in samples:
        for part, rec in s["parts"].items():
            keys[f"rss/{part}"] = "rss"
            keys[f"fds/{part}"] = "fds"
        for k in s["probes"]:
            keys[k] = PROBES[k]
    keys["shm/used_bytes"] = "bytes"
    out = {}
    for key, kind in sorted(keys.items()):
        pts = [(s["step"], value_of(s, key)) for s in samples]
        pts = [(x, y) for x, y in pts if y is not None]
        if len(pts) >= 4:
            out[key] = judge([x for x, _ in pts], [y for _, y in pts], kind, tolerance)
    return out


def value_of(sample: dict, key: str) -> float | None:
    if key == "shm/used_bytes":
        return sample["shm_used_bytes"]
    if key in sample["probes"]:
        return sample["probes"][key]
    what, _, part = key.partition("/")
    rec = sample["parts"].get(part)
    return None if rec is None else rec[what]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--every", type=int, default=10, help="sample every this many steps")
    p.add_argument("--faults", type=float, default=0.05, help="total injected ACR fault rate (0 to 1)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--timeout-s", type=float, default=20.0, help="rollout.timeout_s: slow/no_result faults hit it")
    p.add_argument("--tolerance", type=float, default=0.10)
    p.add_argument("--seed", type=int, default=0, help="the fault draw's seed")
    p.add_argument("--run-dir", default=None, help="the job's run_dir (default: beside --out)")
    p.add_argument("--out", required=True)
    p.add_argument("overrides", nargs="*", help="extra key=value overrides for the job")
    args = p.parse_args(argv)
    if args.every < 1 or args.steps < 8 * args.every:
        p.error(f"--steps must be >= 8 x --every (two samples per quarter), got {args.steps} and {args.every}")
    if not 0 <= args.faults < 1:
        p.error(f"--faults must be in [0, 1), got {args.faults}")
    out = Path(args.out).resolve()
    run_dir = Path(args.run_dir).resolve() if args.run_dir else out.with_suffix("")
    if run_dir.exists():
        p.error(f"--run-dir {run_dir} exists: a soak run starts fresh")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = open(run_dir.with_suffix(".log"), "w")
    job = subprocess.Popen(job_args(args, run_dir), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    driver = psutil.Process(job.pid)
    samples: list[dict] = []
    t0 = time.monotonic()
    try:
        for line in job.stdout:
            log.write(line)
            if not (line.startswith("[step ") and "/" in line):
                continue
            step = int(line[6:line.index("/")])
            if step % args.every:
                continue
            metrics = last_metrics(run_dir / "metrics.jsonl")
            samples.append({"step": step, "wall_s": round(time.monotonic() - t0, 1),
                            "parts": sample_processes(driver, run_dir),
                            "shm_used_bytes": shutil.disk_usage("/dev/shm").used,
                            "probes": {k: metrics[k] for k in PROBES if k in metrics}})
            print(f"soak: step {step}: driver rss {samples[-1]['parts'].get('driver', {}).get('rss', 0) >> 20} MiB, "
                  f"rows held {samples[-1]['probes'].get('buffer/rows_held')}", flush=True)
        code = job.wait()
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
        log.close()
    series = series_of(samples, args.tolerance)
    unbounded = sorted(k for k, v in series.items() if not v["bounded"])
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        summary = {}
    finished = code == 0 and summary.get("steps") == args.steps
    result = {"args": vars(args), "exit_code": code, "finished": finished, "wall_s": round(time.monotonic() - t0, 1),
              "samples": samples, "series": series, "unbounded": unbounded, "run": summary}
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"finished": finished, "unbounded": unbounded, "series": series}, indent=2))
    return 0 if finished and not unbounded else 1


if __name__ == "__main__":
    sys.exit(main())
