"""End to end on every real part: Ray, vLLM (CPU), the ACR emulator + agent processes, moto S3,
the gateway, TransferQueue, the FSDP2 trainer. A short run of the real main job as a subprocess."""

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(900)
def test_main_job_runs_end_to_end_on_real_parts(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator.main", "trainer.total_steps=3", "rollout.batch_size=4",
         "rollout.n=4", "mode.sync_every=2", "logger=console", f"run_dir={run_dir}"],
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
    assert f"run_dir: {run_dir}" in proc.stdout
    # every server the run started (moto, emulator, agents) was stopped by PID
    started = json.loads((run_dir / "pids.json").read_text())
    assert len(started) >= 4  # moto, emulator, two agents
    alive = {name: pid for name, pid in started.items() if psutil.pid_exists(pid)
             and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE}
    assert not alive, alive
