"""Issue 25's acceptance for `rollout.contract=a2a`, end to end: the main job in async mode on the
coding task (`+experiment=swe_mini_local`): its agent, written on agentcore-rl-toolkit's
`RolloutAgentExecutor` unchanged (examples/agents/swe_mini_agent), behind the emulator serving the
A2A protocol, sets each repository up in its session's sandbox through `InvokeAgentRuntimeCommand`
and runs a multi-turn tool loop through the gateway on the random-init Qwen3 with the real Qwen3
template, under a rollout-slot cap that the adaptive concurrency steers, with a warm pool. Every rollout reaches one terminal state, every
completed one trains (filtering off), rewards are the test outcomes, no ACR session is open at
exit (grading sessions included), and each step logs the lifecycle's spans, the grading span and
the reward-hacking shares, and the turns per rollout."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from stand_ins import REPO

EPISODE = re.compile(r"input_id=(\S+): swe_mini episode mode=model turns=(\d+) tool_calls=(\d+) "
                     r"bad_tool_calls=\d+ prompt_tokens=([\d,]+) end=(\w+) reward=([\d.]+)")
TURNS = 2


@pytest.mark.timeout(900)  # Ray + vLLM startup and the trainer's 151k-vocabulary logits dominate
def test_the_toolkit_a2a_coding_agent_trains_two_async_steps_under_a_rollout_slot_cap(tmp_path, real_tokenizers):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator.main", "+experiment=swe_mini_local", "mode=async",
         "trainer.total_steps=2", "rollout.batch_size=1", "rollout.n=2", "rollout.max_tokens=24",
         f"task.max_turns={TURNS}", "rollout.rollout_slots=4", "rollout.acr.limits.max_open_sessions=6",
         "rollout.concurrency=adaptive",
         "rollout.acr.agent_env.SWE_MINI_SETUP_MEDIAN_S=0.5", "logger=console", f"run_dir={run_dir}"],
        cwd=REPO, capture_output=True, text=True, timeout=870, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["rollout/failed"] == 0 and s["rollout/open"] == 0 and s["acr/sessions_open_at_exit"] == 0, s
    assert s["rollout/dispatched"] == s["rollout/completed"] + s["rollout/expired"] + s["rollout/truncated"], s
    assert s["rollout/completed"] >= 4, s
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1, 2] and all(m["perf/trained_tokens"] > 0 for m in steps)
    assert all(m["rollout/setup_s_p50"] >= 0.5 and m["rollout/rollout_slot_wait_s_mean"] >= 0.0
               and m["rollout/turns_mean"] >= 1 for m in steps), steps
    # issue 42: every reward graded in a clean second session (its span per step), the hacking shares logged
    assert all(m["agent/grading_s"] > 0 and 0.0 <= m["agent/hacking/protected_paths"] <= 1.0
               and "alarm/reward_hacking" in m for m in steps), steps
    # gateway.history_mode=linear: every model turn extends its rollout's row (Qwen3 thinking-off
    # would start a new row on each one in tree mode), healed onto the served ids
    assert steps[-1]["gateway/turns_fork"] == 0 and steps[-1]["gateway/turns_healed"] > 0, steps[-1]
    # rollout.concurrency=adaptive steers the rollout-slot cap (from min_groups x n = 2 up to 4)
    assert all(2 <= m["rollout/rollout_slot_limit"] <= 4 for m in steps), steps
    # slot-seconds over the step: busy in step 1; step 2 may train on groups that finished during step 1
    assert steps[0]["rollout/rollout_slot_utilisation"] > 0 and steps[0]["rollout/container_slot_utilisation"] > 0
    assert all(0.0 <= m[f"rollout/{k}_slot_utilisation"] <= 1.0 for m in steps for k in ("rollout", "container"))
    episodes = EPISODE.findall((run_dir / "logs" / "emulator.log").read_text())
    assert len(episodes) >= s["rollout/completed"], episodes
    for input_id, turns, _calls, prompt_tokens, end, reward in episodes:
        grown = [int(t) for t in prompt_tokens.split(",")]
        assert int(turns) == len(grown) and 1 <= int(turns) <= TURNS and float(reward) in (0.0, 1.0), input_id
        assert grown == sorted(grown) and (end == "solved" or int(turns) == TURNS), (input_id, grown, end)
    # the random model fixes nothing: a reward of 1 would mean the tests were not run in the sandbox
    assert all(m["reward/mean"] == 0.0 for m in steps) or any(e[4] == "solved" for e in episodes)
