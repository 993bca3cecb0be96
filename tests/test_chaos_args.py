"""scripts/chaos.py refuses bad arguments with a message naming the flag (issue 29: `--modes ""`
raised ZeroDivisionError, `--steps 1` blamed `--kill`)."""

import json
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


def _chaos_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("chaos_script", REPO / "scripts" / "chaos.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_ten_chaos_runs_draw_every_fault_kind_in_both_modes(seed):
    """Issue 29: seed 1 with 4 runs drew only driver and ACR kills; 10 runs must draw all 8 kinds."""
    import random

    chaos = _chaos_module()
    plan = chaos.schedule(list(chaos.KINDS), ["sync", "async"], 10, random.Random(seed))
    assert len(plan) == 10 and {k for k, _ in plan} == set(chaos.KINDS)
    modes = [m for _, m in plan]
    assert modes.count("sync") == modes.count("async") == 5
    sixteen = chaos.schedule(list(chaos.KINDS), ["sync", "async"], 16, random.Random(seed))
    assert sorted(sixteen) == sorted((k, m) for k in chaos.KINDS for m in ("sync", "async"))  # no pair twice


def test_the_resumed_first_step_is_compared_with_what_the_killed_run_logged(tmp_path):
    """The identical-next-step check (moved from the suite's kill-mid-checkpoint e2e into chaos.py):
    equal when every trained key matches, False on any difference, None when the killed run never
    logged the step or trained nothing in it; a line cut short by the kill is skipped."""
    chaos = _chaos_module()
    step2 = {"step": 2, **{k: 0.5 for k in chaos.TRAINED_KEYS}}
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "actor/pg_loss": 0.1}) + "\n"
                                            + json.dumps(step2) + "\n" + '{"step": 3, "actor/pg')
    killed = chaos.logged_steps(tmp_path)
    assert sorted(killed) == [1, 2]
    assert chaos.identical_next_step(killed, {2: dict(step2)}, from_step=1) is True
    assert chaos.identical_next_step(killed, {2: {**step2, "actor/grad_norm": 0.25}}, from_step=1) is False
    assert chaos.identical_next_step(killed, {3: step2}, from_step=2) is None  # step 3 never logged before the kill
    assert chaos.identical_next_step({2: {"step": 2}}, {2: {"step": 2}}, from_step=1) is None  # nothing trained
