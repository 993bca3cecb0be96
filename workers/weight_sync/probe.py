"""Proof of arrival: after every weight sync, each engine scores a fixed probe sequence and the
trainer compares with its own log-probs, so a sync that did not land (an adapter not loaded, a
stale file, a broadcast into the wrong tensors) stops the run instead of training on the wrong
policy (verl #7495, SkyRL #2064, miles #2075 failed silently this way).

`ProbedWeightSync` wraps any `WeightSync`: `sync(v)` runs the inner sync, then
`InferenceWorker.prompt_logprobs(PROBE)` on every live replica and the trainer's `probe_logprobs`
(both plain log-softmax at temperature 1) and raises `WeightSyncProbeError` naming the version
when max |Δ| > `atol`. The last difference is the metric `weight_sync/probe_max_abs_diff`.

Invariant: the wrapper changes nothing else: version, report, lost replicas and errors of the
inner sync pass through (it is a `WeightSync` over a `WeightSync`: `version`, `sync`, `lost`,
`metrics`, the inner's metrics with the probe's); the probe runs after the inner sync confirmed,
so a failed push never reaches it. A replica whose actor died meanwhile is left out (the replica
supervisor replaces it, through the inner sync's `admit`).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from typing import Any

from workers.core.calls import actor_died
from workers.weight_sync.parts import WeightReceiverClient, WeightSenderClient
from workers.weight_sync.protocol import WeightSync, WeightSyncReport

PROBE_LENGTH = 16
METRIC = "weight_sync/probe_max_abs_diff"


class WeightSyncProbeError(RuntimeError):
    """The engines' log-probs of the probe differ from the trainer's after a sync."""


def probe_tokens(vocab_size: int, length: int = PROBE_LENGTH) -> list[int]:
    """A fixed token sequence inside the vocabulary: 1 + (37 i mod (vocab_size - 1)). Raises
    ValueError for vocab_size < 3."""
    if vocab_size < 3:
        raise ValueError(f"vocab_size must be >= 3 for a probe, got {vocab_size}")
    return [1 + (37 * i) % (vocab_size - 1) for i in range(length)]


class ProbedWeightSync:
    """`inner` with the proof of arrival after every sync; see the module docstring.
    replicas: the engines to probe (`lost()` of the inner sync leaves dead ones out);
    trainer: `probe_logprobs(tokens)` (a TrainerWorker, TrainerGroup or actor handle)."""

    def __init__(self, inner: WeightSync, trainer: Any, replicas: Sequence[Any], tokens: Sequence[int], *,
                 atol: float = 1e-3) -> None:
        if atol <= 0:
            raise ValueError(f"probe atol must be > 0, got {atol}")
        self._inner, self._trainer, self._replicas = inner, trainer, replicas
        self._tokens, self._atol = list(tokens), atol
        self.last_diff = math.nan

    def version(self) -> int:
        return self._inner.version()

    async def sync(self, version: int) -> WeightSyncReport:
        """The inner sync, then the probe. Raises WeightSyncProbeError naming `version` and the
        replica when an engine's max |Δ| exceeds atol."""
        report = await self._inner.sync(version)
        await self.check(version)
        return report

    async def check(self, version: int) -> float:
        """Compare every live replica's probe log-probs with the trainer's; returns max |Δ|."""
        lost = self.lost()
        live = [i for i in range(len(self._replicas)) if i not in lost]
        ours = await WeightSenderClient(self._trainer).probe_logprobs(self._tokens)
        theirs = await asyncio.gather(*(WeightReceiverClient(self._replicas[i]).prompt_logprobs(self._tokens) for i in live),
                                      return_exceptions=True)
        for r in theirs:  # a replica that died since the push is the supervisor's, not a failed sync
            if isinstance(r, BaseException) and not actor_died(r):
                raise r
        diffs = {i: max(abs(a - b) for a, b in zip(ours, lp)) for i, lp in zip(live, theirs)
                 if not isinstance(lp, BaseException)}
        self.last_diff = max(diffs.values(), default=0.0)
        bad = {i: d for i, d in diffs.items() if not d <= self._atol}
        if bad:
            detail = ", ".join(f"replica {i}: {d:.3g}" for i, d in sorted(bad.items()))
            raise WeightSyncProbeError(
                f"weight sync of version {version} did not arrive: the engines' probe log-probs differ from the "
                f"trainer's by max |diff| {detail} > {self._atol:g}; stopping instead of training on the wrong policy")
        return self.last_diff

    async def metrics(self) -> dict[str, float]:
        """The inner sync's metrics and `weight_sync/probe_max_abs_diff` of the last sync (absent
        before the first)."""
        own = {} if math.isnan(self.last_diff) else {METRIC: self.last_diff}
        return {**await self._inner.metrics(), **own}

    def lost(self) -> frozenset[int]:
        """Indices of replicas the inner sync found dead."""
        return self._inner.lost()
