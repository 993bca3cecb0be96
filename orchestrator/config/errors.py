"""ConfigError and the two checks every config group uses; a failed check names the dotted key."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A config value is invalid; the message names the dotted key."""


def check(cond: bool, key: str, msg: str, value: Any) -> None:
    """Raise `ConfigError("<key> <msg>, got <value>")` unless `cond`."""
    if not cond:
        raise ConfigError(f"{key} {msg}, got {value!r}")


def one_of(value: Any, key: str, choices: tuple[Any, ...]) -> None:
    """Raise ConfigError naming `key` unless `value` is one of `choices`."""
    check(value in choices, key, f"must be one of {list(choices)}", value)
