"""The "addition" task: add two one-digit numbers, answered in plain text (no tools).

Row: {"input_id": "addition-<seed>-<index>", "prompt": "What is 3 + 5? Answer with just the
number.", "answer": 8}. The agent is examples/agents/arith_agent (one model call through the
gateway; reward 1.0 when the reply's last integer equals `answer`).

Why this task for the real model (SmolLM2-135M-Instruct, docs/real-model.md): measured on
2026-12-06, its sampled pass rate on one-digit addition sits in the learnable band (about 0.2 at
temperature 1.0, with reward variance in about half of the groups of 4), where two-digit addition
(~0.05), GSM8K (~0.02) and the letters task (~0) do not; its chat template has no tool support, so
the task is a plain answer.

Splits: by unordered pair {a, b}, so a held-out prompt is never a trained prompt with its operands
swapped. The 55 unordered pairs of 0..9 are ordered by a fixed hash; `HELD_OUT_PAIRS` of them (and
both of their orders) form the test split, the rest the train split (`split_pairs`).

Invariants: `make_rows(num, seed, split)` is a pure function of its arguments; `input_id`s are
unique within a call; no train row's unordered pair appears in any test row, whatever the seeds.
"""

from __future__ import annotations

import hashlib
import random

DIGITS: range = range(10)  # operands 0..9
HELD_OUT_PAIRS: int = 11  # of the 55 unordered pairs: 20 % held out (20 ordered prompts)
SPLITS: tuple[str, ...] = ("train", "test")
MAX_ANSWER_TOKENS: int = 32  # generation budget: "8" or "3 + 5 = 8." fits; longer chatter is cut


def format_prompt(a: int, b: int) -> str:
    """The user message for (a, b), e.g. "What is 3 + 5? Answer with just the number."."""
    return f"What is {a} + {b}? Answer with just the number."


def _pair_rank(pair: tuple[int, int]) -> str:
    return hashlib.sha256(f"addition:{pair[0]}+{pair[1]}".encode()).hexdigest()


def held_out_unordered() -> frozenset[tuple[int, int]]:
    """The HELD_OUT_PAIRS unordered pairs (a <= b) of the test split: a fixed, seed-free choice."""
    unordered = sorted(((a, b) for a in DIGITS for b in DIGITS if a <= b), key=_pair_rank)
    return frozenset(unordered[:HELD_OUT_PAIRS])


def split_pairs(split: str) -> list[tuple[int, int]]:
    """The ordered (a, b) pairs of `split` ("train": 80 pairs, "test": 20), in a fixed order.

    Raises ValueError for another split name."""
    if split not in SPLITS:
        raise ValueError(f"addition split must be one of {list(SPLITS)}, got {split!r}")
    test = held_out_unordered()
    return [(a, b) for a in DIGITS for b in DIGITS if ((min(a, b), max(a, b)) in test) == (split == "test")]


def make_rows(num: int | None, seed: int, split: str = "train") -> list[dict]:
    """Rows of `split`: with `num` None, every pair once, shuffled by `random.Random(seed)`; else
    `num` rows cycling through seeded shuffles of the pairs (each pair once per pass, so a short
    run sees as many distinct prompts as it can). input_ids: `addition-{seed}-{i}` (train),
    `addition-test-{seed}-{i}` (test).

    Raises ValueError when num < 0 or the split is unknown.
    """
    if num is not None and num < 0:
        raise ValueError(f"make_rows needs num >= 0, got {num}")
    pairs = split_pairs(split)
    total = len(pairs) if num is None else num
    prefix = "addition" if split == "train" else f"addition-{split}"
    rng = random.Random(seed)
    order: list[tuple[int, int]] = []
    while len(order) < total:
        shuffled = list(pairs)
        rng.shuffle(shuffled)
        order.extend(shuffled)
    return [{"input_id": f"{prefix}-{seed}-{i}", "prompt": format_prompt(a, b), "answer": a + b}
            for i, (a, b) in enumerate(order[:total])]
