"""The default task, "letters": repeat a letter a given number of times.

Row: {"input_id": "letters-<seed>-<index>", "prompt": "Repeat the letter q 4 times.",
"letter": "q", "count": 4}. A perfect answer is "q q q q"; the reward (partial credit in [0, 1])
lives in examples/agents/letters_agent/reward.py. The tiny default model is warm-started on this
answer format (workers/embedded/tiny_model.py), so RL only has to learn to follow the prompt.

Splits: a (letter, count) pair is held out when (alphabet index of the letter + count) % 6 == 0
(`is_held_out`): 26 of the 156 pairs, one count per letter, so every letter and every count is
trained on, only never together as in a held-out prompt. `split="train"` draws from the other
130 pairs, `split="test"` only from the held-out ones.

Invariants: `make_rows(num, seed, split)` is a pure function of its arguments: same arguments,
same rows, and `input_id`s are unique within a call; no train row's (letter, count) pair
appears in any test row, whatever the seeds.
"""

from __future__ import annotations

import random
import string

LETTERS: str = string.ascii_lowercase  # the alphabet prompts draw from
MIN_COUNT: int = 1  # fewest repetitions asked for
MAX_COUNT: int = 6  # most repetitions asked for; keeps answers <= 6 letters (+ eos)
MAX_ANSWER_TOKENS: int = 16  # generation budget that always fits a perfect answer
SPLITS: tuple[str, ...] = ("train", "test")
HELD_OUT_MOD: int = 6  # (letter index + count) % HELD_OUT_MOD == 0: the held-out (test) pairs


def format_prompt(letter: str, count: int) -> str:
    """The user message for (letter, count), e.g. "Repeat the letter q 4 times."."""
    return f"Repeat the letter {letter} {count} times."


def format_answer(letter: str, count: int) -> str:
    """The perfect answer for (letter, count), e.g. "q q q q"."""
    return " ".join([letter] * count)


def is_held_out(letter: str, count: int) -> bool:
    """True when (letter, count) belongs to the held-out test split (see the module docstring)."""
    return (LETTERS.index(letter) + count) % HELD_OUT_MOD == 0


def split_pairs(split: str) -> list[tuple[str, int]]:
    """The (letter, count) pairs of `split` ("train" | "test"), in a fixed order.

    Raises ValueError for another split name."""
    if split not in SPLITS:
        raise ValueError(f"letters split must be one of {list(SPLITS)}, got {split!r}")
    want_test = split == "test"
    return [(l, c) for l in LETTERS for c in range(MIN_COUNT, MAX_COUNT + 1) if is_held_out(l, c) == want_test]


def make_rows(num: int, seed: int, split: str = "train") -> list[dict]:
    """`num` rows whose (letter, count) pair is drawn uniformly from `split`'s pairs by a
    `random.Random(seed)`. input_ids: `letters-{seed}-{i}` (train), `letters-test-{seed}-{i}` (test).

    Raises ValueError when num < 0 or the split is unknown.
    """
    if num < 0:
        raise ValueError(f"make_rows needs num >= 0, got {num}")
    pairs = split_pairs(split)
    prefix = "letters" if split == "train" else f"letters-{split}"
    rng = random.Random(seed)
    rows: list[dict] = []
    for i in range(num):
        letter, count = rng.choice(pairs)
        rows.append(
            {
                "input_id": f"{prefix}-{seed}-{i}",
                "prompt": format_prompt(letter, count),
                "letter": letter,
                "count": count,
            }
        )
    return rows
