"""Task datasets: deterministic prompt rows that the rollout pool sends to agents.

A task module exposes `make_rows(num, seed) -> list[dict]`; every row is JSON-serialisable,
has a unique `input_id` and a `prompt`, plus whatever its agent's reward needs. Rows never use
the payload keys reserved by the rollout contract (`RESERVED_KEYS`).

Modules:
  letters.py        the default task: repeat a letter a given number of times
  gsm8k.py          grade-school math word problems from a JSONL file
  swe_mini.py       small generated Python repositories, each with one bug and a failing test
  custom.py         your own dataset's rows, passed to your agent unchanged
  addition.py       add two one-digit numbers, answered in plain text (the real model's task)
  dataset_files.py  the one loader of JSONL, Parquet and save_to_disk rows
"""

from __future__ import annotations

RESERVED_KEYS: frozenset[str] = frozenset({"_rollout", "_config", "_agentcore_runtime"})
