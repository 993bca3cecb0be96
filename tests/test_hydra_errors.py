"""Hydra's own composition failures exit 2 with `config error:` naming the key (issue: a typo in a
group choice printed Hydra's search path, a stack-trace hint and exited 1)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import orchestrator.main  # noqa: F401  registers the schemas, as the entry point does
from orchestrator.config.hydra_errors import check_overrides

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("override, expected", [
    ("mode=asyn", "mode: no choice 'asyn'; valid choices: async, eval, sync"),
    # the bare schema is a config nobody wrote (it once ran a whole job): it is not a choice of the group
    ("mode=mode_schema", "mode: no choice 'mode_schema'; valid choices: async, eval, sync"),
    ("mode=mode", "mode: no choice 'mode'; valid choices: async, eval, sync"),
    ("trainer.lr=abc", "trainer.lr: Value 'abc' of type 'str' could not be converted to Float"),
    ("trainer.total_steps=1.5", "trainer.total_steps: Value '1.5'"),
    ("rollout.acr.agent_env={K: V}", "rollout.acr.agent_env: a dict value does not merge"),
    ("rollout.acr.agent_env.K=V", "+rollout.acr.agent_env.K=V"),  # the missing + is named
    ("trainer.nope=1", "trainer.nope: no such key; valid keys here: name, total_steps, lr"),
    ("+trainer.lr=1", "trainer.lr: already set by the defaults"),
    ("+experiment=nope", "experiment: no choice 'nope'; valid choices: blog_async_1"),
    ("trainer.lr=[1", "cannot parse the override 'trainer.lr=[1'"),
    # issue 29: tracebacks or silent truncation before
    ("trainer=null", "trainer: a config group needs a choice, not null; valid choices: fsdp"),
    ("mode=null", "mode: a config group needs a choice, not null; valid choices: async, eval, sync"),
    ("seed=abc", "seed: must be an integer, got 'abc'"),
    ("seed=1.7", "seed: must be an integer, got 1.7"),
    ("dry_run=maybe", "dry_run: must be true or false, got 'maybe'"),
])
def test_hydra_failure_names_the_key(override, expected):
    msg = check_overrides([override])
    assert msg is not None and expected in msg, msg
    assert "\n" not in msg and "search path" not in msg


def test_an_unknown_key_reads_the_same_wherever_it_is_found():
    """Hydra's `trainer.nope=1`, the typed config's `+trainer.nope=1` (nested and top-level): one format."""
    from orchestrator.config import ConfigError
    from stand_ins import compose_config

    hydra_msg = check_overrides(["trainer.nope=1"])
    with pytest.raises(ConfigError) as nested:
        compose_config(["+trainer.nope=1"])
    assert str(nested.value) == hydra_msg
    assert hydra_msg.startswith("trainer.nope: no such key; valid keys here: name, total_steps, lr, ")
    with pytest.raises(ConfigError) as nested_deeper:
        compose_config(["+rollout.acr.nope=1"])
    assert str(nested_deeper.value).startswith("rollout.acr.nope: no such key; valid keys here: ")
    with pytest.raises(ConfigError) as top:
        compose_config(["+nope=1"])
    assert str(top.value).startswith("nope: no such key; valid keys here: ")
    assert str(top.value).endswith(", run_dir, seed, dry_run") and "[" not in str(top.value)


def test_accepted_overrides_pass():
    assert check_overrides(["mode=async", "trainer.lr=0.001", "+rollout.acr.agent_env.K=V",
                            "+experiment=blog_sync_2"]) is None
    assert check_overrides(["--cfg", "job"]) is None  # Hydra's flags stay Hydra's


def test_unknown_group_choice_exits_2_before_anything_starts():
    proc = subprocess.run([sys.executable, "-m", "orchestrator.main", "mode=asyn"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("config error: mode: no choice 'asyn'; valid choices: async, eval, sync")
    assert "Traceback" not in proc.stderr and "HYDRA_FULL_ERROR" not in proc.stderr


def test_help_lists_the_groups_and_says_schema_is_not_a_choice():
    proc = subprocess.run([sys.executable, "-m", "orchestrator.main", "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith("python -m orchestrator.main [group=option ...] [key=value ...]")
    assert "mode: async, eval, sync" in out and "+experiment=blog_async_1" in out
    assert "`schema` is not one to choose" in out and "\nschema: " in out  # listed, and said what it is
    assert "\n  sync_every: 1" in out  # the composed config follows
