"""Chaos runs of the main job: kill a part at a random moment, resume where needed, account for
every prompt, rollout, session and process.

    python scripts/chaos.py --runs 10 --seed 1 --out F.json

Each run starts `python -m orchestrator.main` (`--steps` steps, checkpoint every step) in its own
run_dir, waits for a random step, sleeps a random fraction of a second, and injects one fault. The
order is seeded (`schedule`): every kind of `--kill` comes once, modes alternating, before any kind
repeats; then each kind in its other mode; so 10 runs draw all 8 kinds, both modes 5 times:

- driver: SIGKILL of the driver process (possibly mid-checkpoint); the run is resumed with
  `trainer.resume_mode=auto`. Checked: every process the run started is gone within
  `LEFTOVER_WAIT_S` (its reaper, orchestrator/control/reaper.py), no checkpoint staging folder is left.
- checkpoint: SIGKILL of the driver while a checkpoint is being written (its staging folder
  `checkpoints/.step-N-staging-*` exists; polled every `CKPT_POLL_S`), then as for driver. The
  record says whether the kill landed mid-write (`mid_checkpoint`).
- emulator / s3: SIGKILL of the local ACR emulator (its agents and open sessions die with it) or of
  moto's S3 server (its objects go): an ACR or S3 outage. The driver's ServerWatch starts it again
  on its port; rollouts that needed it meanwhile fail `acr_unavailable` / `s3_unavailable` and their
  groups are dispatched again.
- acr: SIGKILL of one ACR agent process of the local emulator (a runtime microVM dying); the
  emulator routes new sessions to the others, rollouts in flight on it fail with a named reason.
- inference / trainer / rollout: SIGKILL of the Ray actor process (`ray::InferenceWorker`,
  `ray::TrainerWorker`, `ray::RolloutActor`) found among the driver's descendants by its process
  title (Ray names actor processes `ray::<Class>`); what happens next is the product's fault
  handling (replica restart, trainer error + resume, rollout re-dispatch). A run that exits with an
  error is resumed once with `trainer.resume_mode=auto`; one that hangs past `--run-timeout-s` is
  killed and resumed.

Per run it records: the fault, whether it was injected and the run finished all steps (survived),
rollouts lost or duplicated (the ledger identity dispatched == completed + failed + filtered + expired
broken one way or the other),
prompts consumed twice or never (consumed_prompts.jsonl across the whole run against the seeded
prompt order), sessions leaked (the emulator's open sessions at exit, summary.json), processes
left after a driver kill, for a sync run resumed after a driver kill whether its first step trained
exactly what the killed run had logged for that step (`identical_next_step`: rewards, trained tokens,
loss, entropy, grad norm; seeded sampling makes a step reproducible in fresh processes), and the wall time from the fault to the next logged step (recovery;
`totals.recover_s_by_kind` per fault kind).

Writes `--out` (JSON): {"runs": [...], "totals": {...}}. Exit status 0 when every run finished
with nothing lost, duplicated, skipped or leaked.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from orchestrator.control.reaper import still_running  # noqa: E402  (the repo on sys.path first)

KINDS = ("inference", "trainer", "rollout", "driver", "checkpoint", "emulator", "s3", "acr")
DRIVER_KILLS = ("driver", "checkpoint")  # the run is resumed by a new driver
SERVER_PIDS = {"emulator": "emulator", "s3": "moto"}  # kind -> its name in run_dir/pids.json
CKPT_POLL_S = 0.002  # how often the checkpoint kind looks for a staging folder (seconds)
CKPT_WAIT_S = 120.0  # ... and for how long before it kills the driver anyway
ACTOR_TITLES = {"inference": "ray::InferenceWorker", "trainer": "ray::TrainerWorker", "rollout": "ray::RolloutActor"}
LEFTOVER_WAIT_S = 15.0  # a killed driver's processes must be gone by then (seconds)
BATCH, N = 2, 2  # groups per step, samples per group: small, the point is the faults
# what a step trained: a sync run resumed from step k's checkpoint recomputes step k + 1 exactly as
# the killed run logged it (seeded sampling per rollout), so these must be equal (`identical_next_step`)
TRAINED_KEYS = ("reward/mean", "perf/trained_tokens", "actor/pg_loss", "actor/entropy", "actor/grad_norm",
                "rollout_corr/log_ppl_diff")


def job_args(mode: str, steps: int, num_prompts: int, run_dir: Path, resume: bool) -> list[str]:
    args = [sys.executable, "-m", "orchestrator.main", f"mode={mode}", f"trainer.total_steps={steps}",
            "trainer.save_freq=1", f"rollout.batch_size={BATCH}", f"rollout.n={N}", f"task.num_prompts={num_prompts}",
            "logger=console", f"run_dir={run_dir}"]
    return args + (["trainer.resume_mode=auto"] if resume else [])


class Job:
    """One driver process of a run; its console lines are read as they come."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        self.log = log_path.open("a")
        self.proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        os.set_blocking(self.proc.stdout.fileno(), False)
        self._buf = ""
        self.steps_seen: list[tuple[float, int]] = []

    def poll_lines(self) -> None:
        try:
            chunk = self.proc.stdout.read()
        except (BlockingIOError, TypeError):
            chunk = None
        if not chunk:
            return
        self.log.write(chunk)
        self.log.flush()
        self._buf += chunk
        *lines, self._buf = self._buf.split("\n")
        for line in lines:
            if line.startswith("[step ") and "/" in line:
                self.steps_seen.append((time.monotonic(), int(line[6:line.index("/")])))

    def wait_step(self, step: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.poll_lines()
            if any(s >= step for _, s in self.steps_seen):
                return True
            if self.proc.poll() is not None:
                self.poll_lines()
                return any(s >= step for _, s in self.steps_seen)
            time.sleep(0.05)
        return False

    def wait_exit(self, timeout_s: float) -> int | None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.poll_lines()
            if self.proc.poll() is not None:
                self.poll_lines()
                return self.proc.returncode
            time.sleep(0.1)
        return None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def find_actor_pid(driver_pid: int, kind: str) -> int | None:
    """The Ray actor process of `kind` among the driver's descendants (its title is `ray::<Class>...`)."""
    for p in descendants(driver_pid):
        try:
            if p.cmdline() and p.cmdline()[0].startswith(ACTOR_TITLES[kind]):
                return p.pid
        except psutil.Error:
            continue
    return None


def wait_checkpoint_write(run_dir: Path, job: Job, timeout_s: float = CKPT_WAIT_S) -> bool:
    """Poll until a checkpoint staging folder exists (a write is under way); False on timeout or exit."""
    root = run_dir / "checkpoints"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and job.proc.poll() is None:
        if root.is_dir() and any(p.name.startswith(".step-") for p in os.scandir(root)):
            return True
        time.sleep(CKPT_POLL_S)
    return False


def inject(kind: str, job: Job, run_dir: Path, rng: random.Random) -> dict:
    """SIGKILL the part `kind` of the running job; returns what was killed."""
    if kind in DRIVER_KILLS:
        mid = wait_checkpoint_write(run_dir, job) if kind == "checkpoint" else None
        tree = [(p.pid, p.create_time()) for p in descendants(job.proc.pid)]
        job.kill()
        return {"pid": job.proc.pid, "tree": tree, "mid_checkpoint": mid}
    if kind in SERVER_PIDS:
        pid = json.loads((run_dir / "pids.json").read_text()).get(SERVER_PIDS[kind])
    elif kind == "acr":
        pids = json.loads((run_dir / "pids.json").read_text())
        agents = sorted(v for k, v in pids.items() if k.startswith("agent-"))
        pid = rng.choice(agents) if agents else None
    else:
        pid = find_actor_pid(job.proc.pid, kind)
    if pid is None:
        return {"pid": None}
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return {"pid": None}
    return {"pid": pid}


def checkpointed_step(run_dir: Path) -> int:
    """The step of the run's latest committed checkpoint (0: none)."""
    from orchestrator.control.checkpoint import latest_checkpoint_dir

    latest = latest_checkpoint_dir(run_dir)
    return int(latest.name.removeprefix("step-")) if latest is not None else 0




def logged_steps(run_dir: Path) -> dict[int, dict]:
    """step -> its metrics.jsonl record (the last one logged for that step)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by the kill
            continue
        out[rec["step"]] = rec
    return out


def identical_next_step(killed: dict[int, dict], resumed: dict[int, dict], from_step: int) -> bool | None:
    """Whether the resumed run's first step (`from_step` + 1, recomputed from the checkpoint of
    `from_step`) trained exactly what the killed run had logged for it (TRAINED_KEYS equal); None
    when there is nothing to compare (the killed run never logged that step, or it trained nothing)."""
    step = from_step + 1
    if step not in killed or step not in resumed or "actor/pg_loss" not in killed[step]:
        return None
    return all(killed[step].get(k) == resumed[step].get(k) for k in TRAINED_KEYS)


def prompt_accounting(run_dir: Path, mode: str, num_prompts: int, seed: int) -> dict:
    """Prompts consumed twice and never, from consumed_prompts.jsonl against the seeded order."""
    from orchestrator.config.task import TaskConfig
    from orchestrator.loop.prompts import PromptCycle
    from orchestrator.tasks import TASKS

    path = run_dir / "consumed_prompts.jsonl"
    records = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    steps = [r["step"] for r in records]
    consumed = [i for r in records for i in r["input_ids"]]
    order = [r["input_id"] for r in PromptCycle(TASKS["letters"].rows(TaskConfig(name="letters", num_prompts=num_prompts), "train"),
                                                  seed).next_rows(len(consumed) + num_prompts)]
    counts = Counter(consumed)
    twice = sorted(i for i, c in counts.items() if c > 1)
    # every prompt drawn before the last consumed one was consumed; async may leave the groups in
    # flight at the end (drained, never trained): at most the admission window past the consumed count
    window = 0 if mode == "sync" else 4 * BATCH
    expected = set(order[:max(0, len(consumed) - window)])
    never = sorted(expected - set(consumed))
    return {"steps_logged": steps, "consumed": len(consumed), "prompts_twice": len(twice),
            "prompts_never": len(never), "duplicate_step_lines": len(steps) - len(set(steps))}


def summary_accounting(run_dir: Path) -> dict:
    path = run_dir / "summary.json"
    if not path.exists():
        return {"summary": False}
    s = json.loads(path.read_text())
    terminal = sum(s.get(f"rollout/{k}", 0) for k in ("completed", "failed", "filtered", "expired"))
    dispatched = s.get("rollout/dispatched", 0)
    return {"summary": True, "steps": s.get("steps"), "interrupted": s.get("interrupted"),
            "rollouts_dispatched": dispatched, "rollouts_lost": max(0, dispatched - terminal),
            "rollouts_duplicated": max(0, terminal - dispatched),
            "sessions_leaked": s.get("acr/sessions_open_at_exit", 0),
            "failed_reasons": {k: v for k, v in s.items() if k.startswith("rollout/failed/")}}


def one_run(i: int, kind: str, mode: str, args: argparse.Namespace, rng: random.Random, out_dir: Path) -> dict:
    run_dir = out_dir / f"run-{i:02d}-{mode}-{kind}"
    num_prompts = args.steps * BATCH if mode == "sync" else 1000
    log = run_dir.parent / f"{run_dir.name}.log"
    kill_step = rng.randint(1, max(1, args.steps - 2))  # a step or more left to train after the fault
    delay_s = rng.uniform(0.0, 0.5)
    rec: dict = {"run": i, "mode": mode, "kind": kind, "kill_after_step": kill_step, "delay_s": round(delay_s, 2)}
    t0 = time.monotonic()
    job = Job(job_args(mode, args.steps, num_prompts, run_dir, resume=False), log)
    rec["injected"] = False
    resumed = 0
    try:
        if job.wait_step(kill_step, args.run_timeout_s):
            time.sleep(delay_s)
            job.poll_lines()
            t_fault = time.monotonic()
            killed = inject(kind, job, run_dir, rng)
            rec["injected"] = killed["pid"] is not None
            if kind == "checkpoint":
                rec["mid_checkpoint"] = killed["mid_checkpoint"]
            if kind in DRIVER_KILLS:
                deadline = time.monotonic() + LEFTOVER_WAIT_S
                while still_running(killed["tree"]) and time.monotonic() < deadline:
                    time.sleep(0.2)
                rec["processes_left"] = len(still_running(killed["tree"]))
                rec["staging_left"] = len(list((run_dir / "checkpoints").glob(".step-*")))
                killed_steps, resumed_from = logged_steps(run_dir), checkpointed_step(run_dir)
            code = job.wait_exit(args.run_timeout_s) if kind not in DRIVER_KILLS else -9
            while code != 0 and resumed < 2:
                if code is None:  # hung: kill it (its reaper cleans up) and resume
                    rec["hung"] = True
                    job.kill()
                if checkpointed_step(run_dir) >= args.steps:  # killed after its last checkpoint: trained
                    rec["trained_before_fault"] = True
                    code = 0
                    break
                resumed += 1
                job = Job(job_args(mode, args.steps, num_prompts, run_dir, resume=True), log)
                code = job.wait_exit(args.run_timeout_s)
            if kind in DRIVER_KILLS and mode == "sync":  # async interleaving is not reproducible step by step
                rec["identical_next_step"] = identical_next_step(killed_steps, logged_steps(run_dir), resumed_from)
            after = [t for t, _ in job.steps_seen if t > t_fault]
            rec["recover_s"] = round(after[0] - t_fault, 1) if after else None
        else:  # ended (or hung) before the fault could be injected
            code = job.wait_exit(args.run_timeout_s)
    finally:
        job.kill()
    rec.update(exit_code=code, resumed=resumed, wall_s=round(time.monotonic() - t0, 1))
    rec.update(summary_accounting(run_dir))
    rec.update(prompt_accounting(run_dir, mode, num_prompts, 0))
    rec["survived"] = bool(code == 0 and not rec.get("interrupted") and rec["steps_logged"][-1:] == [args.steps]
                           and (rec.get("steps") == args.steps or rec.get("trained_before_fault")))
    return rec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kill", default=",".join(KINDS), help=f"comma-separated kinds out of {','.join(KINDS)}")
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=4, help="trainer.total_steps of each run (>= 2)")
    p.add_argument("--modes", default="sync,async")
    p.add_argument("--run-timeout-s", type=float, default=900.0)
    p.add_argument("--out", required=True)
    p.add_argument("--work-dir", default=None, help="where the runs' run_dirs go (default: beside --out)")
    args = p.parse_args(argv)
    kinds = [k for k in args.kill.split(",") if k]
    bad = sorted(set(kinds) - set(KINDS))
    if bad or not kinds:
        p.error(f"--kill takes {','.join(KINDS)} (got {bad or 'none'})")
    if args.steps < 2:
        p.error(f"--steps must be >= 2 (a fault lands between two checkpointed steps), got {args.steps}")
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - {"sync", "async"}:
        p.error(f"--modes takes sync,async (got {args.modes!r})")
    if args.runs < 1:
        p.error(f"--runs must be >= 1, got {args.runs}")
    out = Path(args.out).resolve()
    work = Path(args.work_dir).resolve() if args.work_dir else out.with_suffix("")
    work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    runs = []
    for i, (kind, mode) in enumerate(schedule(kinds, modes, args.runs, rng)):
        rec = one_run(i, kind, mode, args, random.Random(rng.random()), work)
        runs.append(rec)
        print(json.dumps(rec), flush=True)
        out.write_text(json.dumps({"runs": runs, "totals": totals(runs)}, indent=2) + "\n")
    result = totals(runs)
    out.write_text(json.dumps({"runs": runs, "totals": result}, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    ok = (result["survived"] == len(runs) and not any(result[k] for k in
          ("rollouts_lost", "rollouts_duplicated", "prompts_twice", "prompts_never", "sessions_leaked", "processes_left",
           "duplicate_step_lines", "next_step_differs")))
    return 0 if ok else 1


def schedule(kinds: list[str], modes: list[str], runs: int, rng: random.Random) -> list[tuple[str, str]]:
    """`runs` (kind, mode) pairs: a seeded order of `kinds`, each once with modes alternating, then each
    kind in the mode(s) it has not had, then again; so any len(kinds) consecutive runs from the
    start draw every kind, and both modes come about equally often."""
    order = list(kinds)
    rng.shuffle(order)
    first = rng.randrange(len(modes))
    rounds = [[(k, modes[(first + i + r) % len(modes)]) for i, k in enumerate(order)] for r in range(len(modes))]
    cycle = [pair for rnd in rounds for pair in rnd]
    return [cycle[i % len(cycle)] for i in range(runs)]


def recover_stats(values: list[float]) -> dict | None:
    return {"max": max(values), "mean": round(sum(values) / len(values), 1), "n": len(values)} if values else None


def totals(runs: list[dict]) -> dict:
    rec = [r.get("recover_s") for r in runs if r.get("recover_s") is not None]
    return {
        "runs": len(runs),
        "faults_injected": sum(bool(r.get("injected")) for r in runs),
        "by_kind": dict(Counter(r["kind"] for r in runs)),
        "survived": sum(bool(r.get("survived")) for r in runs),
        "resumed": sum(r.get("resumed", 0) for r in runs),
        "rollouts_lost": sum(r.get("rollouts_lost", 0) or 0 for r in runs),
        "rollouts_duplicated": sum(r.get("rollouts_duplicated", 0) or 0 for r in runs),
        "prompts_twice": sum(r.get("prompts_twice", 0) for r in runs),
        "prompts_never": sum(r.get("prompts_never", 0) for r in runs),
        "duplicate_step_lines": sum(r.get("duplicate_step_lines", 0) for r in runs),
        "sessions_leaked": sum(r.get("sessions_leaked", 0) or 0 for r in runs),
        "processes_left": sum(r.get("processes_left", 0) for r in runs),
        "recover_s": recover_stats(rec),
        "recover_s_by_kind": {k: recover_stats([r["recover_s"] for r in runs if r["kind"] == k and r.get("recover_s") is not None])
                              for k in sorted({r["kind"] for r in runs})},
        "mid_checkpoint_kills": sum(bool(r.get("mid_checkpoint")) for r in runs),
        "next_step_compared": sum(r.get("identical_next_step") is not None for r in runs),
        "next_step_differs": sum(r.get("identical_next_step") is False for r in runs),
    }


if __name__ == "__main__":
    sys.exit(main())
