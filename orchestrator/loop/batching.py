"""Groups, filters and mini-batch split: from finished samples' metadata to the train order of an update.

Pure logic (no Ray, no HTTP, no torch). Invariant: every sample handed to `assemble` comes back
in exactly one of `GroupBatch.trainable`, `.filtered`, `.failed` or `.dropped`; a sample without a
finite reward is never trainable. `RolloutLedger` defends the run-level form of the same invariant:
dispatched == open + completed + failed + expired + filtered + truncated, with every rollout closed
once. A truncated rollout (it ran out of context: workers/rollout/overflow.py) closes `truncated`
whatever else befalls it (trained at reward 0 or its agent's reward, dropped, filtered with its group,
or too stale), so `rollout/truncated` counts every rollout that ran out of context.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection
from dataclasses import dataclass, field

from workers.core.types import TERMINAL_STATES, OrderSample, RolloutStatus, SampleInfo, TrainOrder


@dataclass(frozen=True)
class Group:
    """The trainable samples of one prompt (completed, finite reward)."""

    group_id: int
    samples: tuple[SampleInfo, ...]

    @property
    def rewards(self) -> list[float]:
        return [float(s.reward) for s in self.samples]  # type: ignore[arg-type]


@dataclass(frozen=True)
class GroupBatch:
    """One step's samples sorted by fate. `trainable` groups keep the dataset order of group ids."""

    trainable: tuple[Group, ...]
    filtered: tuple[SampleInfo, ...]
    failed: tuple[SampleInfo, ...]
    dropped: tuple[SampleInfo, ...] = ()  # truncated samples with no reward to train on (rollout.overflow)


def assemble(samples: list[SampleInfo], *, filter_zero_variance: bool, min_group_size: int = 2) -> GroupBatch:
    """Group samples by `group_id` and decide each sample's fate.

    - a trainable sample (`SampleInfo.trainable`: completed, or truncated with the reward
      rollout.overflow gave it) joins its group: a truncated one counts in the GRPO baseline;
    - a truncated sample without a reward (rollout.overflow=drop) goes to `dropped`;
    - any other (failed, expired) goes to `failed`;
    - a group with fewer than `min_group_size` trainable samples cannot form a baseline:
      its samples are `filtered`;
    - with `filter_zero_variance`, a group whose rewards are all equal carries no GRPO signal
      (every advantage is 0): its samples are `filtered`.
    """
    by_group: dict[int, list[SampleInfo]] = {}
    failed: list[SampleInfo] = []
    dropped: list[SampleInfo] = []
    for s in samples:
        if s.trainable:
            by_group.setdefault(s.group_id, []).append(s)
        elif s.status == "truncated":
            dropped.append(s)
        elif s.status in ("failed", "expired"):
            failed.append(s)
        else:
            raise ValueError(f"sample {s.session_id} reached batching already {s.status!r}")
    trainable: list[Group] = []
    filtered: list[SampleInfo] = []
    for gid in sorted(by_group):
        members = sorted(by_group[gid], key=lambda s: s.sample_index)
        rewards = [float(s.reward) for s in members]  # type: ignore[arg-type]
        if len(members) < min_group_size or (filter_zero_variance and max(rewards) - min(rewards) == 0.0):
            filtered.extend(members)
        else:
            trainable.append(Group(gid, tuple(members)))
    return GroupBatch(tuple(trainable), tuple(filtered), tuple(failed), tuple(dropped))


def split_groups(groups: tuple[Group, ...], num_mini_batches: int) -> list[tuple[Group, ...]]:
    """Split groups into `num_mini_batches` contiguous chunks of near-equal size (whole groups).

    Chunks differ in size by at most one group; an empty input or fewer groups than chunks gives
    fewer (non-empty) chunks. Raises ValueError when num_mini_batches < 1.
    """
    if num_mini_batches < 1:
        raise ValueError(f"num_mini_batches must be >= 1, got {num_mini_batches}")
    k = min(num_mini_batches, len(groups))
    if k == 0:
        return []
    base, extra = divmod(len(groups), k)
    out, start = [], 0
    for i in range(k):
        size = base + (1 if i < extra else 0)
        out.append(groups[start:start + size])
        start += size
    return out


def train_order(partition: str, groups: tuple[Group, ...], masked: Collection[str] = ()) -> TrainOrder:
    """The train order of one update on `groups` (stored in `partition`): every sample with its group
    and reward, and the keys of the rows a trainer rank reads: those with a generated token, of the
    samples not in `masked` (session ids trained with a zero loss mask: they stay in their group's
    statistics, with no row read). No token: the ranks read the rows themselves."""
    samples = []
    for g in groups:
        for s in g.samples:
            read = () if s.session_id in masked else tuple(j for j, n in enumerate(s.row_generated) if n > 0)
            samples.append(OrderSample(s.session_id, s.group_id, float(s.reward),  # type: ignore[arg-type]
                                       tuple(s.row_keys[j] for j in read), tuple(s.row_lens[j] for j in read)))
    in_order = {s.session_id for s in samples}
    return TrainOrder(partition=partition, samples=tuple(samples),
                      masked=tuple(sorted(m for m in masked if m in in_order)))


def reward_stats(samples: list[SampleInfo]) -> dict[str, float]:
    """`reward/mean`, `reward/std`, `reward/max`, `reward/min` over completed samples (NaN if none)."""
    vals = [float(s.reward) for s in samples if s.status == "completed" and s.reward is not None]
    if not vals:
        return {"reward/mean": math.nan}
    return {
        "reward/mean": statistics.fmean(vals),
        "reward/std": statistics.pstdev(vals),
        "reward/max": max(vals),
        "reward/min": min(vals),
    }


def agent_metric_means(samples: list[SampleInfo]) -> dict[str, float]:
    """`agent/<name>`: the mean of each metric the agents reported (`SampleInfo.agent_metrics`) over
    the samples that reported it. A 0/1 flag's mean is the share of those rollouts it marks: with a
    clean-sandbox grader (examples/agents/agent_common/grading.py) `agent/hacking/protected_paths`
    (the diff touched tests or test config), `agent/hacking/outside_scope` and
    `agent/hacking/episode_vs_graded` (the episode's own tests passed, the clean grading failed),
    which the reward-hacking alarm reads (orchestrator/watch/alarms.py); `agent/grading_s` is the
    grading span's mean seconds."""
    sums: dict[str, list[float]] = {}
    for s in samples:
        for name, value in s.agent_metrics:
            sums.setdefault(name, []).append(value)
    return {f"agent/{name}": statistics.fmean(vals) for name, vals in sorted(sums.items())}


@dataclass
class RolloutLedger:
    """Counts every dispatched rollout until it reaches exactly one terminal state.

    Invariant: dispatched == len(open) + sum(closed counts), the terminal states being
    `TERMINAL_STATES` (completed, failed, expired, filtered, truncated). Closing an unknown or
    already closed rollout raises: a double count is a bug, not something to tolerate.
    """

    _open: set[str] = field(default_factory=set)
    _closed: dict[str, RolloutStatus] = field(default_factory=dict)
    _counts: dict[str, int] = field(default_factory=lambda: {s: 0 for s in TERMINAL_STATES})
    dispatched: int = 0
    trained_groups: int = 0  # groups handed to an update (their samples closed completed/expired)

    def on_group_trained(self) -> None:
        self.trained_groups += 1

    def on_dispatched(self, key: str) -> None:
        if key in self._open or key in self._closed:
            raise ValueError(f"rollout {key} dispatched twice")
        self._open.add(key)
        self.dispatched += 1

    def on_terminal(self, key: str, status: RolloutStatus) -> None:
        if status not in TERMINAL_STATES:
            raise ValueError(f"unknown terminal state {status!r}")
        if key not in self._open:
            raise ValueError(f"rollout {key} closed without being open (closed as {self._closed.get(key)!r})")
        self._open.remove(key)
        self._closed[key] = status
        self._counts[status] += 1

    def open_rollouts(self) -> list[str]:
        return sorted(self._open)

    def settled_counts(self) -> dict[str, int]:
        """`counts()` without the rollouts still open: what a checkpoint keeps (a resumed run
        dispatches the open ones' rows again, so they are counted then)."""
        return {**self.counts(), "rollout/dispatched": self.dispatched - len(self._open), "rollout/open": 0}

    def restore(self, counts: dict[str, int]) -> None:
        """Continue from a checkpoint's `settled_counts()`: the run's counters go on, they do not
        restart from 0. Raises ValueError on a ledger already in use or counts that do not add up."""
        if self.dispatched or self._closed or self._open:
            raise ValueError("restore on a ledger already in use")
        terminal = {s: int(counts.get(f"rollout/{s}", 0)) for s in TERMINAL_STATES}
        dispatched = int(counts.get("rollout/dispatched", 0))
        if dispatched != sum(terminal.values()) or min(terminal.values(), default=0) < 0:
            raise ValueError(f"restored counts do not add up: dispatched={dispatched}, terminal={terminal}")
        self._counts, self.dispatched = terminal, dispatched
        self.trained_groups = int(counts.get("rollout/trained_groups", 0))

    def counts(self) -> dict[str, int]:
        """`rollout/{dispatched,completed,failed,expired,filtered,truncated,trained_groups}` so far, and
        `rollout/open`: dispatched and not yet terminal (in flight at an async step's end, or the
        step in progress when a run was interrupted), so that dispatched == open + the terminal
        counts at every point."""
        return {"rollout/dispatched": self.dispatched, **{f"rollout/{k}": v for k, v in self._counts.items()},
                "rollout/open": len(self._open), "rollout/trained_groups": self.trained_groups}
