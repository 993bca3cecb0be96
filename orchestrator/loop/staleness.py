"""Staleness control for the async loop: group admission and the per-sample staleness verdict.

Pure logic: no Ray, asyncio, HTTP or clock. Facts go in through `on_*` methods, decisions come out
as return values. Blocking ("wait until a slot frees") lives in `orchestrator/loop/staleness_gate.py`.

Admission (AReaL `areal/infra/staleness_manager.py` `StalenessManager.get_capacity`; Fu et al.
2025, "AReaL", §5.1): with max staleness η (policy versions) and G groups consumed per policy
version (groups per optimizer update B times updates per version), the groups admitted at policy
version v that are still counted (running, or kept for training) never exceed (η + v + 1)·G. Group
number k (0-based, in admission order) is then trained in version period ⌊k / G⌋ <= η + v, so a
FIFO consumer trains it at staleness <= η. Groups that end filtered, failed or expired give their
capacity back (they are never trained, so they must not use up a version's quota, or a run whose
groups are all filtered would never reach the next version: deadlock).

Two more bounds: `max_running` caps the groups in flight (dispatched, not yet trained or
returned; AReaL's `max_concurrent_rollouts`; fixed concurrency sets it to `fixed_max_running`). The
staleness budget alone is no concurrency limit: a weight sync frees a whole version's G groups at
once, and with `sync_every` = k it lets (η + 1)·k·B groups run, more than the engines serve, and
the slowest of them finish too late to train (see `fixed_max_running` for the figures). And
`total_groups` (the groups the whole run trains) stops admission once the last update's groups are
in flight: a group admitted past it could never be trained, which is known at dispatch time
(admission instead of discard: discard-and-requeue starves long rollouts, tinker-cookbook PR #822).

Invariant (checked after every event, defended by `tests/test_staleness.py`):
    admitted == running + accepted + returned,   trained <= accepted,   expired <= returned,
and no counter is ever negative. An event that would break it raises `StalenessError` and
leaves the counters unchanged.

Per-sample verdict: staleness = trainer version at update time - oldest policy version among the
sample's generated tokens. A sample staler than η is either dropped (terminal state `expired`)
or, with `on_stale="train_masked"`, kept in its group with no gradient (masked in the train
order: no rank reads its rows; see `judge_samples`). Callers: `orchestrator/loop/async_loop.py`, `orchestrator/control/checkpoint.py`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, Protocol

from workers.core.types import SampleInfo

OnStale = Literal["drop", "train_masked"]
ON_STALE_CHOICES: tuple[OnStale, ...] = ("drop", "train_masked")


class StalenessError(RuntimeError):
    """An event that would break the admission invariant (e.g. finishing a group never admitted)."""


class VersionSource(Protocol):
    """The policy version the inference replicas serve now (bumped at every weight sync)."""

    def current(self) -> int: ...


@dataclass(frozen=True)
class StalenessPolicy:
    """`async.max_staleness` (η, policy versions, >= 0) and `async.on_stale` (drop | train_masked)."""

    max_staleness: int
    on_stale: OnStale = "drop"

    def __post_init__(self) -> None:
        if not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ValueError(f"async.max_staleness must be an int >= 0, got {self.max_staleness!r}")
        if self.on_stale not in ON_STALE_CHOICES:
            raise ValueError(f"async.on_stale must be one of {list(ON_STALE_CHOICES)}, got {self.on_stale!r}")


@dataclass(frozen=True)
class AdmissionCounts:
    """A snapshot of the admission counters (units: groups).

    admitted: groups ever admitted. running: admitted, not finished yet. accepted: finished and
    kept for training (buffered or trained). returned: finished without training (filtered,
    failed, or expired after acceptance); their capacity went back. trained: accepted groups
    an optimizer update consumed. expired: accepted groups later dropped as too stale (also
    counted in `returned`).
    """

    admitted: int
    running: int
    accepted: int
    returned: int
    trained: int
    expired: int

    @property
    def buffered(self) -> int:
        """Accepted groups waiting for an update."""
        return self.accepted - self.trained


@dataclass(frozen=True)
class AdmissionState:
    """What a checkpoint keeps: the policy version and the groups trained through it.

    Running and buffered groups are not kept: their prompts go back to the dataset side
    (`RunState.pending_rows`) and are admitted again after the resume.
    """

    policy_version: int
    trained_groups: int

    def __post_init__(self) -> None:
        if self.policy_version < 0 or self.trained_groups < 0:
            raise ValueError(f"AdmissionState fields must be >= 0, got {self}")


class Admission:
    """Admits groups while the staleness bound holds; see the module docstring for the formula.

    Args:
        versions: the current policy version (read on every `free_slots`/`capacity` call).
        max_staleness: η >= 0, in policy versions.
        groups_per_update: B >= 1, groups in one optimizer update (mini-batch size in groups).
        updates_per_version: optimizer updates between two weight syncs (`mode.sync_every`), >= 1.
        max_running: optional cap on concurrently running groups (None: no cap; AReaL's
            `max_concurrent_rollouts`, in groups; see `fixed_max_running`).
        total_groups: optional number of groups the run trains in all (None: no end); admission
            stops when running + accepted reaches it (accepted counts the trained ones).

    Invariant: admitted == running + accepted + returned at every call boundary; no counter
    goes negative; illegal transitions raise `StalenessError`.

    Events of one group, in order: `on_admitted()` before its rollouts are dispatched; then
    `on_finished(kept=False)` if it ends filtered or failed, or `on_finished(kept=True)` once it
    is known trainable; then `on_trained(1)` when an update consumes it, or `on_expired(1)` if
    it is dropped as too stale instead. (A loop that calls `on_finished(kept=True)` only after the
    update must still call `on_trained` then: checkpoints count trained groups.)
    """

    def __init__(
        self,
        versions: VersionSource,
        *,
        max_staleness: int,
        groups_per_update: int,
        updates_per_version: int = 1,
        max_running: int | None = None,
        total_groups: int | None = None,
    ) -> None:
        StalenessPolicy(max_staleness)  # validates η
        if groups_per_update < 1:
            raise ValueError(f"groups_per_update must be >= 1, got {groups_per_update}")
        if updates_per_version < 1:
            raise ValueError(f"updates_per_version (mode.sync_every) must be >= 1, got {updates_per_version}")
        if max_running is not None and max_running < 1:
            raise ValueError(f"max_running must be >= 1 or None, got {max_running}")
        if total_groups is not None and total_groups < 0:
            raise ValueError(f"total_groups must be >= 0 or None, got {total_groups}")
        self._versions = versions
        self.max_staleness = max_staleness
        self.groups_per_version = groups_per_update * updates_per_version
        self.max_running = max_running
        self.total_groups = total_groups
        self._admitted = self._running = self._accepted = self._returned = 0
        self._trained = self._expired = 0

    # --- queries ----------------------------------------------------------------------------

    def capacity(self) -> int:
        """(η + v + 1)·G: how many groups may be running or accepted at the current version v."""
        v = self._versions.current()
        if v < 0:
            raise StalenessError(f"policy version must be >= 0, the version source says {v}")
        return (self.max_staleness + v + 1) * self.groups_per_version

    def free_slots(self) -> int:
        """Groups that may be admitted now: capacity - (running + accepted), also limited by
        `max_running` (minus the running groups) and `total_groups` (minus running + accepted);
        never negative."""
        free = self.capacity() - (self._running + self._accepted)
        if self.max_running is not None:
            free = min(free, self.max_running - self._running)
        if self.total_groups is not None:
            free = min(free, self.total_groups - (self._running + self._accepted))
        return max(0, free)

    def counts(self) -> AdmissionCounts:
        return AdmissionCounts(
            self._admitted, self._running, self._accepted, self._returned, self._trained, self._expired
        )

    @property
    def admitted(self) -> int:
        return self._admitted

    @property
    def running(self) -> int:
        return self._running

    @property
    def accepted(self) -> int:
        return self._accepted

    @property
    def returned(self) -> int:
        return self._returned

    # --- events -----------------------------------------------------------------------------

    def on_admitted(self) -> None:
        """One group starts. Raises StalenessError when no slot is free (the caller must ask)."""
        if self.free_slots() < 1:
            raise StalenessError(
                f"on_admitted with no free slot (capacity {self.capacity()}, {self.counts()})"
            )
        self._admitted += 1
        self._running += 1
        self._check()

    def on_finished(self, *, kept: bool) -> None:
        """One running group ends: kept for training (capacity stays used until the run's end),
        or not kept (filtered, failed: its capacity goes back)."""
        if self._running == 0:
            raise StalenessError("on_finished without a matching on_admitted (no group is running)")
        self._running -= 1
        if kept:
            self._accepted += 1
        else:
            self._returned += 1
        self._check()

    def on_trained(self, num_groups: int = 1) -> None:
        """An optimizer update consumed `num_groups` accepted groups (capacity stays used)."""
        if num_groups < 0 or self._trained + num_groups > self._accepted:
            raise StalenessError(
                f"on_trained({num_groups}) but only {self._accepted - self._trained} accepted groups wait"
            )
        self._trained += num_groups
        self._check()

    def on_expired(self, num_groups: int = 1) -> None:
        """`num_groups` accepted, not yet trained groups were dropped as too stale: their capacity
        goes back (they will never be trained, so the version's quota must be refilled)."""
        if num_groups < 0 or num_groups > self._accepted - self._trained:
            raise StalenessError(
                f"on_expired({num_groups}) but only {self._accepted - self._trained} accepted groups wait"
            )
        self._accepted -= num_groups
        self._returned += num_groups
        self._expired += num_groups
        self._check()

    # --- checkpoint -------------------------------------------------------------------------

    def state(self) -> AdmissionState:
        """What a checkpoint keeps (running and buffered groups are re-admitted after a resume)."""
        return AdmissionState(policy_version=self._versions.current(), trained_groups=self._trained)

    def restore(self, state: AdmissionState) -> None:
        """Continue from a checkpoint: `trained_groups` groups count as admitted, accepted, trained.

        The bound is then computed from the RESTORED version: free slots = (η + v + 1)·G -
        trained_groups, i.e. about (η + 1)·G, as at the start of a run. (Re-seeding the counters
        from zero at version v would admit (η + v + 1)·G groups at once and break the bound.)

        Raises:
            StalenessError: the controller already admitted groups, or the version source does not
                report the restored version (restore the policy version first).
        """
        if self._admitted:
            raise StalenessError(f"restore on a controller that already admitted groups ({self.counts()})")
        if self._versions.current() != state.policy_version:
            raise StalenessError(
                f"restore at policy version {state.policy_version} but the version source says "
                f"{self._versions.current()}: restore the version source first"
            )
        self._admitted = self._accepted = self._trained = state.trained_groups
        self._check()

    def _check(self) -> None:
        c = self.counts()
        if min(c.admitted, c.running, c.accepted, c.returned, c.trained, c.expired) < 0:
            raise StalenessError(f"negative counter: {c}")
        if c.admitted != c.running + c.accepted + c.returned or c.trained > c.accepted or c.expired > c.returned:
            raise StalenessError(f"admission invariant broken: {c}")




def fixed_max_running(*, max_staleness: int, groups_per_update: int) -> int:
    """The in-flight cap of fixed concurrency (`rollout.concurrency=fixed`, async mode), in groups:

        (η + 1)·B

    with η = `async.max_staleness` and B = `groups_per_update` (groups per optimizer update): the
    mini-batch being generated plus η mini-batches of look-ahead, AReaL's
    `max_concurrent_rollouts` (`areal/infra/staleness_manager.py`, the running term of
    `get_capacity`) set from the staleness bound instead of left unlimited. A group counts from its
    dispatch until it is trained or returned (a finished group waiting for the trainer still ages).

    Why not the staleness budget alone, (η + 1)·k·B with k = `mode.sync_every`: with k = 2 it let
    256 groups (4,096 rollouts) run on the simulator's reference workload at 64 GPUs, four times
    what its 4 replicas of 256 sequences serve; requests queued (~347 per replica), the slowest
    finished more than η versions late and 1,470 rollouts expired (0.86x sync-1). The same run
    capped at 2B, 2.5B, 3B groups: 1.74x / 2.01x / 2.23x sync-1 with 0.00 % / 2.1 % / 3.4 % of the
    dispatched rollouts expired (docs/simulator.md, "Admission"): 2B is the widest window that
    trains what it dispatches. The engines' own limit is the adaptive policy's to measure
    (orchestrator/loop/concurrency.py): an agent rollout spends most of its life outside the engine,
    so a cap of replicas × `max_num_seqs` / n groups (64 there) idles it (0.91x).

    Raises ValueError on η < 0 or B < 1."""
    if max_staleness < 0 or groups_per_update < 1:
        raise ValueError(f"fixed_max_running: need async.max_staleness >= 0 and groups_per_update >= 1, "
                         f"got {max_staleness}, {groups_per_update}")
    return (max_staleness + 1) * groups_per_update


# --- per-sample verdict ------------------------------------------------------------------------


@dataclass(frozen=True)
class SampleStaleness:
    """One sample's staleness facts. min_version/max_version: over its generated tokens (None
    when it generated nothing, then staleness is None and it is never stale)."""

    session_id: str
    min_version: int | None
    max_version: int | None
    staleness: int | None
    stale: bool


def sample_staleness(sample: SampleInfo, trainer_version: int) -> int | None:
    """staleness = trainer_version - (oldest policy version among the sample's generated tokens)
    (docs/architecture.md, "staleness"); None when the sample generated nothing (failed samples, empty rows).

    Raises StalenessError when a token is newer than `trainer_version`.
    """
    rng = sample.version_range()
    if rng is None:
        return None
    if rng[0] > trainer_version:
        raise StalenessError(
            f"sample {sample.session_id} has tokens of version {rng[0]}, newer than the trainer's {trainer_version}"
        )
    return trainer_version - rng[0]


def staleness_facts(sample: SampleInfo, trainer_version: int, max_staleness: int) -> SampleStaleness:
    """`sample_staleness` plus the version range and the verdict: stale iff staleness > max_staleness."""
    st = sample_staleness(sample, trainer_version)
    if st is None:
        return SampleStaleness(sample.session_id, None, None, None, False)
    lo, hi = sample.version_range()  # type: ignore[misc]
    return SampleStaleness(sample.session_id, lo, hi, st, st > max_staleness)


@dataclass(frozen=True)
class StaleSplit:
    """`judge_samples` output. `train`: samples for the batch, in input order (stale ones kept
    under train_masked: the loop lists them as masked in its train order). `expired`: stale samples dropped (status "expired").
    `facts`: one SampleStaleness per input sample, in input order."""

    train: tuple[SampleInfo, ...]
    expired: tuple[SampleInfo, ...]
    facts: tuple[SampleStaleness, ...]

    @property
    def num_stale(self) -> int:
        return sum(f.stale for f in self.facts)


def judge_samples(samples: list[SampleInfo], trainer_version: int, policy: StalenessPolicy) -> StaleSplit:
    """Apply the staleness verdict to the completed samples an update is about to train.

    - drop: a stale sample leaves the batch with status "expired" (its group keeps the rest).
    - train_masked: a stale sample stays in the batch and in its group's reward statistics (the
      GRPO mean/std baseline, and the group size) but contributes no gradient: the loop lists its
      session id as masked in the train order (orchestrator/loop/batching.py `train_order`), so
      no rank reads its rows and it adds nothing to the loss nor to the token-mean denominator.

    Raises StalenessError when a sample is newer than `trainer_version`.
    """
    facts = tuple(staleness_facts(s, trainer_version, policy.max_staleness) for s in samples)
    train: list[SampleInfo] = []
    expired: list[SampleInfo] = []
    for s, f in zip(samples, facts):
        if not f.stale:
            train.append(s)
        elif policy.on_stale == "drop":
            error = f"stale: staleness {f.staleness} > max_staleness {policy.max_staleness}"
            expired.append(dataclasses.replace(s, status="expired", error=error))
        else:
            train.append(s)  # masked by the loop's train order
    return StaleSplit(tuple(train), tuple(expired), facts)


def _distribution(prefix: str, values: list[int]) -> dict[str, float]:
    """`{prefix}mean`, `{prefix}max` and `{prefix}hist/{k}` of staleness `values` ({} when empty)."""
    if not values:
        return {}
    out = {f"{prefix}mean": sum(values) / len(values), f"{prefix}max": float(max(values))}
    return out | {f"{prefix}hist/{k}": float(values.count(k)) for k in sorted(set(values))}


def staleness_metrics(facts: list[SampleStaleness] | tuple[SampleStaleness, ...]) -> dict[str, float]:
    """`staleness/mean`, `staleness/max`, `staleness/hist/{k}` (samples at staleness k),
    `staleness/version_span` (newest - oldest generated-token version over all samples) and
    `async/dropped_stale` (stale samples; dropped or masked per `async.on_stale`): over every
    JUDGED sample, the stale ones included. `staleness/trained_mean`, `staleness/trained_max` and
    `staleness/trained_hist/{k}`: over the samples trained with a gradient only (not stale), the
    ones the bound `staleness <= η` is about. Samples that generated nothing are left out; with
    none left, only `async/dropped_stale`."""
    measured = [f for f in facts if f.staleness is not None]
    out: dict[str, float] = {"async/dropped_stale": float(sum(f.stale for f in facts))}
    if not measured:
        return out
    out |= _distribution("staleness/", [f.staleness for f in measured])  # type: ignore[misc]
    out |= _distribution("staleness/trained_", [f.staleness for f in measured if not f.stale])  # type: ignore[misc]
    lo = min(f.min_version for f in measured)  # type: ignore[type-var]
    hi = max(f.max_version for f in measured)  # type: ignore[type-var]
    out["staleness/version_span"] = float(hi - lo)
    return out
