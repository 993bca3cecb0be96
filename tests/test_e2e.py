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
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator.main", "trainer.total_steps=3", "rollout.batch_size=4",
         "rollout.n=4", "mode.sync_every=1", "logger=console", f"run_dir={run_dir}"],
        cwd=REPO, capture_output=True, text=True, timeout=840, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3
    steps = [json.loads(line) for line in lines]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert [s["policy_version"] for s in steps] == [1, 2, 3]
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
    # which only holds if tokens and log-probs were captured exactly and aligned
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


@pytest.mark.timeout(600)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_stops_every_server_the_run_started(tmp_path, sig):
    """SIGINT (Ctrl-C) or SIGTERM mid-run: the driver unwinds through its own handler (not Ray's,
    which ray.init installs for SIGTERM), stops moto, the emulator and the agents by PID, exits 130."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.main", "trainer.total_steps=50", "rollout.batch_size=2",
         "rollout.n=2", "logger=console", f"run_dir={run_dir}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # a background shell ignores SIGINT
    )
    out = []
    try:
        deadline = time.monotonic() + 480
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            out.append(line)
            if line.startswith("[step 1/"):
                break
        assert any(line.startswith("[step 1/") for line in out), "".join(out[-50:])
        started = json.loads((run_dir / "pids.json").read_text())
        assert all(psutil.pid_exists(pid) for pid in started.values())
        proc.send_signal(sig)
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, rest[-3000:]
    assert "interrupted: stopped every process this run started" in rest
    deadline = time.monotonic() + 15  # SIGTERM grace of the stack
    alive = started
    while alive and time.monotonic() < deadline:
        alive = {n: p for n, p in started.items() if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE}
        time.sleep(0.2)
    assert not alive, (alive, rest[-3000:])


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
