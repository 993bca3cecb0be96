"""`trainer.max_restarts`: a dead trainer rank restarts the run's actors from the last checkpoint,
inside the same run (same driver, Ray cluster, local stack, run_dir and reaper).

What a restart does (orchestrator/main.py drives it): the failed attempt's parts close as at the end of
a run (rollouts cancelled, their ACR sessions stopped, the weight sync closed), its actors are killed
(`discard`: the live trainer ranks, the inference replicas, the gateway, the rollout actors) and its
placement groups and trajectory buffer go with its ExitStack; then every part is built again from
the checkpoint `checkpoints/latest` names, exactly as `trainer.resume_mode=auto` would in a new
process: the trainer loads its weights and optimizer state, the replicas start on the same weights
at the checkpoint's policy version (so no replica serves a version the new trainer group does not
have), metrics.jsonl and consumed_prompts.jsonl drop the steps after the checkpoint, and the loop
continues from the checkpoint's position.

Invariant: a restarted run trains every prompt exactly once, as one uninterrupted run would (the
resume invariant of orchestrator/control/run_checkpoint.py, applied in-process); past
`max_restarts`, or with no checkpoint yet, the run stops with the TrainerLost message as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any, Iterable

from orchestrator.control.checkpoint import Checkpoint, load_latest, remove_staging

log = logging.getLogger(__name__)

DISCARD_WAIT_S = 10.0  # bound on killing a failed attempt's actors (seconds)


class TrainerRestarts:
    """Counts restarts against `max_restarts` and finds the checkpoint the next attempt starts from."""

    def __init__(self, run_dir: Path, max_restarts: int) -> None:
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
        self._run_dir = Path(run_dir)
        self._max = max_restarts
        self.restarts = 0

    def next_checkpoint(self) -> Checkpoint | None:
        """The checkpoint to restart from, counting the restart; None when `max_restarts` are used up
        or no checkpoint was written yet (the run then stops). A checkpoint the dead rank was
        writing is not committed: its staging folder is removed and `latest` still names the previous
        one. Raises CheckpointError when `latest` names a bad checkpoint."""
        if self.restarts >= self._max:
            return None
        remove_staging(self._run_dir)
        ckpt = load_latest(self._run_dir)
        if ckpt is not None:
            self.restarts += 1
        return ckpt

    def line(self, ckpt: Checkpoint, why: str) -> str:
        """The console line of a restart."""
        return (f"{why.split('; the run stopped')[0]}; restarting the trainer group from {ckpt.path} (step "
                f"{ckpt.state.step}, policy version {ckpt.state.policy_version}): restart {self.restarts}/{self._max}")


async def discard(actors: Iterable[Any]) -> None:
    """Kill a failed attempt's actors (no Ray restart), bounded by DISCARD_WAIT_S; dead ones are skipped."""
    import ray

    def kill_all() -> None:
        for actor in actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)

    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(DISCARD_WAIT_S):
            await asyncio.to_thread(kill_all)
