"""`task` group: the dataset and its agent. Names come from the one task registry
(orchestrator/tasks.py); whether a task's data file exists is checked by pre-flight."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from orchestrator.config.errors import check, one_of
from orchestrator.tasks import TASK_NAMES, TASKS


@dataclass
class TaskConfig:
    """Dataset and its agent (orchestrator/tasks.py maps `name` to a row loader and an agent app).

    num_prompts: rows generated (letters) or drawn from the file (gsm8k; null: every row), cycled
        through epochs. seed: which rows. data_path: the task's JSONL file (gsm8k); a relative
        path resolves against the repository root. max_turns: model turns an agent may take per
        episode (sent to the agent in each row of multi-turn tasks).
    """

    name: str = "letters"
    num_prompts: Optional[int] = 512
    seed: int = 0
    data_path: Optional[str] = None
    max_turns: int = 1

    def __post_init__(self) -> None:
        one_of(self.name, "task.name", TASK_NAMES)
        if self.num_prompts is not None or self.name == "letters":
            check(self.num_prompts is not None and self.num_prompts >= 1, "task.num_prompts", "must be >= 1",
                  self.num_prompts)
        check(self.max_turns >= 1, "task.max_turns", "must be >= 1", self.max_turns)
        if TASKS[self.name].check_data is not None:
            check(bool(self.data_path), "task.data_path", f"must be set for task={self.name} (its JSONL file)",
                  self.data_path)
