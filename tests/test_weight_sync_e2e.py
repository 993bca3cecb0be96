"""The bucketed broadcast weight sync wired into the run (workers/weight_sync/setup.py).

Unit level, real parts in one process: a real TrainerWorker (FSDP2) and a real vLLM
InferenceWorker (in_flight="continue") joined through `open_weight_sync("shm", ...)`; a push
lands in the engine while a request is generating (its tokens switch version at the swap), the
engine then scores tokens exactly as the trainer's weights do, and a stale push is still taken
off the wire and refused without hanging the trainer.

The main job with `trainer.weight_sync.backend=gloo` (no weights file is written, the policy version
advances every step, and sync mode stays on-policy: the engine's log-probs equal the trainer's
recompute, which only holds if the engine got the trainer's weights) is run end to end by
tests/test_e2e.py (test_main_job_runs_end_to_end_on_real_parts), which syncs by the broadcast.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from stand_ins import InThread
from workers.core.types import GenerateRequest
from workers.weight_sync.setup import close_weight_sync, open_weight_sync

T_TIMEOUT_S = 120.0
SHM_DIR = Path("/dev/shm")


def _weight_sync_slots() -> set[str]:
    return {p.name for p in SHM_DIR.glob("weight-sync-*")}


def _reference_logprobs(model_path: str, state: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]), t >= 1, under `state` loaded into a plain HF model (fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


@pytest.mark.timeout(300)
async def test_shm_push_reaches_a_generating_engine_and_matches_the_trainer():
    from workers.inference.worker import InferenceSettings, InferenceWorker
    from workers.embedded.tiny_model import ensure_tiny_model
    from workers.trainer.worker import TrainerSettings, TrainerWorker

    model_path = str(ensure_tiny_model())
    slots_before = _weight_sync_slots()
    trainer = TrainerWorker(TrainerSettings(model_path=model_path, weight_sync_bucket_mb=0.25))
    engine = InferenceWorker(InferenceSettings(model_path=model_path, in_flight="continue"))
    try:
        await asyncio.wait_for(engine.start(), T_TIMEOUT_S)
        with torch.no_grad():  # the trainer's weights move away from the engine's
            gen = torch.Generator().manual_seed(0)
            for p in trainer.model.parameters():
                local = p.to_local() if hasattr(p, "to_local") else p
                local.add_(torch.randn(local.shape, generator=gen) * 0.05)
        state = trainer.full_state_dict()
        ids = list(range(3, 40))
        want = _reference_logprobs(model_path, state, ids)
        before = torch.tensor(await engine.prompt_logprobs(ids))
        assert (before - want).abs().max() > 1e-2  # the check below can tell the weights apart

        sync = await asyncio.wait_for(open_weight_sync("shm", InThread(trainer), [engine]), T_TIMEOUT_S)
        running = asyncio.create_task(engine.generate(GenerateRequest(
            request_id="in-flight", prompt_ids=(3, 4, 5), max_tokens=256, seed=1)))
        while engine.num_in_flight() == 0:  # admitted: the push below lands while it generates
            await asyncio.sleep(0.01)
        report = await asyncio.wait_for(sync.sync(1), T_TIMEOUT_S)
        assert report.version == 1 and sync.version() == 1 and engine.policy_version() == 1
        result = await asyncio.wait_for(running, T_TIMEOUT_S)
        assert len(result.output_ids) == 256
        assert result.token_versions[0] == 0 and result.token_versions[-1] == 1  # switched at the swap
        after = torch.tensor(await engine.prompt_logprobs(ids))
        assert (after - want).abs().max() < 1e-3, (after - want).abs().max()
        assert _weight_sync_slots() - slots_before  # the shm slots exist while the group is open

        # a stale push (the sync itself refuses v <= 1; here the trainer sends anyway) is drained
        # by the engine and refused, and the trainer returns instead of waiting forever
        send, recv = await asyncio.wait_for(asyncio.gather(
            asyncio.to_thread(trainer.broadcast_weights, 1), engine.receive_weights(1),
            return_exceptions=True), T_TIMEOUT_S)
        assert send.version == 1 and isinstance(recv, ValueError) and "must increase" in str(recv)
        assert engine.policy_version() == 1
        with pytest.raises(ValueError, match="must increase"):
            await sync.sync(1)
        await close_weight_sync(sync, InThread(trainer))
        assert _weight_sync_slots() <= slots_before  # the sender removed its slots
    finally:
        await engine.shutdown()
        trainer.close()
