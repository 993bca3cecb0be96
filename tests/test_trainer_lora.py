"""TrainerWorker with `model.lora` in-process (no Ray): FSDP2 over a tiny random Qwen2 with a PEFT
adapter on gloo, world size 1. The base stays frozen, the optimizer holds only the adapter, and
the adapter's two ways out (PEFT directory, merged HF weights) give the trainer's own log-probs."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from stand_ins import hf_token_logprobs
from workers.core.algorithms.batch import TrainBatch
from workers.core.types import TrajectoryRow
from workers.weight_sync.lora import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE
from workers.trainer.settings import LoraSettings
from workers.weight_sync.lora import LORA_ADAPTER_DIR
from workers.trainer.worker import TrainerSettings, TrainerWorker

PROBE = [1, 17, 42, 99, 5, 110, 71, 8, 64, 127, 7, 50, 2, 45, 90, 11]


@pytest.fixture
def trainer_defaults() -> dict:
    """make_trainer's settings here: a rank-4 adapter at a LoRA learning rate."""
    return {"lr": 1e-2, "weight_decay": 0.0, "micro_batch_size": 4, "seed": 0, "lora": LoraSettings(rank=4, alpha=8.0)}


def batch() -> TrainBatch:
    gen = torch.Generator().manual_seed(1)
    rows = []
    for i in range(4):
        ids = torch.randint(1, 128, (9,), generator=gen).tolist()
        rows.append(TrajectoryRow(token_ids=tuple(ids), loss_mask=(0,) * 3 + (1,) * 6, rollout_logprobs=(0.0,) * 9,
                                  versions=(-1,) * 3 + (0,) * 6))
    return TrainBatch.from_rows(rows, advantages=[1.0, -1.0, 1.0, -1.0], pad_id=0)


def step(trainer: TrainerWorker) -> dict[str, float]:
    b = batch()
    before = trainer.compute_logprobs(b)
    return trainer.train_batch(TrainBatch(b.input_ids, b.attention_mask, b.loss_mask, before * b.loss_mask, b.advantages))


def test_only_the_adapter_trains_and_holds_optimizer_state(random_qwen2_dir, make_trainer):
    trainer = make_trainer(random_qwen2_dir)
    base0 = {k: v.clone() for k, v in trainer.full_state_dict().items()}
    assert trainer.probe_logprobs(PROBE) == pytest.approx(
        hf_token_logprobs(AutoModelForCausalLM.from_pretrained(random_qwen2_dir, dtype=torch.float32).eval(), PROBE),
        abs=1e-5)  # B = 0: version 0 is the base model
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    metrics = step(trainer)
    assert metrics["actor/step_skipped"] == 0.0 and metrics["actor/grad_norm"] > 0
    state = trainer.engine.optimizer_state()["state"]
    assert set(state) == trainable  # Adam moments for the adapter only
    frozen = trainer.engine.full_state_dict(merge=False)
    for k, v in base0.items():
        assert torch.equal(frozen[k], v), k  # the base did not move
    merged = trainer.full_state_dict()
    assert any(not torch.equal(merged[k], base0[k]) for k in base0)  # the adapter did


def test_merged_weights_and_adapter_dir_give_the_trainers_logprobs(random_qwen2_dir, make_trainer, tmp_path):
    from peft import PeftModel

    trainer = make_trainer(random_qwen2_dir, lora=LoraSettings(rank=4, alpha=8.0, init="gaussian"))
    step(trainer)
    ours = trainer.probe_logprobs(PROBE)

    merged = AutoModelForCausalLM.from_pretrained(random_qwen2_dir, dtype=torch.float32).eval()
    merged.load_state_dict(trainer.full_state_dict(), strict=False)
    assert hf_token_logprobs(merged, PROBE) == pytest.approx(ours, abs=1e-5)

    adapter = trainer.export_adapter(str(tmp_path / "adapter"))
    cfg = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG_FILE).read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8.0 and cfg["peft_type"] == "LORA"
    assert all(".lora_" in k and ".default." not in k for k in load_file(tmp_path / "adapter" / ADAPTER_WEIGHTS_FILE))
    base = AutoModelForCausalLM.from_pretrained(random_qwen2_dir, dtype=torch.float32)
    served = PeftModel.from_pretrained(base, adapter).eval()
    assert hf_token_logprobs(served, PROBE) == pytest.approx(ours, abs=1e-5)


def test_checkpoint_resumes_the_adapter_and_its_optimizer_exactly(random_qwen2_dir, make_trainer, tmp_path):
    a = make_trainer(random_qwen2_dir)
    step(a)
    ckpt = a.save_hf(str(tmp_path / "ckpt"))
    a.save_optimizer(str(tmp_path / "optimizer.pt"))
    base = load_file(tmp_path / "ckpt" / "model.safetensors")
    assert torch.equal(base["model.layers.0.self_attn.q_proj.weight"],
                       load_file(f"{random_qwen2_dir}/model.safetensors")["model.layers.0.self_attn.q_proj.weight"])
    after_a = (step(a), a.probe_logprobs(PROBE))
    a.close()

    b = make_trainer(ckpt, lora_adapter_path=str(tmp_path / "ckpt" / LORA_ADAPTER_DIR))
    b.load_optimizer(str(tmp_path / "optimizer.pt"))
    after_b = (step(b), b.probe_logprobs(PROBE))
    assert after_b[1] == pytest.approx(after_a[1], abs=1e-6)
    assert after_b[0]["actor/grad_norm"] == pytest.approx(after_a[0]["actor/grad_norm"], rel=1e-5)


def test_adapter_that_does_not_match_is_refused(random_qwen2_dir, make_trainer, tmp_path):
    a = make_trainer(random_qwen2_dir)
    a.export_adapter(str(tmp_path / "r4"))
    a.close()
    weights = load_file(tmp_path / "r4" / ADAPTER_WEIGHTS_FILE)
    save_file({k: v for i, (k, v) in enumerate(weights.items()) if i}, tmp_path / "r4" / ADAPTER_WEIGHTS_FILE)
    with pytest.raises(ValueError, match="does not match model.lora"):
        make_trainer(random_qwen2_dir, lora_adapter_path=str(tmp_path / "r4"))


def test_bad_lora_settings_name_the_key():
    with pytest.raises(ValueError, match="model.lora.rank"):
        LoraSettings(rank=0)
    with pytest.raises(ValueError, match="model.lora.init"):
        LoraSettings(rank=8, init="pissa")
    with pytest.raises(ValueError, match="lora_adapter_path needs model.lora"):
        TrainerSettings(model_path="/x", lora_adapter_path="/y")


def test_bf16_mixed_precision_keeps_the_frozen_base_in_bf16(random_qwen2_dir, make_trainer):
    trainer = make_trainer(random_qwen2_dir, mixed_precision="bf16")
    dtypes = {p.requires_grad: p.dtype for p in trainer.model.parameters()}
    assert dtypes == {False: torch.bfloat16, True: torch.float32}  # base bf16, adapter fp32 master
    assert step(trainer)["actor/step_skipped"] == 0.0


def test_export_merges_the_adapter_into_a_model_transformers_loads(random_qwen2_dir, make_trainer, tmp_path):
    """`python -m orchestrator.export CKPT_MODEL --merge / --adapter` on a LoRA checkpoint's model dir."""
    from peft import PeftModel

    from orchestrator.export import main

    trainer = make_trainer(random_qwen2_dir, lora=LoraSettings(rank=4, alpha=8.0, init="gaussian"))
    step(trainer)
    ours = trainer.probe_logprobs(PROBE)
    ckpt = trainer.save_hf(str(tmp_path / "model"))
    assert main([ckpt, "--merge", "--out", str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    assert hf_token_logprobs(merged, PROBE) == pytest.approx(ours, abs=1e-5)
    assert main([ckpt, "--adapter", "--out", str(tmp_path / "adapter")]) == 0
    base = AutoModelForCausalLM.from_pretrained(random_qwen2_dir, dtype=torch.float32)
    assert hf_token_logprobs(PeftModel.from_pretrained(base, tmp_path / "adapter").eval(), PROBE) == pytest.approx(
        ours, abs=1e-5)
    assert main([ckpt, "--adapter", "--out", str(tmp_path / "adapter")]) == 2  # exists: refused
    assert main([random_qwen2_dir, "--merge", "--out", str(tmp_path / "x")]) == 2  # no adapter: refused
