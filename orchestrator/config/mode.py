"""`mode` group: sync or async loop, and how often weights sync (the loops' settings are built from
it and four other groups by orchestrator/config/run.py `sync_loop_settings` / `async_loop_settings`)."""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.config.errors import check, one_of

MODE_NAMES = ("sync", "async", "eval")  # eval: orchestrator/evaluate.py, no trainer


@dataclass
class ModeConfig:
    """Sync or async training loop, or eval (batch evaluation, no training). `sync_every`: optimizer updates (mini-batches) per weight sync
    (verl: `parameter_sync_step`)."""

    name: str = "sync"
    sync_every: int = 1

    def __post_init__(self) -> None:
        one_of(self.name, "mode.name", MODE_NAMES)
        check(self.sync_every >= 1, "mode.sync_every", "must be >= 1", self.sync_every)

