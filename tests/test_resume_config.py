"""Resume into a changed config (issue 47, item 3): pre-flight compares the checkpoint's recorded
config with the new one before any part starts; a key that changes what is trained or on what data is
refused naming it (exit 2), the safe ones may change, and the old config.yaml is never overwritten."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from orchestrator.config import ConfigError
from orchestrator.control.checkpoint import RunState, stage_checkpoint
from orchestrator.control.preflight import preflight
from orchestrator.control.resume_config import changed_keys, run_config_dict
from orchestrator.loop.prompts import PromptCycle
from orchestrator.loop.staleness import AdmissionState
from stand_ins import compose_config

REPO = Path(__file__).resolve().parent.parent


def test_changed_keys_are_the_fixed_ones_only():
    old = {"model": {"lora": {"rank": 0}, "name": "tiny"}, "trainer": {"total_steps": 4, "name": "fsdp"},
           "logger": {"name": "console"}, "task": {"name": "letters"}}
    new = {"model": {"lora": {"rank": 8}, "name": "tiny"}, "trainer": {"total_steps": 9, "name": "fsdp"},
           "logger": {"name": "jsonl"}, "task": {"name": "gsm8k"}}
    assert changed_keys(old, new) == [("model.lora.rank", 0, 8), ("task.name", "letters", "gsm8k")]
    assert changed_keys({"model": {"name": "tiny"}}, {"model": {"name": "tiny", "added_since": 1}}) == []


@pytest.fixture()
def saved_run(tmp_path):
    """A run_dir holding a step-2 checkpoint and the config.yaml of the run that saved it."""
    run = tmp_path / "run"
    run.mkdir()
    text = OmegaConf.to_yaml(run_config_dict(compose_config(run_dir=run)))
    (run / "config.yaml").write_text(text)
    cycle = PromptCycle([{"input_id": "p0", "prompt": "q"}], 0)
    state = RunState(step=2, policy_version=2, next_group_id=4, prompts=cycle.state(),
                     admission=AdmissionState(policy_version=2, trained_groups=4))
    with stage_checkpoint(run, 2) as stage:
        stage.model_dir.mkdir()
        (stage.model_dir / "config.json").write_text('{"model_type": "qwen2"}')
        (stage.model_dir / "model.safetensors").write_bytes(b"\x01" * 64)
        stage.optimizer_path.write_bytes(b"\x02" * 64)
        stage.commit(state)
    return run, text


@pytest.mark.parametrize("override, key", [
    ("model.lora.rank=8", "model.lora.rank"),
    ("inference.lora_sync=merged", "inference.lora_sync"),
    ("rollout.n=8", "rollout.n"),
    ("seed=3", "seed"),
])
def test_a_resume_that_changes_what_is_trained_is_refused_naming_the_key(saved_run, override, key):
    run, text = saved_run
    with pytest.raises(ConfigError, match=rf"^trainer.resume_mode=auto: .* {key}: "):
        preflight(compose_config(["trainer.resume_mode=auto", "trainer.total_steps=9", override], run_dir=run))
    assert (run / "config.yaml").read_text() == text


def test_a_resume_that_changes_only_safe_keys_passes(saved_run):
    run, _ = saved_run
    pre = preflight(compose_config(["trainer.resume_mode=auto", "trainer.total_steps=9", "logger=console",
                                    "rollout.timeout_s=30"], run_dir=run))
    assert pre.checkpoint is not None and pre.checkpoint.state.step == 2


def test_the_entry_point_refuses_with_exit_2_before_anything_starts(saved_run):
    run, text = saved_run
    out = subprocess.run([sys.executable, "-m", "orchestrator.main", f"run_dir={run}", "trainer.resume_mode=auto",
                          "trainer.total_steps=9", "model.lora.rank=8"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2, out.stderr
    assert "config error: trainer.resume_mode=auto" in out.stderr and "model.lora.rank: 0 -> 8" in out.stderr
    assert "Traceback" not in out.stderr and "Error executing job" not in out.stderr
    assert (run / "config.yaml").read_text() == text
    assert not (run / "pids.json").exists() and not (run / "summary.json").exists()
