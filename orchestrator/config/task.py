"""`task` group: the dataset and its agent. Names come from the one task registry
(orchestrator/tasks.py); whether a task's data file exists is checked by pre-flight."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from orchestrator.config.errors import check, one_of
from orchestrator.tasks import SPLITS, TASK_NAMES, TASKS


@dataclass
class TaskConfig:
    """Dataset and its agent (orchestrator/tasks.py maps `name` to a row loader and an agent app).

    num_prompts: rows generated (letters) or drawn from the file (gsm8k; null: every row), cycled
        through epochs. seed: which rows. data_path: the task's JSONL file (gsm8k); a relative
        path resolves against the repository root. max_turns: model turns an agent may take per
        episode (sent to the agent in each row of multi-turn tasks).
    split: the split `mode=eval` evaluates ("train" | "test"; test prompts are never drawn for
        training). val_split: the split validation during training reads (`trainer.test_freq`).
    val_num_prompts: rows of the test split (letters: generated from the held-out pairs;
        gsm8k: drawn from `val_data_path`, null: every row). val_data_path: the test split's
        JSONL file (gsm8k); relative paths resolve against the repository root.
    """

    name: str = "letters"
    num_prompts: Optional[int] = 512
    seed: int = 0
    data_path: Optional[str] = None
    max_turns: int = 1
    split: str = "train"
    val_split: str = "test"
    val_num_prompts: Optional[int] = 32
    val_data_path: Optional[str] = None

    def __post_init__(self) -> None:
        one_of(self.name, "task.name", TASK_NAMES)
        if self.num_prompts is not None or self.name == "letters":
            check(self.num_prompts is not None and self.num_prompts >= 1, "task.num_prompts", "must be >= 1",
                  self.num_prompts)
        check(self.max_turns >= 1, "task.max_turns", "must be >= 1", self.max_turns)
        one_of(self.split, "task.split", SPLITS)
        one_of(self.val_split, "task.val_split", SPLITS)
        check(self.val_num_prompts is None or self.val_num_prompts >= 1, "task.val_num_prompts",
              "must be null or >= 1", self.val_num_prompts)
        if TASKS[self.name].check_data is not None:
            check(bool(self.data_path), "task.data_path", f"must be set for task={self.name} (its JSONL file)",
                  self.data_path)
            check(self.split != "test" or bool(self.val_data_path), "task.val_data_path",
                  f"must be set for task={self.name} with task.split=test (the test JSONL file)", self.val_data_path)
