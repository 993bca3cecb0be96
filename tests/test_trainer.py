"""TrainerWorker in-process (no Ray): FSDP2 over a tiny random Qwen2 on gloo, world size 1."""

from __future__ import annotations

import math
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from stand_ins import random_qwen2
from workers.core.algorithms.batch import TrainBatch
from workers.core.algorithms.rollout_correction_config import RolloutCorrectionConfig
from workers.core.types import TrajectoryRow
from workers.trainer.worker import TrainerSettings, TrainerWorker

VOCAB = 128




def row(prompt: list[int], generated: list[int]) -> TrajectoryRow:
    return TrajectoryRow(
        token_ids=tuple(prompt + generated),
        loss_mask=(0,) * len(prompt) + (1,) * len(generated),
        rollout_logprobs=(0.0,) * (len(prompt) + len(generated)),
        versions=(-1,) * len(prompt) + (0,) * len(generated),
    )


def with_rollout_logprobs(batch: TrainBatch, logprobs: torch.Tensor) -> TrainBatch:
    return TrainBatch(batch.input_ids, batch.attention_mask, batch.loss_mask, logprobs * batch.loss_mask,
                      batch.advantages)


def ragged_batch() -> TrainBatch:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for i in range(5):  # prompt 2..4 tokens, 3..9 generated: right padding in every row but one
        ids = torch.randint(1, VOCAB, (2 + i % 3 + 3 + 2 * i,), generator=gen).tolist()
        rows.append(row(ids[: 2 + i % 3], ids[2 + i % 3:]))
    return TrainBatch.from_rows(rows, advantages=[1.0, -1.0, 0.5, -0.5, 2.0], pad_id=0)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_compute_logprobs_matches_plain_hf_forward(random_qwen2_dir, make_trainer, temperature):
    """FSDP2 wrapping, micro-batching and right padding do not change the numbers; the trainer
    scores the rollout temperature's distribution (log_softmax(logits / T), as vLLM and verl)."""
    batch = ragged_batch()
    trainer = make_trainer(random_qwen2_dir, micro_batch_size=2, sampling_temperature=temperature)
    ours = trainer.compute_logprobs(batch)

    ref = AutoModelForCausalLM.from_pretrained(random_qwen2_dir, dtype=torch.float32).eval()
    for b in range(batch.batch_size):
        n = int(batch.attention_mask[b].sum())
        ids = batch.input_ids[b : b + 1, :n]
        with torch.no_grad():
            logits = ref(input_ids=ids).logits[0]  # one unpadded sequence
        want = torch.log_softmax(logits[:-1] / temperature, dim=-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        torch.testing.assert_close(ours[b, 1:n], want, atol=1e-5, rtol=0)
        assert ours[b, 0] == 0.0 and bool((ours[b, n:] == 0).all())


def test_update_raises_logprob_of_favoured_tokens(random_qwen2_dir, make_trainer):
    """Rows with positive advantage gain log-prob after one step; negative rows lose it."""
    gen = torch.Generator().manual_seed(1)
    prompt = [3, 4, 5]
    good = [torch.randint(1, VOCAB, (6,), generator=gen).tolist() for _ in range(3)]
    bad = [torch.randint(1, VOCAB, (6,), generator=gen).tolist() for _ in range(3)]
    batch = TrainBatch.from_rows([row(prompt, g) for g in good + bad], [1.0] * 3 + [-1.0] * 3, pad_id=0)
    trainer = make_trainer(random_qwen2_dir, lr=1e-3, micro_batch_size=4)
    before = trainer.compute_logprobs(batch)
    batch = with_rollout_logprobs(batch, before)  # on-policy rollout: π_rollout == π_old

    metrics = trainer.train_batch(batch)
    after = trainer.compute_logprobs(batch)

    mask = batch.loss_mask
    gain = ((after - before) * mask).sum(-1) / mask.sum(-1)
    assert bool((gain[:3] > 0).all()), gain
    assert bool((gain[3:] < 0).all()), gain
    # on-policy first step: ratio 1 everywhere, IS weights 1, nothing clipped
    assert metrics["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["actor/pg_clipfrac"] == 0.0
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["rollout_corr/kl"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["actor/num_tokens"] == 36.0
    assert metrics["actor/pg_loss"] == pytest.approx(0.0, abs=1e-6)  # -mean(A) with balanced ±1 advantages
    assert math.isfinite(metrics["actor/grad_norm"]) and metrics["actor/grad_norm"] > 0
    assert metrics["actor/step_skipped"] == 0.0 and metrics["actor/entropy"] > 0
    assert trainer.num_updates == 1


def test_update_is_independent_of_micro_batch_size(random_qwen2_dir, make_trainer):
    """Token-mean over the whole mini-batch: 1-row and 5-row micro-batches give the same step."""
    batch = ragged_batch()
    results = []
    for mbs in (1, 5):
        trainer = make_trainer(random_qwen2_dir, micro_batch_size=mbs)
        stale = with_rollout_logprobs(batch, trainer.compute_logprobs(batch) - 0.3)  # IS weights e^0.3
        metrics = trainer.train_batch(stale)
        results.append((metrics, trainer.full_state_dict()))
        trainer.close()
    (m1, sd1), (m5, sd5) = results
    assert m1["actor/pg_loss"] == pytest.approx(m5["actor/pg_loss"], abs=1e-6)
    assert m1["actor/grad_norm"] == pytest.approx(m5["actor/grad_norm"], rel=1e-5)
    assert m1["rollout_corr/rollout_is_mean"] == pytest.approx(math.exp(0.3), rel=1e-5)
    for name in sd1:
        torch.testing.assert_close(sd1[name], sd5[name], atol=1e-6, rtol=0)


def test_only_trained_columns_reach_the_vocabulary_and_the_step_is_unchanged(random_qwen2_dir, make_trainer,
                                                                               monkeypatch):
    """The update projects onto the vocabulary only the hidden states that predict a trained token
    (helpers.trained_columns, HF `logits_to_keep`): lm_head sees fewer columns than the rows have,
    trained-only scoring equals full scoring on every trained token (0 where no row trains), and the step
    equals the one taken with the logits of every column."""
    import workers.trainer.worker as worker_module
    from workers.trainer.helpers import trained_columns

    batch = ragged_batch()
    trainer = make_trainer(random_qwen2_dir, micro_batch_size=5)
    widths: list[int] = []
    hook = trainer.model.lm_head.register_forward_hook(lambda _m, _i, out: widths.append(out.shape[1]))
    full = trainer.compute_logprobs(batch)
    trained = trainer.engine.compute_logprobs(batch, trained_only=True)
    hook.remove()
    mask = batch.loss_mask.bool()
    assert widths == [batch.trimmed().seq_len, len(trained_columns(batch.trimmed().loss_mask))]
    assert widths[1] < widths[0]  # the shortest prompt's columns are not projected
    torch.testing.assert_close(trained[mask], full[mask], atol=1e-6, rtol=0)
    scored = torch.zeros_like(mask)
    scored[:, trained_columns(batch.loss_mask) + 1] = True  # a column trained in any row is scored in all
    assert bool((trained[~scored] == 0).all()) and bool((~scored).any())

    stale = with_rollout_logprobs(batch, full - 0.3)
    results = []
    for keep_all in (False, True):
        if keep_all:  # every column projected: the update as it was before trained_columns
            monkeypatch.setattr(worker_module, "trained_columns",
                                lambda m: torch.arange(m.shape[1] - 1, device=m.device))
        t = make_trainer(random_qwen2_dir, micro_batch_size=2)
        results.append((t.train_batch(stale), t.full_state_dict()))
        t.close()
    (m_kept, sd_kept), (m_all, sd_all) = results
    assert m_kept["actor/pg_loss"] == pytest.approx(m_all["actor/pg_loss"], abs=1e-6)
    assert m_kept["actor/grad_norm"] == pytest.approx(m_all["actor/grad_norm"], rel=1e-5)
    assert m_kept["actor/entropy"] == pytest.approx(m_all["actor/entropy"], rel=1e-5)
    for name in sd_kept:
        torch.testing.assert_close(sd_kept[name], sd_all[name], atol=1e-6, rtol=0)


def test_tis_caps_weights_when_rollout_policy_is_far(random_qwen2_dir, make_trainer):
    batch = ragged_batch()
    trainer = make_trainer(random_qwen2_dir)
    far = with_rollout_logprobs(batch, trainer.compute_logprobs(batch) - 2.0)  # raw weights e^2 ≈ 7.4
    metrics = trainer.train_batch(far)
    assert metrics["rollout_corr/rollout_is_max"] == pytest.approx(2.0)
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == 1.0
    assert metrics["rollout_corr/kl"] == pytest.approx(-2.0, abs=1e-5)


def test_export_weights_round_trips_into_fresh_hf_model(random_qwen2_dir, make_trainer, tmp_path):
    batch = ragged_batch()
    trainer = make_trainer(random_qwen2_dir)
    trainer.train_batch(with_rollout_logprobs(batch, trainer.compute_logprobs(batch)))  # weights differ from disk
    expected = trainer.compute_logprobs(batch)

    path = trainer.export_weights(str(tmp_path / "out" / "model.safetensors"))
    assert os.listdir(tmp_path / "out") == ["model.safetensors"]  # no temp file left
    sd = load_file(path)
    fresh = Qwen2ForCausalLM(Qwen2Config.from_pretrained(random_qwen2_dir))
    assert set(sd) == set(fresh.state_dict())  # HF names, nothing missing or extra
    assert all(t.dtype == torch.float32 for t in sd.values())
    fresh.load_state_dict(sd)
    fresh.eval()
    with torch.no_grad():
        logits = fresh(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    valid = batch.attention_mask[:, 1:].bool()
    torch.testing.assert_close(lp[valid], expected[:, 1:][valid], atol=1e-5, rtol=0)
    original = load_file(os.path.join(random_qwen2_dir, "model.safetensors"))
    assert not torch.equal(original["model.layers.0.mlp.up_proj.weight"], sd["model.layers.0.mlp.up_proj.weight"])


def test_save_hf_of_tied_model_loads_with_from_pretrained(tmp_path, make_trainer):
    """tie_word_embeddings: lm_head aliases embed_tokens and is written once, as HF does."""
    src = random_qwen2(tmp_path / "tied", tie=True, seed=3)
    trainer = make_trainer(src)
    batch = ragged_batch()
    trainer.train_batch(with_rollout_logprobs(batch, trainer.compute_logprobs(batch)))
    expected = trainer.compute_logprobs(batch)
    out = trainer.save_hf(str(tmp_path / "saved"))
    assert "lm_head.weight" not in load_file(os.path.join(out, "model.safetensors"))
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = loaded(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    valid = batch.attention_mask[:, 1:].bool()
    torch.testing.assert_close(lp[valid], expected[:, 1:][valid], atol=1e-5, rtol=0)


def test_update_rejects_batch_without_trained_tokens(random_qwen2_dir, make_trainer):
    trainer = make_trainer(random_qwen2_dir)
    empty = TrainBatch.from_rows([row([1, 2, 3], [])], advantages=[0.0], pad_id=0)
    with pytest.raises(ValueError, match="no trained token"):
        trainer.train_batch(empty)


def test_settings_reject_bad_values(random_qwen2_dir):
    with pytest.raises(ValueError, match="micro_batch_size"):
        TrainerSettings(model_path=random_qwen2_dir, micro_batch_size=0)
    with pytest.raises(ValueError, match="is_threshold"):
        TrainerSettings(model_path=random_qwen2_dir, rollout_correction=RolloutCorrectionConfig(is_threshold=0.5))
    with pytest.raises(ValueError, match="clip_ratio_c"):
        TrainerSettings(model_path=random_qwen2_dir, clip_ratio_c=0.9)


DP_RANK_SCRIPT = """
import sys, torch
from workers.core.algorithms.batch import TrainBatch
from workers.trainer.worker import TrainerSettings, TrainerWorker
rank, world, model_path, init, batch_path, out_path = sys.argv[1:]
rank, world = int(rank), int(world)
torch.set_num_threads(1)
batch = TrainBatch(**torch.load(batch_path))
half = (batch.batch_size + 1) // 2
shard = batch.select(0, half) if rank == 0 else batch.select(half, batch.batch_size)
w = TrainerWorker(TrainerSettings(model_path=model_path, lr=1e-3, weight_decay=0.0, micro_batch_size=3),
                  rank=rank, world_size=world, init_method=init)
metrics = w.train_batch(shard)
sd = w.full_state_dict()
if rank == 0:
    torch.save({"metrics": metrics, "state_dict": sd}, out_path)
w.close()
"""


def test_two_data_parallel_ranks_take_the_same_step_as_one(random_qwen2_dir, make_trainer, tmp_path):
    """world_size 2 over gloo (two real processes, half the mini-batch each) == world_size 1 on all of it:
    the global token count and the dp_size factor undo FSDP's gradient averaging."""
    import subprocess
    import sys
    from pathlib import Path

    from workers.weight_sync.rendezvous import host_store, release_store

    batch = ragged_batch()
    trainer = make_trainer(random_qwen2_dir, micro_batch_size=3)
    batch = with_rollout_logprobs(batch, trainer.compute_logprobs(batch) - 0.3)
    torch.save({f: getattr(batch, f) for f in ("input_ids", "attention_mask", "loss_mask", "rollout_logprobs",
                                                 "advantages")}, tmp_path / "batch.pt")
    one = trainer.train_batch(batch)
    sd_one = trainer.full_state_dict()

    script = tmp_path / "rank.py"
    script.write_text(DP_RANK_SCRIPT)
    env = os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    rendezvous = host_store("127.0.0.1")  # served here, kept bound: both ranks join it as clients
    init = rendezvous.url
    procs = [
        subprocess.Popen([sys.executable, str(script), str(r), "2", random_qwen2_dir, init,
                          str(tmp_path / "batch.pt"), str(tmp_path / "out.pt")],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for r in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=180)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        release_store(rendezvous)
    assert all(p.returncode == 0 for p in procs), outputs
    two = torch.load(tmp_path / "out.pt")
    assert two["metrics"]["actor/num_tokens"] == one["actor/num_tokens"]
    assert two["metrics"]["actor/pg_loss"] == pytest.approx(one["actor/pg_loss"], abs=1e-6)
    assert two["metrics"]["actor/grad_norm"] == pytest.approx(one["actor/grad_norm"], rel=1e-5)
    for name, t in sd_one.items():
        torch.testing.assert_close(two["state_dict"][name], t, atol=1e-6, rtol=0)


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 0.9), (0.7, 0.5), (1.3, 0.95)])
def test_sampling_logits_match_vllms_top_p_reference(temperature, top_p):
    """Reference test: the trainer's nucleus equals vLLM's sampler (apply_top_k_top_p_pytorch on
    logits / T), and the sampled token is kept even when it lies outside it."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    from workers.trainer.helpers import sampling_logits

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 300, generator=gen) * 3
    ref = apply_top_k_top_p_pytorch(logits.clone() / temperature, None, torch.full((64,), top_p))
    targets = ref.argmax(dim=-1)  # inside the nucleus
    ours = sampling_logits(logits, targets, temperature=temperature, top_p=top_p)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    assert torch.allclose(ours.log_softmax(-1)[~torch.isinf(ours)], ref.log_softmax(-1)[~torch.isinf(ref)], atol=1e-6)
    outside = torch.isinf(ref).float().argmax(dim=-1)  # a dropped token per row (top_p < 1 drops some)
    kept = sampling_logits(logits, outside, temperature=temperature, top_p=top_p)
    assert torch.isfinite(kept.gather(-1, outside[:, None])).all()


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_a_rollout_of_two_rows_counts_once_in_the_loss(random_qwen2_dir, make_trainer, mode):
    """Issue 28 item 4 through the real trainer: rollout 0 split into two rows (3 + 4 trained
    tokens, a compaction) beside rollouts of 5 and 2 tokens, in micro-batches of one row. On policy
    (π_rollout = π_old = π_θ: ratio and IS weight 1) each token's loss is -A, so the step's pg_loss
    is the aggregate of -A with the rollout counted once: seq-mean-token-sum -(7·A0 + 5·A1 + 2·A2)/3
    (rows would divide by 4), seq-mean-token-mean -(A0 + A1 + A2)/3 (per-row means over 4 rows
    would count A0 twice), token-mean -(7·A0 + 5·A1 + 2·A2)/14."""
    from workers.core.algorithms.batch import SampleTable

    gen = torch.Generator().manual_seed(3)
    ids = lambda n: torch.randint(1, VOCAB, (n,), generator=gen).tolist()  # noqa: E731
    rows = [row(ids(2), ids(3)), row(ids(3), ids(4)), row(ids(2), ids(5)), row(ids(4), ids(2))]
    adv = {0: 1.0, 1: -0.5, 2: 2.0}
    table = SampleTable(group_index=torch.tensor([0, 0, 0]), rewards=torch.tensor([1.0, 0.0, 2.0]),
                        row_sample=torch.tensor([0, 0, 1, 2]))
    batch = TrainBatch.from_rows(rows, [adv[0], adv[0], adv[1], adv[2]], pad_id=0, samples=table)
    trainer = make_trainer(random_qwen2_dir, micro_batch_size=1, loss_agg_mode=mode)
    lp = trainer.compute_logprobs(batch) * batch.loss_mask
    on_policy = TrainBatch(batch.input_ids, batch.attention_mask, batch.loss_mask, lp, batch.advantages, samples=table)
    metrics = trainer.train_batch(on_policy)
    weighted = 7 * adv[0] + 5 * adv[1] + 2 * adv[2]
    want = {"token-mean": -weighted / 14, "seq-mean-token-sum": -weighted / 3,
            "seq-mean-token-mean": -(adv[0] + adv[1] + adv[2]) / 3}[mode]
    assert metrics["actor/pg_loss"] == pytest.approx(want, abs=1e-5)
