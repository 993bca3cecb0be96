"""The dry-run memory plan with `model.lora` (workers/core/memory_plan.py): the adapter's parameter
count is PEFT's, and only the adapter holds gradients and AdamW state."""

from __future__ import annotations

import json
from pathlib import Path

from workers.core.memory_plan import ModelShape, TrainerLoad, known_shape, trainer_memory


def test_adapter_parameter_count_is_what_peft_trains(random_qwen2_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    shape = ModelShape.from_hf_config(json.loads((Path(random_qwen2_dir) / "config.json").read_text()))
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(random_qwen2_dir),
                           LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert shape.lora_params(8) == trained


def test_lora_plan_keeps_optimizer_state_for_the_adapter_only():
    shape = known_shape("Qwen3-14B")
    full = trainer_memory(shape, TrainerLoad(8, "bf16", 16384, True))
    lora = trainer_memory(shape, TrainerLoad(8, "bf16", 16384, True, lora_rank=64))
    q = shape.lora_params(64)
    assert lora.optimizer == 8 * q // 8 and lora.gradients == 4 * q // 8
    assert full.optimizer == 8 * shape.num_params // 8
    assert lora.weights < full.weights  # the frozen base in bf16, no fp32 master copy
    assert lora.activations == full.activations
