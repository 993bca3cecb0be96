"""Reward of the GSM8K task: 1.0 when the final answer equals the ground truth, else 0.0.

This file is the single source of the GSM8K reward. The agent imports it (with its own directory
on sys.path) and the tests import it by path; it imports nothing from the project.

The final answer of a completion (`extract_answer`):
1. the first number after the last `####` when the text has one (the GSM8K convention the
   system prompt asks for), else
2. the last number in the text.
Numbers may carry a sign, a `$`, thousands commas ("1,200") and decimals (".5"); a trailing
sentence period is not part of a number, and the minus of "3-4" is a subtraction, not a sign. "Equal" means |pred - truth| <= 1e-6 * max(1, |truth|), so
"18.00" matches 18 and "18.5" does not.
"""

from __future__ import annotations

import math
import re
from typing import Any, Mapping

# an optional minus that is not a subtraction ("3-4" is 3 and 4), then thousands-grouped numbers
# first ("1,200,000"), then plain ones ("1200", "3.5", ".5")
_NUMBER = re.compile(r"(?:(?<![\w)])-)?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d*\.?\d+)")
REL_TOL = 1e-6  # relative tolerance of the comparison (absolute below |truth| = 1)


def _to_float(token: str) -> float:
    return float(token.replace(",", ""))


def extract_answer(text: str) -> float | None:
    """The final numeric answer of `text` (see the module docstring), or None when it has no number."""
    if "####" in text:
        tail = text.rsplit("####", 1)[1]
        m = _NUMBER.search(tail.replace("$", ""))
        if m:
            return _to_float(m.group(0))
    numbers = _NUMBER.findall(text.replace("$", ""))
    return _to_float(numbers[-1]) if numbers else None


def is_correct(pred: float | None, truth: float) -> bool:
    """|pred - truth| <= REL_TOL * max(1, |truth|); False for None or non-finite pred."""
    if pred is None or not math.isfinite(pred):
        return False
    return abs(pred - truth) <= REL_TOL * max(1.0, abs(truth))


def score(row: Mapping[str, Any], completion: str) -> float:
    """1.0 if the final answer of `completion` equals `row["answer"]` (a number), else 0.0.

    Raises ValueError when the row's `answer` is not a finite number.
    """
    truth = row.get("answer")
    if isinstance(truth, bool) or not isinstance(truth, (int, float)) or not math.isfinite(truth):
        raise ValueError(f"gsm8k row needs a numeric 'answer', got {truth!r}")
    return 1.0 if is_correct(extract_answer(completion), float(truth)) else 0.0
