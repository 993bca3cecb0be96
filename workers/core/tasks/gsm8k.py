"""The GSM8K task: grade-school math word problems read from a JSONL file (Cobbe et al. 2021).

Each line of the file is `{"question": str, "answer": str}` where the answer is a worked
solution ending in `#### <number>` (the format of openai/grade-school-math). A row sent to the
agent (examples/agents/gsm8k_agent) is

    {"input_id": "gsm8k-<file stem>-<line number>", "question": str, "answer": <int | float>,
     "max_turns": int}

where `answer` is the numeric ground truth after `####` (thousands commas removed; an int when
integral) and `max_turns` is the agent's turn cap (`task.max_turns`). The reward lives in
examples/agents/gsm8k_agent/reward.py. Nothing here downloads data: `task.data_path` names a
local file; a relative path resolves against the repository root, not the working directory. The
repository ships a sample (`SAMPLE_DIR`: the first 256 rows of the train split as train.jsonl,
the first 128 of the test split as test.jsonl, MIT licence beside them); configs/task/gsm8k.yaml
makes its train file the default `task.data_path`.

Invariants: `load_rows` is a pure function of (file contents, num, seed, max_turns); input_ids
are unique (one per line); a malformed line raises `DatasetError` naming the file and line.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

REPO_ROOT: Path = Path(__file__).resolve().parents[3]  # workers/core/tasks/gsm8k.py -> the repository
SAMPLE_DIR = "examples/data/gsm8k"  # the in-repository sample, relative to REPO_ROOT
DATA_PATH_KEY = "task.data_path"
# "#### 1,234.5" at the end of a GSM8K solution; thousands commas allowed, as in the dataset.
_FINAL = re.compile(r"####\s*(-?\d[\d,]*(?:\.\d+)?)\s*$")


class DatasetError(ValueError):
    """A GSM8K file or line is malformed; the message names the file and the line."""


def resolve_data_path(data_path: str | None, root: Path = REPO_ROOT) -> Path:
    """The absolute path of `task.data_path` (relative paths resolve against `root`).

    Raises ValueError if `data_path` is unset, FileNotFoundError (naming `task.data_path` and the
    resolved path) if no file is there.
    """
    if not data_path:
        raise ValueError(f"{DATA_PATH_KEY} must be set for task=gsm8k (a GSM8K JSONL file)")
    path = Path(data_path).expanduser()
    if not path.is_absolute():
        path = root / path
    path = path.resolve()
    if not path.is_file():
        raise FileNotFoundError(
            f"{DATA_PATH_KEY}={data_path!r}: no file at {path} (relative paths resolve against the "
            f"repository root {root}); point {DATA_PATH_KEY} at a GSM8K JSONL file"
        )
    return path


def parse_final_number(answer: str) -> int | float:
    """The number after the final `####` of a GSM8K solution, e.g. "... #### 1,200" -> 1200.

    Raises ValueError when the solution does not end in `#### <number>`.
    """
    m = _FINAL.search(answer)
    if m is None:
        raise ValueError(f"answer does not end in '#### <number>': ...{answer[-60:]!r}")
    text = m.group(1).replace(",", "")
    value = float(text)
    return int(text) if re.fullmatch(r"-?\d+", text) else value


def parse_line(line: str, where: str) -> tuple[str, int | float]:
    """(question, numeric answer) of one JSONL line. Raises DatasetError prefixed with `where`."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    question, answer = obj.get("question"), obj.get("answer")
    if not isinstance(question, str) or not question.strip():
        raise DatasetError(f"{where}: needs a non-empty string 'question'")
    if not isinstance(answer, str):
        raise DatasetError(f"{where}: needs a string 'answer' ending in '#### <number>'")
    try:
        return question, parse_final_number(answer)
    except ValueError as exc:
        raise DatasetError(f"{where}: {exc}") from None


def read_file(path: Path) -> list[dict]:
    """Every row of a GSM8K JSONL file, in file order (blank lines skipped; `max_turns` not set).

    Raises DatasetError naming `path:line` on the first malformed line, or when no row is found.
    """
    rows: list[dict] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            question, answer = parse_line(line, f"{path}:{lineno}")
            rows.append({"input_id": f"gsm8k-{path.stem}-{lineno}", "question": question, "answer": answer})
    if not rows:
        raise DatasetError(f"{path}: no GSM8K rows in the file")
    return rows


def load_rows(data_path: str | None, num: int | None, seed: int, max_turns: int, root: Path = REPO_ROOT) -> list[dict]:
    """The task's rows: `num` rows of the file drawn by `random.Random(seed)` (None: every row, in
    file order), each with `max_turns` added.

    The draw shuffles all line indices and keeps the first `num`, so for one seed a smaller `num`
    gives a prefix of a larger one. Raises FileNotFoundError / ValueError naming `task.data_path`,
    DatasetError naming the line, ValueError naming `task.num_prompts` when it exceeds the rows.
    """
    path = resolve_data_path(data_path, root)
    rows = read_file(path)
    if num is not None:
        if not 1 <= num <= len(rows):
            raise ValueError(f"task.num_prompts={num} must be in [1, {len(rows)}] (rows in {path}); "
                             f"null takes every row")
        order = list(range(len(rows)))
        random.Random(seed).shuffle(order)
        rows = [rows[i] for i in order[:num]]
    return [{**r, "max_turns": max_turns} for r in rows]
