"""Resume into a changed config: the keys that must match the checkpoint's run, checked before any
part starts.

A resume used to take whatever config it was given: `model.lora.rank=8` added, `task=gsm8k`, or
`inference.lora_sync=merged` on a LoRA run each ended in a raw traceback 39-130 s in (the weights,
the optimizer state or the prompt cycle did not fit), and `model=qwen3_random` silently kept
training the tiny model. The checkpoint's run recorded its config in `RUN_DIR/config.yaml` (written
at every start, never on a refusal); pre-flight compares it with the new one here.

Rule: a key under one of RESUME_FIXED (the model and its adapter, the task and its data, what shapes
a group or a step, the trainer engine, the sampling seed) must keep its value; every other key (for
example `trainer.total_steps`, `trainer.save_freq`, `logger.*`, timeouts, limits) may change.

Invariant: `changed_keys` is pure (two nested dicts in, sorted dotted keys out); `check_resume_config`
raises ConfigError naming every changed fixed key with both values, and reads one file. Caller:
orchestrator/control/preflight.py once the checkpoint is found.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from orchestrator.config import ConfigError, RunConfig

# dotted prefixes of the keys a resume must keep (a key matches its prefix exactly or as `prefix.`)
RESUME_FIXED = (
    "model",                 # the weights and the adapter (model.lora.*) the checkpoint holds
    "task",                  # what data the prompt cycle draws from (its rows are checked against the state too)
    "trainer.name",          # fsdp and verl save different optimizer states
    "inference.lora_sync",   # adapter or merged weights reach the engines
    "mode.name", "mode.sync_every",  # the loop and its mini-batches the position was saved in
    "rollout.n", "rollout.batch_size",  # group and step shapes of the pending rows and counters
    "algorithm.name",
    "seed",                  # the prompt cycle's order
)
# keys whose values are paths: compared resolved (a relative and an absolute spelling are one value)
PATH_KEYS = ("model.path", "model.chat_template", "task.data_path", "task.val_data_path")


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; leaves are anything but dicts."""
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _fixed(key: str) -> bool:
    return any(key == p or key.startswith(f"{p}.") for p in RESUME_FIXED)


def _same(key: str, a: Any, b: Any) -> bool:
    if key in PATH_KEYS and a is not None and b is not None:
        return Path(str(a)).resolve() == Path(str(b)).resolve()
    return a == b


def changed_keys(recorded: dict, new: dict) -> list[tuple[str, Any, Any]]:
    """The fixed keys whose value differs between the checkpoint's run `recorded` and `new` (nested
    config dicts): (dotted key, recorded value, new value), sorted by key. Keys `recorded` lacks
    (added to the schema since that run) are not compared: an older run stays resumable."""
    old, cur = flatten(recorded), flatten(new)
    return [(key, old[key], cur.get(key, "<absent>")) for key in sorted(old)
            if _fixed(key) and not _same(key, old[key], cur.get(key, "<absent>"))]


def run_config_dict(cfg: RunConfig) -> dict:
    """`cfg` as the nested dict `config.yaml` records (the `async` group under its config key)."""
    resolved = OmegaConf.to_container(OmegaConf.structured(cfg))
    resolved["async"] = resolved.pop("async_")
    return resolved


def check_resume_config(cfg: RunConfig, checkpoint_path: Path) -> None:
    """Raise ConfigError when `cfg` changes a RESUME_FIXED key of the run that saved the checkpoint
    at `checkpoint_path` (`RUN/checkpoints/step_N`: its config is `RUN/config.yaml`; absent, the
    check is skipped)."""
    recorded_path = Path(checkpoint_path).parent.parent / "config.yaml"
    if not recorded_path.is_file():
        return
    recorded = OmegaConf.to_container(OmegaConf.load(recorded_path))
    changes = changed_keys(recorded, run_config_dict(cfg))
    if changes:
        listed = "; ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in changes)
        raise ConfigError(f"trainer.resume_mode={cfg.trainer.resume_mode}: the checkpoint {checkpoint_path} was "
                          f"trained with another config ({recorded_path}); these keys change what is trained or on "
                          f"what data and must keep their values to resume: {listed}. Resume with the recorded "
                          f"values, or start a new run_dir (trainer.total_steps, logging and timeouts may change)")
