"""End to end on every real part: Ray, vLLM (CPU), the ACR emulator + agent processes, moto S3,
the gateway, TransferQueue, the FSDP2 trainer. A short run of the real main job as a subprocess."""

import json
import os
import signal
import subprocess
import time
import sys
from pathlib import Path

import psutil
import pytest
from report_checks import check_report

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(900)
def test_main_job_runs_end_to_end_on_real_parts(tmp_path):
    """The embedded default's sync run, its report, its quiet console and its cleanup; the weights
    go by the bucketed gloo broadcast (trainer.weight_sync.backend=gloo, 1 MB buckets: several per
    push), the file sync being run end to end by the other e2e tests (gsm8k, own agent, rollout=aws)."""
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator.main", "trainer.total_steps=3", "rollout.batch_size=4",
         "rollout.n=4", "mode.sync_every=1", "trainer.weight_sync.backend=gloo", "trainer.weight_sync.bucket_mb=1",
         "logger=console", f"run_dir={run_dir}"],
        cwd=REPO, capture_output=True, text=True, timeout=840, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3
    steps = [json.loads(line) for line in lines]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert [s["policy_version"] for s in steps] == [1, 2, 3]
    assert not list(run_dir.glob("weights/*.safetensors"))  # the broadcast path writes no file
    assert all(s["timing_s/update_weights"] > 0 for s in steps)
    for s in steps:
        for key in ("reward/mean", "perf/throughput", "timing_s/gen", "timing_s/update_actor",
                    "timing_s/update_weights", "rollout/completed", "rollout/failed", "rollout_corr/is_mean"):
            assert key in s, key
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rollout/dispatched"] == 3 * 4 * 4
    assert summary["rollout/dispatched"] == (summary["rollout/completed"] + summary["rollout/failed"]
                                             + summary["rollout/filtered"])
    assert summary["rollout/failed"] == 0, proc.stdout[-4000:]
    assert summary["acr/sessions_open_at_exit"] == 0
    assert summary["rollout/completed"] > 0  # some groups had reward variance and were trained
    # sync mode is on-policy: the gateway's recorded log-probs must match the trainer's recompute,
    # which only holds if tokens and log-probs were captured exactly and aligned, and if the engine
    # got exactly the trainer's weights of each version through the broadcast
    trained = [s for s in steps if s["rollout/step_completed"] > 0]
    assert trained and all(abs(s["rollout_corr/log_ppl_abs_diff"]) < 1e-3 for s in trained)
    assert all(abs(s["rollout_corr/is_mean"] - 1.0) < 1e-3 for s in trained)
    assert f"run_dir: {run_dir}" in proc.stdout
    # the report of a short real run: every plot a valid PNG with data, referenced files only; its
    # path is the last console line
    check_report(run_dir / "report" / "report.html")
    assert proc.stdout.rstrip().splitlines()[-1] == f"report: {run_dir / 'report' / 'report.html'}"
    # a quiet console: nothing from Ray, vLLM, Triton or TransferQueue before the first step
    before_step_1 = proc.stdout.split("[step 1/")[0] + proc.stderr
    for noise in ("Ray instance", "(InferenceWorker", "(TrainerWorker", "Triton", "TransferQueue", "NUMA",
                  "FutureWarning", "Loading"):
        assert noise not in before_step_1, (noise, before_step_1[-3000:])
    assert (run_dir / "logs" / "driver.log").is_file()
    # every server the run started (moto, emulator, agents) was stopped by PID
    started = json.loads((run_dir / "pids.json").read_text())
    assert len(started) >= 4  # moto, emulator, two agents
    alive = {name: pid for name, pid in started.items() if psutil.pid_exists(pid)
             and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE}
    assert not alive, alive


# The target is 10 s (issue 14; it was 36-56 s), measured by scripts/bench_stop.py: 5.7 s (async) and
# 5.5 s (sync) at load 51 on 2 cores; the test's bound leaves room for a machine loaded by other jobs.
STOP_BOUND_S = 30.0


def _snapshot(pid: int) -> tuple[list[tuple[int, float]], set[int]]:
    """The driver's descendants (PID, start time) and the inodes of the /dev/shm files they map."""
    from orchestrator.reaper import Record

    record = Record(pid)
    assert record.scan()
    return list(record.procs.items()), set(record.shm)


def _left_behind(tree: list[tuple[int, float]], shm: set[int], timeout_s: float) -> tuple[list[int], list[str]]:
    """Processes of `tree` still alive and /dev/shm entries with an inode of `shm` after `timeout_s`."""
    from orchestrator.reaper import still_running

    def alive() -> list[int]:
        return still_running(tree)

    deadline = time.monotonic() + timeout_s
    while alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive(), [e.name for e in os.scandir("/dev/shm") if e.inode() in shm]


def _start_job(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "orchestrator.main", *args], cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # a background shell ignores SIGINT


def _read_until(proc: subprocess.Popen, prefix: str, timeout_s: float) -> list[str]:
    out: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        out.append(line)
        if line.startswith(prefix):
            return out
    raise AssertionError(f"no {prefix!r} line:\n" + "".join(out[-50:]))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode,sig", [("async", signal.SIGINT), ("sync", signal.SIGTERM)])
def test_first_ctrl_c_stops_the_run_fast_and_leaves_nothing_behind(tmp_path, mode, sig):
    """Regression (issue 14): the first Ctrl-C took 36-56 s, printed ~185 lines of connection
    errors, was ignored in 3 of 5 async tries, and left a /dev/shm/sem.mp-*. Ctrl-C (SIGINT to the
    whole process group, as a terminal sends it) or SIGTERM mid-run: the run ends within 10 s with
    status 130, a few lines, summary.json saying `interrupted: true` and no ACR session open; then
    no process the run started and no /dev/shm file they mapped is left."""
    run_dir = tmp_path / "run"
    proc = _start_job([f"mode={mode}", "trainer.total_steps=50", "rollout.batch_size=2", "rollout.n=2",
                       "rollout.num_workers=1", "rollout.acr.num_agents=1", "logger=console", f"run_dir={run_dir}"])
    try:
        _read_until(proc, "[step 1/", 480)
        tree, shm = _snapshot(proc.pid)
        assert len(tree) >= 6  # moto, emulator, two agents, Ray and its actors
        t0 = time.monotonic()
        os.killpg(proc.pid, sig) if sig == signal.SIGINT else proc.send_signal(sig)
        rest, _ = proc.communicate(timeout=120)
        stop_s = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, rest[-3000:]
    assert stop_s < STOP_BOUND_S, (stop_s, rest[-3000:])
    lines = [line for line in rest.splitlines() if line.strip() and not line.startswith("[step ")]
    assert len(lines) <= 4 and "Traceback" not in rest, rest[-3000:]
    assert "interrupted: stopped at step" in rest
    report = run_dir / "report" / "report.html"  # drawn while the parts stopped (issue 15: also when interrupted)
    assert f"report: {report}" in rest and report.is_file(), rest[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["steps"] >= 1
    alive, shm_left = _left_behind(tree, shm, timeout_s=15)
    assert not alive and not shm_left, (alive, shm_left)
    assert summary["acr/sessions_open_at_exit"] == 0  # stopped before the emulator went


@pytest.mark.timeout(900)
def test_driver_killed_mid_checkpoint_resumes_with_every_prompt_trained_once(tmp_path):
    """Regression (issue 14): after `kill -9` of the driver, moto, the emulator and the agents
    kept running, a /dev/shm/sem.mp-* stayed, and a resume would duplicate step lines and restart
    the counters. SIGKILL as step 2 is logged (its checkpoint is being written): every process the
    run started and every /dev/shm file they mapped goes, no staging folder stays; the resumed run
    trains each of the 6 prompts of the epoch exactly once over the whole run (consumed_prompts.jsonl),
    metrics.jsonl holds steps 1-3 once, and the counters and summary cover the whole run."""
    from orchestrator.config.task import TaskConfig
    from orchestrator.tasks import TASKS

    run_dir = tmp_path / "run"
    args = ["trainer.total_steps=3", "trainer.save_freq=1", "rollout.batch_size=2", "rollout.n=2",
            "task.num_prompts=6", "logger=console", f"run_dir={run_dir}"]
    proc = _start_job(args)
    try:
        _read_until(proc, "[step 1/", 480)
        tree, shm = _snapshot(proc.pid)
        _read_until(proc, "[step 2/", 240)
        proc.kill()  # the step-2 checkpoint is being written
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    alive, shm_left = _left_behind(tree, shm, timeout_s=15)
    assert not alive and not shm_left, (alive, shm_left)
    assert not list((run_dir / "checkpoints").glob(".step-*"))
    assert not (run_dir / "summary.json").exists()

    resumed = subprocess.run([sys.executable, "-m", "orchestrator.main", *args, "trainer.resume_mode=auto"],
                             cwd=REPO, capture_output=True, text=True, timeout=480,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout
    consumed = [json.loads(x) for x in (run_dir / "consumed_prompts.jsonl").read_text().splitlines()]
    assert [c["step"] for c in consumed] == [1, 2, 3]
    ids = [i for c in consumed for i in c["input_ids"]]
    epoch = {r["input_id"] for r in TASKS["letters"].rows(TaskConfig(name="letters", num_prompts=6), "train")}
    assert sorted(ids) == sorted(epoch)  # every prompt once: none skipped, none twice
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert steps[-1]["rollout/dispatched"] == 3 * 2 * 2  # cumulative: continued, not restarted
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["interrupted"] is False and summary["resumed_from_step"] in (1, 2)
    assert summary["rollout/dispatched"] == 12 == (summary["rollout/completed"] + summary["rollout/failed"]
                                                   + summary["rollout/filtered"] + summary["rollout/expired"])
    assert summary["acr/sessions_open_at_exit"] == 0


@pytest.mark.timeout(900)
def test_async_run_resumes_from_its_checkpoint(tmp_path):
    """A 2-step async run saves a checkpoint; the same command with `trainer.resume_mode=auto` and
    a higher step count continues at step 3 and policy version 3 (weights, optimizer, prompt cursor
    and staleness counters from the checkpoint), appending to the same metrics.jsonl."""
    run_dir = tmp_path / "run"
    base = [sys.executable, "-m", "orchestrator.main", "mode=async", "rollout.batch_size=2", "rollout.n=4",
            "logger=console", f"run_dir={run_dir}", "trainer.save_freq=2"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    first = subprocess.run([*base, "trainer.total_steps=2"], cwd=REPO, capture_output=True, text=True,
                           timeout=420, env=env)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-00000002"
    refused = subprocess.run([*base, "trainer.total_steps=3"], cwd=REPO, capture_output=True, text=True,
                             timeout=60, env=env)
    assert refused.returncode == 2 and "run_dir" in refused.stderr  # no silent overwrite without resume
    second = subprocess.run([*base, "trainer.total_steps=3", "trainer.resume_mode=auto"], cwd=REPO,
                            capture_output=True, text=True, timeout=420, env=env)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resuming from" in second.stdout and "step-00000002" in second.stdout
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert [s["policy_version"] for s in steps] == [1, 2, 3]
    assert steps[-1]["staleness/max"] <= 1  # the bound holds after the resume (async.max_staleness=1)
