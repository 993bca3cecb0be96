"""ConfigError, the two checks every config group uses, and the one wording of an unknown key; a
failed check names the dotted key."""

from __future__ import annotations

from typing import Any, Iterable


class ConfigError(ValueError):
    """A config value is invalid; the message names the dotted key."""


def check(cond: bool, key: str, msg: str, value: Any) -> None:
    """Raise `ConfigError("<key> <msg>, got <value>")` unless `cond`."""
    if not cond:
        raise ConfigError(f"{key} {msg}, got {value!r}")


def one_of(value: Any, key: str, choices: tuple[Any, ...]) -> None:
    """Raise ConfigError naming `key` unless `value` is one of `choices`."""
    check(value in choices, key, f"must be one of {list(choices)}", value)


def unknown_key(key: str, valid: Iterable[str]) -> str:
    """The message for a config key the schema does not declare, in one format wherever it is found
    (Hydra's composition, orchestrator/config/hydra_errors.py, or the typed config, run.py):
    `<key>: no such key; valid keys here: a, b, c` (`valid` in declaration order)."""
    return f"{key}: no such key; valid keys here: {', '.join(valid)}"
