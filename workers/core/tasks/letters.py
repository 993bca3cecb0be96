"""The default task, "letters": repeat a letter a given number of times.

Row: {"input_id": "letters-<seed>-<index>", "prompt": "Repeat the letter q 4 times.",
"letter": "q", "count": 4}. A perfect answer is "q q q q"; the reward (partial credit in [0, 1])
lives in examples/agents/letters_agent/reward.py. The tiny default model is warm-started on this
answer format (workers/embedded/tiny_model.py), so RL only has to learn to follow the prompt.

Invariant: `make_rows(num, seed)` is a pure function of (num, seed): same arguments, same rows,
and `input_id`s are unique within a call.
"""

from __future__ import annotations

import random
import string

LETTERS: str = string.ascii_lowercase  # the alphabet prompts draw from
MIN_COUNT: int = 1  # fewest repetitions asked for
MAX_COUNT: int = 6  # most repetitions asked for; keeps answers <= 6 letters (+ eos)
MAX_ANSWER_TOKENS: int = 16  # generation budget that always fits a perfect answer


def format_prompt(letter: str, count: int) -> str:
    """The user message for (letter, count), e.g. "Repeat the letter q 4 times."."""
    return f"Repeat the letter {letter} {count} times."


def format_answer(letter: str, count: int) -> str:
    """The perfect answer for (letter, count), e.g. "q q q q"."""
    return " ".join([letter] * count)


def make_rows(num: int, seed: int) -> list[dict]:
    """`num` rows with letters and counts drawn uniformly by a `random.Random(seed)`.

    Raises ValueError when num < 0.
    """
    if num < 0:
        raise ValueError(f"make_rows needs num >= 0, got {num}")
    rng = random.Random(seed)
    rows: list[dict] = []
    for i in range(num):
        letter = rng.choice(LETTERS)
        count = rng.randint(MIN_COUNT, MAX_COUNT)
        rows.append(
            {
                "input_id": f"letters-{seed}-{i}",
                "prompt": format_prompt(letter, count),
                "letter": letter,
                "count": count,
            }
        )
    return rows
