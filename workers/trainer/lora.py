"""LoRA on the trainer's model (PEFT): wrapping, and the adapter's two ways out of the trainer.

`wrap_lora` puts a PEFT adapter on an HF causal LM and freezes every base weight, so only the
adapter's A and B train (and only they get optimizer state). Out of a full (gathered) state dict
of the wrapped model (PEFT names: `base_model.model.<hf name>`, adapted layers' weights under
`<module>.base_layer.weight`, the adapter under `<module>.lora_A.<adapter>.weight`):

- `adapter_state_dict`: the adapter alone under PEFT's saved names
  (`base_model.model.<module>.lora_A.weight`), what `write_adapter_dir` writes as a PEFT
  directory (adapter_config.json + adapter_model.safetensors) that PEFT and vLLM's LoRA loader read;
- `merged_state_dict`: the full HF state dict with every adapted weight replaced by
  W + (alpha / r) B A (PEFT's merge for `nn.Linear`; fan_in_fan_out is never set here), under HF
  names, which `from_pretrained` and vLLM load like any model.

Invariant: with B = 0 (both supported inits) the adapted model equals the base exactly, so policy
version 0 is the base model the engines start with. Only `nn.Linear` targets are supported (PEFT
wraps others differently); `wrap_lora` raises ValueError naming a target that is not a Linear.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import TYPE_CHECKING

import torch

from workers.weight_sync.lora import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE

if TYPE_CHECKING:
    from workers.trainer.settings import LoraSettings

ADAPTER_NAME = "default"  # PEFT's adapter name inside the model; left out of saved names
PEFT_PREFIX = "base_model.model."


def peft_config(lora: LoraSettings, base_model_path: str = ""):
    """PEFT's LoraConfig for `lora` (task CAUSAL_LM, biases not trained)."""
    from peft import LoraConfig, TaskType

    targets = lora.target_modules
    return LoraConfig(
        task_type=TaskType.CAUSAL_LM, r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
        target_modules="all-linear" if targets == ("all-linear",) else list(targets), bias="none",
        init_lora_weights=True if lora.init == "default" else "gaussian",
        base_model_name_or_path=base_model_path or None,
    )


def wrap_lora(model: torch.nn.Module, lora: LoraSettings, base_model_path: str = "") -> torch.nn.Module:
    """`model` wrapped in a PEFT LoRA adapter (a `PeftModel`); base weights frozen
    (requires_grad False), adapter weights trainable. Raises ValueError when a target module
    is not an `nn.Linear`, or when no module matched."""
    from peft import get_peft_model

    wrapped = get_peft_model(model, peft_config(lora, base_model_path))
    adapted = [(n, m) for n, m in wrapped.named_modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")]
    if not adapted:
        raise ValueError(f"model.lora.target_modules={list(lora.target_modules)} matched no module of the model")
    for name, m in adapted:
        if not isinstance(m.base_layer, torch.nn.Linear):
            raise ValueError(f"model.lora.target_modules: {name} is a {type(m.base_layer).__name__}, only "
                             "nn.Linear layers can be adapted here")
    return wrapped


def set_lora_dropout(model: torch.nn.Module, active: bool) -> None:
    """Switch the adapter's dropout modules to train (`active`) or eval mode; the rest of the
    model stays in eval mode (no base dropout)."""
    for name, m in model.named_modules():
        if name.endswith(f"lora_dropout.{ADAPTER_NAME}"):
            m.train(active)


def _strip(name: str) -> str:
    return name[len(PEFT_PREFIX):] if name.startswith(PEFT_PREFIX) else name


def adapter_state_dict(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter tensors of a wrapped model's full state dict, under PEFT's saved names
    (adapter name dropped), fp32, contiguous."""
    tag = f".{ADAPTER_NAME}."
    return {k.replace(tag, "."): v.detach().to(torch.float32).contiguous()
            for k, v in full.items() if ".lora_A." in k or ".lora_B." in k}


def merged_state_dict(full: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """The HF state dict of the merged model: each adapted `<m>.base_layer.weight` becomes
    `<m>.weight` = W + scaling * B @ A (fp32), biases `<m>.base_layer.bias` -> `<m>.bias`, adapter
    tensors dropped, the PEFT prefix stripped. Raises KeyError when an A has no B."""
    out: dict[str, torch.Tensor] = {}
    suffix_a, suffix_b = f".lora_A.{ADAPTER_NAME}.weight", f".lora_B.{ADAPTER_NAME}.weight"
    for k, v in full.items():
        if ".lora_A." in k or ".lora_B." in k:
            continue
        name = _strip(k).replace(".base_layer.", ".")
        t = v.detach().to(torch.float32)
        if k.endswith(".base_layer.weight"):
            module = k[: -len(".base_layer.weight")]
            a, b = full[module + suffix_a].to(torch.float32), full[module + suffix_b].to(torch.float32)
            t = t + scaling * (b @ a)
        out[name] = t.contiguous()
    return out


def write_adapter_dir(directory: str, config, adapter: dict[str, torch.Tensor]) -> str:
    """Write a PEFT adapter directory (adapter_config.json from PEFT's `config`,
    adapter_model.safetensors from `adapter`) atomically: a temp directory beside it, renamed into
    place (an existing `directory` is replaced). Returns directory."""
    from safetensors.torch import save_file

    parent = os.path.dirname(os.path.abspath(directory))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=".partial-adapter-")
    try:
        cfg = config.to_dict()
        with open(os.path.join(tmp, ADAPTER_CONFIG_FILE), "w") as f:
            json.dump(_jsonable(cfg), f, indent=2, sort_keys=True)
        save_file(adapter, os.path.join(tmp, ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
        if os.path.isdir(directory):
            shutil.rmtree(directory)
        os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def _jsonable(value):
    """PEFT's config dict with sets as sorted lists and enums as their values (what PEFT's own
    `save_pretrained` writes)."""
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return getattr(value, "value", value)


def load_adapter_weights(model: torch.nn.Module, directory: str) -> int:
    """Load a PEFT adapter directory's weights into the wrapped, not yet sharded `model` (the
    resume path). Returns the number of tensors loaded; raises ValueError when the file's tensors
    do not match the model's adapter (other rank or targets)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = load_file(os.path.join(directory, ADAPTER_WEIGHTS_FILE))
    result = set_peft_model_state_dict(model, weights)
    missing = [k for k in result.missing_keys if ".lora_" in k]
    if missing or result.unexpected_keys:
        raise ValueError(f"adapter {directory} does not match model.lora: missing {missing[:3]}, "
                         f"unexpected {list(result.unexpected_keys)[:3]}")
    return len(weights)
