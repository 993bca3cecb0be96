"""Numbers that are not numbers (issue 47, item 7): every float key of the schema refuses NaN, inf and
-inf with one `config error` naming the key, before any group's own check (`x <= 0` passes NaN) and
before a dry run says the plan fits."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from orchestrator.config import GROUP_SCHEMAS, ConfigError, register, to_run_config
from stand_ins import CONFIGS, compose_config

REPO = Path(__file__).resolve().parent.parent


def _float_keys(schema: type, prefix: str):
    """Every dotted key of `schema` whose type is float, Optional[float] or dict[str, float] (walked
    through nested dataclasses), from the type hints, so a float key added later is covered."""
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        hint = hints[f.name]
        args = typing.get_args(hint)
        if dataclasses.is_dataclass(hint):
            yield from _float_keys(hint, f"{prefix}.{f.name}")
        elif hint is float or (float in args and typing.get_origin(hint) is not dict):
            yield f"{prefix}.{f.name}"
        elif typing.get_origin(hint) is dict and args[1:] == (float,):
            yield f"{prefix}.{f.name}.crash"  # a dict of floats: one entry
        elif typing.get_origin(hint) is list and dataclasses.is_dataclass(args[0]):
            yield from _float_keys(args[0], f"{prefix}.{f.name}[0]")  # a list of rules: its first


FLOAT_KEYS = sorted({key for group, schema in GROUP_SCHEMAS.items() for key in _float_keys(schema, group)})


def test_the_walk_finds_the_keys_of_the_report():
    assert {"rollout.acr.limits.requests_per_s", "rollout.timeout_s", "rollout.temperature", "trainer.lr",
            "rollout.acr.faults.crash"} <= set(FLOAT_KEYS)
    assert len(FLOAT_KEYS) > 40


@pytest.fixture(scope="module")
def composed():
    register()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name="config", overrides=["run_dir=/tmp/x"])


@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_every_float_key_refuses_nan_and_infinities(composed, key):
    for bad in (float("nan"), float("inf"), float("-inf")):
        cfg = composed.copy()
        OmegaConf.set_struct(cfg, False)  # a dict-of-floats entry is a new key
        if "[0]." in key:  # one list item holding the bad value (a k1 rule takes each of its floats)
            head, _, leaf = key.partition("[0].")
            OmegaConf.update(cfg, head, [{"name": "seq_mean_k1", leaf: bad}], force_add=True)
        else:
            OmegaConf.update(cfg, key, bad, force_add=True)
        with pytest.raises(ConfigError, match=rf"^{re.escape(key)} must be a finite number"):
            to_run_config(cfg)


@pytest.mark.parametrize("override", ["rollout.acr.limits.requests_per_s=nan", "rollout.timeout_s=nan",
                                      "rollout.temperature=nan", "trainer.lr=inf", "rollout.top_p=-inf"])
def test_the_reported_overrides_name_their_key(override):
    with pytest.raises(ConfigError, match=rf"^{override.split('=')[0].replace('.', '[.]')} must be a finite"):
        compose_config([override])


def test_a_dry_run_with_a_nan_temperature_is_a_config_error_not_a_fitting_plan(tmp_path):
    out = subprocess.run([sys.executable, "-m", "orchestrator.main", "rollout.temperature=nan", "dry_run=true",
                          f"run_dir={tmp_path / 'run'}"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "config error: rollout.temperature must be a finite number, got nan" in out.stderr
    assert "fits" not in out.stdout and "Error executing job" not in out.stderr + out.stdout


def test_an_agent_cmd_yaml_read_as_a_boolean_is_refused():
    with pytest.raises(ConfigError, match=r"^rollout.acr.agent_cmd .*boolean"):
        compose_config(["rollout.acr.agent_cmd=true"])
    assert compose_config(["rollout.acr.agent_cmd='true'"]).rollout.acr.agent_cmd == "true"  # quoted: a command
