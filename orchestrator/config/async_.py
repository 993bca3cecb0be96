"""`async` group (attribute `RunConfig.async_`): staleness bound and in-flight policy of the async
loop (its settings are built by orchestrator/config/run.py `async_loop_settings`). The choice
lists are the modules' that give them meaning: `on_stale` is orchestrator/loop/staleness.py's,
`in_flight` workers/inference/settings.py's (less `drain`, which the sync loop uses)."""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.config.errors import check, one_of
from orchestrator.loop.staleness import ON_STALE_CHOICES
from workers.inference.settings import IN_FLIGHT_MODES

SYNC_IN_FLIGHT = "drain"  # sync mode never updates weights under a running request
ASYNC_IN_FLIGHT_MODES = tuple(m for m in IN_FLIGHT_MODES if m != SYNC_IN_FLIGHT)


@dataclass
class AsyncConfig:
    """Async mode (`mode=async`; the config key is `async`, the attribute `RunConfig.async_`).

    max_staleness: η in policy versions; at most (η + v + 1)·k·B groups admitted by version v and,
        with `rollout.concurrency=fixed`, at most (η + 1)·B in flight (orchestrator/loop/staleness.py).
    on_stale: a sample older than η at update time is dropped (`expired`) or trained with its
        loss mask zeroed (`train_masked`: kept for group statistics, no gradient).
    in_flight: generation in flight at a weight sync keeps running (`continue`; tokens carry the
        version that produced them) or is aborted and resumed (`abort_resume`).
    resume_aborted: with `abort_resume`, resume aborted requests (False: they fail and are never trained).
    max_concurrent_rollouts: with `rollout.concurrency=fixed`, the rollouts in flight at once
        (AReaL's `max_concurrent_rollouts`), in whole groups of `rollout.n`; null: (η + 1)·B groups
        (orchestrator/loop/staleness.py `fixed_max_running`). At least one mini-batch (B·n).
    drain_timeout_s: seconds the end of a finished run waits for groups still generating before it
        cancels them (their rollouts end `expired`). Admission stops once the last update's groups
        are in flight, so normally nothing is left to wait for; 0 cancels at once.
    """

    max_staleness: int = 1
    on_stale: str = "drop"
    in_flight: str = "continue"
    resume_aborted: bool = True
    max_concurrent_rollouts: int | None = None
    drain_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        check(self.max_staleness >= 0, "async.max_staleness", "must be >= 0", self.max_staleness)
        one_of(self.on_stale, "async.on_stale", ON_STALE_CHOICES)
        one_of(self.in_flight, "async.in_flight", ASYNC_IN_FLIGHT_MODES)
        check(self.max_concurrent_rollouts is None or self.max_concurrent_rollouts >= 1,
              "async.max_concurrent_rollouts", "must be >= 1 or null", self.max_concurrent_rollouts)
        check(self.drain_timeout_s >= 0, "async.drain_timeout_s", "must be >= 0 (seconds)", self.drain_timeout_s)

