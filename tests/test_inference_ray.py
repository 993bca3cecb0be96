"""InferenceWorker inside a real Ray actor: start, generate and a weight push through the handle."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import ray
import torch
from safetensors.torch import save_file

from stand_ins import own_ray
from workers.core.types import GenerateRequest
from workers.inference.worker import InferenceSettings, InferenceWorker
from workers.embedded.tiny_model import ensure_tiny_model
from workers.weight_sync.file import FileWeightSync


@pytest.fixture
def ray_cluster():
    with own_ray():
        yield


async def test_generate_and_weight_push_through_ray_actor(ray_cluster, tmp_path):
    model_path = Path(ensure_tiny_model())
    actor_cls = ray.remote(num_cpus=1)(InferenceWorker)
    actor = actor_cls.remote(InferenceSettings(model_path=str(model_path)))
    try:
        info = await actor.start.remote()
        print(f"\nengine startup in Ray actor: {info.startup_s:.1f} s")
        req = GenerateRequest(request_id=uuid.uuid4().hex, prompt_ids=(1, 2, 3, 4), max_tokens=8, seed=0)
        r = await actor.generate.remote(req)
        assert len(r.output_ids) == len(r.logprobs) == 8 and r.finish_reason == "length"
        assert r.policy_version == 0

        from transformers import AutoModelForCausalLM

        sd = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).state_dict()
        path = tmp_path / "v1.safetensors"
        save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
        sync = FileWeightSync([actor])
        report = await sync.push(str(path), 1)
        assert report.version == 1
        assert await actor.policy_version.remote() == 1
        r2 = await actor.generate.remote(req)
        assert r2.policy_version == 1
        assert r2.output_ids == r.output_ids  # same weights, same seed: same tokens
    finally:
        await actor.shutdown.remote()
        ray.kill(actor)
