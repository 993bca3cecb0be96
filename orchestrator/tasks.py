"""The task registry: `task.name` -> its row loader, its agent app and its data-file check.

The one list of tasks: config validation (orchestrator/config/task.py) accepts exactly these
names, pre-flight (orchestrator/control/preflight.py) runs each task's data-file check, and the driver
loads rows and starts agents from here. The tasks' data code is in workers/core/tasks/.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Protocol

from workers.core.tasks import addition, custom, gsm8k, letters, swe_mini

REPO_ROOT = Path(__file__).resolve().parent.parent
AGENTS_DIR = REPO_ROOT / "examples" / "agents"


class TaskParams(Protocol):
    """What a row loader reads: the `task` group's values (orchestrator/config/task.py TaskConfig)."""

    num_prompts: Optional[int]
    seed: int
    data_path: Optional[str]
    max_turns: int
    val_num_prompts: Optional[int]
    val_data_path: Optional[str]
    prompt_key: str


@dataclass(frozen=True)
class TaskEntry:
    """A task: its row loader ((task config, split "train" | "test") -> dataset rows; the test
    split holds prompts never drawn for training), its agent app (run with this Python
    by the local ACR emulator unless `rollout.acr.agent_cmd` names another command; None for a task
    whose agent is the user's) and, for a
    task that reads `task.data_path`, the check that the file is there (raises FileNotFoundError
    or ValueError naming `task.data_path`; run by pre-flight, not by schema validation)."""

    rows: Callable[[TaskParams, str], list[dict]]
    agent: Optional[Path]  # None: the user's own (rollout.acr.agent_cmd locally, the runtime ARN on AWS)
    check_data: Optional[Callable[[Optional[str]], object]] = None
    a2a_agent: Optional[Path] = None  # its agent for rollout.contract=a2a (an A2A server), if it has one

    def agent_for(self, contract: str) -> Optional[Path]:
        """The task's own agent app for `contract` (None: the user names one)."""
        return self.a2a_agent if contract == "a2a" else self.agent


SPLITS: tuple[str, ...] = ("train", "test")  # every task has both; "test" is held out from training


def _letters_rows(t: TaskParams, split: str) -> list[dict]:
    if split == "test":  # (letter, count) pairs never drawn for training (workers/core/tasks/letters.py)
        return letters.make_rows(t.val_num_prompts or letters.MAX_COUNT * len(letters.LETTERS), t.seed, "test")
    return letters.make_rows(t.num_prompts, t.seed, "train")


def _addition_rows(t: TaskParams, split: str) -> list[dict]:
    # the test split: the held-out pairs, each once (null val_num_prompts) (workers/core/tasks/addition.py)
    return addition.make_rows(t.val_num_prompts if split == "test" else t.num_prompts, t.seed, split)


def _gsm8k_rows(t: TaskParams, split: str) -> list[dict]:
    if split == "test":  # the test file: its questions are not in the train file
        return gsm8k.load_rows(t.val_data_path, t.val_num_prompts, t.seed, t.max_turns)
    return gsm8k.load_rows(t.data_path, t.num_prompts, t.seed, t.max_turns)


def _custom_rows(t: TaskParams, split: str) -> list[dict]:
    data_path, num = (t.val_data_path, t.val_num_prompts) if split == "test" else (t.data_path, t.num_prompts)
    path = gsm8k.resolve_data_path(data_path, task="custom")
    return custom.load_rows(path, t.prompt_key, num, t.seed, t.max_turns)


def _swe_mini_rows(t: TaskParams, split: str) -> list[dict]:
    num = (t.val_num_prompts or 16) if split == "test" else t.num_prompts
    return swe_mini.make_rows(num, t.seed, split, max_turns=t.max_turns)


TASKS: dict[str, TaskEntry] = {
    "letters": TaskEntry(_letters_rows, AGENTS_DIR / "letters_agent" / "app.py",
                         a2a_agent=AGENTS_DIR / "letters_a2a_agent" / "app.py"),
    "addition": TaskEntry(_addition_rows, AGENTS_DIR / "arith_agent" / "app.py"),  # the real model's task (docs/real-model.md)
    "gsm8k": TaskEntry(_gsm8k_rows, AGENTS_DIR / "gsm8k_agent" / "app.py", check_data=gsm8k.resolve_data_path),
    "swe_mini": TaskEntry(_swe_mini_rows, None, a2a_agent=AGENTS_DIR / "swe_mini_agent" / "app.py"),
    "custom": TaskEntry(_custom_rows, None, check_data=lambda p: gsm8k.resolve_data_path(p, task="custom")),
}
TASK_NAMES: tuple[str, ...] = tuple(TASKS)
