"""Evaluation statistics: the unbiased pass@k estimator, mean with its standard error, percentiles.

pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", section 2.1, eq. 1):
for one prompt with n samples of which c are correct, the probability that at least one of k
samples drawn without replacement is correct is 1 - C(n-c, k) / C(n, k). It is computed as the
product 1 - prod_{i=n-c+1}^{n} (1 - k / i) (the paper's numerically stable form), never with
factorials. Invariant: equals the fraction of k-subsets of the n samples that hold at least one
correct sample (tests/test_eval.py checks it against enumeration of every subset).

Pure: no torch, Ray or HTTP. Callers: orchestrator/evaluate.py, orchestrator/loop/validation.py.
"""

from __future__ import annotations

import math
from typing import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt: n samples, c of them correct, k <= n (Chen et al. 2021, eq. 1).

    Raises ValueError unless 0 <= c <= n and 1 <= k <= n.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def mean_pass_at_k(correct: Sequence[tuple[int, int]], k: int) -> float:
    """Mean pass@k over prompts given as (n, c) pairs; prompts with n < k are skipped; nan if none remain."""
    vals = [pass_at_k(n, c, k) for n, c in correct if n >= k]
    return sum(vals) / len(vals) if vals else math.nan


def mean_and_sem(values: Sequence[float]) -> tuple[float, float]:
    """(mean, standard error of the mean = sample std (ddof 1) / sqrt(len)); (nan, nan) when empty,
    sem nan for a single value."""
    m = len(values)
    if m == 0:
        return math.nan, math.nan
    mean = sum(values) / m
    if m == 1:
        return mean, math.nan
    var = sum((v - mean) ** 2 for v in values) / (m - 1)
    return mean, math.sqrt(var / m)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) by linear interpolation between order statistics
    (numpy's default "linear" method); nan when empty."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
