"""Evaluation of a split through the rollout pool: per-rollout records, the summary (mean reward
± standard error, pass@k, failures by reason, latency, tokens/s), validation during training.

`evaluate_rows` runs every row x `n` samples once through a `Rollouts` pool (the real ACR pool:
same cluster-wide limits) in a buffer partition of its own, cleared afterwards; nothing it
stores is ever read by a trainer. `summarize` is pure.

Invariants: `summarize(records)` accounts for every rollout: `rollouts == completed + failed`,
and `failed == sum(failed/{reason})`; a failed rollout never enters the reward mean or pass@k
(it is not a reward 0). pass@k per prompt uses its completed samples only (a prompt with fewer
than k completed samples is left out of pass@k), Chen et al. 2021 (workers/core/passk.py).

Validation during training: `Validator.due(step)` says when (`trainer.test_freq`,
`trainer.val_before_train` at step 0); the sync loop awaits `Validator.run` at the step
boundary; the async loop runs `ValidationLane` beside training (its own pool: no staleness slot,
never feeds the trainer). Callers: orchestrator/loop/sync_loop.py, async_loop.py, evaluate.py.
No torch, Ray or HTTP import.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Protocol

from orchestrator.loop.common import Rollouts
from workers.core.passk import mean_and_sem, mean_pass_at_k, percentile
from workers.core.types import RolloutRequest, RolloutResult


class PartitionStore(Protocol):
    async def clear(self, partition: str) -> None: ...


@dataclass(frozen=True)
class EvalSettings:
    """n: samples per prompt; pass_threshold: reward >= this is correct (pass@k); max_prompts:
    the first prompts of the split evaluated (None: all); max_concurrent_rollouts: rollouts in flight
    at once, whole prompts (at least one prompt's n; None: every prompt at once)."""

    n: int
    pass_threshold: float = 1.0
    max_prompts: int | None = None
    max_concurrent_rollouts: int | None = None

    def prompts_in_flight(self, prompts: int) -> int:
        """How many of `prompts` prompts run at once."""
        if self.max_concurrent_rollouts is None:
            return max(1, prompts)
        return max(1, min(prompts, self.max_concurrent_rollouts // self.n))


@dataclass(frozen=True)
class EvalRecord:
    """One evaluation rollout (one line of eval.jsonl). reward None when failed (`reason` says why);
    latency in seconds; policy_version: the oldest version of a generated token (None: none)."""

    prompt_index: int
    sample_index: int
    input_id: str
    status: str
    reward: float | None
    reason: str | None
    error: str | None
    tokens_in: int
    tokens_out: int
    turns: int
    latency_s: float
    policy_version: int | None

    def to_json(self) -> dict:
        return asdict(self)


_TRUNCATED = {"truncated": "context_length_exceeded"}  # an eval rollout that ran out of context: failed, named


def to_record(result: RolloutResult, group_offset: int = 0) -> EvalRecord:
    """The record of one rollout's result (workers/core/types.py `RolloutResult`)."""
    s = result.sample
    return EvalRecord(prompt_index=s.group_id - group_offset, sample_index=s.sample_index, input_id=s.input_id,
                      status=s.status, reward=s.reward if s.status == "completed" else None,
                      reason=(result.reason or _TRUNCATED.get(s.status)) if s.status != "completed" else None,
                      error=s.error, tokens_in=result.num_input_tokens, tokens_out=s.num_generated_tokens,
                      turns=s.num_turns, latency_s=s.latency_s, policy_version=s.min_version)


def summarize(records: list[EvalRecord], *, n: int, pass_threshold: float, wall_s: float) -> dict[str, Any]:
    """The evaluation summary (eval_summary.json): counts, `reward/mean` and `reward/sem` over
    completed rollouts, `pass@{k}` for k = 1..n, `failed/{reason}`, `latency_s/p50|p99`,
    `tokens_out_per_s` (generated tokens / wall_s), `rollouts_per_s`. See the module invariants."""
    done = [r for r in records if r.status == "completed"]
    failed = [r for r in records if r.status != "completed"]
    mean, sem = mean_and_sem([r.reward for r in done])  # type: ignore[misc]
    per_prompt: dict[int, list[float]] = {}
    for r in done:
        per_prompt.setdefault(r.prompt_index, []).append(r.reward)  # type: ignore[arg-type]
    nc = [(len(v), sum(x >= pass_threshold for x in v)) for v in per_prompt.values()]
    reasons = Counter(r.reason or "unknown" for r in failed)
    latencies = [r.latency_s for r in records]
    versions = [r.policy_version for r in done if r.policy_version is not None]
    return {
        "num_prompts": len({r.prompt_index for r in records}), "n": n, "rollouts": len(records),
        "completed": len(done), "failed": len(failed),
        **{f"failed/{k}": v for k, v in sorted(reasons.items())},
        "reward/mean": mean, "reward/sem": sem,
        **{f"pass@{k}": mean_pass_at_k(nc, k) for k in range(1, n + 1)},
        "pass_threshold": pass_threshold,
        "latency_s/p50": percentile(latencies, 50), "latency_s/p99": percentile(latencies, 99),
        "tokens_out_per_s": sum(r.tokens_out for r in records) / wall_s if wall_s > 0 else math.nan,
        "rollouts_per_s": len(records) / wall_s if wall_s > 0 else math.nan,
        "wall_s": wall_s,
        "policy_version/min": min(versions) if versions else None,
        "policy_version/max": max(versions) if versions else None,
    }


async def evaluate_rows(pool: Rollouts, store: PartitionStore | None, rows: list[dict], settings: EvalSettings,
                        partition: str, clock: Callable[[], float],
                        on_record: Callable[[EvalRecord], None] | None = None) -> tuple[list[EvalRecord], float]:
    """Run the first `settings.max_prompts` rows x n through `pool` in `partition` (cleared after),
    at most `settings.max_concurrent_rollouts` in flight (whole prompts, in row order); returns the
    records (request order) and the wall time in seconds. `on_record` is called as each prompt's
    rollouts finish (progress). Raises what the pool raises (ContractError)."""
    rows = rows[:settings.max_prompts] if settings.max_prompts else rows
    t0 = clock()
    slots = asyncio.Semaphore(settings.prompts_in_flight(len(rows)))
    try:
        async def one_prompt(i: int, row: dict) -> list[EvalRecord]:
            async with slots:  # the same in-flight bound as a training step (EvalSettings)
                return await run_prompt(i, row)

        async def run_prompt(i: int, row: dict) -> list[EvalRecord]:
            reqs = [RolloutRequest(group_id=i, input_id=str(row["input_id"]), sample_index=j, row=row)
                    for j in range(settings.n)]
            out = [to_record(r) for r in await pool.run_all(reqs, partition)]
            if on_record is not None:
                for r in out:
                    on_record(r)
            return out

        chunks = await asyncio.gather(*(one_prompt(i, row) for i, row in enumerate(rows)))
    finally:
        if store is not None:
            await store.clear(partition)
    return list(itertools.chain.from_iterable(chunks)), clock() - t0


def val_metrics(summary: dict[str, Any], version: int) -> dict[str, float]:
    """The `val/*` metrics of one validation: reward mean, pass@k, failures, the version measured."""
    out = {"val/reward/mean": summary["reward/mean"], "val/reward/sem": summary["reward/sem"],
           "val/failed": float(summary["failed"]), "val/policy_version": float(version),
           "val/wall_s": summary["wall_s"]}
    out.update({f"val/{k}": v for k, v in summary.items() if k.startswith("pass@")})
    return out


@dataclass
class Validator:
    """Validation on the held-out split at given steps. `history`: (policy version, val/reward/mean)
    of every validation, in order; `initial_final()` gives the summary's first and last."""

    pool: Rollouts
    store: PartitionStore | None
    rows: list[dict]
    settings: EvalSettings
    test_freq: int
    val_before_train: bool
    clock: Callable[[], float]
    history: list[tuple[int, float]] = field(default_factory=list)
    _runs: int = 0

    def due(self, step: int, total_steps: int) -> bool:
        """Step 0 (before training) with val_before_train; every test_freq-th step; the last step
        when test_freq > 0."""
        if step == 0:
            return self.val_before_train
        return self.test_freq > 0 and (step % self.test_freq == 0 or step == total_steps)

    async def run(self, version: int) -> dict[str, float]:
        """Evaluate the split on the weights of `version`; return the `val/*` metrics."""
        self._runs += 1
        records, wall_s = await evaluate_rows(self.pool, self.store, self.rows, self.settings,
                                              f"val-{self._runs}", self.clock)
        summary = summarize(records, n=self.settings.n, pass_threshold=self.settings.pass_threshold, wall_s=wall_s)
        self.history.append((version, summary["reward/mean"]))
        return val_metrics(summary, version)

    def initial_final(self) -> dict[str, float]:
        """`val/reward/initial` and `val/reward/final` (first and last validation); {} if none ran."""
        if not self.history:
            return {}
        return {"val/reward/initial": self.history[0][1], "val/reward/final": self.history[-1][1],
                "val/policy_version/initial": float(self.history[0][0]),
                "val/policy_version/final": float(self.history[-1][0])}


class ValidationLane:
    """Async mode: validations run as tasks beside training, on their own pool (no admission slot,
    nothing reaches the trainer). `on_version(v, step)` queues one when `step` is due; at most one
    runs at a time and a newer due version replaces a queued one (the newest weights are the ones
    worth measuring); `take()` hands back finished metrics and starts the queued one; `finish()`
    runs what is in flight and queued. A validation that raised re-raises from `take`/`finish`."""

    def __init__(self, validator: Validator, total_steps: int) -> None:
        self._v = validator
        self._total = total_steps
        self._task: asyncio.Task | None = None
        self._queued: int | None = None  # policy version waiting for the running validation
        self._done: list[dict[str, float]] = []

    def on_version(self, version: int, step: int) -> None:
        if self._v.due(step, self._total):
            self._queued = version
        self._kick()

    def _kick(self) -> None:
        if self._task is not None and self._task.done():
            task, self._task = self._task, None
            self._done.append(task.result())  # raises what the validation raised
        if self._task is None and self._queued is not None:
            version, self._queued = self._queued, None
            self._task = asyncio.create_task(self._v.run(version), name=f"validation-v{version}")

    def take(self) -> dict[str, float]:
        """Metrics of the validations finished since the last call (the latest wins); {} if none."""
        self._kick()
        out: dict[str, float] = {}
        for m in self._done:
            out.update(m)
        self._done.clear()
        return out

    async def finish(self) -> dict[str, float]:
        """Run the validation in flight and the queued one to the end; their metrics (or {})."""
        while self._task is not None:
            await asyncio.wait({self._task})
            self._kick()
        return self.take()

    async def cancel(self) -> None:
        self._queued = None
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
