"""scripts/chaos.py refuses bad arguments with a message naming the flag (issue 29: `--modes ""`
raised ZeroDivisionError, `--steps 1` blamed `--kill`)."""

import subprocess
import sys

import pytest

from stand_ins import REPO


@pytest.mark.parametrize("argv, message", [
    (["--modes", ""], "--modes takes sync,async (got '')"),
    (["--modes", "sync,eventually"], "--modes takes sync,async"),
    (["--steps", "1"], "--steps must be >= 2"),
    (["--kill", "gremlin"], "--kill takes inference"),
    (["--runs", "0"], "--runs must be >= 1"),
])
def test_chaos_names_the_bad_flag(argv, message, tmp_path):
    proc = subprocess.run([sys.executable, "scripts/chaos.py", *argv, "--out", str(tmp_path / "c.json")],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "c.json").exists()
