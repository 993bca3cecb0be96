"""`model.lora.target_modules` checked against the model before any part starts.

A typo in a target module used to surface as a dead trainer ("trainer lost ... a rerun starts from
step 0", exit 3, about a minute in): PEFT raised inside the trainer actor. Here the model is built
on PyTorch's meta device from its config.json (no weights read, no memory used) and every target
is matched the way PEFT matches a list of names: a module whose name is the target or ends with
`.<target>`. A target that matches no `nn.Linear` is refused naming it and the Linear names the
model has; `all-linear` matches by definition.

Invariant: `unmatched_targets` reads config.json only and never loads weights. Caller:
orchestrator/wiring/runtime.py beside `check_kv_cache`, once the model directory is known (the
embedded tiny model is built after pre-flight).
"""

from __future__ import annotations

from pathlib import Path

from orchestrator.config import ConfigError, RunConfig

ALL_LINEAR = "all-linear"


def linear_names(model_dir: str | Path) -> list[str]:
    """The dotted names of every `nn.Linear` of the causal LM in `model_dir` (built on the meta device)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def unmatched_targets(targets: list[str], names: list[str]) -> list[str]:
    """The targets that match none of `names` (PEFT's list rule: equal, or a `.<target>` suffix)."""
    return [t for t in targets if t != ALL_LINEAR and not any(n == t or n.endswith(f".{t}") for n in names)]


def check_lora_targets(cfg: RunConfig, model_dir: str | Path) -> None:
    """Raise ConfigError naming `model.lora.target_modules` when a training run with LoRA names a
    module the model at `model_dir` does not have (or that is not a Linear layer)."""
    lora = cfg.model.lora
    if not lora.enabled or cfg.mode.name == "eval":
        return
    names = linear_names(model_dir)
    missing = unmatched_targets(list(lora.target_modules), names)
    if missing:
        leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
        raise ConfigError(f"model.lora.target_modules: {missing} match no Linear layer of the model in {model_dir}; "
                          f"its Linear layers are named {leaves} (or use [all-linear]), got "
                          f"{list(lora.target_modules)}")
