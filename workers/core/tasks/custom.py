"""Your own task: rows of your dataset, passed through to your agent unchanged.

Reads `task.data_path` with the one dataset loader (workers/core/tasks/dataset_files.py: JSONL,
Parquet in verl's schema or any columns, `datasets` `save_to_disk`). Every row must carry the
prompt field (`task.prompt_key`, default `prompt`: a string or a list of chat messages); every
field of the row reaches the agent's payload as is (`reward_model`, `extra_info`, `data_source`,
your own), plus

    "input_id": the row's own `input_id`, else `extra_info.index`, else "<file stem>-<line or row>"
    "max_turns": task.max_turns

Invariants: `load_rows` is a pure function of (file contents, prompt_key, num, seed, max_turns);
input_ids are unique; a row that lacks the prompt field, carries a key the rollout contract
reserves (`_rollout`, `_config`, `_agentcore_runtime`), or repeats an input_id raises
DatasetError naming the file, the row and the field.
"""

from __future__ import annotations

from pathlib import Path

from workers.core.tasks import RESERVED_KEYS
from workers.core.tasks.dataset_files import DatasetError, Record, draw_rows, field, read_records


def parse_row(rec: Record, stem: str, prompt_key: str) -> dict:
    """The agent's row for one record (module docstring). Raises DatasetError naming row and field."""
    prompt = field(rec, prompt_key)
    if not (isinstance(prompt, str) and prompt.strip()) and not (isinstance(prompt, list) and prompt):
        raise DatasetError(f"{rec.where}: field {prompt_key!r} must be a non-empty string or list of chat messages")
    reserved = sorted(RESERVED_KEYS & set(rec.row))
    if reserved:
        raise DatasetError(f"{rec.where}: field {reserved[0]!r} is reserved by the rollout contract; rename it")
    index = (rec.row.get("extra_info") or {}).get("index") if isinstance(rec.row.get("extra_info"), dict) else None
    input_id = rec.row.get("input_id") or (f"{stem}-{index}" if index is not None else f"{stem}-{rec.number}")
    return {**rec.row, "input_id": str(input_id)}


def read_rows(path: Path, prompt_key: str) -> list[dict]:
    """Every row of the dataset at `path`, in file order. Raises DatasetError / FileNotFoundError."""
    rows, seen = [], {}
    for rec in read_records(path):
        row = parse_row(rec, path.stem, prompt_key)
        if row["input_id"] in seen:
            raise DatasetError(f"{rec.where}: field 'input_id' {row['input_id']!r} repeats {seen[row['input_id']]}")
        seen[row["input_id"]] = rec.where
        rows.append(row)
    return rows


def load_rows(path: Path, prompt_key: str, num: int | None, seed: int, max_turns: int) -> list[dict]:
    """`num` rows drawn by `random.Random(seed)` (None: every row, in file order), each with
    `max_turns`. Raises ValueError naming `task.num_prompts` when it exceeds the rows."""
    return [{**r, "max_turns": max_turns} for r in draw_rows(read_rows(path, prompt_key), num, seed, path)]
