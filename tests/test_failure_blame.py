"""Failures blamed on the right part (issue 47, item 6): a typo in `model.lora.target_modules` and a
`gateway.host` that is not on this machine are config errors naming the key, before any part starts,
instead of a "trainer lost" (exit 3, a minute in) or a bind traceback inside the gateway actor.
(The emulator restarting a crashed agent process is tests/test_acr_emulator.py's.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.config import ConfigError
from orchestrator.control.lora_targets import check_lora_targets, unmatched_targets
from orchestrator.control.preflight import preflight
from stand_ins import compose_config, random_qwen2

REPO = Path(__file__).resolve().parent.parent


def test_unmatched_targets_follow_peft_list_matching():
    names = ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj", "lm_head"]
    assert unmatched_targets(["q_proj", "down_proj", "all-linear"], names) == []
    assert unmatched_targets(["q_prj", "self_attn.q_proj", "proj"], names) == ["q_prj", "proj"]


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    return random_qwen2(tmp_path_factory.mktemp("qwen2"))


def test_a_typo_in_target_modules_is_a_config_error_naming_the_key(small_model):
    cfg = compose_config(["model.lora.rank=4", "model.lora.target_modules=[q_proj,v_prj]"])
    with pytest.raises(ConfigError, match=r"^model.lora.target_modules: \['v_prj'\] match no Linear layer.*'v_proj'"):
        check_lora_targets(cfg, small_model)
    check_lora_targets(compose_config(["model.lora.rank=4", "model.lora.target_modules=[q_proj,v_proj]"]), small_model)
    check_lora_targets(compose_config(["model.lora.rank=4"]), small_model)  # all-linear


def test_a_gateway_host_not_on_this_machine_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"^gateway.host '8.8.8.8' is not an address of this machine"):
        preflight(compose_config(["gateway.host=8.8.8.8"], run_dir=tmp_path / "a"))
    with pytest.raises(ConfigError, match=r"^gateway.host 'no-such-host.invalid' does not resolve"):
        preflight(compose_config(["gateway.host=no-such-host.invalid"], run_dir=tmp_path / "b"))
    preflight(compose_config(["gateway.host=0.0.0.0"], run_dir=tmp_path / "c"))
    assert not (tmp_path / "a").exists()  # refused before run_dir was created


def test_the_entry_point_exits_2_on_a_foreign_gateway_host_at_once(tmp_path):
    out = subprocess.run([sys.executable, "-m", "orchestrator.main", "gateway.host=8.8.8.8", f"run_dir={tmp_path / 'r'}"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("config error: gateway.host '8.8.8.8' is not an address of this machine")
    assert "Traceback" not in out.stderr and "Error executing job" not in out.stderr
