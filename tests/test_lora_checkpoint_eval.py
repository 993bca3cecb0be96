"""A LoRA checkpoint evaluated as documented (issue 47, item 2): `mode=eval
model.path=RUN/checkpoints/latest/model` scored the untrained base (0.138 where the trained adapter
scores 0.177), because the checkpoint's `model/` holds the frozen base and the adapter sits beside it
in `lora_adapter/`. Pre-flight now serves that adapter: the same command gives the same config as
adding `eval.adapter_path=.../lora_adapter` by hand (which gave the trained score), and training
from such a directory is refused with the ways that keep the adapter."""

from __future__ import annotations

import json
import re

import pytest

from orchestrator.config import ConfigError
from orchestrator.control.preflight import check_model
from stand_ins import REPO, compose_config


def _lora_checkpoint(run):
    model = run / "checkpoints" / "step-00000004" / "model"
    (model / "lora_adapter").mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "lora_adapter" / "adapter_config.json").write_text(json.dumps({"r": 8, "peft_type": "LORA"}))
    (run / "checkpoints" / "latest").symlink_to("step-00000004")  # as a run writes it (relative)
    return model


def test_the_documented_eval_command_serves_the_checkpoints_adapter(tmp_path, capsys):
    documented = re.search(r"model\.path=(\S+)", (REPO / "docs" / "training.md").read_text()).group(1)
    model = _lora_checkpoint(tmp_path / documented.split("/checkpoints/")[0])
    as_documented = compose_config(["mode=eval", f"model.path={tmp_path / documented}"])
    by_hand = compose_config(["mode=eval", f"model.path={model}", f"eval.adapter_path={model / 'lora_adapter'}"])
    check_model(as_documented)
    check_model(by_hand)
    assert as_documented.eval.adapter_path == by_hand.eval.adapter_path == str(model / "lora_adapter")
    assert as_documented.model.path == by_hand.model.path == str(model)
    assert "evaluating its base with its trained adapter" in capsys.readouterr().err


def test_an_explicit_adapter_wins_and_a_full_checkpoint_is_served_alone(tmp_path):
    model = _lora_checkpoint(tmp_path / "run")
    cfg = compose_config(["mode=eval", f"model.path={model}", f"eval.adapter_path={tmp_path / 'other'}"])
    check_model(cfg)
    assert cfg.eval.adapter_path == str(tmp_path / "other")
    (model / "lora_adapter" / "adapter_config.json").unlink()  # a full fine-tune's model/: no adapter
    cfg = compose_config(["mode=eval", f"model.path={model}"])
    check_model(cfg)
    assert cfg.eval.adapter_path is None


def test_training_from_a_lora_checkpoint_dir_is_refused(tmp_path):
    model = _lora_checkpoint(tmp_path / "run")
    with pytest.raises(ConfigError, match=r"^model.path .* is a LoRA checkpoint .*resume_mode=auto.*--merge"):
        check_model(compose_config([f"model.path={model}"]))
