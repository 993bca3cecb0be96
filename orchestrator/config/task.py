"""`task` group: the dataset and its agent. Names come from the one task registry
(orchestrator/tasks.py); whether a task's data file exists is checked by pre-flight."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from orchestrator.config.errors import check, one_of
from orchestrator.loop.sampler import SAMPLER_CHOICES, SamplerSettings
from orchestrator.tasks import SPLITS, TASK_NAMES, TASKS


@dataclass
class TaskConfig:
    """Dataset and its agent (orchestrator/tasks.py maps `name` to a row loader and an agent app).

    num_prompts: rows generated (letters) or drawn from the file (gsm8k; null: every row), cycled
        through epochs. seed: which rows. data_path: the task's JSONL file (gsm8k); a relative
        path resolves against the repository root. max_turns: model turns an agent may take per
        episode (sent to the agent in each row of multi-turn tasks).
    split: the split `mode=eval` evaluates ("train" | "test"; test prompts are never drawn for
        training); null: the held-out "test" split where the task has one (letters; gsm8k and
        custom with `val_data_path`), else "train" (`eval_split`). val_split: the split validation
        during training reads (`trainer.test_freq`).
    val_num_prompts: rows of the test split (letters: generated from the held-out pairs;
        gsm8k: drawn from `val_data_path`, null: every row). val_data_path: the test split's
        JSONL file (gsm8k); relative paths resolve against the repository root.
    prompt_key: the field every row of task=custom must carry (its prompt: a string or a list of
        chat messages); all fields reach the agent's payload.
    sampler: how prompts are drawn. uniform: a reshuffled cycle, every prompt once per epoch.
        difficulty: prompts whose groups are expected to have reward variance are drawn more
        (orchestrator/loop/sampler.py; its knobs: sampler_floor, the share of draw probability spread
        uniformly, in (0, 1]; sampler_window, recent groups kept per prompt; sampler_prior_strength,
        pseudo-groups of the prior; sampler_sharpness, the exponent on a prompt's informative rate).
    """

    name: str = "letters"
    num_prompts: Optional[int] = 512
    seed: int = 0
    data_path: Optional[str] = None
    max_turns: int = 1
    split: Optional[str] = None
    val_split: str = "test"
    val_num_prompts: Optional[int] = 32
    val_data_path: Optional[str] = None
    prompt_key: str = "prompt"
    sampler: str = "uniform"
    sampler_floor: float = 0.05
    sampler_window: int = 4
    sampler_prior_strength: float = 0.5
    sampler_sharpness: float = 4.0

    def __post_init__(self) -> None:
        one_of(self.name, "task.name", TASK_NAMES)
        if self.num_prompts is not None or self.name == "letters":
            check(self.num_prompts is not None and self.num_prompts >= 1, "task.num_prompts", "must be >= 1",
                  self.num_prompts)
        check(self.max_turns >= 1, "task.max_turns", "must be >= 1", self.max_turns)
        one_of(self.sampler, "task.sampler", SAMPLER_CHOICES)
        check(0.0 < self.sampler_floor <= 1.0, "task.sampler_floor", "must be in (0, 1]", self.sampler_floor)
        check(self.sampler_window >= 1, "task.sampler_window", "must be >= 1", self.sampler_window)
        check(self.sampler_prior_strength > 0, "task.sampler_prior_strength", "must be > 0",
              self.sampler_prior_strength)
        check(self.sampler_sharpness > 0, "task.sampler_sharpness", "must be > 0", self.sampler_sharpness)
        if self.split is not None:
            one_of(self.split, "task.split", SPLITS)
        one_of(self.val_split, "task.val_split", SPLITS)
        check(self.val_num_prompts is None or self.val_num_prompts >= 1, "task.val_num_prompts",
              "must be null or >= 1", self.val_num_prompts)
        if TASKS[self.name].check_data is None:  # a task that generates its rows reads no file: say so
            for key in ("data_path", "val_data_path"):
                check(getattr(self, key) is None, f"task.{key}", f"is not read by task={self.name} (it generates its "
                      f"rows); choose a task that reads a JSONL file (e.g. task=gsm8k) or drop it", getattr(self, key))
        else:
            check(bool(self.data_path), "task.data_path", f"must be set for task={self.name} (its JSONL file)",
                  self.data_path)
            check(self.split != "test" or bool(self.val_data_path), "task.val_data_path",
                  f"must be set for task={self.name} with task.split=test (the test JSONL file)", self.val_data_path)


def eval_split(task: TaskConfig) -> str:
    """The split `mode=eval` reads: `task.split`, or when null the held-out "test" split where the
    task has one (a generated task always; a file task when `task.val_data_path` is set), else "train"."""
    if task.split is not None:
        return task.split
    return "test" if TASKS[task.name].check_data is None or task.val_data_path else "train"


def sampler_settings(task: TaskConfig) -> SamplerSettings | None:
    """The difficulty sampler's settings, or None for task.sampler=uniform (the PromptCycle)."""
    if task.sampler == "uniform":
        return None
    return SamplerSettings(floor=task.sampler_floor, window=task.sampler_window,
                           prior_strength=task.sampler_prior_strength, sharpness=task.sampler_sharpness)
