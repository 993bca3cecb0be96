"""`logger` group: metric sinks (orchestrator/metrics.py `build_sinks` builds them from these)."""

from __future__ import annotations

from dataclasses import dataclass, field

from orchestrator.config.errors import one_of

SINK_NAMES = ("console", "jsonl", "wandb")
WANDB_MODES = ("offline", "online", "disabled")


@dataclass
class LoggerConfig:
    """Metric sinks: any of console, jsonl, wandb (offline unless `wandb_mode` says otherwise)."""

    sinks: list[str] = field(default_factory=lambda: list(SINK_NAMES))
    wandb_project: str = "acr-rl"
    wandb_mode: str = "offline"

    def __post_init__(self) -> None:
        for s in self.sinks:
            one_of(s, "logger.sinks", SINK_NAMES)
        one_of(self.wandb_mode, "logger.wandb_mode", WANDB_MODES)
