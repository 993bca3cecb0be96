"""scripts/submit.sh against a real Ray head started here with `ray start --head`.

The head lives in its own temp dir with its own ports, token auth on (its token in a file of the
test's, never ~/.ray/auth_token), 2 CPUs and 1 logical GPU. Two submissions share it:
- a 2-step run with `cluster=colocated`: exercises submit.sh (upload, token, log following,
  exit 0 on SUCCEEDED) and, inside the job, the GPU placement check on the cluster's logical GPU
  and the colocated sleep/wake of the real vLLM CPU engine (level 0: nothing released, reported);
- a run with a bad override: the job FAILS and submit.sh exits non-zero.
Without a head (nothing listening at RAY_ADDRESS) submit.sh says so in one line and exits 2.
The head's processes are found by the temp dir in their command lines (plus their descendants)
and stopped by PID at the end; never `ray stop`, never by name.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from stand_ins import REPO
from workers.embedded.emulator_agents import free_port  # ray start takes its ports as numbers

VENV_BIN = Path(sys.executable).parent
RAY_CLI = str(VENV_BIN / "ray")
JOB_TIMEOUT_S = 420


def _head_processes(temp_dir: str) -> list[psutil.Process]:
    """Processes whose command line names our temp dir, and all their descendants."""
    roots = []
    for p in psutil.process_iter(["cmdline"]):
        with _gone():
            if any(temp_dir in arg for arg in (p.info["cmdline"] or [])):
                roots.append(p)
    procs = {p.pid: p for p in roots}
    for p in roots:
        with _gone():
            procs.update({c.pid: c for c in p.children(recursive=True)})
    return list(procs.values())


class _gone:
    """Ignore processes that exit while we look at them."""

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        return exc_type is not None and issubclass(exc_type, (psutil.NoSuchProcess, psutil.ZombieProcess))


STOP_GRACE_S = 3.0  # SIGTERM -> SIGKILL; a throwaway head keeps nothing worth a graceful stop


def _stop(procs: list[psutil.Process]) -> None:
    for p in procs:
        with _gone():
            p.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=STOP_GRACE_S)
    for p in alive:
        with _gone():
            p.kill()
    psutil.wait_procs(alive, timeout=10)


@pytest.fixture(scope="module")
def ray_head():
    """A token-auth Ray head with a dashboard (the job server) on free ports; yields the env for submit.sh."""
    temp_dir = tempfile.mkdtemp(prefix="ray-submit-", dir="/tmp")  # short: Ray's socket paths must stay < 108 chars
    token_path = Path(temp_dir) / "auth_token"
    token_path.write_text(secrets.token_hex(32))
    dash_port = free_port()
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path),
           "ORCH_CACHE_DIR": str(REPO / ".cache" / "models")}  # the job reuses the built tiny model
    env.pop("RAY_ADDRESS", None)
    cmd = [RAY_CLI, "start", "--head", f"--temp-dir={temp_dir}", f"--port={free_port()}",
           "--node-ip-address=127.0.0.1", "--num-cpus=2", "--num-gpus=1", "--include-dashboard=true",
           "--dashboard-host=127.0.0.1", f"--dashboard-port={dash_port}",
           f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
           f"--metrics-export-port={free_port()}", "--disable-usage-stats"]
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        procs = _head_processes(temp_dir)
        assert procs, "ray start reported success but no process names the temp dir"
        submit_env = {k: v for k, v in env.items() if k != "RAY_AUTH_MODE"}  # submit.sh must turn token mode on
        submit_env.update(RAY_ADDRESS=f"http://127.0.0.1:{dash_port}", RAY=RAY_CLI, PYTHON="python")
        yield submit_env
    finally:
        _stop(_head_processes(temp_dir))
        left = _head_processes(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not left, f"head processes still running after stop: {[p.pid for p in left]}"


def _submit(env: dict, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(REPO / "scripts" / "submit.sh"), *overrides], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=JOB_TIMEOUT_S)


@pytest.mark.timeout(JOB_TIMEOUT_S + 240)
def test_submit_runs_two_colocated_steps_and_succeeds(ray_head, tmp_path):
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    proc = _submit(ray_head, "cluster=colocated", "trainer.total_steps=2", "rollout.batch_size=2", "rollout.n=2",
                   "logger=console", "algorithm.filter_zero_variance=false",  # every step trains: sleeps once
                   f"run_dir={run_dir}")
    print(f"\nsubmitted 2-step job ran in {time.monotonic() - t0:.0f} s")
    log = proc.stdout[-5000:] + proc.stderr[-5000:]
    assert proc.returncode == 0, log
    assert "SUCCEEDED" in proc.stderr and "auth: token" in proc.stderr, log  # submit.sh turned token mode on
    assert "run_dir:" in proc.stdout, log  # the job's own output was followed
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    assert [s["policy_version"] for s in steps] == [1, 2]
    for s in steps:  # colocated: the engine slept around every update; vLLM's CPU build only pauses
        # scheduling and releases nothing, and the metrics say so
        assert s["perf/inference_sleep_level"] == 0.0 and s["perf/inference_released_memory"] == 0.0
        assert s["perf/inference_sleep_s"] > 0


@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_submit_exits_nonzero_when_the_job_fails(ray_head, tmp_path):
    proc = _submit(ray_head, "trainer.total_steps=0", f"run_dir={tmp_path / 'bad'}")
    log = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 1, log
    assert "trainer.total_steps must be >= 1" in proc.stdout + proc.stderr, log  # the job's error, followed
    assert "did not succeed" in proc.stderr and "failed" in proc.stderr, log


def test_submit_without_a_reachable_cluster_says_so_in_one_line():
    """Issue 29: with no cluster reachable, submit.sh printed 116 lines of the job client's tracebacks
    and never its own message (`set -euo pipefail` exited at `ray job status` first). Now one line
    names the address it tried and how to set it, before anything is submitted; exit 2."""
    address = f"http://127.0.0.1:{free_port()}"  # a free port: nothing listens there
    env = {**os.environ, "RAY_ADDRESS": address, "RAY": RAY_CLI, "PYTHON": "python"}
    proc = subprocess.run([str(REPO / "scripts" / "submit.sh"), "trainer.total_steps=1"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"submit.sh: no Ray job server answers at {address} (")
    assert "RAY_ADDRESS=http://HEAD:8265" in lines[0]
