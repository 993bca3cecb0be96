"""`default_of`: a config field's default read from the settings dataclass that owns it.

A config group maps its values onto a worker's settings dataclass (e.g. `rollout` onto
workers/rollout/settings.py `RolloutSettings`); the default is written once, in that dataclass, and
the config field reads it from there, so the two cannot differ."""

from __future__ import annotations

from dataclasses import MISSING, fields
from typing import Any


def default_of(cls: type, name: str) -> Any:
    """The declared default of dataclass field `name` of `cls`. Raises KeyError for an unknown
    field or one without a plain default (a default_factory is not read here)."""
    for f in fields(cls):
        if f.name == name and f.default is not MISSING:
            return f.default
    raise KeyError(f"{cls.__name__}.{name} has no plain default")
