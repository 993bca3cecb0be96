"""Hydra's own composition failures as `config error:` messages that name the key.

Hydra reports an unknown group choice (`mode=asyn`), a type error (`trainer.lr=abc`), a missing
`+` or a dict value with its own wording, a stack-trace hint and exit status 1. `check_overrides`
composes the command line's overrides once with Hydra's compose API before `@hydra.main` runs and
turns each failure into one line naming the key (and, for a group, its valid choices); the entry
point prints it as `config error: ...` and exits 2, like every other config error.

Callers: orchestrator/main.py (`__main__`). Pure mapping in `describe`; no Ray.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from orchestrator.config.errors import unknown_key

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def _override_key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


def _valid_keys(cause: BaseException) -> list[str]:
    t = getattr(cause, "object_type", None)
    return [f.name for f in dataclasses.fields(t)] if dataclasses.is_dataclass(t) else []


def _parses(override: str) -> bool:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        OverridesParser.create().parse_overrides([override])
    except OverrideParseException:
        return False
    return True


def describe(exc: BaseException, overrides: list[str]) -> str:
    """The one-line message (without the `config error: ` prefix) of a Hydra composition failure
    `exc` caused by the command line `overrides`."""
    if isinstance(exc, MissingConfigException) and exc.missing_cfg_file and "/" in exc.missing_cfg_file:
        group, choice = exc.missing_cfg_file.rsplit("/", 1)
        return f"{group}: no choice {choice!r}; valid choices: {', '.join(exc.options or [])}"
    if isinstance(exc, OverrideParseException):
        bad = next((o for o in overrides if not _parses(o)), " ".join(overrides))
        return (f"cannot parse the override {bad!r}: {str(exc).splitlines()[0]} (quote a value with spaces or "
                "special characters: key='value')")
    cause = exc.__cause__
    text = str(exc)
    key = getattr(cause, "full_key", None) or ""
    if text.startswith("Could not override '"):  # a key that is not in the config
        key = text.split("'")[1]
        override = next((o for o in overrides if _override_key(o) == key), f"{key}=...")
        value = override.split("=", 1)[1] if "=" in override else ""
        if value.startswith("{"):
            return (f"{key}: a dict value does not merge into the defaults; set one entry with "
                    f"+{key}.NAME=VALUE, or replace the whole dict with ++{key}={value}")
        valid = _valid_keys(cause)
        if valid:
            return unknown_key(key, valid)
        return f"{key}: no such key; to add it, prefix the override with +: +{override}"
    if text.startswith("Could not append to config. An item is already at '"):
        key = text.split("'")[1]
        return f"{key}: already set by the defaults; drop the + (`{key}=...`) or use ++ to add or override"
    if isinstance(cause, OmegaConfBaseException) and key:
        return f"{key}: {str(cause).splitlines()[0]}"
    return " ".join(line.strip() for line in text.splitlines() if line.strip() and "search path" not in line)


def check_overrides(overrides: list[str], config_name: str = "config") -> str | None:
    """Compose `config_name` with `overrides`; None when Hydra accepts them, else the message.
    Command-line flags (`--cfg`, `-m`, ...) and `hydra.*` overrides are left to `@hydra.main`."""
    if any(o.startswith("-") for o in overrides):
        return None
    from hydra import compose, initialize_config_dir

    mine = [o for o in overrides if not _override_key(o).startswith("hydra.")]
    for o in mine:  # `trainer=null`: Hydra raises a bare ValueError about the override's type
        key, _, value = o.partition("=")
        if value in ("null", "~") and (CONFIG_DIR / key.lstrip("+~")).is_dir():
            group = key.lstrip("+~")
            return f"{group}: a config group needs a choice, not {value}; valid choices: {', '.join(_choices(group))}"
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cfg = compose(config_name, overrides=mine)
    except (ConfigCompositionException, OverrideParseException, OmegaConfBaseException) as exc:
        return describe(exc, mine)
    return _top_level_types(cfg)


def _choices(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def _top_level_types(cfg: DictConfig) -> str | None:
    """The root keys outside every group's schema (`seed`, `dry_run`): Hydra takes any value there,
    and `seed=1.7` used to become 1 silently."""
    seed, dry_run = cfg.get("seed"), cfg.get("dry_run")
    if isinstance(seed, bool) or not isinstance(seed, int):
        return f"seed: must be an integer, got {seed!r}"
    if not isinstance(dry_run, bool):
        return f"dry_run: must be true or false, got {dry_run!r}"
    return None
