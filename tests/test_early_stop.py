"""A run whose agent speaks the other contract stops after its first rollouts, naming the contract
(issue 29: `rollout.contract=http` with an S3-contract agent failed every rollout `agent_error` and
nothing stopped the run)."""

import asyncio
import random
import dataclasses

import pytest

from orchestrator.loop.async_loop import AsyncLoopSettings, run_async
from orchestrator.loop.batching import RolloutLedger
from orchestrator.loop.common import LoopParts
from orchestrator.loop.early_stop import FirstRollouts
from orchestrator.loop.prompts import PromptCycle
from stand_ins import ListLogger, MemoryStore, RecordingTrainer, SimReplica, SimRollouts, make_sample
from workers.core.types import RolloutResult


def failed(i: int, reason: str = "agent_error"):
    return dataclasses.replace(make_sample(i, 0, status="failed"), error=f"{reason}: KeyError: '_rollout'")


def test_first_rollouts_all_failing_for_one_contract_reason_stop_the_run_naming_the_contract():
    check = FirstRollouts(4, "http")
    assert check.observe([failed(0), failed(1), failed(2)]) is None  # not decided yet
    why = check.observe([failed(3), failed(4)])
    assert why.startswith("the first 4 rollouts all failed agent_error: does the agent speak rollout.contract=http?")
    assert "needs rollout.contract=s3" in why and "KeyError" in why
    assert check.observe([failed(5)]) is None  # said once


@pytest.mark.parametrize("batch", [
    [failed(0), make_sample(1, 0), failed(2), failed(3), failed(4)],  # one completed: the agent works
    [failed(0, "timeout"), failed(1, "timeout"), failed(2, "timeout"), failed(3, "timeout")],  # not the contract
    [failed(0), failed(1, "bad_result"), failed(2), failed(3)],  # two reasons: faults, not one mismatch
])
def test_a_working_agent_or_our_own_faults_never_stop_the_run_here(batch):
    check = FirstRollouts(4, "s3")
    assert check.observe(batch) is None
    assert check.observe([failed(9) for _ in range(8)]) is None  # decided: later failures are not its business


class FailingRollouts(SimRollouts):
    """Every rollout fails as an agent on the other contract would."""

    async def run_all(self, reqs, partition):
        self.dispatched += len(reqs)
        await asyncio.sleep(0.001)
        out = [dataclasses.replace(make_sample(r.group_id, r.sample_index, status="failed"),
                                   session_id=f"s{r.group_id}-{r.sample_index}", input_id=r.input_id,
                                   error="agent_error: RuntimeClientError: the agent raised") for r in reqs]
        await self.store.put(out, partition)
        return [RolloutResult(s.info()) for s in out]


async def test_the_async_loop_stops_with_the_message_and_every_rollout_accounted_for():
    store, engine = MemoryStore(), SimReplica(0)
    rows = [{"input_id": f"p{i}", "prompt": "x"} for i in range(50)]
    parts = LoopParts(prompts=PromptCycle(rows, seed=0), rollouts=FailingRollouts(store, engine, random.Random(0), None),
                      store=store, trainer=RecordingTrainer(engine, store), weights=engine, logger=ListLogger(),
                      ledger=RolloutLedger(), first_rollouts=FirstRollouts(8, "http"))
    settings = AsyncLoopSettings(total_steps=50, groups_per_update=2, n=4, sync_every=1, max_staleness=1,
                                 on_stale="drop", filter_zero_variance=True, drain_timeout_s=1)
    report = await asyncio.wait_for(run_async(parts, settings), timeout=30)
    assert report.steps == 0 and "rollout.contract=http" in report.stopped
    c = report.counts
    assert c["rollout/dispatched"] == c["rollout/failed"] + c["rollout/expired"] + c["rollout/completed"] + c["rollout/filtered"]
    assert c["rollout/failed"] >= 8 and c["rollout/dispatched"] <= 8 * 4  # stopped within the admission window


async def test_the_sync_loop_names_the_contract_instead_of_a_bare_all_failed():
    from orchestrator.loop.sync_loop import SyncLoopSettings, run_sync

    store, engine = MemoryStore(), SimReplica(0)
    rows = [{"input_id": f"p{i}", "prompt": "x"} for i in range(50)]
    parts = LoopParts(prompts=PromptCycle(rows, seed=0), rollouts=FailingRollouts(store, engine, random.Random(0), None),
                      store=store, trainer=RecordingTrainer(engine, store), weights=engine, logger=ListLogger(),
                      ledger=RolloutLedger(), first_rollouts=FirstRollouts(8, "s3"))
    report = await asyncio.wait_for(run_sync(parts, SyncLoopSettings(total_steps=5, batch_size=2, n=4, sync_every=1,
                                                                     filter_zero_variance=True)), timeout=30)
    assert report.steps == 1 and "does the agent speak rollout.contract=s3?" in report.stopped
    assert report.counts["rollout/failed"] == report.counts["rollout/dispatched"] == 8
