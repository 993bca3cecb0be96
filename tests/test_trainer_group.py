"""Data-parallel trainer ranks driven as one trainer: sharding an order (pure) and a real 2-rank gloo group.

The parity test runs two TrainerWorker ranks as Ray actors through `TrainerGroup` and one
TrainerWorker (world size 1) in this process on the whole batch: one update must give the same
weights, loss, token count and grad norm.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from stand_ins import own_ray
from workers.core.algorithms.batch import TrainBatch
from workers.core.types import OrderData, Sample, TrainOrder, TrajectoryRow
from workers.trainer.group import TrainerGroup, start_trainer_ranks
from workers.trainer.order import merge_rank_metrics, shard_order
from workers.trainer.scale import plan_micro_batches, split_to_count
from workers.trainer.train_batch import build_train_batch, order_batch, sample_order


def grouped_samples(group_rows: list[list[list[int]]], *, vocab: int = 100, seed: int = 0,
                    rewards: list[list[float]] | None = None) -> list[Sample]:
    """group_rows[g][s] = generated-token counts of the rows of sample s of group g (prompt 3 tokens
    each); rollout log-probs random; reward (s + g) % 2 unless given."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for g, sizes in enumerate(group_rows):
        for s, gens in enumerate(sizes):
            rows = []
            for n in gens:
                ids = torch.randint(1, vocab, (3 + n,), generator=gen).tolist()
                lps = (torch.rand(3 + n, generator=gen) * -3.0).tolist()
                rows.append(TrajectoryRow(token_ids=tuple(ids), loss_mask=(0,) * 3 + (1,) * n,
                                          rollout_logprobs=tuple(0.0 if t < 3 else lps[t] for t in range(3 + n)),
                                          versions=(-1,) * 3 + (0,) * n))
            r = rewards[g][s] if rewards else float((s + g) % 2)
            samples.append(Sample(f"g{g}-s{s}", g, f"in-{g}", s, tuple(rows), r, "completed", 0.0))
    return samples


def rank_batches(samples: list[Sample], world_size: int, **kw) -> tuple[TrainBatch, list[TrainOrder], list[TrainBatch]]:
    """The whole batch, each rank's shard of the order, and the batch each rank builds from the rows it
    reads (by key, as from the buffer)."""
    order, _ = sample_order(samples)
    by_key = {k: r for s in samples for k, r in zip(s.info().row_keys, s.rows)}
    shards = shard_order(order, world_size, **kw)
    return (build_train_batch(samples, pad_id=0, norm_adv_by_std=True), shards,
            [order_batch(sh, [by_key[k] for s in sh.samples for k in s.row_keys], OrderData()) for sh in shards])


def _groups_read(shard: TrainOrder) -> set[int]:
    return {s.group_id for s in shard.samples if s.row_keys}


# --- sharding an order (pure) ------------------------------------------------------------------


def test_shards_hold_whole_groups_every_row_once_and_balanced_tokens():
    sizes = [[[4], [9]], [[20], [2, 3]], [[5], [5]], [[30], [1]], [[7], [8]], [[3], [6]]]
    samples = grouped_samples(sizes)
    whole, shards, batches = rank_batches(samples, 2, micro_batch_size=2)
    keys = [k for sh in shards for s in sh.samples for k in s.row_keys]
    assert sorted(keys) == sorted(k for s in samples for k in s.info().row_keys)  # every row read once
    groups = [_groups_read(sh) for sh in shards]
    assert groups[0].isdisjoint(groups[1]) and groups[0] | groups[1] == set(range(len(sizes)))
    tokens = [sh.num_tokens for sh in shards]
    total = int(whole.attention_mask.sum())
    assert sum(tokens) == total and sum(int(b.attention_mask.sum()) for b in batches) == total  # no padding needed
    assert abs(tokens[0] - tokens[1]) < 0.25 * total
    # every row arrives with the advantage the whole batch gives it, its group's samples in the shard
    whole_adv = {k: float(whole.advantages[i].max() + whole.advantages[i].min())
                 for i, k in enumerate(k for s in samples for k in s.info().row_keys)}
    for sh, b in zip(shards, batches):
        row_keys = [k for s in sh.samples for k in s.row_keys]
        assert [float(b.advantages[i].max() + b.advantages[i].min()) for i in range(len(row_keys))] == \
            pytest.approx([whole_adv[k] for k in row_keys])
        for g in _groups_read(sh):  # the whole group's samples, with their rewards
            assert [s.reward for s in sh.samples if s.group_id == g] == [s.reward for s in samples if s.group_id == g]


def test_shards_get_equal_micro_batch_counts_by_padding_rows_without_tokens():
    # one group of 1-row samples vs one group of 8 rows: the small rank must run as many micro-batches
    samples = grouped_samples([[[2], [3]], [[9, 8, 7, 6], [5, 4, 3, 2]]])
    whole, shards, batches = rank_batches(samples, 2, micro_batch_size=2)
    counts = [len(plan_micro_batches(b.attention_mask.sum(-1).tolist(), micro_batch_size=2, max_tokens=None))
              for b in batches]
    target = max(counts)
    for b in batches:  # what TrainerWorker.micro_batches does: split up to the max count
        assert len(split_to_count(plan_micro_batches(b.attention_mask.sum(-1).tolist(), micro_batch_size=2,
                                                     max_tokens=None), target)) == target
    small = min(batches, key=lambda b: b.num_loss_tokens)
    assert small.batch_size == target == 4 and sorted(sh.pad_rows for sh in shards) == [0, 2]
    pad = small.loss_mask.sum(-1) == 0
    assert int(pad.sum()) == 2 and small.attention_mask[pad].sum(-1).tolist() == [1, 1]
    assert sum(b.num_loss_tokens for b in batches) == whole.num_loss_tokens
    pad_samples = set(small.samples.row_sample[pad].tolist())
    assert len(pad_samples) == 1  # padding rows sit in a sample of a fresh group, alone
    (ps,) = pad_samples
    assert int((small.samples.group_index == small.samples.group_index[ps]).sum()) == 1
    # with a token budget the counts are matched the same way
    _, _, budget = rank_batches(samples, 2, micro_batch_size=1, max_tokens_per_micro_batch=24)
    assert sum(b.num_loss_tokens for b in budget) == whole.num_loss_tokens


def test_fewer_groups_than_ranks_splits_by_sample_and_too_few_rows_raise():
    samples = grouped_samples([[[3], [4], [5], [6]]])
    _, shards, batches = rank_batches(samples, 2, micro_batch_size=4)
    assert all(b.num_loss_tokens > 0 for b in batches)
    for sh in shards:  # each rank still sees the whole group's rewards, reads only its rows
        assert len(sh.samples) == 4 and 0 < sh.num_rows < 4
    order, _ = sample_order(samples)
    with pytest.raises(ValueError, match="fewer than the 5 trainer ranks"):
        shard_order(order, 5, micro_batch_size=4)
    assert shard_order(order, 1, micro_batch_size=4) == [order]


@pytest.mark.parametrize("seed", range(20))
def test_random_orders_shard_into_every_key_once_masked_samples_nowhere(seed):
    """Seeded random orders (groups, samples, rows; some samples masked) over 1-4 ranks: every key
    read by exactly one rank, a masked sample's by none, every shard's masked list its own masked
    samples; whole groups per rank whenever there are at least as many groups as ranks."""
    import random

    rng = random.Random(seed)
    sizes = [[[rng.randint(1, 9) for _ in range(rng.randint(1, 3))] for _ in range(rng.randint(2, 4))]
             for _ in range(rng.randint(1, 5))]
    samples = grouped_samples(sizes, seed=seed)
    masked = [s.session_id for s in samples if rng.random() < 0.2]
    order, _ = sample_order(samples, masked=masked)
    world = rng.randint(1, 4)
    if order.num_rows < world:
        with pytest.raises(ValueError):
            shard_order(order, world, micro_batch_size=2)
        return
    shards = shard_order(order, world, micro_batch_size=2)
    read = [k for sh in shards for s in sh.samples for k in s.row_keys]
    want = [k for s in samples if s.session_id not in masked for k in s.info().row_keys]
    assert sorted(read) == sorted(want) and len(read) == len(set(read))
    for sh in shards:
        assert set(sh.masked) == {s.session_id for s in sh.samples} & set(masked)
    if len({s.group_id for s in order.samples if s.row_keys}) >= world:
        seen = [_groups_read(sh) for sh in shards]
        assert sum(len(g) for g in seen) == len(set().union(*seen))


def test_merge_rank_metrics_rules():
    a = {"actor/pg_loss": 0.5, "actor/num_tokens": 30.0, "actor/ppo_kl": 0.1, "rollout_corr/rollout_is_max": 2.0,
         "rollout_corr/rollout_is_min": 0.5, "rollout_corr/rs_recomputed_groups": 1.0}
    b = {"actor/pg_loss": 0.5, "actor/num_tokens": 30.0, "actor/ppo_kl": 0.4, "rollout_corr/rollout_is_max": 3.0,
         "rollout_corr/rollout_is_min": 0.2, "rollout_corr/rs_recomputed_groups": 2.0}
    m = merge_rank_metrics([a, b], [10.0, 20.0])
    assert m["actor/pg_loss"] == 0.5 and m["actor/num_tokens"] == 30.0
    assert m["actor/ppo_kl"] == pytest.approx(0.3)
    assert m["rollout_corr/rollout_is_max"] == 3.0 and m["rollout_corr/rollout_is_min"] == 0.2
    assert m["rollout_corr/rs_recomputed_groups"] == 3.0


def test_both_trainers_and_the_group_implement_the_one_trainer_protocol():
    """TrainerWorker, VerlTrainerWorker and TrainerGroup answer every `Trainer` method with the same
    parameters (the group's answers are awaitable), so the driver treats them alike."""
    import inspect

    from workers.trainer.protocol import TRAINER_METHODS, Trainer
    from workers.trainer.verl_worker import VerlTrainerWorker
    from workers.trainer.worker import TrainerWorker

    def params(cls: type, name: str) -> list[str]:
        fn = getattr(cls, name)
        # Ray's tracing hook adds `_ray_trace_ctx` to a class's methods in place once any test made it
        # an actor class (ray.remote(TrainerWorker)): not part of the protocol
        return [p for p in inspect.signature(getattr(fn, "_fn", fn)).parameters if p != "_ray_trace_ctx"]

    assert set(TRAINER_METHODS) == {n for n in vars(Trainer) if not n.startswith("_")}
    for name in TRAINER_METHODS:
        expected = params(Trainer, name)
        for cls in (TrainerWorker, VerlTrainerWorker, TrainerGroup):
            assert params(cls, name) == expected, (cls.__name__, name)


def test_rendezvous_store_stays_bound_from_host_to_release():
    """Regression: the port of a rendezvous used to be found by bind, close and reuse, so another
    process could take it in between. A hosted store keeps its port bound until released: binding
    it again fails, and a client joins it at once."""
    import socket

    from workers.weight_sync.rendezvous import StoreAddress, host_store, join_store, release_store

    address = host_store("127.0.0.1")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s, pytest.raises(OSError):
            s.bind(("127.0.0.1", address.port))
        assert StoreAddress.parse(address.url) == address
        a, b = join_store(address, timeout_s=5.0), join_store(address, timeout_s=5.0)
        assert a is not b  # one client per join, also in the hosting process
        a.set("k", "v")
        assert b.get("k") == b"v"
    finally:
        release_store(address)
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        StoreAddress.parse("127.0.0.1:80")


# --- two real ranks (gloo, Ray actors) == one rank ---------------------------------------------


@pytest.fixture(scope="module")
def ray_local():
    with own_ray(num_gpus=3) as ray:  # logical GPUs
        yield ray


def test_two_rank_group_update_equals_one_rank_on_the_whole_batch(ray_local, tmp_path):
    """The ranks read their own rows from a real trajectory buffer (TransferQueue), each key once:
    the update equals one rank's on the whole batch built from the same samples."""
    from workers.buffer.store import BufferConfig, TrajectoryBuffer
    from workers.embedded.tiny_model import ensure_tiny_model
    from workers.trainer.worker import TrainerSettings, TrainerWorker

    model = str(ensure_tiny_model())
    settings = TrainerSettings(model_path=model, lr=1e-3, weight_decay=0.0, micro_batch_size=2, seed=0,
                               device="cpu")
    samples = grouped_samples([[[5], [9]], [[12], [3, 4]], [[7], [2]]], vocab=200, seed=1)
    batch = build_train_batch(samples, pad_id=0, norm_adv_by_std=True)

    one = TrainerWorker(settings)
    try:
        m_one = one.train_batch(batch)
        sd_one = one.full_state_dict()
    finally:
        one.close()

    from workers.core.placement import PlacementSpec, plan_placement
    from orchestrator.wiring.placement_groups import PlacedGroups

    buffer = TrajectoryBuffer.start(BufferConfig())
    buffer.put_sync(samples, "step-1")
    order = sample_order(samples, partition="step-1")[0]
    threads = {"runtime_env": {"env_vars": {"OMP_NUM_THREADS": "1"}}}
    cls = ray_local.remote(num_cpus=0)(TrainerWorker)
    # as main.py: ranks in their placement-group bundles; this process serves their rendezvous store
    placed = PlacedGroups.create(plan_placement(PlacementSpec("disaggregated", trainer_gpus_per_node=2,
                                                              inference_replicas=1)))

    async def run_group():
        group = await start_trainer_ranks(cls, settings, world_size=2,
                                          rank_options=lambda r: {**threads, **placed.trainer_options(r)})
        assert isinstance(group, TrainerGroup) and group.world_size == 2
        try:
            gpus = await asyncio.gather(*(r.__ray_call__.remote(lambda w: __import__("os").environ.get(
                "CUDA_VISIBLE_DEVICES")) for r in group.ranks))
            assert len(set(gpus)) == 2 and None not in gpus  # one (logical) GPU per rank
            assert await group.run_on_lead(lambda w: w.rank) == 0  # runs inside rank 0
            assert not hasattr(group.update, "remote")  # one typed adapter: no imitation of a Ray handle
            await group.open_data(OrderData(buffer.handle))  # once: the orders carry only their samples
            m = await group.update(order)
            sd = await group.full_state_dict()
            path = await group.save_optimizer(str(tmp_path / "optim.pt"))
            await group.load_optimizer(path)
            return m, sd
        finally:
            await group.close()
            for r in group.ranks:
                ray_local.kill(r)

    try:
        m_two, sd_two = asyncio.run(run_group())
    finally:
        placed.remove()
        buffer.stop()
    assert m_two["trainer/rows_read"] == order.num_rows == batch.batch_size  # each row once, by one rank
    assert m_two["perf/total_num_tokens"] == order.num_tokens == int(batch.attention_mask.sum())
    assert m_two["actor/num_tokens"] == m_one["actor/num_tokens"] == batch.num_loss_tokens
    assert m_two["actor/pg_loss"] == pytest.approx(m_one["actor/pg_loss"], abs=1e-6)
    assert m_two["actor/grad_norm"] == pytest.approx(m_one["actor/grad_norm"], rel=1e-5)
    assert m_two["actor/ppo_kl"] == pytest.approx(m_one["actor/ppo_kl"], abs=1e-6)
    assert m_two["actor/step_skipped"] == 0.0
    for name, t in sd_one.items():
        torch.testing.assert_close(sd_two[name], t, atol=1e-5, rtol=0)
    assert (tmp_path / "optim.pt").is_file()
    # the step did change the weights (so the parity above is not trivially true)
    from safetensors.torch import load_file

    base = {}
    for f in sorted(Path(model).glob("*.safetensors")):
        base.update(load_file(str(f)))
    moved = max(float((sd_one[k] - base[k]).abs().max()) for k in base if k in sd_one)
    assert moved > 1e-4
