"""Trainer at GPU scale, checked on CPU: token-budget micro-batches (planner and gradient parity with
one big batch), activation checkpointing (same step, layers recomputed), bf16 mixed precision."""

from __future__ import annotations

import random

import pytest
import torch

from stand_ins import random_qwen2
from workers.core.algorithms.batch import TrainBatch
from workers.core.types import TrajectoryRow
from workers.trainer.worker import TrainerSettings, TrainerWorker
from workers.trainer.scale import padded_tokens, plan_micro_batches, split_to_count

VOCAB = 128
NUM_LAYERS = 2


@pytest.fixture(scope="module")
def scale_model(tmp_path_factory) -> str:
    return random_qwen2(tmp_path_factory.mktemp("scale_qwen2"), vocab=VOCAB, num_layers=NUM_LAYERS)


@pytest.fixture
def make_trainer():
    made: list[TrainerWorker] = []

    def build(model_path: str, **overrides) -> TrainerWorker:
        kw = {"lr": 1e-3, "weight_decay": 0.0, "micro_batch_size": 2, "seed": 0} | overrides
        made.append(TrainerWorker(TrainerSettings(model_path=model_path, **kw)))
        return made[-1]

    yield build
    for w in made:
        w.close()


def ragged_batch(num_rows: int = 7, seed: int = 0) -> TrainBatch:
    """Rows of 5..29 tokens (prompt 2..4), stale rollout log-probs so IS weights and clipping act."""
    gen = torch.Generator().manual_seed(seed)
    rows, adv = [], []
    for i in range(num_rows):
        p, g = 2 + i % 3, 3 + (7 * i) % 23
        ids = torch.randint(1, VOCAB, (p + g,), generator=gen).tolist()
        lps = (torch.rand(p + g, generator=gen) * -3.0).tolist()
        rows.append(TrajectoryRow(token_ids=tuple(ids), loss_mask=(0,) * p + (1,) * g,
                                  rollout_logprobs=tuple(0.0 if t < p else lps[t] for t in range(p + g)),
                                  versions=(-1,) * p + (0,) * g))
        adv.append(float(torch.randn(1, generator=gen)))
    return TrainBatch.from_rows(rows, adv, pad_id=0)


# --- planner (pure) --------------------------------------------------------------------------


def test_budget_packs_longest_first_and_long_rows_go_alone():
    # lengths 10, 3, 8, 40, 5 with budget 20: sorted 40 | 10 8 -> 2x10=20 fits, 3x10=30 not | 5 3 -> 2x5
    assert plan_micro_batches([10, 3, 8, 40, 5], micro_batch_size=99, max_tokens=20) == [[3], [0, 2], [4, 1]]
    assert plan_micro_batches([10, 3, 8], micro_batch_size=2, max_tokens=None) == [[0, 1], [2]]


def test_randomized_budget_plans_cover_every_row_once_within_the_budget():
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(1, 64) for _ in range(rng.randint(1, 40))]
        budget = rng.randint(1, 256)
        plan = plan_micro_batches(lengths, micro_batch_size=1, max_tokens=budget)
        assert sorted(i for mb in plan for i in mb) == list(range(len(lengths)))
        for mb, tokens in zip(plan, padded_tokens(lengths, plan)):
            assert tokens <= budget or len(mb) == 1
        target = len(plan) + rng.randint(0, 3)
        if target <= len(lengths):
            split = split_to_count(plan, target)
            assert len(split) == target and sorted(i for mb in split for i in mb) == list(range(len(lengths)))


def test_planner_errors_name_the_problem():
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        plan_micro_batches([3], micro_batch_size=1, max_tokens=0)
    with pytest.raises(ValueError, match="needs 3 micro-batches"):
        split_to_count([[0], [1]], 3)
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        TrainerSettings(model_path="x", max_tokens_per_micro_batch=0)
    with pytest.raises(ValueError, match="mixed_precision"):
        TrainerSettings(model_path="x", mixed_precision="fp8")


# --- real tiny model -------------------------------------------------------------------------


@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_token_budget_micro_batches_give_the_one_big_batch_gradient(scale_model, make_trainer, loss_agg_mode):
    """7 rows with a 40-token budget vs all 7 rows in one forward. Lengths 5 13 21 26 11 19 24
    -> sorted 26 | 24 | 21 | 19 13 (2x19=38) | 11 5 (2x11=22): 5 micro-batches, rows reordered. Same log-probs, loss, grad norm and weights after the
    step to 1e-5 (only float summation order differs)."""
    batch = ragged_batch()
    budget = 40
    results = []
    for kw in ({"micro_batch_size": batch.batch_size}, {"max_tokens_per_micro_batch": budget}):
        trainer = make_trainer(scale_model, loss_agg_mode=loss_agg_mode, **kw)
        plan = trainer.micro_batches(batch)
        lp = trainer.compute_logprobs(batch)
        metrics = trainer.train_batch(batch)
        results.append((plan, lp, metrics, trainer.full_state_dict()))
    (plan_one, lp_one, m_one, sd_one), (plan_tok, lp_tok, m_tok, sd_tok) = results
    assert len(plan_one) == 1 and [mb.tolist() for mb in plan_tok] == [[3], [6], [2], [5, 1], [4, 0]]
    lengths = batch.attention_mask.sum(-1).tolist()
    assert all(len(mb) * max(lengths[i] for i in mb) <= budget for mb in plan_tok if len(mb) > 1)
    torch.testing.assert_close(lp_tok, lp_one, atol=1e-5, rtol=0)
    assert m_tok["actor/pg_loss"] == pytest.approx(m_one["actor/pg_loss"], abs=1e-5)
    assert m_tok["actor/grad_norm"] == pytest.approx(m_one["actor/grad_norm"], rel=1e-5)
    assert m_one["actor/grad_norm"] > 0 and m_tok["actor/step_skipped"] == 0.0
    for name in sd_one:
        torch.testing.assert_close(sd_tok[name], sd_one[name], atol=1e-5, rtol=0)


def test_activation_checkpointing_recomputes_layers_and_keeps_the_step(scale_model, make_trainer):
    """With checkpointing every decoder layer's MLP runs once more per training micro-batch (the
    recompute in backward); the step is the same."""
    batch = ragged_batch()
    out = []
    for ac in (False, True):
        trainer = make_trainer(scale_model, activation_checkpointing=ac, micro_batch_size=4)
        calls = [0]
        for layer in trainer.model.model.layers:
            layer.mlp.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        metrics = trainer.train_batch(batch)  # decoupled: 2 no-grad micro-batches + 2 training ones
        out.append((calls[0], metrics, trainer.full_state_dict()))
    (calls_off, m_off, sd_off), (calls_on, m_on, sd_on) = out
    assert calls_off == 2 * 2 * NUM_LAYERS  # (π_old pass + training pass) x 2 micro-batches x layers
    assert calls_on == calls_off + 2 * NUM_LAYERS  # + one recompute per training micro-batch and layer
    assert m_on["actor/grad_norm"] == pytest.approx(m_off["actor/grad_norm"], rel=1e-6)
    for name in sd_off:
        torch.testing.assert_close(sd_on[name], sd_off[name], atol=1e-6, rtol=0)


def test_bf16_mixed_precision_trains_with_fp32_master_weights(scale_model, make_trainer):
    """bf16 compute: log-probs within bf16 rounding of fp32 ones, fp32 weights and grads kept,
    and the step moves favoured tokens up like the fp32 step does."""
    batch = ragged_batch()
    fp32 = make_trainer(scale_model).compute_logprobs(batch)
    trainer = make_trainer(scale_model, mixed_precision="bf16", lr=1e-2)
    lp = trainer.compute_logprobs(batch)
    assert lp.dtype == torch.float32
    assert (lp - fp32).abs().max() < 0.1 and not torch.equal(lp, fp32)  # bf16 really computed
    on_policy = TrainBatch(batch.input_ids, batch.attention_mask, batch.loss_mask, lp * batch.loss_mask,
                           torch.where(batch.loss_mask > 0, 1.0, 0.0))  # every trained token favoured
    metrics = trainer.train_batch(on_policy)
    after = trainer.compute_logprobs(batch)
    mask = batch.loss_mask
    assert metrics["actor/step_skipped"] == 0.0 and metrics["actor/grad_norm"] > 0
    assert float(((after - lp) * mask).sum()) > 0
    assert all(t.dtype == torch.float32 for t in trainer.full_state_dict().values())
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
