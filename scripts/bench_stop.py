"""How fast and how clean the first Ctrl-C / SIGTERM stops the main job (issue 14: under 10 s).

    python scripts/bench_stop.py --modes async,sync --tries 3 [--out F.json] [OVERRIDE ...]

Each try starts `python -m orchestrator.main` (the embedded default: `rollout=local`, the tiny
model) in its own process group and run_dir, waits for the `[step 1/` line (or the first line with
`--at TEXT`, then `--delay` seconds: a stop during startup), records the driver's
descendants and the /dev/shm files they map, then sends the signal of the mode (async: SIGINT to
the whole group, as a terminal's Ctrl-C does; sync: SIGTERM to the driver, as a scheduler does)
and measures the time to the driver's exit. Then, after up to LEFTOVER_WAIT_S: processes of the
run still alive, its /dev/shm files still there, what the run's reaper had to stop (the driver
should have stopped everything itself), ACR sessions open at exit (summary.json), the exit status
and console lines after the signal. The stop timeline the driver logged (`stop +...s: what`,
orchestrator/control/stopping.py) shows where the time went.

Prints one block per try and a closing line per mode (median and max stop time against the
10-s target). Exit status 0 when every try met the target and left nothing behind.
Extra `key=value` arguments go to the job (e.g. `rollout.num_workers=1`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from orchestrator.control.reaper import Record, still_running  # noqa: E402  (the repo on sys.path first)
from orchestrator.control.stopping import STOP_MARK  # noqa: E402

TARGET_S = 10.0  # issue 14: the first Ctrl-C / SIGTERM ends the run within this (seconds)
LEFTOVER_WAIT_S = 15.0  # processes of the run must be gone by then (the reaper's grace included)
STEP1 = "[step 1/"  # the default moment of the signal: the first step's console line
STEP1_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 120.0
SIGNAL_OF = {"async": signal.SIGINT, "sync": signal.SIGTERM}
JOB = ["trainer.total_steps=50", "rollout.batch_size=2", "rollout.n=2", "logger=console"]


def one_try(mode: str, run_dir: Path, overrides: list[str], at: str = STEP1, delay_s: float = 0.0) -> dict:
    sig = SIGNAL_OF[mode]
    t_start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.main", f"mode={mode}", *JOB, *overrides, f"run_dir={run_dir}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # a background shell ignores SIGINT
    try:
        deadline = time.monotonic() + STEP1_TIMEOUT_S
        head: list[str] = []
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                return {"mode": mode, "error": f"exited before a line with {at!r}", "output": "".join(head[-30:])}
            head.append(line)
            if at in line:
                break
        time.sleep(delay_s)
        record = Record(proc.pid)
        record.scan()
        tree, shm = list(record.procs.items()), set(record.shm)
        names = {pid: _name(pid) for pid, _ in tree}
        t0 = time.monotonic()
        step1_s = t0 - t_start
        os.killpg(proc.pid, sig) if sig == signal.SIGINT else proc.send_signal(sig)
        rest, _ = proc.communicate(timeout=STOP_TIMEOUT_S)
        stop_s = time.monotonic() - t0
        at_exit = sorted(names[pid] for pid in still_running(tree))  # the reaper's work, if any
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    deadline = time.monotonic() + LEFTOVER_WAIT_S
    while still_running(tree) and time.monotonic() < deadline:
        time.sleep(0.2)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    log = run_dir / "logs" / "driver.log"
    timeline = [ln.split(STOP_MARK, 1)[1].strip() for ln in log.read_text().splitlines()
                if STOP_MARK in ln] if log.exists() else []
    reaper = run_dir / "logs" / "reaper.log"
    console = [ln for ln in rest.splitlines() if ln.strip() and not ln.startswith("[step ")]
    return {
        "mode": mode, "at": at, "signal": signal.Signals(sig).name, "step1_s": round(step1_s, 1), "stop_s": round(stop_s, 2), "exit": proc.returncode,
        "interrupted": summary.get("interrupted"), "sessions_open": summary.get("acr/sessions_open_at_exit"),
        "processes_left": len(still_running(tree)), "processes": len(tree), "alive_at_exit": at_exit,
        "shm_left": [e.name for e in os.scandir("/dev/shm") if e.inode() in shm],
        "reaper": reaper.read_text().strip().splitlines()[-1:] if reaper.exists() else [],
        "console_lines": len(console), "traceback": "Traceback" in rest, "timeline": timeline,
    }


def _name(pid: int) -> str:
    try:
        p = psutil.Process(pid)
        return " ".join(p.cmdline()[:3])[:80] or p.name()
    except psutil.Error:
        return "?"


def clean(r: dict) -> bool:
    # no ACR session count: stopped before the local stack's emulator answered (startup), no session opened
    sessions_ok = r.get("sessions_open") == 0 or (r.get("sessions_open") is None and r.get("at") != STEP1)
    return (r.get("exit") == 130 and r.get("interrupted") is True and sessions_ok
            and not r.get("processes_left") and not r.get("shm_left") and not r.get("traceback"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="async,sync")
    p.add_argument("--tries", type=int, default=3)
    p.add_argument("--at", default=STEP1, help="send the signal on the first console line containing this text "
                   "(e.g. 'inference replica' or 'starting Ray' for the startup window; default: step 1's line)")
    p.add_argument("--out", default=None, help="write every try as JSON here")
    p.add_argument("--keep", default=None, help="keep the run dirs under this folder (default: a temporary one)")
    p.add_argument("--delay", type=float, default=0.0, help="seconds from that line to the signal")
    p.add_argument("overrides", nargs="*", help="key=value overrides for the job")
    args = p.parse_args(argv)
    print(f"load: {os.getloadavg()[0]:.1f} {os.getloadavg()[1]:.1f} {os.getloadavg()[2]:.1f} "
          f"on {os.cpu_count()} cores", flush=True)
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench_stop-") as tmp:
        tmp = args.keep or tmp
        for i in range(args.tries):
            for mode in args.modes.split(","):
                r = one_try(mode, Path(tmp) / f"{mode}-{i}", args.overrides, args.at, args.delay)
                runs.append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "timeline"}), flush=True)
                for step in r.get("timeline", []):
                    print(f"    {step}", flush=True)
    ok = True
    for mode in args.modes.split(","):
        times = [r["stop_s"] for r in runs if r["mode"] == mode and "stop_s" in r]
        good = sum(clean(r) for r in runs if r["mode"] == mode)
        tries = sum(r["mode"] == mode for r in runs)
        met = bool(times) and max(times) < TARGET_S and good == tries
        ok &= met
        print(f"{mode} ({SIGNAL_OF[mode].name}): stop median {statistics.median(times) if times else float('nan'):.1f} s, "
              f"max {max(times, default=float('nan')):.1f} s over {len(times)} tries (target {TARGET_S:.0f} s); "
              f"clean {good}/{tries}; {'met' if met else 'NOT met'}", flush=True)
    print(f"load after: {os.getloadavg()[0]:.1f}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"runs": runs}, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
