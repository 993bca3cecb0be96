"""Two runs on one run directory (issue 47, item 4): a second launch on a run directory in use fails at
once naming the holder's PID, before it changes anything there (config.yaml, pids.json, summary.json)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.config import ConfigError
from orchestrator.control.preflight import preflight
from stand_ins import compose_config

REPO = Path(__file__).resolve().parent.parent


def _hold(run_dir: Path, pid: int) -> int:
    """Hold run_dir's lock as another run would: its own open file description, its PID in the file."""
    fd = os.open(run_dir / "run.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.ftruncate(fd, 0)
    os.write(fd, f"{pid}\n".encode())
    return fd


def test_preflight_takes_the_lock_and_a_held_lock_refuses_naming_the_pid(tmp_path):
    run = tmp_path / "run"
    preflight(compose_config(run_dir=run))  # a fresh run: creates run_dir and takes its lock
    assert (run / "run.lock").read_text().strip() == str(os.getpid())
    preflight(compose_config(run_dir=run))  # this process holds it already: pre-flight again passes
    other = tmp_path / "other"
    other.mkdir()
    fd = _hold(other, 4242)
    try:
        with pytest.raises(ConfigError, match=r"^run_dir .*other is in use by another run \(PID 4242\)"):
            preflight(compose_config(run_dir=other))
    finally:
        os.close(fd)
    preflight(compose_config(run_dir=other))  # released (the holder ended): the next run takes it


def test_a_second_launch_on_a_run_in_use_exits_2_and_leaves_its_files(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("the first run's\n")
    fd = _hold(run, os.getpid())
    try:
        out = subprocess.run([sys.executable, "-m", "orchestrator.main", f"run_dir={run}", "trainer.resume_mode=auto"],
                             cwd=REPO, capture_output=True, text=True, timeout=120)
    finally:
        os.close(fd)
    assert out.returncode == 2, out.stderr
    assert f"config error: run_dir {run} is in use by another run (PID {os.getpid()})" in out.stderr
    assert (run / "config.yaml").read_text() == "the first run's\n"
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml", "run.lock"]  # no pids.json, no summary
