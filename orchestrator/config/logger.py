"""`logger` group: metric sinks (orchestrator/watch/metrics.py `build_sinks` builds them from these)."""

from __future__ import annotations

from dataclasses import dataclass, field

from orchestrator.config.errors import one_of

SINK_NAMES = ("console", "jsonl", "wandb", "tensorboard")
WANDB_MODES = ("auto", "offline", "online", "disabled")  # auto: online when WANDB_API_KEY is set, else offline
CONSOLE_LEVELS = ("debug", "info", "warning", "error")


@dataclass
class LoggerConfig:
    """Metric sinks: any of console, jsonl, wandb, tensorboard (RUN_DIR/tensorboard). `wandb_mode`:
    auto (online when WANDB_API_KEY is set, else offline), offline, online or disabled.
    `console_level`: the lowest level of library output (Ray, vLLM, Triton, TransferQueue) shown on
    the console; everything goes to RUN_DIR/logs/ whatever the level (debug or info brings the
    libraries' own lines back to the console)."""

    sinks: list[str] = field(default_factory=lambda: ["console", "jsonl", "wandb"])
    wandb_project: str = "acr-rl"
    wandb_mode: str = "auto"
    console_level: str = "warning"

    def __post_init__(self) -> None:
        for s in self.sinks:
            one_of(s, "logger.sinks", SINK_NAMES)
        one_of(self.wandb_mode, "logger.wandb_mode", WANDB_MODES)
        one_of(self.console_level, "logger.console_level", CONSOLE_LEVELS)
