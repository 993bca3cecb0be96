"""What the sync and the async loop share: their parts, the dispatch of a group, the ledger
closing of untrained samples, the weight sync, the per-step metrics and the end-of-run check.

The loops are handed a `LoopParts` (built by `orchestrator/wiring/training.py`, or by a test with simulated
parts) whose members are small protocols, so a simulated engine, pool, trainer or clock can stand in
for the real ones. Invariant defended here: a loop returns its `LoopReport` only when every
dispatched rollout has reached a terminal state in the ledger (`finish` raises otherwise).

No torch, Ray or HTTP import: the loops import without them.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterable, Protocol

from orchestrator.loop.batching import Group, GroupBatch, RolloutLedger, agent_metric_means, reward_stats
from orchestrator.watch.alarms import HealthAlarms
from workers.core.types import RolloutRequest, RolloutResult, SampleInfo, TrainOrder
from workers.weight_sync.protocol import WeightSync

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoopPosition:
    """Where a loop stands between two steps.

    step: optimizer steps done (the loop's step counter). policy_version: the version the trainer
    weights carry now. next_group_id: the id of the next group to admit. trained_groups: groups
    consumed by updates so far (the staleness controller's counter). pending_rows: dataset rows of
    groups admitted but not trained (running or buffered): they are dispatched again on resume.
    """

    step: int
    policy_version: int
    next_group_id: int
    trained_groups: int
    pending_rows: tuple[dict, ...] = ()


class PromptSource(Protocol):
    def next_rows(self, num: int) -> list[dict]: ...
    def on_group_rewards(self, input_id: str, rewards: list[float]) -> None: ...
    def take_metrics(self) -> dict[str, float]: ...


class Rollouts(Protocol):
    """The rollout pool: one `RolloutResult` per request, in request order, each sample stored in
    `partition` before its result returns (workers/rollout/pool.py). The results are all a loop
    learns of its rollouts: it never lists them back from the buffer."""

    async def run_all(self, reqs: list[RolloutRequest], partition: str) -> list[RolloutResult]: ...


class SampleStore(Protocol):
    """The buffer as the loops see it: they only free what they are done with, a whole partition or
    the samples named (by the keys their results carry: no listing)."""

    async def clear(self, partition: str) -> None: ...
    async def clear_samples(self, partition: str, samples: list[SampleInfo]) -> None: ...


class Trainer(Protocol):
    async def update(self, order: TrainOrder) -> dict[str, float]: ...  # the ranks read the order's rows


class StepLogger(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...


@dataclass
class LoopParts:
    """Everything a loop talks to. `clock`: seconds (monotonic); `probe`: extra per-step metrics
    (gateway, engines); `checkpoint`: called after every step with the loop's position;
    `validator`: validation on the held-out split (orchestrator/loop/validation.py Validator), or None;
    `concurrency`: the async producer's group limit (`rollout.concurrency=adaptive`:
    orchestrator/loop/concurrency.py ConcurrencyGate), or None for no limit beyond staleness;
    `first_rollouts`: the contract check on the run's first rollouts (orchestrator/loop/early_stop.py
    FirstRollouts), or None (a resumed run: its first rollouts are behind it); `alarms`: the health
    alarms every logged step feeds (orchestrator/watch/alarms.py)."""

    prompts: PromptSource
    rollouts: Rollouts
    store: SampleStore
    trainer: Trainer
    weights: WeightSync
    logger: StepLogger
    ledger: RolloutLedger = field(default_factory=RolloutLedger)
    clock: Callable[[], float] = time.monotonic
    probe: Callable[[], Awaitable[dict[str, float]]] | None = None
    checkpoint: Callable[[LoopPosition], Awaitable[None]] | None = None
    validator: Any = None
    concurrency: Any = None
    first_rollouts: Any = None
    alarms: HealthAlarms = field(default_factory=HealthAlarms)


@dataclass(frozen=True)
class LoopReport:
    steps: int
    policy_version: int
    counts: dict[str, int]
    stopped: str | None = None  # why the loop ended before its last step (None: it ran them all)


def ledger_key(s: SampleInfo | RolloutRequest) -> str:
    """The ledger's key of one rollout: `g{group_id}/s{sample_index}`."""
    return f"g{s.group_id}/s{s.sample_index}"


def dispatch_group(ledger: RolloutLedger, row: dict, group_id: int, n: int) -> list[RolloutRequest]:
    """The `n` rollout requests of one group for dataset `row`, each recorded as dispatched."""
    reqs = [RolloutRequest(group_id=group_id, input_id=str(row["input_id"]), sample_index=i, row=row)
            for i in range(n)]
    for r in reqs:
        ledger.on_dispatched(ledger_key(r))
    return reqs


async def run_rollouts(parts: LoopParts, reqs: list[RolloutRequest], partition: str) -> list[SampleInfo]:
    """Run `reqs` through the pool; their samples' metadata, in request order. Raises RuntimeError
    when the pool's results do not answer the requests one to one (the pool's invariant broke)."""
    results = await parts.rollouts.run_all(reqs, partition)
    got = [ledger_key(r.sample) for r in results]
    if got != [ledger_key(r) for r in reqs]:
        raise RuntimeError(f"the rollout pool returned {len(results)} results for {len(reqs)} requests, or out of "
                           f"order: {got[:8]}")
    return [r.sample for r in results]


def report_groups(prompts: PromptSource, samples: list[SampleInfo]) -> None:
    """Feed each finished group's completed rewards back to the prompt source (one call per group;
    a group with no completed sample is reported with no rewards)."""
    by_group: dict[int, tuple[str, list[float]]] = {}
    for s in samples:
        _, rewards = by_group.setdefault(s.group_id, (s.input_id, []))
        if s.status == "completed" and s.reward is not None:
            rewards.append(float(s.reward))
    for gid in sorted(by_group):
        prompts.on_group_rewards(*by_group[gid])


def close_sample(ledger: RolloutLedger, s: SampleInfo, state: str) -> None:
    """Close one rollout as `state`, or `truncated` when it ran out of context: a truncated rollout
    closes truncated whatever else befell it (orchestrator/loop/batching.py)."""
    ledger.on_terminal(ledger_key(s), "truncated" if s.status == "truncated" else state)  # type: ignore[arg-type]


def close_untrained(ledger: RolloutLedger, batch: GroupBatch) -> None:
    """Close the failed, filtered and dropped samples of `batch` in the ledger (failures are logged)."""
    for s in batch.failed:
        close_sample(ledger, s, "failed")
        log.warning("rollout %s failed: %s", s.session_id, s.error)
    for s in (*batch.filtered, *batch.dropped):
        close_sample(ledger, s, "filtered")


def close_trained(ledger: RolloutLedger, groups: Iterable[Group], masked: set[str] = frozenset()) -> None:
    """Close every sample of trained `groups`: `completed` (`truncated` when it ran out of context),
    or `expired` when it was trained with a zero loss mask (its key in `masked`)."""
    for g in groups:
        ledger.on_group_trained()
        for s in g.samples:
            close_sample(ledger, s, "expired" if ledger_key(s) in masked else "completed")


async def sync_weights(parts: LoopParts) -> int:
    """Sync the trainer's weights to the engines as the next version (one call: the backend exports
    and pushes); return the version the weight sync now serves, the one source of the policy version."""
    await parts.weights.sync(parts.weights.version() + 1)
    return parts.weights.version()


def start_position(parts: LoopParts, start: LoopPosition | None) -> LoopPosition:
    """Where a loop starts: `start` (a resumed run), else the beginning. Raises RuntimeError when the
    weight sync does not serve the position's policy version (the loops read the version from it)."""
    start = start or LoopPosition(0, parts.weights.version(), 0, 0)
    if start.policy_version != parts.weights.version():
        raise RuntimeError(f"the loop starts at policy version {start.policy_version} but the weight sync serves "
                           f"version {parts.weights.version()}: build the weight sync with the checkpoint's version")
    return start


STEP_SUMS = ("actor/num_tokens", "perf/total_num_tokens",  # counts: a step's is the sum over its mini-batches
             "trainer/rows_read", "trainer/rows_ordered")


def mean_update_metrics(updates: list[dict[str, float]]) -> dict[str, float]:
    """Average each trainer metric over the step's mini-batches (the counts in `STEP_SUMS` are summed)."""
    keys = {k for m in updates for k in m}
    out = {}
    for k in sorted(keys):
        vals = [m[k] for m in updates if k in m]
        out[k] = sum(vals) if k in STEP_SUMS else sum(vals) / len(vals)
    return out


def step_metrics(parts: LoopParts, *, samples: list[SampleInfo], updates: list[dict[str, float]], t_gen: float,
                 t_update: float, t_sync: float, step_s: float, version: int,
                 trained: list[SampleInfo] | None = None) -> dict[str, float]:
    """The metrics both loops log per step (times in seconds, throughput in trained tokens/s: the
    loss-mask tokens; `perf/total_num_tokens`, every token of the trained samples, prompts and
    environment tokens too, is verl's measure of throughput and the trainer's to report). With
    rollouts in `samples` (those the step took: a sync step's batch, an async step's collected
    groups), `rollout/latency_s_p50` and `rollout/latency_s_max`: seconds from dispatch to result;
    with the A2A contract's spans, `rollout/setup_s_p50`, `_p90` and `rollout/rollout_slot_wait_s_mean`
    (seconds; the spans of workers/rollout/lifecycle.py); `rollout/turns_mean` (model turns per
    rollout) and `rollout/response_tokens_mean` (generated tokens per rollout), and with `trained`
    (the samples the step's updates took) `rollout/trained_turns_mean` and
    `rollout/trained_response_tokens_mean`: the length-bias alarm compares the two
    (orchestrator/watch/alarms.py); `rollout/step_truncated` (rollouts of the step that ran out of
    context) and `rollout/truncated_share` (their share of the step's rollouts; an alarm too);
    `agent/<name>`: the means of the agents' own metrics (`batching.agent_metric_means`: the
    reward-hacking shares `agent/hacking/...` and the grading span `agent/grading_s`)."""
    trained_tokens = sum(m.get("actor/num_tokens", 0.0) for m in updates)
    m: dict[str, float] = {
        **reward_stats(samples),
        "perf/throughput": trained_tokens / step_s if step_s > 0 else 0.0,
        "perf/trained_tokens": trained_tokens,
        "perf/total_num_tokens": 0.0,  # nothing trained; the updates' sum replaces it (mean_update_metrics)
        "trainer/rows_read": 0.0, "trainer/rows_ordered": 0.0,  # rows the ranks read / the orders named
        "timing_s/gen": t_gen,
        "timing_s/update_actor": t_update,
        "timing_s/update_weights": t_sync,
        "timing_s/step": step_s,
        "policy_version": float(version),
        **{k: float(v) for k, v in parts.ledger.counts().items()},
    }
    m.update(mean_update_metrics(updates))
    m.update(parts.prompts.take_metrics())
    # the short name of verl's `rollout_corr/rollout_is_mean` (mean TIS weight over trained tokens)
    m["rollout_corr/is_mean"] = m.get("rollout_corr/rollout_is_mean", math.nan)
    latencies = sorted(s.latency_s for s in samples)
    if latencies:
        m["rollout/latency_s_p50"] = latencies[len(latencies) // 2]
        m["rollout/latency_s_max"] = latencies[-1]
        m["rollout/turns_mean"] = sum(s.num_turns for s in samples) / len(samples)
        m["rollout/response_tokens_mean"] = sum(s.num_generated_tokens for s in samples) / len(samples)
        m["rollout/step_truncated"] = float(sum(s.status == "truncated" for s in samples))
        m["rollout/truncated_share"] = m["rollout/step_truncated"] / len(samples)
    if trained:
        m["rollout/trained_turns_mean"] = sum(s.num_turns for s in trained) / len(trained)
        m["rollout/trained_response_tokens_mean"] = sum(s.num_generated_tokens for s in trained) / len(trained)
    setups = sorted(s.setup_s for s in samples if s.setup_s is not None)
    if setups:
        m["rollout/setup_s_p50"] = setups[len(setups) // 2]
        m["rollout/setup_s_p90"] = setups[min(len(setups) - 1, int(0.9 * len(setups)))]
    waits = [s.rollout_slot_wait_s for s in samples if s.rollout_slot_wait_s is not None]
    if waits:
        m["rollout/rollout_slot_wait_s_mean"] = sum(waits) / len(waits)
    m.update(agent_metric_means(samples))
    return m


async def end_step(parts: LoopParts, step: int, metrics: dict[str, float],
                   position: Callable[[], LoopPosition]) -> None:
    """Add the probe's metrics, log the step, then checkpoint at `position()`.

    `position` is read after the probe's await, in the same synchronous instant as the
    checkpointer's prompt snapshot (orchestrator/control/run_checkpoint.py): an async producer draws rows
    during any await, and a position read before one would miss them: neither pending nor ahead
    of the cursor, a resume would skip those prompts (seen in scripts/chaos.py, issue 14)."""
    if parts.probe is not None:
        metrics.update(await parts.probe())
    metrics.update(parts.alarms.observe(step, metrics))
    parts.logger.log(step, metrics)
    if parts.checkpoint is not None:
        await parts.checkpoint(position())


def finish(parts: LoopParts, steps: int, version: int, stopped: str | None = None) -> LoopReport:
    """The run's report (`stopped`: why it ended early); raises RuntimeError when a dispatched
    rollout has no terminal state."""
    if parts.ledger.open_rollouts():
        raise RuntimeError(f"rollouts left open after the loop: {parts.ledger.open_rollouts()[:5]}")
    return LoopReport(steps=steps, policy_version=version, counts=parts.ledger.counts(), stopped=stopped)
