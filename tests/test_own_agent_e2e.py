"""docs/agents.md "Train your own agent", end to end with rollout=local: the example agentcore-rl-toolkit
agent (examples/agents/arith_agent), its dataset (examples/data/arith) and the documented command
(task=custom + rollout.acr.agent_cmd). Every rollout must reach the agent with the row's own fields
(`prompt`, `answer`: the agent raises without them, which fails the rollout) and come back with a
reward read from S3, and the step must train. It runs in async mode, the suite's one async run of the
main job to its end: admission stops once the last update's groups are in flight, so the run
dispatches exactly the rollouts it trains and expires none (it used to admit through the final
update and sync, then wait to mark those expired: 24 % of a 3-step run)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from stand_ins import REPO

# bound on what the driver receives per rollout in this run: 4 rollouts in one step, so the step's fixed
# messages (the trainer's metrics, the probes' answers) weigh in. Measured 1729 B (5386 B through Ray,
# 1530 B from TransferQueue, 2026-12-06); before issue 44 the driver also listed every group's tags back
DRIVER_BYTES_PER_ROLLOUT = 4096

README_COMMAND = re.compile(r"python -m orchestrator\.main task=custom task\.data_path=(\S+) \\\n\s+"
                            r"rollout\.acr\.agent_cmd='python (\S+)'")


@pytest.mark.timeout(600)  # Ray + vLLM startup dominate
def test_the_readme_example_trains_the_toolkit_agent(tmp_path):
    data, agent = README_COMMAND.search((REPO / "docs" / "agents.md").read_text()).groups()  # the command users copy
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator.main", "mode=async", "task=custom", f"task.data_path={data}",
         f"rollout.acr.agent_cmd={sys.executable} {agent}", "trainer.total_steps=1", "rollout.batch_size=2",
         "rollout.n=2", "rollout.max_tokens=8", "rollout.timeout_s=60", "algorithm.filter_zero_variance=false",
         "logger=console", f"run_dir={run_dir}"],
        cwd=REPO, capture_output=True, text=True, timeout=570, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["rollout/completed"], summary["rollout/failed"]) == (4, 0), proc.stdout[-3000:]
    assert (summary["rollout/dispatched"], summary["rollout/expired"]) == (4, 0), summary
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1] and steps[0]["perf/trained_tokens"] > 0
    # the driver is a control plane (issue 44): everything it received in the step through Ray (rollout
    # results, trainer metrics, every probe) and from TransferQueue, metered at those clients, per rollout
    s = steps[0]
    assert s["driver/rollouts_returned"] == 4 and s["driver/bytes_from_ray"] > 0, s
    assert s["driver/bytes_per_rollout"] == (s["driver/bytes_from_ray"] + s["driver/bytes_from_buffer"]) / 4, s
    assert s["driver/bytes_per_rollout"] <= DRIVER_BYTES_PER_ROLLOUT, s
