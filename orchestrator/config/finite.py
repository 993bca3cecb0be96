"""Every float of the composed config is a number: NaN, inf and -inf are refused in one place,
before any group's own checks run.

Why one place: the groups' checks are written `x <= 0` / `x > 1`, which NaN passes (every comparison
with NaN is false), and `inf` passes `> 0`; so `rollout.temperature=nan` was accepted and failed
every rollout later, `trainer.lr=inf` a minute in, and `rollout.acr.limits.requests_per_s=nan`
raised a traceback inside the settings it builds. No key of the schema takes a non-finite value
(none means "unbounded" by inf: unbounded is `null` where a key allows it), so the rule has no
exceptions. Signs and ranges stay with each group's own checks, which hold once values are finite.

Invariant: `check_finite` raises ConfigError naming the dotted key of the first non-finite float
(in the groups' declaration order), and reads values only. Caller: orchestrator/config/run.py
`to_run_config`, before `OmegaConf.to_object` runs any `__post_init__`.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

from omegaconf import DictConfig, OmegaConf

from orchestrator.config.errors import ConfigError


def non_finite(value: Any, where: str) -> Iterable[str]:
    """The dotted keys under `where` whose value is a float that is NaN or ±inf (dicts and lists
    walked; list items named `key[i]`)."""
    if isinstance(value, float) and not math.isfinite(value):
        yield where
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from non_finite(item, f"{where}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from non_finite(item, f"{where}[{i}]")


def check_finite(cfg: DictConfig, groups: Iterable[str]) -> None:
    """Raise ConfigError `<key> must be a finite number, got nan` for the first non-finite float in
    `groups` of `cfg`. A group whose interpolations do not resolve is skipped here (its own
    validation reports that)."""
    for group in groups:
        if group not in cfg:
            continue
        try:
            values = OmegaConf.to_container(cfg[group], resolve=True, throw_on_missing=False)
        except Exception:  # noqa: BLE001  a broken interpolation: OmegaConf.to_object names it
            continue
        for key in non_finite(values, group):
            value = OmegaConf.select(cfg, key.replace("[", ".").replace("]", ""), throw_on_missing=False)
            raise ConfigError(f"{key} must be a finite number, got {value!r} (NaN and infinity pass no "
                              "range check; set a number, or null where the key allows it)")
