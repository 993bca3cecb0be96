"""Reward of the default task ("letters"): repeat a letter a given number of times.

This file is the single source of the reward. The letters agent imports it (with its own
directory on sys.path), and the project's checks import it by path. It imports nothing from
the project so that the agent stays a standalone container app.

A row carries `letter` (one lowercase ASCII letter) and `count` (an int >= 1); the prompt reads
"Repeat the letter q 4 times." and a perfect answer is "q q q q" (or "qqqq": whitespace is
ignored).

Formula (partial credit, always in [0, 1]):

    chars   = the completion, lower-cased, with all whitespace removed
    correct = number of i < count with chars[i] == letter
    score   = correct / max(count, len(chars))          (0.0 when chars is empty)

So each right letter in the first `count` positions earns 1/count, and every character beyond
`count` dilutes the score (too long is penalised as much as too short). Examples with letter q,
count 4: "q q q q" -> 1.0, "q q" -> 0.5, "q q q q q q q q" -> 0.5, "z z z z" -> 0.0,
"q z q z" -> 0.5, "q q q q." -> 0.8.
"""

from __future__ import annotations

from typing import Any, Mapping


def score(row: Mapping[str, Any], completion: str) -> float:
    """Partial-credit reward in [0, 1] for `completion` on a letters-task `row`.

    row: needs `letter` (str of length 1) and `count` (int >= 1).
    completion: the assistant's final text (special tokens already stripped).
    Raises ValueError when the row lacks a valid `letter` or `count`.
    """
    letter = row.get("letter")
    count = row.get("count")
    if not isinstance(letter, str) or len(letter) != 1:
        raise ValueError(f"letters row needs a one-character 'letter', got {letter!r}")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"letters row needs an int 'count' >= 1, got {count!r}")
    chars = "".join(completion.lower().split())
    if not chars:
        return 0.0
    target = letter.lower()
    correct = sum(1 for ch in chars[:count] if ch == target)
    return correct / max(count, len(chars))
