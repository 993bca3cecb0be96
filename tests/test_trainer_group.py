"""Data-parallel trainer ranks driven as one trainer: sharding (pure) and a real 2-rank gloo group.

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
from workers.core.algorithms.batch import SampleTable, TrainBatch
from workers.trainer.group import TrainerGroup, start_trainer_ranks
from workers.trainer.shard import assign_rows, merge_rank_metrics, shard_batch
from workers.core.types import TrajectoryRow
from workers.trainer.scale import plan_micro_batches, split_to_count


def grouped_batch(group_rows: list[list[list[int]]], *, vocab: int = 100, seed: int = 0,
                  rewards: list[list[float]] | None = None) -> TrainBatch:
    """group_rows[g][s] = generated-token counts of the rows of sample s of group g (prompt 3 tokens
    each); rollout log-probs random; advantages from +-1 per sample; a SampleTable over it all."""
    gen = torch.Generator().manual_seed(seed)
    rows, adv, row_sample, group_index, rew = [], [], [], [], []
    for g, samples in enumerate(group_rows):
        for s, gens in enumerate(samples):
            sample = len(group_index)
            r = rewards[g][s] if rewards else float((s + g) % 2)
            group_index.append(g)
            rew.append(r)
            for n in gens:
                ids = torch.randint(1, vocab, (3 + n,), generator=gen).tolist()
                lps = (torch.rand(3 + n, generator=gen) * -3.0).tolist()
                rows.append(TrajectoryRow(token_ids=tuple(ids), loss_mask=(0,) * 3 + (1,) * n,
                                          rollout_logprobs=tuple(0.0 if t < 3 else lps[t] for t in range(3 + n)),
                                          versions=(-1,) * 3 + (0,) * n))
                adv.append(r - 0.5)
                row_sample.append(sample)
    table = SampleTable(group_index=torch.tensor(group_index), rewards=torch.tensor(rew),
                        row_sample=torch.tensor(row_sample))
    return TrainBatch.from_rows(rows, adv, pad_id=0, samples=table)


def _groups_of(shard: TrainBatch) -> set[int]:
    t = shard.samples
    trained = shard.loss_mask.sum(-1) > 0
    return {int(t.group_index[s]) for s, on in zip(t.row_sample.tolist(), trained.tolist()) if on}


# --- sharding (pure) ------------------------------------------------------------------------


def test_shards_hold_whole_groups_every_row_once_and_balanced_tokens():
    sizes = [[[4], [9]], [[20], [2, 3]], [[5], [5]], [[30], [1]], [[7], [8]], [[3], [6]]]
    batch = grouped_batch(sizes)
    rows = assign_rows(batch, 2)
    assert sorted(i for r in rows for i in r) == list(range(batch.batch_size))
    shards = shard_batch(batch, 2, micro_batch_size=2)
    groups = [_groups_of(s) for s in shards]
    assert groups[0].isdisjoint(groups[1]) and groups[0] | groups[1] == set(range(len(sizes)))
    tokens = [int(s.attention_mask.sum()) for s in shards]
    total = int(batch.attention_mask.sum())
    assert sum(tokens) == total
    assert abs(tokens[0] - tokens[1]) < 0.25 * total
    # every row arrives unchanged, with its group's rewards in the shard's own table
    for shard, idx in zip(shards, rows):
        torch.testing.assert_close(shard.input_ids[:, :batch.seq_len], batch.input_ids[idx])
        torch.testing.assert_close(shard.advantages, batch.advantages[idx])
        t = shard.samples
        assert t.row_sample.tolist() == sorted(t.row_sample.tolist())
        for r_local, r_global in enumerate(idx):
            s_global = int(batch.samples.row_sample[r_global])
            s_local = int(t.row_sample[r_local])
            assert float(t.rewards[s_local]) == float(batch.samples.rewards[s_global])
            assert int(t.group_index[s_local]) == int(batch.samples.group_index[s_global])
        for g in _groups_of(shard):  # the whole group's samples, nothing else of that group elsewhere
            assert int((t.group_index == g).sum()) == int((batch.samples.group_index == g).sum())


def test_shards_get_equal_micro_batch_counts_by_padding_rows_without_tokens():
    # one group of 1-row samples vs one group of 8 rows: the small rank must run as many micro-batches
    batch = grouped_batch([[[2], [3]], [[9, 8, 7, 6], [5, 4, 3, 2]]])
    shards = shard_batch(batch, 2, micro_batch_size=2)
    counts = [len(plan_micro_batches(s.attention_mask.sum(-1).tolist(), micro_batch_size=2, max_tokens=None))
              for s in shards]
    target = max(counts)
    for s, c in zip(shards, counts):  # what TrainerWorker.micro_batches does: split up to the max count
        assert len(split_to_count(plan_micro_batches(s.attention_mask.sum(-1).tolist(), micro_batch_size=2,
                                                     max_tokens=None), target)) == target
    small = min(shards, key=lambda s: s.num_loss_tokens)
    assert small.batch_size == target == 4
    pad = small.loss_mask.sum(-1) == 0
    assert int(pad.sum()) == 2 and small.attention_mask[pad].sum(-1).tolist() == [1, 1]
    assert sum(s.num_loss_tokens for s in shards) == batch.num_loss_tokens
    pad_samples = set(small.samples.row_sample[pad].tolist())
    assert len(pad_samples) == 1  # padding rows sit in a sample of a fresh group, alone
    (ps,) = pad_samples
    assert int((small.samples.group_index == small.samples.group_index[ps]).sum()) == 1
    # with a token budget the counts are matched the same way
    budget = shard_batch(batch, 2, micro_batch_size=1, max_tokens_per_micro_batch=24)
    assert sum(s.num_loss_tokens for s in budget) == batch.num_loss_tokens


def test_fewer_groups_than_ranks_splits_by_sample_and_too_few_rows_raise():
    batch = grouped_batch([[[3], [4], [5], [6]]])
    shards = shard_batch(batch, 2, micro_batch_size=4)
    assert all(s.num_loss_tokens > 0 for s in shards)
    for s in shards:  # each rank still sees the whole group's rewards
        assert s.samples.num_samples >= 4
    with pytest.raises(ValueError, match="fewer than the 5 trainer ranks"):
        shard_batch(batch, 5, micro_batch_size=4)
    assert shard_batch(batch, 1, micro_batch_size=4)[0] is batch


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
    from workers.embedded.tiny_model import ensure_tiny_model
    from workers.trainer.worker import TrainerSettings, TrainerWorker

    model = str(ensure_tiny_model())
    settings = TrainerSettings(model_path=model, lr=1e-3, weight_decay=0.0, micro_batch_size=2, seed=0,
                               device="cpu")
    batch = grouped_batch([[[5], [9]], [[12], [3, 4]], [[7], [2]]], vocab=200, seed=1)

    one = TrainerWorker(settings)
    try:
        m_one = one.update(batch)
        sd_one = one.full_state_dict()
    finally:
        one.close()

    from workers.core.placement import PlacementSpec, plan_placement
    from workers.placement_groups import PlacedGroups

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
            assert await group.__ray_call__.remote(lambda w: w.rank) == 0  # runs inside rank 0
            m = await group.update.remote(batch)  # the actor-handle spelling TrainerClient uses
            sd = await group.full_state_dict()
            path = await group.save_optimizer.remote(str(tmp_path / "optim.pt"))
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
