"""One loader for the dataset formats users have: JSONL, Parquet (verl's schema or any columns) and
a Hugging Face `datasets` directory written by `save_to_disk`.

`read_records(path)` returns every row as a dict, in file order, with where it came from
(`Record.where`: `FILE:LINE` for JSONL, `FILE row N` otherwise, 1-based), so a task's row check can
name the file, the row and the field. Parquet and `save_to_disk` directories (Arrow IPC stream
files listed in `state.json`) are read with pyarrow, without importing `datasets`. verl's schema
(`prompt`: a list of chat messages, `reward_model.ground_truth`, `extra_info`, `data_source`;
verl/examples/data_preprocess/gsm8k.py) is read as is: nested columns become nested dicts/lists.

Raises DatasetError (a ValueError) naming the file and row: an unreadable or empty file, a JSONL
line that is not UTF-8 or not a JSON object, a `DatasetDict` directory (one split must be named);
FileNotFoundError when nothing is at `path`. Pure apart from reading the file; callers:
workers/core/tasks/gsm8k.py and custom.py, through orchestrator/tasks.py (pre-flight reads every
row before anything starts).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMATS = ("jsonl", "parquet", "save_to_disk")


class DatasetError(ValueError):
    """A dataset file or row is malformed; the message names the file, the row and the field."""


@dataclass(frozen=True)
class Record:
    """One row and where it is: `where` is `FILE:LINE` (JSONL) or `FILE row N`; `number` is that
    LINE or N (1-based, unique within the file)."""

    where: str
    number: int
    row: dict[str, Any]


def dataset_format(path: Path) -> str:
    """"save_to_disk" for a directory, "parquet" for *.parquet, else "jsonl"."""
    if path.is_dir():
        return "save_to_disk"
    return "parquet" if path.suffix.lower() in (".parquet", ".pq") else "jsonl"


def read_records(path: Path) -> list[Record]:
    """Every row of `path` (module docstring). Raises DatasetError / FileNotFoundError."""
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    fmt = dataset_format(path)
    records = _read_jsonl(path) if fmt == "jsonl" else _read_arrow(path, fmt)
    if not records:
        raise DatasetError(f"{path}: no rows (empty {fmt} dataset)")
    return records


def field(record: Record, name: str) -> Any:
    """The value of `name` (dotted for nested fields, e.g. `reward_model.ground_truth`); raises
    DatasetError naming the row and the field when it is missing or null."""
    value: Any = record.row
    for part in name.split("."):
        if not isinstance(value, dict) or value.get(part) is None:
            raise DatasetError(f"{record.where}: missing field {name!r} (fields: {sorted(record.row)})")
        value = value[part]
    return value


def _read_jsonl(path: Path) -> list[Record]:
    records: list[Record] = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DatasetError(f"{where}: not UTF-8 (byte {exc.start}: {raw[exc.start:exc.start + 1]!r})") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{where}: not valid JSON ({exc})") from None
            if not isinstance(obj, dict):
                raise DatasetError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            records.append(Record(where, lineno, obj))
    return records


def _read_arrow(path: Path, fmt: str) -> list[Record]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if fmt == "parquet":
            table = pq.read_table(path)
        else:
            table = pa.concat_tables([_read_stream(f) for f in _arrow_files(path)])
    except DatasetError:
        raise
    except (OSError, pa.ArrowException, ValueError, KeyError) as exc:
        raise DatasetError(f"{path}: cannot read it as {fmt} ({exc})") from None
    return [Record(f"{path} row {i}", i, row) for i, row in enumerate(table.to_pylist(), start=1)]


def _arrow_files(path: Path) -> list[Path]:
    """The Arrow files of a `save_to_disk` directory, in order (`state.json` `_data_files`)."""
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        raise DatasetError(f"{path}: a DatasetDict (splits: {', '.join(splits)}); point the path at one split's "
                           f"directory, e.g. {path / (splits[0] if splits else 'train')}")
    state = path / "state.json"
    if not state.is_file():
        raise DatasetError(f"{path}: a directory without state.json: not a Hugging Face `save_to_disk` dataset")
    return [path / f["filename"] for f in json.loads(state.read_text())["_data_files"]]


def _read_stream(file: Path):
    import pyarrow as pa

    with pa.memory_map(str(file)) as source:
        return pa.ipc.open_stream(source).read_all()


def draw_rows(rows: list[dict], num: int | None, seed: int, source: Path) -> list[dict]:
    """`num` rows drawn by `random.Random(seed)` (None: all, in order). The draw shuffles all indices
    and keeps the first `num`, so for one seed a smaller `num` gives a prefix of a larger one.
    Raises ValueError naming `task.num_prompts` when it is not in [1, len(rows)]."""
    if num is None:
        return list(rows)
    if not 1 <= num <= len(rows):
        raise ValueError(f"task.num_prompts={num} must be in [1, {len(rows)}] (rows in {source}); null takes every row")
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    return [rows[i] for i in order[:num]]
