"""The sync loop we ship, driven with simulated parts at its seams (no models, no Ray)."""

import dataclasses
import math
import re

import pytest

from orchestrator.loop.batching import RolloutLedger
from orchestrator.loop.common import LoopParts
from orchestrator.loop.sync_loop import SyncLoopSettings, run_sync
from orchestrator.loop.prompts import PromptCycle
from orchestrator.loop.batching import train_order
from workers.trainer.train_batch import build_train_batch, order_batch
from stand_ins import ListLogger, MemoryStore, SimReplica
from workers.core.types import OrderData, RolloutResult, Sample, TrajectoryRow


class SimRollouts:
    """Each rollout: reward = index-dependent; every 5th rollout fails (no reward, tokens captured)."""

    def __init__(self, store, versions):
        self.store, self.versions, self.count = store, versions, 0

    async def run_all(self, reqs, partition):
        out = []
        for r in reqs:
            self.count += 1
            v = self.versions[-1]
            row = TrajectoryRow((1, 2, 3, 4), (0, 0, 1, 1), (0.0, 0.0, -0.3, -0.2), (-1, -1, v, v))
            failed = self.count % 5 == 0
            s = Sample(f"sess-{r.group_id}-{r.sample_index}", r.group_id, r.input_id, r.sample_index, (row,),
                       None if failed else float(r.sample_index % 2), "failed" if failed else "completed", 0.01)
            out.append(s)
        await self.store.put(out, partition)
        return [RolloutResult(s.info()) for s in out]


class RecordingTrainer:
    """Reads each order's rows from the store as a rank does and builds the real batch."""

    def __init__(self, store):
        self.store, self.updates = store, []

    async def update(self, order):
        samples = [self.store.sample(order.partition, s.session_id) for s in order.samples]
        assert all(s.status == "completed" for s in samples)
        self.updates.append(order)
        rows = self.store.read_rows(order.partition, [k for s in order.samples for k in s.row_keys])
        batch = order_batch(order, rows, OrderData())
        return {"actor/num_tokens": float(batch.num_loss_tokens), "rollout_corr/rollout_is_mean": 1.0}


class RecordingPush(SimReplica):
    """A weight sync recording every version it was asked for."""

    def __init__(self):
        super().__init__(0)
        self.versions = [0]

    async def sync(self, version):
        await super().sync(version)
        self.versions.append(version)


@pytest.mark.parametrize("sync_every", [1, 2, 4])
async def test_sync_loop_closes_every_rollout_and_bumps_version_once_per_step(sync_every):
    store, push, logger = MemoryStore(), RecordingPush(), ListLogger()
    trainer = RecordingTrainer(store)
    rows = [{"input_id": f"p{i}", "prompt": "x"} for i in range(10)]
    parts = LoopParts(prompts=PromptCycle(rows, seed=0), rollouts=SimRollouts(store, push.versions),
                          store=store, trainer=trainer, weights=push, logger=logger, ledger=RolloutLedger())
    report = await run_sync(parts, SyncLoopSettings(total_steps=3, batch_size=4, n=4, sync_every=sync_every,
                                                    filter_zero_variance=True))
    c = report.counts
    assert c["rollout/dispatched"] == 3 * 4 * 4
    assert c["rollout/dispatched"] == c["rollout/completed"] + c["rollout/failed"] + c["rollout/filtered"]
    assert c["rollout/failed"] == 48 // 5  # every 5th rollout failed
    assert push.versions == [0, 1, 2, 3] and report.policy_version == 3
    assert len(trainer.updates) == 3 * sync_every  # sync_every mini-batches per step
    assert store.cleared == ["step-1", "step-2", "step-3"] and not store.partitions
    assert [s for s, _ in logger.steps] == [1, 2, 3]
    m = logger.steps[-1][1]
    for key in ("reward/mean", "perf/throughput", "timing_s/gen", "timing_s/update_actor",
                "timing_s/update_weights", "rollout/completed", "rollout/failed", "rollout_corr/is_mean"):
        assert key in m and not math.isnan(m[key]), key


async def test_sync_loop_raises_when_the_pool_loses_a_result():
    """The pool's results are the loop's only account of its rollouts: one missing is an error, not a
    smaller batch."""
    class LossyRollouts(SimRollouts):
        async def run_all(self, reqs, partition):
            return (await super().run_all(reqs, partition))[1:]

    store, push = MemoryStore(), RecordingPush()
    parts = LoopParts(prompts=PromptCycle([{"input_id": "p", "prompt": "x"}], seed=0),
                          rollouts=LossyRollouts(store, push.versions), store=store, trainer=RecordingTrainer(store),
                          weights=push, logger=ListLogger())
    with pytest.raises(RuntimeError, match="returned 3 results for 4 requests"):
        await run_sync(parts, SyncLoopSettings(total_steps=1, batch_size=1, n=4, sync_every=1,
                                               filter_zero_variance=True))


def test_prompt_cycle_is_seeded_and_covers_each_epoch():
    rows = [{"input_id": str(i)} for i in range(7)]
    a, b = PromptCycle(rows, seed=3), PromptCycle(rows, seed=3)
    first = a.next_rows(7)
    assert sorted(r["input_id"] for r in first) == sorted(r["input_id"] for r in rows)
    assert [r["input_id"] for r in b.next_rows(7)] == [r["input_id"] for r in first]


def test_train_batch_gives_each_row_its_sample_advantage():
    from orchestrator.loop.batching import assemble

    row = TrajectoryRow((1, 2, 3), (0, 1, 1), (0.0, -1.0, -1.0), (-1, 0, 0))
    samples = [Sample(f"s{i}", 0, "in", i, (row, row) if i == 0 else (row,), float(i), "completed", 0.0)
               for i in range(2)]
    [group] = assemble([s.info() for s in samples], filter_zero_variance=True).trainable
    order = train_order("p", (group,))
    batch = order_batch(order, [samples[0].rows[0], row, row], OrderData(norm_adv_by_std=False))
    assert order.num_rows == 3
    assert build_train_batch(samples, pad_id=0, norm_adv_by_std=False).advantages.tolist() == batch.advantages.tolist()
    # rewards 0 and 1: advantages -0.5, +0.5; sample 0 has two rows
    assert batch.batch_size == 3
    assert batch.advantages[:, 1].tolist() == [-0.5, -0.5, 0.5]


async def test_a_step_where_every_rollout_failed_stops_the_run():
    """Regression (new-user report): with ACR unreachable every rollout failed and the run still
    'succeeded' with nothing trained. A step with no usable sample now stops the run."""
    store, push, logger = MemoryStore(), RecordingPush(), ListLogger()
    trainer = RecordingTrainer(store)
    class AllFail(SimRollouts):
        async def run_all(self, reqs, partition):
            out = [Sample(f"sess-{r.group_id}-{r.sample_index}", r.group_id, r.input_id, r.sample_index, (), None,
                          "failed", 0.01, error="transport: could not connect") for r in reqs]
            await self.store.put(out, partition)
            return [RolloutResult(s.info()) for s in out]

    rows = [{"input_id": f"p{i}", "prompt": "x"} for i in range(10)]
    parts = LoopParts(prompts=PromptCycle(rows, seed=0), rollouts=AllFail(store, push.versions), store=store,
                          trainer=trainer, weights=push, logger=logger, ledger=RolloutLedger())
    report = await run_sync(parts, SyncLoopSettings(total_steps=3, batch_size=2, n=4, sync_every=1,
                                                    filter_zero_variance=True))
    # issue 29: it ends like any other run (a report, summary.json, `run failed:` from main), not a traceback
    assert report.stopped is not None and re.search("step 1: all 8 rollouts failed .*could not connect", report.stopped)
    assert report.steps == 1 and report.counts["rollout/failed"] == 8 and not parts.ledger.open_rollouts()
    assert [step for step, _ in logger.steps] == [1]  # the failed step is logged: the report shows it
    assert not trainer.updates and push.versions == [0]


async def test_a_step_with_nothing_to_train_neither_syncs_nor_advances_the_version():
    """Regression (new-user report): with a reward that never varies every group was filtered, yet
    each step pushed weights, bumped the policy version and logged is_mean=nan."""
    store, push, logger = MemoryStore(), RecordingPush(), ListLogger()
    trainer = RecordingTrainer(store)

    class SameReward(SimRollouts):
        async def run_all(self, reqs, partition):
            row = TrajectoryRow((1, 2, 3, 4), (0, 0, 1, 1), (0.0, 0.0, -0.3, -0.2), (-1, -1, 0, 0))
            out = [Sample(f"sess-{r.group_id}-{r.sample_index}", r.group_id, r.input_id, r.sample_index, (row,), 1.0,
                          "completed", 0.01) for r in reqs]
            await self.store.put(out, partition)
            return [RolloutResult(s.info()) for s in out]

    rows = [{"input_id": f"p{i}", "prompt": "x"} for i in range(10)]
    parts = LoopParts(prompts=PromptCycle(rows, seed=0), rollouts=SameReward(store, push.versions), store=store,
                      trainer=trainer, weights=push, logger=logger, ledger=RolloutLedger())
    report = await run_sync(parts, SyncLoopSettings(total_steps=2, batch_size=2, n=4, sync_every=1,
                                                    filter_zero_variance=True))
    assert not trainer.updates and push.versions == [0] and report.policy_version == 0
    assert report.counts["rollout/filtered"] == 16 and report.counts.get("rollout/trained_groups", 0) == 0
    assert [m["policy_version"] for _, m in logger.steps] == [0.0, 0.0]


def test_total_num_tokens_counts_every_token_of_the_trained_rows_and_sums_over_mini_batches():
    """verl's perf/total_num_tokens: prompt and generated tokens of the rows that train (what the
    ranks read: the order's rows); a masked sample trains nothing, has no row read and is not
    counted, nor is a row without a generated token; a step's count is the sum of its mini-batches'
    (a per-token metric is their mean)."""
    from orchestrator.loop.batching import Group
    from orchestrator.loop.common import mean_update_metrics

    trained = TrajectoryRow((1, 2, 3, 4, 5), (0, 0, 1, 1, 1), (0.0, 0.0, -0.1, -0.1, -0.1), (-1, -1, 0, 0, 0))
    turn2 = TrajectoryRow((1, 2, 3), (0, 1, 1), (0.0, -0.1, -0.1), (-1, 0, 0))
    prompt_only = TrajectoryRow((1, 2, 3, 4), (0, 0, 0, 0), (0.0, 0.0, 0.0, 0.0), (-1, -1, -1, -1))
    groups = (Group(0, (Sample("a", 0, "p", 0, (trained, turn2, prompt_only), 1.0, "completed", 0.0).info(),
                        Sample("b", 0, "p", 1, (trained,), 0.0, "completed", 0.0).info())),
              Group(1, (Sample("c", 1, "q", 0, (turn2,), 0.5, "completed", 0.0).info(),)))
    order = train_order("step-1", groups, masked={"b"})
    assert order.num_tokens == 5 + 3 + 3 and order.num_rows == 3 and order.masked == ("b",)
    assert [s.row_keys for s in order.samples] == [("a/0", "a/1"), (), ("c/0",)]
    m = mean_update_metrics([{"perf/total_num_tokens": 11.0, "actor/num_tokens": 7.0, "actor/pg_loss": 1.0},
                             {"perf/total_num_tokens": 5.0, "actor/num_tokens": 2.0, "actor/pg_loss": 3.0}])
    assert m == {"perf/total_num_tokens": 16.0, "actor/num_tokens": 9.0, "actor/pg_loss": 2.0}


async def test_buffer_store_clears_by_the_keys_results_carry_and_driver_bytes_count_all_received():
    """The driver's store frees samples by the keys their results carry (a sample without rows by its
    placeholder key), never listing a partition; the driver's bytes are what its Ray and TQ clients
    received (each answer's pickled size), per rollout the pools returned, reset once taken."""
    from orchestrator.adapters.clients import BufferStore, DriverBytes, MeteredRollouts
    from stand_ins import make_sample

    class Buffer:
        def __init__(self):
            self.cleared = []

        async def clear_keys(self, partition, keys):
            self.cleared.append((partition, list(keys)))

        async def sample_infos(self, *a):
            raise AssertionError("the loops never list the buffer")

    buffer = Buffer()
    two_rows = make_sample(0, 0, 1.0)
    two_rows = dataclasses.replace(two_rows, rows=two_rows.rows * 2)
    empty = dataclasses.replace(make_sample(0, 1, None, status="failed"), rows=())
    await BufferStore(buffer).clear_samples("async", [two_rows.info(), empty.info()])
    assert buffer.cleared == [("async", [f"{two_rows.session_id}/0", f"{two_rows.session_id}/1",
                                          f"{empty.session_id}/empty"])]

    results = [RolloutResult(make_sample(0, i, float(i % 2)).info()) for i in range(6)]

    class Pool:
        async def run_all(self, reqs, partition):
            return results

    meter = DriverBytes()
    assert await MeteredRollouts(Pool(), meter).run_all(list(range(6)), "step-1") == results
    meter.ray.add(results)  # what the Ray client meters (workers/core/calls.py), here by hand
    meter.buffer.add({"answer": "meta"})
    m = await meter()
    assert m["driver/rollouts_returned"] == 6 and 0 < m["driver/bytes_from_ray"] <= 1024 * 6
    assert m["driver/bytes_per_rollout"] == pytest.approx((m["driver/bytes_from_ray"] + m["driver/bytes_from_buffer"]) / 6)
    assert (await meter())["driver/bytes_from_ray"] == 0.0  # per step: reset once taken


async def test_trainer_client_skips_an_order_with_no_row_and_hands_on_the_others():
    """An order whose samples are all masked trains nothing: no trainer call, a skipped step; any
    other order reaches the trainer as it is (the ranks got the buffer, pad id and advantage setting
    once at start: `open_data`)."""
    from orchestrator.adapters.clients import TrainerClient
    from workers.core.types import OrderSample, TrainOrder

    class Trainer:
        def __init__(self):
            self.orders = []

        async def update(self, order):
            self.orders.append(order)
            return {"actor/num_tokens": 5.0}

    trainer = Trainer()
    client = TrainerClient(trainer)
    masked = TrainOrder("async", (OrderSample("a", 0, 1.0), OrderSample("b", 0, 0.0)), masked=("a", "b"))
    assert (await client.update(masked))["actor/step_skipped"] == 1.0 and not trainer.orders
    order = TrainOrder("async", (OrderSample("a", 0, 1.0, ("a/0",), (4,)), OrderSample("b", 0, 0.0, ("b/0",), (3,))))
    assert (await client.update(order))["trainer/rows_ordered"] == 2.0
    assert trainer.orders == [order]
