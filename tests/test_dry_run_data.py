"""Small items of issue 47 (item 8): `dry_run=true` reads the dataset (a bad row is the same config
error as at a real start), and a resumed run's first line gives the steps left, not trainer.total_steps."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from orchestrator.control.checkpoint import Checkpoint, RunState
from orchestrator.loop.prompts import PromptCycle
from orchestrator.loop.staleness import AdmissionState
from orchestrator.main import _training_line
from stand_ins import compose_config

REPO = Path(__file__).resolve().parent.parent


def _dry_run(tmp_path, *overrides) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.main", "dry_run=true", f"run_dir={tmp_path / 'r'}",
                           *overrides], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_a_dry_run_reads_the_data_and_refuses_a_bad_row(tmp_path):
    bad = tmp_path / "train.jsonl"
    bad.write_text('{"question": "1+1?", "answer": "#### 2"}\n{"question": "no answer"}\n')
    out = _dry_run(tmp_path, "task=gsm8k", f"task.data_path={bad}", "algorithm.filter_zero_variance=false")
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stderr.startswith("config error: task.data_path") and "Traceback" not in out.stderr
    good = _dry_run(tmp_path, "task=gsm8k", "algorithm.filter_zero_variance=false")
    assert good.returncode == 0, good.stderr[-2000:]
    assert "dry run: data read: every row parses" in good.stdout


def test_a_resumed_run_says_the_steps_left():
    cfg = compose_config(["trainer.total_steps=8"])
    state = RunState(step=5, policy_version=5, next_group_id=40, prompts=PromptCycle([{"input_id": "p"}], 0).state(),
                     admission=AdmissionState(policy_version=5, trained_groups=40))
    assert _training_line(cfg, None).startswith("training: 8 steps;")
    assert _training_line(cfg, Checkpoint(Path("/x"), state)).startswith("training: 3 steps left (steps 6..8 of")
