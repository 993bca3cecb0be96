"""LoRA served by the real vLLM CPU engine: the adapter-only weight sync, its proof of arrival,
adapter versions pinned per request across syncs, the merged weights against the adapter, and a
LoRA checkpoint evaluated as docs/training.md says (served with its trained adapter).

One engine (tiny Qwen2, `lora_rank=8`, `max_loras=3`, in_flight "continue" as in async mode) and
one in-process LoRA trainer are shared by the module. The trainer is stepped on a fixed batch
between syncs, so each version's adapter differs.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
import pytest_asyncio
import torch
from transformers import AutoModelForCausalLM

from stand_ins import hf_token_logprobs
from workers.core.algorithms.batch import TrainBatch
from workers.core.types import GenerateRequest, TrajectoryRow
from workers.inference.worker import InferenceSettings, InferenceWorker
from workers.trainer.settings import LoraSettings
from workers.trainer.worker import TrainerSettings, TrainerWorker
from workers.weight_sync.adapter import AdapterWeightSync
from workers.weight_sync.probe import ProbedWeightSync, WeightSyncProbeError, probe_tokens

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROBE_ATOL = 1e-3  # the run's default on CPU; fp32 engine vs fp32 trainer measure ~1e-6


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tiny_model_dir, tmp_path_factory):
    engine = InferenceWorker(InferenceSettings(model_path=str(tiny_model_dir), max_model_len=256, max_num_seqs=16,
                                               lora_rank=8, max_loras=3, in_flight="continue"))
    await asyncio.wait_for(engine.start(), timeout=240)
    trainer = TrainerWorker(TrainerSettings(model_path=str(tiny_model_dir), lr=5e-2, weight_decay=0.0,
                                            lora=LoraSettings(rank=8, alpha=16.0, init="gaussian")))
    weights_dir = tmp_path_factory.mktemp("adapters")
    try:
        yield engine, trainer, weights_dir
    finally:
        trainer.close()
        await engine.shutdown()


def train_once(trainer: TrainerWorker, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    rows = [TrajectoryRow(token_ids=tuple(torch.randint(1, 250, (10,), generator=gen).tolist()),
                          loss_mask=(0,) * 4 + (1,) * 6, rollout_logprobs=(0.0,) * 10, versions=(-1,) * 4 + (0,) * 6)
            for _ in range(4)]
    b = TrainBatch.from_rows(rows, advantages=[1.0, -1.0, 1.0, -1.0], pad_id=0)
    lp = trainer.compute_logprobs(b)
    trainer.train_batch(TrainBatch(b.input_ids, b.attention_mask, b.loss_mask, lp * b.loss_mask, b.advantages))


def probed(engine, trainer, weights_dir, replicas=None) -> ProbedWeightSync:
    replicas = replicas or [engine]
    inner = AdapterWeightSync(replicas, initial_version=engine.policy_version(), trainer=trainer,
                              weights_dir=weights_dir, keep=4)
    return ProbedWeightSync(inner, trainer, replicas, probe_tokens(256), atol=PROBE_ATOL)


async def test_adapter_sync_arrives_and_the_probe_proves_it(stack, tiny_model_dir):
    engine, trainer, weights_dir = stack
    sync = probed(engine, trainer, weights_dir)
    base = await engine.prompt_logprobs(probe_tokens(256))
    train_once(trainer, 1)
    await sync.sync(1)
    assert 0 <= sync.last_diff <= PROBE_ATOL, sync.last_diff
    served = await engine.prompt_logprobs(probe_tokens(256))
    assert max(abs(a - b) for a, b in zip(served, base)) > 1e-2  # the adapter changed the policy
    assert engine.adapter_versions() == [1]
    assert sorted(p.name for p in weights_dir.iterdir()) == ["adapter-v1"]
    # the merged full weights give the adapter-served log-probs (what `export --merge` writes)
    merged = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    merged.load_state_dict(trainer.full_state_dict(), strict=False)
    assert max(abs(a - b) for a, b in zip(hf_token_logprobs(merged, probe_tokens(256)), served)) <= 1e-3
    print(f"\nprobe max |diff| after sync 1: {sync.last_diff:.2e}")


async def test_requests_keep_their_adapter_version_across_two_syncs(stack):
    engine, trainer, weights_dir = stack
    sync = probed(engine, trainer, weights_dir)
    v0 = engine.policy_version()

    def request() -> GenerateRequest:
        return GenerateRequest(request_id=uuid.uuid4().hex, prompt_ids=(1, 5, 9, 13), max_tokens=120,
                               temperature=1.0, seed=7)

    first = asyncio.create_task(engine.generate(request()))
    await asyncio.sleep(0.3)  # in flight on v0's adapter
    train_once(trainer, 2)
    await sync.sync(v0 + 1)
    second = asyncio.create_task(engine.generate(request()))
    await asyncio.sleep(0.3)
    train_once(trainer, 3)
    await sync.sync(v0 + 2)
    third = asyncio.create_task(engine.generate(request()))
    results = await asyncio.gather(first, second, third)
    for want, r in zip((v0, v0 + 1, v0 + 2), results):
        assert set(r.token_versions) == {want} and r.policy_version == want
    assert engine.adapter_versions() == [v0 + 2]  # older versions unloaded once their requests ended
    # each result's log-probs are those of its own version's adapter (temperature 1: processed == raw)
    from peft import PeftModel

    for version, r in zip((v0 + 1, v0 + 2), results[1:]):
        base = AutoModelForCausalLM.from_pretrained(engine._settings.model_path, dtype=torch.float32)
        model = PeftModel.from_pretrained(base, str(weights_dir / f"adapter-v{version}")).eval()
        ref = hf_token_logprobs(model, [1, 5, 9, 13, *r.output_ids])[3:]
        assert max(abs(a - b) for a, b in zip(ref, r.logprobs)) <= 1e-3


class ForgetfulReplica:
    """A replica whose adapter load is lost (the bug of verl #7495): it confirms and loads nothing."""

    def __init__(self, worker: InferenceWorker) -> None:
        self._worker = worker

    async def load_adapter(self, path: str, version: int, initial: bool = False) -> None:
        return None

    async def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        return await self._worker.prompt_logprobs(token_ids)


async def test_a_sync_that_did_not_arrive_stops_with_the_version_named(stack):
    engine, trainer, weights_dir = stack
    v = engine.policy_version()
    sync = probed(engine, trainer, weights_dir, replicas=[ForgetfulReplica(engine)])
    train_once(trainer, 4)
    with pytest.raises(WeightSyncProbeError, match=f"version {v + 1} did not arrive"):
        await sync.sync(v + 1)
    assert sync.last_diff > PROBE_ATOL


async def test_exported_merged_model_in_vllm_gives_the_adapter_served_logprobs(stack, tmp_path):
    """`python -m orchestrator.export CKPT --merge`: vLLM loads the merged model, and its probe
    log-probs equal those of the base + adapter it was served as (<= 1e-3)."""
    from orchestrator.export import main

    engine, trainer, weights_dir = stack
    sync = probed(engine, trainer, weights_dir)
    train_once(trainer, 5)
    await sync.sync(engine.policy_version() + 1)
    served = await engine.prompt_logprobs(probe_tokens(256))
    ckpt = trainer.save_hf(str(tmp_path / "model"))
    assert main([ckpt, "--merge", "--out", str(tmp_path / "merged")]) == 0
    merged = InferenceWorker(InferenceSettings(model_path=str(tmp_path / "merged"), max_model_len=256, max_num_seqs=4))
    await asyncio.wait_for(merged.start(), timeout=240)
    try:
        got = await merged.prompt_logprobs(probe_tokens(256))
    finally:
        await merged.shutdown()
    diff = max(abs(a - b) for a, b in zip(got, served))
    print(f"\nmerged (vLLM) vs adapter-served probe max |diff|: {diff:.2e}")
    assert diff <= 1e-3


async def test_a_lora_checkpoint_evaluated_as_documented_scores_the_trained_adapter(stack, tmp_path):
    """Issue 47 (item 2): `mode=eval model.path=RUN/checkpoints/latest/model` on a LoRA run scored the
    untrained base (0.138 where the trained adapter scores 0.177). The checkpoint here is what a LoRA
    run writes (the trainer's save_hf: base weights + lora_adapter/, committed, `latest` pointing at
    it); pre-flight turns the documented command into the config, and the replica serves it the way
    mode=eval does (`serve_adapter`). The score, the served model's mean log-prob of the probe, is the
    trained adapter's (HF PEFT on the same files, <= 1e-3 per token) and differs from the base's by
    what the adapter changes. (That the config carries the adapter, whatever the pointer's form, and
    that training from such a dir is refused: tests/test_lora_checkpoint_eval.py, no engine.)"""
    import re

    from peft import PeftModel

    from orchestrator.control.checkpoint import RunState, stage_checkpoint
    from orchestrator.control.preflight import check_model
    from orchestrator.loop.prompts import PromptCycle
    from orchestrator.loop.staleness import AdmissionState
    from orchestrator.wiring.eval import adapter_rank, serve_adapter
    from stand_ins import REPO, compose_config

    engine, trainer, _ = stack
    train_once(trainer, 6)  # with the earlier tests' steps: an adapter well away from the base
    documented = re.search(r"model\.path=(\S+)", (REPO / "docs" / "training.md").read_text()).group(1)
    run = tmp_path / documented.split("/checkpoints/")[0]
    with stage_checkpoint(run, 3) as stage:
        trainer.save_hf(str(stage.model_dir))
        trainer.save_optimizer(str(stage.optimizer_path))
        ckpt = stage.commit(RunState(step=3, policy_version=3, next_group_id=0,
                                     prompts=PromptCycle([{"input_id": "a"}], seed=0).state(),
                                     admission=AdmissionState(policy_version=3, trained_groups=3)))
    cfg = compose_config(["mode=eval", f"model.path={tmp_path / documented}"])
    check_model(cfg)  # pre-flight
    assert cfg.eval.adapter_path == str(ckpt / "model" / "lora_adapter") and adapter_rank(cfg.eval.adapter_path) == 8
    await serve_adapter([engine], cfg.eval.adapter_path, engine.policy_version() + 1)
    served = await engine.prompt_logprobs(probe_tokens(256))

    base = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32).eval()
    base_lp = hf_token_logprobs(base, probe_tokens(256))
    trained_lp = hf_token_logprobs(PeftModel.from_pretrained(base, cfg.eval.adapter_path).eval(), probe_tokens(256))

    def score(lps):
        return sum(lps) / len(lps)

    print(f"\nprobe score: base {score(base_lp):.4f}, trained adapter {score(trained_lp):.4f}, served {score(served):.4f}")
    assert max(abs(a - b) for a, b in zip(served, trained_lp)) <= 1e-3  # the trained adapter is what is served
    assert abs(score(served) - score(trained_lp)) <= 1e-3
    assert abs(score(trained_lp) - score(base_lp)) > 0.05  # ... and it is not the base's score
