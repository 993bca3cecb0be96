"""Bounded control calls (workers/core/bounds.py, `PartClient.call_within`): a part that stalls during a
weight sync, a health check or a colocated pause stops the run (or fails the sync) within the bound, with an
error naming the part and the call, instead of hanging it (the hang prime-rl PR #2673 fixed for an engine
pause). The stalled parts here are real objects whose method never returns; the sync, supervisor and
colocation code under test is the shipped code. The bounds are shrunk to fractions of a second for the test.
"""

from __future__ import annotations

import asyncio
import pickle
import time

import pytest

from orchestrator.adapters.colocate import SleepingTrainer
from orchestrator.control.supervise import ReplicaSupervisor, run_watched
from workers.core import bounds
from workers.core.calls import PartClient, PartTimeout, within
from workers.inference.settings import SleepReport
from workers.weight_sync.file import FileWeightSync

BOUND_S = 0.3  # the shrunk bound (s)
SLACK_S = 2.0  # scheduling slack on a loaded 2-core machine (s); a hang would exceed T_TEST_S instead
T_TEST_S = 20.0  # every await in this module is bounded by this (s)


class Replica:
    """A replica that answers: serves `version`, loads any file, sleeps and wakes."""

    def __init__(self, version: int = 0) -> None:
        self.version = version

    async def policy_version(self) -> int:
        return self.version

    async def update_weights(self, path: str, version: int) -> None:
        self.version = version

    async def sleep(self) -> SleepReport:
        return SleepReport(level=1, released_memory=True, elapsed_s=0.0)

    async def wake_up(self) -> SleepReport:
        return SleepReport(level=1, released_memory=True, elapsed_s=0.0)


class StalledReplica(Replica):
    """A replica whose control calls never return (a blocked engine, a hung collective); counts the calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        self._never = asyncio.Event()

    async def _stall(self, call: str) -> None:
        self.calls.append(call)
        await self._never.wait()

    async def policy_version(self) -> int:
        await self._stall("policy_version")
        return 0

    async def update_weights(self, path: str, version: int) -> None:
        await self._stall("update_weights")

    async def sleep(self) -> SleepReport:
        await self._stall("sleep")
        return SleepReport(level=1, released_memory=True, elapsed_s=0.0)


class OneStepTrainer:
    async def update(self, order) -> dict[str, float]:
        return {"actor/pg_loss": 0.0}


@pytest.fixture
def short_bounds(monkeypatch):
    for name in ("STATUS_S", "PAUSE_RESUME_S", "ENGINE_START_S", "WEIGHT_SYNC_S"):
        monkeypatch.setattr(bounds, name, BOUND_S)


async def test_within_names_the_part_and_lets_the_calls_own_timeout_through():
    with pytest.raises(PartTimeout, match=r"^replica-1: sleep did not return within 0.05 s") as err:
        await within(0.05, asyncio.Event().wait(), part="replica-1", call="sleep")
    assert (err.value.part, err.value.call, err.value.timeout_s) == ("replica-1", "sleep", 0.05)

    async def own_timeout() -> None:
        raise TimeoutError("the call's own")

    with pytest.raises(TimeoutError, match="the call's own") as err:
        await within(5.0, own_timeout(), part="p", call="c")
    assert not isinstance(err.value, PartTimeout)
    assert await within(5.0, asyncio.sleep(0, result=7), part="p", call="c") == 7


def test_part_timeout_survives_pickling():
    """Ray carries an actor's exception pickled; the fields, not only the message, come back."""
    back = pickle.loads(pickle.dumps(PartTimeout("Actor(InferenceWorker, ab12)", "update_weights", 1200.0)))
    assert (back.part, back.call, back.timeout_s) == ("Actor(InferenceWorker, ab12)", "update_weights", 1200.0)


async def test_a_replica_stalled_in_a_weight_sync_fails_the_sync_within_the_bound(short_bounds):
    good, stalled = Replica(), StalledReplica()
    sync = FileWeightSync([good, stalled])
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        await asyncio.wait_for(sync.push("/weights/policy-v1.safetensors", 1), T_TEST_S)
    elapsed = time.monotonic() - t0
    assert BOUND_S <= elapsed < BOUND_S + SLACK_S, elapsed
    message = str(err.value)
    assert "weight sync to version 1 failed on 1/2 replicas" in message
    assert "replica 1: PartTimeout: StalledReplica: update_weights did not return within 0.3 s" in message
    assert isinstance(err.value.__cause__, PartTimeout)
    assert stalled.calls == ["update_weights"] and good.version == 1
    assert sync.version() == 0  # the sync's version stays: the next push retries every replica


async def test_a_replica_stalled_in_the_health_check_stops_the_run_within_the_bound(short_bounds):
    """The supervisor runs beside the loop (run_watched): its health call to a stalled replica raises
    PartTimeout past bounds.STATUS_S, which cancels the loop and propagates."""
    stalled = StalledReplica()
    supervisor = ReplicaSupervisor([Replica(), stalled], spawn=lambda i: Replica(), weights=None, gateway=None,
                                   loaded_version=0, max_restarts=3, check_every_s=0.05)
    loop_cancelled = asyncio.Event()

    async def loop_forever() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            loop_cancelled.set()

    t0 = time.monotonic()
    with pytest.raises(PartTimeout, match="StalledReplica: policy_version did not return within 0.3 s"):
        await asyncio.wait_for(run_watched(loop_forever(), [supervisor.run]), T_TEST_S)
    assert time.monotonic() - t0 < 0.05 + BOUND_S + SLACK_S
    assert loop_cancelled.is_set() and supervisor.restarts == 0  # stalled is not dead: not replaced


async def test_a_colocated_engine_stalled_in_its_pause_fails_the_step_naming_it(short_bounds):
    stalled = StalledReplica()
    trainer = SleepingTrainer(OneStepTrainer(), [Replica(), stalled])
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"colocated inference sleep failed on 1/2 replicas \(replica 1: "
                                           r"PartTimeout: StalledReplica: sleep did not return within 0.3 s"):
        await asyncio.wait_for(trainer.update(object()), T_TEST_S)
    assert time.monotonic() - t0 < BOUND_S + SLACK_S


def test_part_names():
    assert PartClient(Replica()).name == "Replica"
    assert PartClient(Replica(), name="inference-0").name == "inference-0"
