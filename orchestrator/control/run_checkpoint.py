"""Checkpoint and resume of a whole run: when to save, what a loop hands over, where it restarts.

The loops call a hook after every step with a `LoopPosition` (step, policy version, next group
id, groups trained, and the dataset rows of groups admitted but not trained yet). `RunCheckpointer`
turns every `save_freq`-th position into a checkpoint (`orchestrator/control/checkpoint.py`): the trainer
writes its HF weights and optimizer state, the driver its `RunState`. On resume, `ResumablePrompts`
hands out the pending rows before drawing new ones from the restored prompt cycle.

Invariant: no prompt is lost or drawn twice across a checkpoint and resume. The prompt cursor and
the pending rows are read in the same synchronous instant (no await between them), so a row is
either behind the cursor and pending, behind the cursor and trained, or ahead of the cursor.
The staleness counters restart from the restored version (`Admission.restore`), never from zero;
the ledger's counters continue from the checkpoint's (`RunState.counters`).

Every step (saved or not) the checkpointer appends `{"step", "input_ids"}` to
`RUN_DIR/consumed_prompts.jsonl`: the prompt ids of the groups the step consumed (trained,
filtered or failed), in order; a resume drops the lines after its checkpoint's step, so across a
killed and resumed run the file lists what an uninterrupted run would have consumed.

No Ray import: the trainer is any object whose `save_hf` / `save_optimizer` are coroutines (a TrainerGroup).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Awaitable, Callable

from orchestrator.control.checkpoint import Checkpoint, RunState, load_checkpoint, load_latest, stage_checkpoint
from orchestrator.watch.metrics import METRICS_FILENAME, keep_steps_upto
from orchestrator.loop.common import LoopPosition
from orchestrator.loop.prompts import PromptCycle, PromptCycleState
from orchestrator.loop.sampler import DifficultySampler, SamplerSettings
from orchestrator.loop.staleness import AdmissionState

CONSUMED_FILENAME = "consumed_prompts.jsonl"


def trim_after(run_dir: Path, step: int) -> list[dict]:
    """Before a resumed run logs anything: drop the per-step records written after `step` by the
    run that died (metrics.jsonl, consumed_prompts.jsonl); returns the metrics records kept."""
    keep_steps_upto(Path(run_dir) / CONSUMED_FILENAME, step)
    return keep_steps_upto(Path(run_dir) / METRICS_FILENAME, step)


def position_of(state: RunState) -> LoopPosition:
    """The position a loop resumes from, given a checkpoint's run state."""
    return LoopPosition(state.step, state.policy_version, state.next_group_id, state.admission.trained_groups,
                        state.pending_rows)


class ResumablePrompts:
    """The loop's prompt source: rows left over from a checkpoint first, then the prompt cycle."""

    def __init__(self, cycle: PromptCycle | DifficultySampler, pending: tuple[dict, ...] = ()) -> None:
        self._cycle = cycle
        self._pending = list(pending)
        self._consumed: list[str] = []

    @classmethod
    def restore(cls, rows: list[dict], seed: int, state: RunState | None,
                sampler: SamplerSettings | None = None) -> "ResumablePrompts":
        """A fresh source over `rows` (seeded) or, with `state`, the one the checkpoint saved: the
        uniform `PromptCycle`, or with `sampler` settings the `DifficultySampler`.

        Raises ValueError when the dataset rows differ from those the checkpoint was taken on, or
        the checkpoint was taken with the other sampler."""
        if state is None:
            return cls(PromptCycle(rows, seed) if sampler is None else DifficultySampler(rows, seed, sampler))
        saved_difficulty = isinstance(state.prompts, dict)
        if saved_difficulty != (sampler is not None):
            raise ValueError(f"the checkpoint was taken with task.sampler="
                             f"{'difficulty' if saved_difficulty else 'uniform'}: resume with the same sampler")
        if sampler is None:
            return cls(PromptCycle.from_state(rows, state.prompts), state.pending_rows)
        return cls(DifficultySampler.from_state(rows, state.prompts, sampler), state.pending_rows)

    def on_group_rewards(self, input_id: str, rewards: list[float]) -> None:
        self._consumed.append(input_id)
        self._cycle.on_group_rewards(input_id, rewards)

    def take_consumed(self) -> list[str]:
        """Prompt ids of the groups finished since the last call (each group reported once)."""
        out, self._consumed = self._consumed, []
        return out

    def take_metrics(self) -> dict[str, float]:
        return self._cycle.take_metrics()

    def next_rows(self, num: int) -> list[dict]:
        out = self._pending[:num]
        del self._pending[:num]
        if len(out) < num:
            out.extend(self._cycle.next_rows(num - len(out)))
        return out

    def snapshot(self) -> tuple[PromptCycleState | dict, tuple[dict, ...]]:
        """The cycle's (or sampler's) state and the leftover rows not handed out yet (read without awaiting)."""
        return self._cycle.state(), tuple(self._pending)


class RunCheckpointer:
    """The loops' checkpoint hook: saves every `save_freq` steps (and never when `save_freq <= 0`).

    Args:
        run_dir: the run directory (checkpoints go to `run_dir/checkpoints/step-XXXXXXXX/`).
        trainer: the trainer (a TrainerGroup: `await save_hf(dir)`, `await save_optimizer(path)`).
        prompts: the loop's prompt source.
        save_freq: steps between checkpoints. keep_last: checkpoints kept (older ones pruned).
        counters: the run's cumulative counters now (the ledger's `settled_counts`), read with the position.
        acr_counters: the run's cumulative `acr/*` counters now (awaited before the position is read),
            kept beside them so that a resumed run's summary counts its ACR calls from the start.
    """

    def __init__(self, run_dir: Path, trainer: Any, prompts: ResumablePrompts, *, save_freq: int,
                 keep_last: int, counters: Callable[[], dict[str, int]] = dict,
                 acr_counters: Callable[[], Awaitable[dict[str, int]]] | None = None) -> None:
        self._run_dir = Path(run_dir)
        self._trainer = trainer
        self._prompts = prompts
        self._save_freq = save_freq
        self._keep_last = keep_last
        self._counters = counters
        self._acr_counters = acr_counters
        self.saved: list[Path] = []

    async def __call__(self, pos: LoopPosition) -> None:
        with (self._run_dir / CONSUMED_FILENAME).open("a", encoding="utf-8") as f:
            f.write(json.dumps({"step": pos.step, "input_ids": self._prompts.take_consumed()}) + "\n")
        if self._save_freq <= 0 or pos.step % self._save_freq:
            return
        prompt_state, undrawn = self._prompts.snapshot()  # same instant as pos.pending_rows: no await before
        counters = self._counters()
        acr = await self._acr_counters() if self._acr_counters is not None else {}  # calls, not the position
        state = RunState(step=pos.step, policy_version=pos.policy_version, next_group_id=pos.next_group_id,
                         prompts=prompt_state, admission=AdmissionState(pos.policy_version, pos.trained_groups),
                         pending_rows=(*pos.pending_rows, *undrawn), counters={**acr, **counters})
        with stage_checkpoint(self._run_dir, pos.step, keep_last=self._keep_last) as stage:
            await self._trainer.save_hf(str(stage.model_dir))
            await self._trainer.save_optimizer(str(stage.optimizer_path))
            self.saved.append(stage.commit(state))


def find_resume_checkpoint(run_dir: Path, resume_mode: str, resume_from_path: str | None) -> Checkpoint | None:
    """The checkpoint a run continues from (verl's `trainer.resume_mode`), verified, or None.

    disable: None. auto: `run_dir/checkpoints/latest` if present, else None (a fresh run).
    resume_path: the checkpoint directory `resume_from_path`.

    Raises:
        CheckpointError: the named checkpoint is missing, partial or corrupt.
    """
    if resume_mode == "disable":
        return None
    if resume_mode == "auto":
        return load_latest(run_dir)
    return load_checkpoint(Path(resume_from_path or ""))
