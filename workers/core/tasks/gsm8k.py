"""The GSM8K task: grade-school math word problems read from a JSONL file (Cobbe et al. 2021).

Each row is `{"question": str, "answer": str}` where the answer is a worked solution ending in
`#### <number>` (the format of openai/grade-school-math), or a row of verl's GSM8K parquet
(`prompt` messages, `reward_model.ground_truth`, `extra_info.question`); the file is JSONL,
Parquet or a `datasets` `save_to_disk` directory (workers/core/tasks/dataset_files.py). A row
sent to the agent (examples/agents/gsm8k_agent) is

    {"input_id": "gsm8k-<file stem>-<line or row number>", "question": str, "answer": <int | float>,
     "max_turns": int}

where `answer` is the numeric ground truth after `####` (thousands commas removed; an int when
integral) and `max_turns` is the agent's turn cap (`task.max_turns`). The reward lives in
examples/agents/gsm8k_agent/reward.py. Nothing here downloads data: `task.data_path` names a
local file; a relative path resolves against the repository root, not the working directory. The
repository ships a sample (`SAMPLE_DIR`: the first 256 rows of the train split as train.jsonl,
the first 128 of the test split as test.jsonl, MIT licence beside them); configs/task/gsm8k.yaml
makes its train file the default `task.data_path`.

Invariants: `load_rows` is a pure function of (file contents, num, seed, max_turns); input_ids
are unique (one per row); a malformed row raises `DatasetError` naming the file, row and field.
"""

from __future__ import annotations

import re
from pathlib import Path

from workers.core.tasks.dataset_files import DatasetError, Record, draw_rows, field, read_records

REPO_ROOT: Path = Path(__file__).resolve().parents[3]  # workers/core/tasks/gsm8k.py -> the repository
SAMPLE_DIR = "examples/data/gsm8k"  # the in-repository sample, relative to REPO_ROOT
DATA_PATH_KEY = "task.data_path"
# "#### 1,234.5" at the end of a GSM8K solution; thousands commas allowed, as in the dataset.
# What a row must hold, in the words of docs/configuration.md, 'Datasets' (named in row errors).
ROW_LAYOUTS = ('a GSM8K row is {"question": str, "answer": "... #### <number>"} '
               "(or verl's layout: prompt, reward_model.ground_truth)")
_FINAL = re.compile(r"####\s*(-?\d[\d,]*(?:\.\d+)?)\s*$")


def resolve_data_path(data_path: str | None, root: Path = REPO_ROOT, task: str = "gsm8k") -> Path:
    """The absolute path of `task.data_path` (relative paths resolve against `root`).

    Raises ValueError if `data_path` is unset, FileNotFoundError (naming `task.data_path` and the
    resolved path) if no file is there.
    """
    if not data_path:
        raise ValueError(f"{DATA_PATH_KEY} must be set for task={task} (a JSONL or Parquet file, or a save_to_disk "
                         "directory)")
    path = Path(data_path).expanduser()
    if not path.is_absolute():
        path = root / path
    path = path.resolve()
    if not path.exists():
        raise FileNotFoundError(
            f"{DATA_PATH_KEY}={data_path!r}: no file at {path} (relative paths resolve against the "
            f"repository root {root}); point {DATA_PATH_KEY} at a JSONL or Parquet file or a save_to_disk directory"
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


def parse_row(record: Record) -> tuple[str, int | float]:
    """(question, numeric answer) of one row: GSM8K's own `{"question", "answer": "... #### N"}`, or
    verl's schema (`extra_info.question`, else the last user message of `prompt`, and
    `reward_model.ground_truth`) when the row has `reward_model` and neither `question` nor
    `answer`. Raises DatasetError naming the row and the field (`missing field 'answer'` for a row
    with neither layout, listing the row's fields and the two layouts read)."""
    row = record.row
    if "question" in row or "answer" in row or "reward_model" not in row:
        question, answer = row.get("question"), row.get("answer")
        for name, value in (("question", question), ("answer", answer)):
            if value is None:
                raise DatasetError(f"{record.where}: missing field {name!r} (fields: {sorted(row)}); {ROW_LAYOUTS}")
        if not isinstance(question, str) or not question.strip():
            raise DatasetError(f"{record.where}: field 'question': needs a non-empty string 'question'")
        if not isinstance(answer, str):
            raise DatasetError(f"{record.where}: field 'answer': needs a string 'answer' ending in '#### <number>'")
        try:
            return question, parse_final_number(answer)
        except ValueError as exc:
            raise DatasetError(f"{record.where}: field 'answer': {exc}") from None
    truth = str(field(record, "reward_model.ground_truth"))  # verl's schema
    question = (row.get("extra_info") or {}).get("question") or _last_user_message(record)
    try:
        return question, parse_final_number(f"#### {truth}")
    except ValueError:
        raise DatasetError(f"{record.where}: field 'reward_model.ground_truth' is not a number: {truth!r}") from None


def _last_user_message(record: Record) -> str:
    prompt = field(record, "prompt")
    users = [m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"] \
        if isinstance(prompt, list) else []
    if not users or not isinstance(users[-1], str):
        raise DatasetError(f"{record.where}: field 'prompt' must be a list of chat messages with a user message")
    return users[-1]


def read_file(path: Path) -> list[dict]:
    """Every row of a GSM8K dataset (JSONL, Parquet or `save_to_disk`; dataset_files.py), in file
    order (`max_turns` not set). Raises DatasetError naming the file, row and field."""
    rows = []
    for rec in read_records(path):
        question, answer = parse_row(rec)
        rows.append({"input_id": f"gsm8k-{path.stem}-{rec.number}", "question": question, "answer": answer})
    return rows


def load_rows(data_path: str | None, num: int | None, seed: int, max_turns: int, root: Path = REPO_ROOT) -> list[dict]:
    """The task's rows: `num` rows of the file drawn by `random.Random(seed)` (None: every row, in
    file order), each with `max_turns` added.

    The draw shuffles all line indices and keeps the first `num`, so for one seed a smaller `num`
    gives a prefix of a larger one. Raises FileNotFoundError / ValueError naming `task.data_path`,
    DatasetError naming the line, ValueError naming `task.num_prompts` when it exceeds the rows.
    """
    path = resolve_data_path(data_path, root)
    return [{**r, "max_turns": max_turns} for r in draw_rows(read_file(path), num, seed, path)]
