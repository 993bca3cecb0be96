"""Issue 25's acceptance for `rollout.contract=a2a`, end to end: the main job in async mode with the
letters agent written on agentcore-rl-toolkit's `RolloutAgentExecutor`, unchanged
(examples/agents/letters_a2a_agent), behind the emulator serving the A2A protocol, under a rollout
slot cap. Every rollout reaches one terminal state, every completed one trains (filtering off), no
ACR session is open at exit, and each step logs the lifecycle's spans."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from stand_ins import REPO


@pytest.mark.timeout(600)  # Ray + vLLM startup dominate
def test_the_toolkit_a2a_agent_trains_two_async_steps_under_a_rollout_slot_cap(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator.main", "mode=async", "rollout.contract=a2a", "trainer.total_steps=2",
         "rollout.batch_size=2", "rollout.n=2", "rollout.max_tokens=8", "rollout.rollout_slots=2",
         "rollout.setup_timeout_s=60", "rollout.run_timeout_s=60", "algorithm.filter_zero_variance=false",
         "logger=console", f"run_dir={run_dir}"],
        cwd=REPO, capture_output=True, text=True, timeout=570, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["rollout/failed"] == 0 and s["rollout/open"] == 0 and s["acr/sessions_open_at_exit"] == 0, s
    assert s["rollout/dispatched"] == s["rollout/completed"] + s["rollout/expired"] and s["rollout/completed"] >= 8, s
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1, 2] and all(m["perf/trained_tokens"] > 0 for m in steps)
    # rewards are the agent's (letters: a fraction in [0, 1]); the spans of every step's rollouts
    assert all(0.0 <= m["reward/mean"] <= 1.0 and m["rollout/setup_s_p50"] >= 0.0
               and m["rollout/rollout_slot_wait_s_mean"] >= 0.0 for m in steps), steps
