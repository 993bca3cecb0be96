"""SleepingTrainer (orchestrator/adapters/colocate.py): engines sleep exactly around each update.

The real vLLM CPU engine's sleep/wake runs in tests/test_submit.py (a colocated job); here small
scripted replicas with InferenceWorker's sleep/wake interface pin the failure paths that a real
engine cannot be made to take on demand: a trainer error or a replica that fails to sleep must
still leave every slept replica awake.
"""

from __future__ import annotations

import pytest

from orchestrator.adapters.colocate import SleepingTrainer
from workers.core.types import OrderSample, TrainOrder
from stand_ins import FakeClock
from workers.inference.settings import SleepReport


class ScriptedReplica:
    """Records sleep/wake calls; `fail_sleep` makes sleep raise (as a dead engine would)."""

    def __init__(self, log: list[str], name: str, *, fail_sleep: bool = False, level: int = 0) -> None:
        self.log, self.name, self.fail_sleep, self.level = log, name, fail_sleep, level
        self.asleep = False

    async def sleep(self) -> SleepReport:
        if self.fail_sleep:
            raise RuntimeError("engine dead")
        assert not self.asleep
        self.asleep = True
        self.log.append(f"{self.name}.sleep")
        return SleepReport(self.level, self.level >= 1, 0.0)

    async def wake_up(self) -> SleepReport:
        assert self.asleep
        self.asleep = False
        self.log.append(f"{self.name}.wake")
        return SleepReport(self.level, self.level >= 1, 0.0)


ORDER = TrainOrder("step-1", (OrderSample("s-0", 0, 1.0, ("s-0/0",), (4,)), OrderSample("s-1", 0, 0.0)))


class ScriptedTrainer:
    def __init__(self, log: list[str], replicas: list[ScriptedReplica], *, fail: bool = False) -> None:
        self.log, self.replicas, self.fail = log, replicas, fail

    async def update(self, order) -> dict[str, float]:
        assert all(r.asleep for r in self.replicas), "trainer ran while an engine was awake"
        assert order is ORDER  # the train order passes through unchanged (its ranks read the rows)
        self.log.append("update")
        if self.fail:
            raise ValueError("bad batch")
        return {"actor/pg_loss": 0.5}


async def test_update_runs_between_sleep_and_wake_and_reports_it():
    log: list[str] = []
    replicas = [ScriptedReplica(log, "r0"), ScriptedReplica(log, "r1")]
    trainer = SleepingTrainer(ScriptedTrainer(log, replicas), replicas, clock=FakeClock(0.0, tick_s=1.5))
    metrics = await trainer.update(ORDER)
    assert log[:2] == ["r0.sleep", "r1.sleep"] and log[2] == "update" and sorted(log[3:]) == ["r0.wake", "r1.wake"]
    assert metrics == {"actor/pg_loss": 0.5, "perf/inference_sleep_s": 1.5, "perf/inference_sleep_level": 0.0,
                       "perf/inference_released_memory": 0.0}
    assert not any(r.asleep for r in replicas)  # the weight sync that follows finds the engines awake


async def test_gpu_sleep_mode_is_reported_as_released():
    log: list[str] = []
    replicas = [ScriptedReplica(log, "r0", level=1)]
    metrics = await SleepingTrainer(ScriptedTrainer(log, replicas), replicas).update(ORDER)
    assert metrics["perf/inference_sleep_level"] == 1.0 and metrics["perf/inference_released_memory"] == 1.0


async def test_trainer_error_still_wakes_every_replica():
    log: list[str] = []
    replicas = [ScriptedReplica(log, "r0"), ScriptedReplica(log, "r1")]
    with pytest.raises(ValueError, match="bad batch"):
        await SleepingTrainer(ScriptedTrainer(log, replicas, fail=True), replicas).update(ORDER)
    assert not any(r.asleep for r in replicas)


async def test_a_replica_that_cannot_sleep_stops_the_update_and_the_others_wake():
    log: list[str] = []
    replicas = [ScriptedReplica(log, "r0"), ScriptedReplica(log, "r1", fail_sleep=True)]
    with pytest.raises(RuntimeError, match=r"sleep failed on 1/2 replicas \(replica 1: RuntimeError: engine dead\)"):
        await SleepingTrainer(ScriptedTrainer(log, replicas), replicas).update(ORDER)
    assert "update" not in log and not replicas[0].asleep
