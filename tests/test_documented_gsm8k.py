"""The GSM8K command of docs/agents.md works (issue 47, item 8): `make run ARGS='task=gsm8k
trainer.total_steps=2'` ended "nothing was trained" (exit 1): the tiny model earns reward 0 on GSM8K,
so every group is zero-variance and the default filter drops them all. The documented command now
keeps them, as the e2e run (tests/test_gsm8k_e2e.py, on the tiny model) does."""

from __future__ import annotations

import re
from pathlib import Path

from stand_ins import compose_config

REPO = Path(__file__).resolve().parent.parent


def _documented() -> list[str]:
    section = (REPO / "docs" / "agents.md").read_text().split("## GSM8K with a calculator tool", 1)[1]
    return re.search(r"make run ARGS='([^']*)'", section).group(1).split()


def test_the_documented_gsm8k_command_keeps_the_groups_the_tiny_model_earns_nothing_on():
    cfg = compose_config(_documented())
    assert cfg.task.name == "gsm8k" and cfg.model.path is None  # the embedded tiny model
    assert cfg.algorithm.filter_zero_variance is False
    assert "algorithm.filter_zero_variance=false" in (REPO / "tests" / "test_gsm8k_e2e.py").read_text()


def test_a_bare_python_in_agent_cmd_runs_on_the_drivers_interpreter():
    """The README's hint (write `.venv/bin/python` for `python`) missed the `python` inside
    `rollout.acr.agent_cmd`: the agent then ran on whatever `python` PATH found."""
    import sys

    from orchestrator.wiring.runtime import agent_command

    cmd = compose_config(["task=custom", "task.data_path=x.jsonl", "rollout.acr.agent_cmd='python examples/agents/arith_agent/app.py --x 1'"])
    assert agent_command(cmd) == [sys.executable, "examples/agents/arith_agent/app.py", "--x", "1"]
    other = compose_config(["task=custom", "task.data_path=x.jsonl", "rollout.acr.agent_cmd='/opt/py/bin/python app.py'"])
    assert agent_command(other) == ["/opt/py/bin/python", "app.py"]  # a named interpreter is kept
