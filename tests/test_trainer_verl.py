"""trainer=verl: VerlTrainerWorker drives verl 0.9.1's real FSDP2 engine on CPU (gloo, world size 1)
and must train exactly like our TrainerWorker: same log-probs, loss, metrics and updated weights on
the same batches (to ~1e-5), and checkpoint files either trainer can read. Megatron cannot run
without CUDA: that path is checked to fail at startup with the reason.

One module-scoped pair of workers per settings (verl's import and engine build dominate the time).
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("verl.workers.engine.base")

from stand_ins import InThread, compose_config  # noqa: E402
from workers.core.algorithms.batch import TrainBatch  # noqa: E402
from workers.core.algorithms.rollout_correction_config import RolloutCorrectionConfig  # noqa: E402
from workers.core.types import TrajectoryRow  # noqa: E402
from workers.trainer.worker import TrainerSettings, TrainerWorker  # noqa: E402
from workers.trainer.verl_worker import (  # noqa: E402
    VerlSettings,
    VerlTrainerWorker,
    check_verl_available,
    verl_configs,
)

TOL = 1e-5
# lr 1e-3, not larger: k_proj biases have a zero true gradient (softmax ignores a shift shared by all
# keys), so AdamW turns their float-rounding gradients into steps of about ±lr that differ between any
# two implementations; at 1e-3 those stay below TOL while every other weight moves by ~lr.
COMPARED = ("actor/pg_loss", "actor/grad_norm", "actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower",
            "actor/entropy", "actor/num_tokens", "actor/step_skipped")


def make_batch(seed: int, advantages: list[float], vocab: int = 300) -> TrainBatch:
    """Ragged rows (row i: prompt 2 + i % 3 tokens, 3 + 2i generated) with nonzero rollout log-probs."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i, _ in enumerate(advantages):
        prompt_len, n = 2 + i % 3, 2 + i % 3 + 3 + 2 * i
        ids = torch.randint(1, vocab, (n,), generator=gen).tolist()
        lps = (-torch.rand(n - prompt_len, generator=gen) * 6).tolist()  # far from π: IS weights matter
        rows.append(TrajectoryRow(
            token_ids=tuple(ids), loss_mask=(0,) * prompt_len + (1,) * (n - prompt_len),
            rollout_logprobs=(0.0,) * prompt_len + tuple(lps), versions=(-1,) * prompt_len + (0,) * (n - prompt_len)))
    return TrainBatch.from_rows(rows, advantages=advantages, pad_id=0)


@pytest.fixture(scope="module")
def model_path(tiny_model_dir) -> str:
    return str(tiny_model_dir)


def _pair(settings: TrainerSettings):
    ref = TrainerWorker(settings)  # owns the gloo process group; the verl worker joins it
    ours = VerlTrainerWorker(settings, VerlSettings(strategy="fsdp"))
    return ours, ref


@pytest.fixture(scope="module")
def decoupled_pair(model_path):
    """Defaults: decoupled rollout correction (π_old recomputed), token TIS, token-mean."""
    ours, ref = _pair(TrainerSettings(model_path=model_path, lr=1e-3, weight_decay=0.01, micro_batch_size=2,
                                      device="cpu"))
    yield ours, ref
    ours.close()
    ref.close()


def _assert_same_update(m_ours: dict, m_ref: dict) -> None:
    assert m_ours.keys() == m_ref.keys()
    for key in [k for k in COMPARED if k in m_ref] + [k for k in m_ref if k.startswith("rollout_corr/")]:
        assert m_ours[key] == pytest.approx(m_ref[key], abs=TOL, rel=TOL), key


def _assert_same_weights(ours: VerlTrainerWorker, ref: TrainerWorker) -> None:
    a, b = ours.full_state_dict(), ref.full_state_dict()
    assert a.keys() == b.keys()
    for name in b:
        assert torch.allclose(a[name], b[name], atol=TOL, rtol=0), name


def test_two_updates_match_trainer_worker(decoupled_pair):
    """verl's engine forward/backward/step + our loss hook == TrainerWorker, step after step."""
    ours, ref = decoupled_pair
    before = {k: v.clone() for k, v in ref.full_state_dict().items()}
    batches = [make_batch(0, [1.0, -1.0, 0.5, -0.5, 2.0]), make_batch(1, [-2.0, 1.5, 0.25, -1.0])]
    lp_ours, lp_ref = ours.compute_logprobs(batches[0]), ref.compute_logprobs(batches[0])
    assert lp_ours.shape == batches[0].input_ids.shape
    assert torch.allclose(lp_ours, lp_ref, atol=TOL)
    assert bool((lp_ours[:, 0] == 0).all()) and bool((lp_ours[batches[0].attention_mask == 0] == 0).all())
    for batch in batches:
        m_ours, m_ref = ours.train_batch(batch), ref.train_batch(batch)
        assert m_ours["actor/step_skipped"] == 0.0 and m_ours["actor/grad_norm"] > 0
        _assert_same_update(m_ours, m_ref)
        _assert_same_weights(ours, ref)
    moved = max((ours.full_state_dict()[k] - before[k]).abs().max().item() for k in before)
    assert moved > 5e-4  # the comparison is not between two untouched models
    assert ours.num_updates == 2


def test_weights_and_optimizer_files_are_interchangeable(decoupled_pair, tmp_path):
    """export_weights / save_hf / save_optimizer write what TrainerWorker writes; load_optimizer
    reads TrainerWorker's file."""
    from transformers import AutoModelForCausalLM

    ours, ref = decoupled_pair
    batch = make_batch(3, [0.5, -1.0, 1.0])
    ours.train_batch(batch), ref.train_batch(batch)  # non-empty AdamW state, whatever ran before
    w_ours = load_file(ours.export_weights(str(tmp_path / "ours.safetensors")))
    w_ref = load_file(ref.export_weights(str(tmp_path / "ref.safetensors")))
    assert w_ours.keys() == w_ref.keys()
    assert all(torch.allclose(w_ours[k], w_ref[k], atol=TOL) for k in w_ref)

    hf = AutoModelForCausalLM.from_pretrained(ours.save_hf(str(tmp_path / "hf")), dtype=torch.float32)
    assert all(torch.equal(hf.state_dict()[k], w_ours[k]) for k in w_ours)

    o_ours = torch.load(ours.save_optimizer(str(tmp_path / "ours.pt")), weights_only=True)
    o_ref = torch.load(ref.save_optimizer(str(tmp_path / "ref.pt")), weights_only=True)
    assert o_ours["num_updates"] == o_ref["num_updates"] == ours.num_updates
    st_ours, st_ref = o_ours["optimizer"]["state"], o_ref["optimizer"]["state"]
    assert st_ours.keys() == st_ref.keys() and len(st_ref) > 0
    for name in st_ref:
        assert torch.allclose(st_ours[name]["exp_avg_sq"], st_ref[name]["exp_avg_sq"], atol=1e-8), name

    blob = torch.load(str(tmp_path / "ref.pt"), weights_only=True)
    blob["num_updates"] = 7
    torch.save(blob, str(tmp_path / "ref7.pt"))
    ours.load_optimizer(str(tmp_path / "ref7.pt"))
    assert ours.num_updates == 7
    again = torch.load(ours.save_optimizer(str(tmp_path / "again.pt")), weights_only=True)["optimizer"]["state"]
    assert all(torch.allclose(again[k]["exp_avg"], st_ref[k]["exp_avg"], atol=1e-8) for k in st_ref)
    with pytest.raises(ValueError, match="not an optimizer checkpoint"):
        torch.save({"x": 1}, str(tmp_path / "bad.pt"))
        ours.load_optimizer(str(tmp_path / "bad.pt"))


async def test_broadcast_weights_sends_the_engine_weights(decoupled_pair):
    """weight_specs / open_weight_group / broadcast_weights (the GPU weight-sync path, here over
    shared memory): a receiver ends up holding exactly full_state_dict, in small buckets."""
    from workers.weight_sync.broadcast import BroadcastWeightSync, new_group_info
    from workers.weight_sync.receiver import TensorReceiver

    ours, _ = decoupled_pair
    full = ours.full_state_dict()
    assert [(s.name, s.shape) for s in ours.weight_specs()] == [(n, tuple(t.shape)) for n, t in full.items()]
    target = {n: torch.zeros_like(t) for n, t in full.items()}
    receiver = TensorReceiver(target)
    info = new_group_info("shm", 1, timeout_s=60.0)
    sync = BroadcastWeightSync([InThread(ours)], [InThread(receiver)], info)
    report = await asyncio.wait_for(sync.sync(1), 60.0)
    assert report.version == 1 and receiver.version() == 1
    assert all(torch.equal(target[n], full[n]) for n in full)
    receiver.close()


def test_bypass_seq_mean_and_token_budget_match_trainer_worker(model_path):
    """Bypass mode (log π_θ captured inside verl's micro-batch loop, rows reordered by verl's
    token balancing), seq-mean-token-mean aggregation, a small token budget (several micro-batches)
    and activation checkpointing: none of them changes the step."""
    settings = TrainerSettings(
        model_path=model_path, lr=1e-3, weight_decay=0.0, micro_batch_size=2, max_tokens_per_micro_batch=16,
        loss_agg_mode="seq-mean-token-mean", rollout_correction=RolloutCorrectionConfig(mode="bypass"),
        compute_entropy=False, activation_checkpointing=True, device="cpu",
    )
    ours, ref = _pair(settings)
    try:
        assert ours.hf_model().is_gradient_checkpointing
        batch = make_batch(2, [1.0, -1.0, 0.5, -0.5, 2.0, -1.5])
        m_ours, m_ref = ours.train_batch(batch), ref.train_batch(batch)
        assert "actor/entropy" not in m_ours
        assert m_ours["rollout_corr/training_log_ppl"] != 0.0  # π_θ really captured from the forward
        _assert_same_update(m_ours, m_ref)
        _assert_same_weights(ours, ref)
    finally:
        ours.close()
        ref.close()


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "seq-mean-token-sum"])
def test_rollouts_of_several_rows_count_once_in_both_engines(model_path, mode):
    """Issue 28 item 4: rows 0-1 and 2-4 are two rollouts (a compaction, a sub-agent), row 5 a third;
    the seq-mean denominators count rollouts and seq-mean-token-mean takes each rollout's one token
    mean (TrainBatch.rollout_num_tokens, looked up by row in verl's reordered micro-batches of a
    16-token budget): verl's engine and TrainerWorker take the same step."""
    from workers.core.algorithms.batch import SampleTable

    settings = TrainerSettings(model_path=model_path, lr=1e-3, weight_decay=0.0, micro_batch_size=2,
                               max_tokens_per_micro_batch=16, loss_agg_mode=mode, compute_entropy=False, device="cpu")
    ours, ref = _pair(settings)
    try:
        b = make_batch(3, [1.0, 1.0, -0.5, -0.5, -0.5, 2.0])
        table = SampleTable(group_index=torch.tensor([0, 0, 0]), rewards=torch.tensor([1.0, 0.0, 2.0]),
                            row_sample=torch.tensor([0, 0, 1, 1, 1, 2]))
        batch = TrainBatch(b.input_ids, b.attention_mask, b.loss_mask, b.rollout_logprobs, b.advantages, samples=table)
        assert batch.num_trained_rollouts() == 3 and batch.rollout_num_tokens().tolist()[:2] == [8.0, 8.0]  # 3 + 5
        m_ours, m_ref = ours.train_batch(batch), ref.train_batch(batch)
        _assert_same_update(m_ours, m_ref)
        _assert_same_weights(ours, ref)
    finally:
        ours.close()
        ref.close()


def test_megatron_configs_build_but_the_engine_refuses_a_cpu_host(model_path):
    """Megatron needs CUDA (and megatron-core): trainer=verl fails at startup naming the reason;
    verl's Megatron configs themselves are built from our settings."""
    settings = TrainerSettings(model_path=model_path, lr=3e-4, grad_clip=0.5)
    vc = VerlSettings(strategy="megatron", tensor_model_parallel_size=2)
    c = verl_configs(settings, vc)
    assert type(c.engine).__name__ == "McoreEngineConfig" and c.engine.tensor_model_parallel_size == 2
    assert c.optimizer.lr == 3e-4 and c.optimizer.clip_grad == 0.5
    with pytest.raises(RuntimeError, match="megatron needs CUDA"):
        check_verl_available(vc, cuda=False)
    with pytest.raises(RuntimeError, match="megatron needs CUDA"):
        VerlTrainerWorker(settings, vc)
    check_verl_available(VerlSettings(strategy="fsdp"), cuda=False)  # fsdp runs on CPU: no error




def test_config_picks_the_trainer_class_by_name():
    """orchestrator/config/trainer.py: trainer=verl selects VerlTrainerWorker with trainer.verl.*; megatron on
    a CPU cluster stops before any actor starts; a bad strategy names its key."""
    from orchestrator.config import ConfigError
    from orchestrator.config import trainer_class

    def _trainer_class(cfg):
        return trainer_class(cfg.trainer, cluster=cfg.cluster)

    assert _trainer_class(compose_config([]))[0] is TrainerWorker
    cls, kw = _trainer_class(compose_config(["trainer=verl", "trainer.verl.use_remove_padding=true"]))
    assert cls is VerlTrainerWorker and kw["verl"] == VerlSettings(strategy="fsdp", use_remove_padding=True)
    with pytest.raises(RuntimeError, match="megatron needs CUDA"):
        _trainer_class(compose_config(["trainer=verl", "trainer.verl.strategy=megatron"]))
    with pytest.raises(ConfigError, match="trainer.verl.strategy"):
        compose_config(["trainer=verl", "trainer.verl.strategy=deepspeed"])
