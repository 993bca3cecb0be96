"""Staleness control: admission capacity, lifecycle, resume, per-sample verdict, and the async gate.

Capacity formula under test (orchestrator/loop/staleness.py): free = (η + v + 1)·G - (running + accepted),
G = groups_per_update · updates_per_version.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import pytest
import torch

from workers.core.algorithms.advantages import grpo_outcome_advantages
from orchestrator.loop.batching import Group, train_order
from workers.trainer.train_batch import order_batch
from orchestrator.loop.staleness import (
    Admission,
    AdmissionState,
    StalenessError,
    SampleStaleness,
    StalenessPolicy,
    judge_samples,
    sample_staleness,
    staleness_facts,
    staleness_metrics,
)
from orchestrator.loop.staleness_gate import AdmissionGate
from stand_ins import ManualVersions, make_row, make_sample
from workers.core.types import OrderData, Sample


def make_admission(versions: ManualVersions, eta: int, b: int, **kw) -> Admission:
    return Admission(versions, max_staleness=eta, groups_per_update=b, **kw)


def sample_at(versions: list[int], *, reward: float = 1.0, group_id: int = 0, idx: int = 0) -> Sample:
    """A completed sample with one row: a 2-token prompt, then one generated token per version."""
    rows = (make_row((1, 2), range(10, 10 + len(versions)), versions=versions),) if versions else ()
    return make_sample(group_id, idx, reward, rows=rows)


# --- capacity -----------------------------------------------------------------------------------

# (η, B, v, expected free slots on an empty controller) with expected = (η + v + 1)·B
CAPACITY_TABLE = [
    (0, 2, 0, 2), (0, 2, 1, 4), (0, 2, 2, 6), (0, 2, 3, 8),          # (0+v+1)·2
    (1, 2, 0, 4), (1, 2, 1, 6), (1, 2, 2, 8), (1, 2, 3, 10),         # (1+v+1)·2
    (2, 2, 0, 6), (2, 2, 1, 8), (2, 2, 2, 10), (2, 2, 3, 12),        # (2+v+1)·2
    (0, 4, 0, 4), (0, 4, 1, 8), (0, 4, 2, 12), (0, 4, 3, 16),        # (0+v+1)·4
    (1, 4, 0, 8), (1, 4, 1, 12), (1, 4, 2, 16), (1, 4, 3, 20),       # (1+v+1)·4
    (2, 4, 0, 12), (2, 4, 1, 16), (2, 4, 2, 20), (2, 4, 3, 24),      # (2+v+1)·4
]


@pytest.mark.parametrize("eta,b,v,expected", CAPACITY_TABLE)
def test_capacity_at_version(eta, b, v, expected):
    adm = make_admission(ManualVersions(v), eta, b)
    assert adm.free_slots() == expected
    for _ in range(expected):
        adm.on_admitted()
    assert adm.free_slots() == 0
    with pytest.raises(StalenessError, match="no free slot"):
        adm.on_admitted()


def test_capacity_counts_running_and_accepted_not_returned():
    versions = ManualVersions(0)
    adm = make_admission(versions, eta=1, b=2)  # capacity (1+0+1)·2 = 4
    for _ in range(4):
        adm.on_admitted()
    adm.on_finished(kept=True)   # accepted: still uses its slot
    assert adm.free_slots() == 0
    adm.on_finished(kept=False)  # filtered: slot goes back
    assert adm.free_slots() == 1
    adm.on_trained(1)            # trained: capacity stays used
    assert adm.free_slots() == 1
    versions.v = 1               # one version later: +G = +2 slots
    assert adm.free_slots() == 3


def test_updates_per_version_scales_the_window():
    # B=2 groups per update, 3 updates per weight sync: G = 6 groups per version; η=1, v=0 -> (1+0+1)·6 = 12
    adm = make_admission(ManualVersions(0), eta=1, b=2, updates_per_version=3)
    assert adm.free_slots() == 12


def test_max_running_caps_concurrency():
    adm = make_admission(ManualVersions(0), eta=2, b=4, max_running=3)  # staleness allows 12, concurrency 3
    for _ in range(3):
        adm.on_admitted()
    assert adm.free_slots() == 0
    adm.on_finished(kept=True)   # running 2: one concurrency slot back; staleness still allows 12 - 3 = 9
    assert adm.free_slots() == 1


@pytest.mark.parametrize("kwargs", [dict(max_staleness=-1, groups_per_update=1),
                                    dict(max_staleness=0, groups_per_update=0),
                                    dict(max_staleness=0, groups_per_update=1, updates_per_version=0),
                                    dict(max_staleness=0, groups_per_update=1, max_running=0)])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        Admission(ManualVersions(0), **kwargs)


def test_policy_validates_its_keys():
    with pytest.raises(ValueError, match="async.max_staleness"):
        StalenessPolicy(-1)
    with pytest.raises(ValueError, match="async.on_stale"):
        StalenessPolicy(1, on_stale="keep")  # type: ignore[arg-type]


# --- lifecycle and illegal transitions -----------------------------------------------------------

def test_illegal_transitions_raise_and_change_nothing():
    adm = make_admission(ManualVersions(0), eta=0, b=2)
    with pytest.raises(StalenessError, match="without a matching on_admitted"):
        adm.on_finished(kept=True)
    adm.on_admitted()
    with pytest.raises(StalenessError, match="on_trained"):
        adm.on_trained(1)        # nothing accepted yet
    with pytest.raises(StalenessError, match="on_expired"):
        adm.on_expired(1)        # nothing accepted yet
    adm.on_finished(kept=True)
    adm.on_trained(1)
    before = adm.counts()
    with pytest.raises(StalenessError):
        adm.on_expired(1)        # a trained group cannot expire
    with pytest.raises(StalenessError):
        adm.on_trained(-1)
    assert adm.counts() == before
    assert (before.admitted, before.running, before.accepted, before.returned, before.trained) == (1, 0, 1, 0, 1)


def test_expired_groups_give_capacity_back():
    adm = make_admission(ManualVersions(0), eta=0, b=2)  # capacity 2
    adm.on_admitted(); adm.on_admitted()
    adm.on_finished(kept=True); adm.on_finished(kept=True)
    assert adm.free_slots() == 0
    adm.on_expired(2)            # both too stale at update time: never trained, quota refilled
    c = adm.counts()
    assert adm.free_slots() == 2
    assert (c.accepted, c.returned, c.expired, c.buffered) == (0, 2, 2, 0)


def test_negative_version_is_an_error():
    with pytest.raises(StalenessError, match="version"):
        make_admission(ManualVersions(-1), eta=0, b=1).free_slots()


def test_randomized_invariant_holds_under_any_event_order():
    """Seeded random events, legal and illegal: the ledger identity holds after each, counters stay
    >= 0, and a refused event leaves the counters untouched."""
    rng = random.Random(1234)
    for trial in range(30):
        versions = ManualVersions(0)
        adm = make_admission(versions, eta=rng.randint(0, 3), b=rng.randint(1, 4),
                             updates_per_version=rng.randint(1, 2),
                             max_running=rng.choice([None, rng.randint(1, 8)]))
        refused = 0
        for _ in range(300):
            before = adm.counts()
            op = rng.choice(["admit", "keep", "drop", "train", "expire", "bump"])
            try:
                if op == "admit":
                    adm.on_admitted()
                elif op == "keep":
                    adm.on_finished(kept=True)
                elif op == "drop":
                    adm.on_finished(kept=False)
                elif op == "train":
                    adm.on_trained(rng.randint(0, 3))
                elif op == "expire":
                    adm.on_expired(rng.randint(0, 2))
                else:
                    versions.v += 1
            except StalenessError:
                refused += 1
                assert adm.counts() == before, f"trial {trial}: a refused {op} changed the counters"
            c = adm.counts()
            assert c.admitted == c.running + c.accepted + c.returned
            assert min(c.admitted, c.running, c.accepted, c.returned, c.trained, c.expired) >= 0
            assert c.trained <= c.accepted and c.expired <= c.returned
            assert c.running + c.accepted <= adm.capacity()  # the staleness bound itself
        assert refused > 0  # the sequence did exercise illegal events


# --- a realistic run: FIFO consumer, the bound is tight, resume keeps it ---------------------------

@dataclass
class SimRun:
    """Producers as fast as allowed; the trainer consumes B kept groups FIFO per update and bumps the
    version after each. Records each trained group's staleness (trainer version - admission version)."""

    versions: ManualVersions
    adm: Admission
    b: int
    buffer: list[int] = field(default_factory=list)       # admission versions of accepted groups
    trained_staleness: list[int] = field(default_factory=list)

    def fill(self) -> None:
        while self.adm.free_slots() > 0:
            self.adm.on_admitted()
            self.adm.on_finished(kept=True)
            self.buffer.append(self.versions.current())

    def update(self) -> None:
        batch, self.buffer = self.buffer[: self.b], self.buffer[self.b:]
        assert len(batch) == self.b, "the bound starved the trainer"
        self.trained_staleness += [self.versions.current() - v for v in batch]
        self.adm.on_trained(self.b)
        self.versions.v += 1

    def run(self, updates: int) -> None:
        for _ in range(updates):
            self.fill()
            self.update()


@pytest.mark.parametrize("eta,b", [(0, 2), (1, 2), (2, 4)])
def test_fifo_run_trains_at_staleness_at_most_eta_and_reaches_it(eta, b):
    versions = ManualVersions(0)
    sim = SimRun(versions, make_admission(versions, eta, b), b)
    sim.run(updates=8)
    assert max(sim.trained_staleness) == eta  # tight: producers run exactly η versions ahead


@pytest.mark.parametrize("eta,b", [(0, 2), (1, 2), (2, 4)])
def test_after_a_resume_from_checkpoint_the_staleness_bound_still_holds(eta, b):
    """Regression: a resumed run that re-seeded the counters from zero at the restored version v
    admitted (η + v + 1)·B groups at once, and trained the last of them v versions too stale.
    Restoring `trained_groups` keeps the window at (η + 1)·B groups ahead of the trainer."""
    versions = ManualVersions(0)
    sim = SimRun(versions, make_admission(versions, eta, b), b)
    sim.run(updates=3)
    state = sim.adm.state()  # checkpoint at v=3: running/buffered groups go back to the prompts
    assert state == AdmissionState(policy_version=3, trained_groups=3 * b)

    resumed_versions = ManualVersions(state.policy_version)   # the resumed run restores the version first
    restored = make_admission(resumed_versions, eta, b)
    restored.restore(state)
    # (η + 3 + 1)·B - 3·B trained = (η + 1)·B, as at the start of a run
    assert restored.free_slots() == (eta + 1) * b
    resumed = SimRun(resumed_versions, restored, b)
    resumed.run(updates=6)
    assert max(resumed.trained_staleness) <= eta

    # the bug this pins: counters from zero at v=3 offer (η + 4)·B slots and train past η
    buggy_versions = ManualVersions(3)
    buggy = SimRun(buggy_versions, make_admission(buggy_versions, eta, b), b)
    assert buggy.adm.free_slots() == (eta + 4) * b
    buggy.run(updates=6)
    assert max(buggy.trained_staleness) > eta


def test_restore_refuses_a_version_source_that_was_not_restored_or_a_used_controller():
    state = AdmissionState(policy_version=4, trained_groups=8)
    with pytest.raises(StalenessError, match="restore the version source first"):
        make_admission(ManualVersions(0), eta=1, b=2).restore(state)
    used = make_admission(ManualVersions(4), eta=1, b=2)
    used.on_admitted()
    with pytest.raises(StalenessError, match="already admitted"):
        used.restore(state)


# --- per-sample verdict and metrics --------------------------------------------------------------

def test_staleness_is_trainer_version_minus_oldest_token_version():
    # trainer at 5, tokens from versions 3 and 4: staleness 5 - 3 = 2
    assert sample_staleness(sample_at([3, 3, 4]), trainer_version=5) == 2
    f = staleness_facts(sample_at([3, 3, 4]), trainer_version=5, max_staleness=2)
    assert (f.staleness, f.stale, f.min_version, f.max_version) == (2, False, 3, 4)
    assert staleness_facts(sample_at([2, 4]), 5, 2).stale           # 5 - 2 = 3 > 2
    assert sample_staleness(sample_at([]), 5) is None                # nothing generated
    assert not staleness_facts(sample_at([]), 5, 0).stale            # ... is never stale
    with pytest.raises(StalenessError, match="newer than the trainer"):
        sample_staleness(sample_at([6]), 5)


def test_drop_expires_stale_samples():
    fresh, stale = sample_at([4], idx=0), sample_at([1, 4], idx=1)   # staleness 1 and 4 at v=5
    split = judge_samples([fresh, stale], trainer_version=5, policy=StalenessPolicy(2, "drop"))
    assert [s.session_id for s in split.train] == ["s-0-0"]
    assert [s.status for s in split.expired] == ["expired"]
    assert "staleness 4 > max_staleness 2" in split.expired[0].error
    assert split.num_stale == 1


def test_train_masked_keeps_the_sample_in_group_statistics_without_gradient():
    """train_masked: the stale sample's reward still enters the group baseline, its tokens get no loss."""
    samples = [sample_at([1], reward=1.0, idx=0),   # stale at v=5, η=1
               sample_at([5], reward=0.0, idx=1),
               sample_at([4], reward=0.0, idx=2)]
    split = judge_samples([s.info() for s in samples], trainer_version=5, policy=StalenessPolicy(1, "train_masked"))
    assert not split.expired and len(split.train) == 3
    stale = {f.session_id for f in split.facts if f.stale}
    assert stale == {samples[0].session_id}
    order = train_order("async", (Group(0, split.train),), masked=stale)  # what the async loop sends
    assert order.masked == (samples[0].session_id,) and order.samples[0].row_keys == ()  # no row read
    assert [s.reward for s in order.samples] == [1.0, 0.0, 0.0]  # ... yet in the group's statistics
    batch = order_batch(order, [r for s in samples[1:] for r in s.rows], OrderData())
    assert batch.batch_size == 2                       # the masked sample adds no row and no token
    # advantages of samples 1 and 2 come from the 3-sample group (mean 1/3), not from [0, 0]
    expected = grpo_outcome_advantages(torch.tensor([1.0, 0.0, 0.0]), [0, 0, 0], norm_adv_by_std=True)[1:]
    got = batch.advantages[batch.loss_mask.bool()]
    assert torch.allclose(got, expected) and bool((expected != 0).all())


def test_staleness_metrics():
    facts = [staleness_facts(sample_at(v), 5, 2) for v in ([5], [4, 5], [4], [2, 3], [])]
    m = staleness_metrics(facts)
    # staleness 0, 1, 1, 3 (the empty sample is left out): mean 5/4, max 3; versions 2..5
    assert m["staleness/mean"] == 1.25 and m["staleness/max"] == 3.0
    assert (m["staleness/hist/0"], m["staleness/hist/1"], m["staleness/hist/3"]) == (1.0, 2.0, 1.0)
    assert "staleness/hist/2" not in m
    assert m["staleness/version_span"] == 3.0 and m["async/dropped_stale"] == 1.0
    assert staleness_metrics([]) == {"async/dropped_stale": 0.0}


# --- the async gate ------------------------------------------------------------------------------

async def test_acquire_waits_for_a_returned_slot():
    gate = AdmissionGate(make_admission(ManualVersions(0), eta=0, b=1))  # capacity 1
    assert await gate.acquire(timeout_s=1)
    waiter = asyncio.create_task(gate.acquire(timeout_s=5))
    await asyncio.sleep(0)
    assert not waiter.done()
    gate.release(kept=False)                 # filtered: the slot goes back, the waiter gets it
    assert await asyncio.wait_for(waiter, timeout=2)
    assert gate.admission.running == 1 and gate.admission.returned == 1


async def test_acquire_wakes_on_version_change():
    versions = ManualVersions(0)
    gate = AdmissionGate(make_admission(versions, eta=0, b=1))
    assert await gate.acquire(timeout_s=1)
    gate.release(kept=True)                  # kept: no slot back
    waiter = asyncio.create_task(gate.acquire(timeout_s=5))
    await asyncio.sleep(0)
    versions.v = 1                           # the version moves; the waiter only learns it from notify()
    await asyncio.sleep(0)
    assert not waiter.done()
    gate.notify()
    assert await asyncio.wait_for(waiter, timeout=2)
    assert gate.admission.admitted == 2


async def test_acquire_times_out():
    gate = AdmissionGate(make_admission(ManualVersions(0), eta=0, b=1))
    assert await gate.acquire()
    assert await gate.acquire(timeout_s=0.05) is False
    with pytest.raises(TimeoutError, match="no admission slot within 0.05s"):
        async with gate.slot(timeout_s=0.05):
            pass
    assert gate.admission.admitted == 1      # the timed-out waiters admitted nothing


async def test_slot_context_releases_exactly_once():
    gate = AdmissionGate(make_admission(ManualVersions(0), eta=0, b=4))
    async with gate.slot() as s:
        s.finish(kept=True)
    async with gate.slot():
        pass                                 # no verdict: counts as not kept
    with pytest.raises(ValueError):
        async with gate.slot():
            raise ValueError("rollout crashed")
    c = gate.admission.counts()
    assert (c.admitted, c.running, c.accepted, c.returned) == (3, 0, 1, 2)


async def _simulate(*, eta: int, b: int, updates: int, give_back: bool, timeout_s: float) -> list[int]:
    """Producers (3 tasks) admit through the gate; a trainer consumes B kept groups per update and
    bumps the version. The first 3·B groups generated at versions 0 and 2 all have zero reward
    variance (filtered) — more than the (η + 1)·B window. Returns each trained group's staleness."""
    versions = ManualVersions(0)
    gate = AdmissionGate(make_admission(versions, eta, b))
    queue: asyncio.Queue[int] = asyncio.Queue()
    zero_variance_left = {0: 3 * b, 2: 3 * b}

    async def producer() -> None:
        while True:
            async with gate.slot(timeout_s=timeout_s) as s:
                v = versions.current()
                await asyncio.sleep(0)                     # "generation"
                if zero_variance_left.get(v, 0) > 0:
                    zero_variance_left[v] -= 1
                    s.finish(kept=not give_back)           # the bug: a filtered group keeps its slot
                else:
                    s.finish(kept=True)
                    queue.put_nowait(v)

    async def trainer() -> list[int]:
        staleness = []
        for _ in range(updates):
            batch = [await queue.get() for _ in range(b)]
            gate.admission.on_trained(b)
            staleness += [versions.current() - v for v in batch]
            versions.v += 1
            gate.notify()
        return staleness

    producers = [asyncio.create_task(producer()) for _ in range(3)]
    try:
        return await asyncio.wait_for(trainer(), timeout=timeout_s)
    finally:
        for p in producers:
            p.cancel()
        await asyncio.gather(*producers, return_exceptions=True)


async def test_zero_variance_groups_dropped_by_the_filter_do_not_starve_the_producers():
    """Regression (no deadlock): filtered groups must hand their capacity back. If they kept it, a
    burst of zero-variance groups larger than the (η + 1)·B window used every slot at version 0, the
    trainer never got B groups, the version never moved, and producers waited forever."""
    staleness = await _simulate(eta=1, b=2, updates=6, give_back=True, timeout_s=5.0)
    assert len(staleness) == 6 * 2 and max(staleness) <= 1
    # the same simulation with the bug stalls: this is what the test above would catch
    with pytest.raises(TimeoutError):
        await _simulate(eta=1, b=2, updates=6, give_back=False, timeout_s=0.5)


def test_the_controller_module_is_pure():
    """staleness.py imports neither Ray, asyncio, torch nor an HTTP client (the gate holds asyncio)."""
    import subprocess
    import sys

    code = ("import sys, orchestrator.loop.staleness; "
            "print(sorted(m for m in ('ray', 'asyncio', 'torch', 'httpx', 'aiohttp') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


async def test_a_cancelled_slot_body_gives_its_capacity_back():
    gate = AdmissionGate(make_admission(ManualVersions(0), eta=0, b=1))
    entered = asyncio.Event()

    async def body() -> None:
        async with gate.slot() as s:
            entered.set()
            await asyncio.Event().wait()     # a rollout that hangs until cancelled
            s.finish(kept=True)

    task = asyncio.create_task(body())
    await asyncio.wait_for(entered.wait(), timeout=2)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    c = gate.admission.counts()
    assert (c.running, c.returned) == (0, 1) and gate.admission.free_slots() == 1


async def test_gate_expired_wakes_waiters():
    gate = AdmissionGate(make_admission(ManualVersions(0), eta=0, b=1))
    assert await gate.acquire()
    gate.release(kept=True)
    waiter = asyncio.create_task(gate.acquire(timeout_s=5))
    await asyncio.sleep(0)
    assert not waiter.done()
    gate.expired(1)                          # the accepted group was too stale: its slot comes back
    assert await asyncio.wait_for(waiter, timeout=2)


def test_fixed_max_running_is_eta_plus_one_mini_batches():
    from orchestrator.loop.staleness import fixed_max_running

    assert fixed_max_running(max_staleness=1, groups_per_update=64) == 128
    assert fixed_max_running(max_staleness=0, groups_per_update=4) == 4
    assert fixed_max_running(max_staleness=2, groups_per_update=3) == 9
    with pytest.raises(ValueError, match="max_staleness"):
        fixed_max_running(max_staleness=-1, groups_per_update=4)
    with pytest.raises(ValueError, match="groups_per_update"):
        fixed_max_running(max_staleness=1, groups_per_update=0)


def test_admission_stops_at_the_runs_last_update():
    """total_groups: no group is admitted that the run could never train; a returned (filtered)
    group's slot comes back, so the last update can still fill."""
    c = Admission(ManualVersions(0), max_staleness=5, groups_per_update=2, total_groups=3)
    for _ in range(3):
        c.on_admitted()
    assert c.free_slots() == 0
    c.on_finished(kept=False)  # filtered: its slot comes back
    assert c.free_slots() == 1
    c.on_admitted()
    for _ in range(3):
        c.on_finished(kept=True)
    c.on_trained(3)
    assert c.free_slots() == 0
    with pytest.raises(ValueError, match="total_groups"):
        Admission(ManualVersions(0), max_staleness=1, groups_per_update=2, total_groups=-1)


def test_admission_resumed_counts_the_trained_groups_against_the_total():
    c = Admission(ManualVersions(3), max_staleness=1, groups_per_update=2, total_groups=10)
    c.restore(AdmissionState(policy_version=3, trained_groups=8))
    assert c.free_slots() == 2


def test_trained_staleness_metrics_leave_out_the_stale_samples():
    facts = [SampleStaleness("a", 0, 0, 0, False), SampleStaleness("b", 0, 0, 1, False), SampleStaleness("c", 0, 0, 2, True)]
    m = staleness_metrics(facts)
    assert m["staleness/max"] == 2.0 and m["staleness/trained_max"] == 1.0
    assert m["staleness/trained_hist/1"] == 1.0 and "staleness/trained_hist/2" not in m
