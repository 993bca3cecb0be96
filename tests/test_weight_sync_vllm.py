"""Receiver side of the broadcast weight sync inside a real vLLM CPU engine (workers/inference/vllm_ext.py).

One offline `vllm.LLM` engine with our worker extension joins a weight-sync group, receives a
push of perturbed weights from a sender thread, and must then compute the prompt log-probs of a
Hugging Face fp32 forward over the same perturbed weights: the stream went through vLLM's
in-place reload, output layer included. Then it leaves, joins a gloo group and takes a second push.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from stand_ins import hf_token_logprobs
from workers.embedded.tiny_model import ensure_tiny_model
from workers.weight_sync.broadcast import new_group_info, send_weights
from workers.weight_sync.plan import specs_of
from workers.weight_sync.transport import open_transport

PROBE = [1, 17, 42, 99, 5, 230, 211, 8, 64, 128, 7, 250, 2, 45, 90, 11]
LOGPROB_ATOL = 1e-4  # fp32 engine vs fp32 HF: only summation order differs
T_TIMEOUT_S = 120.0
MP_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


@pytest.fixture(scope="module")
def llm():
    from vllm import LLM

    old = os.environ.get(MP_ENV)
    os.environ[MP_ENV] = "0"  # model worker in this process: faster start on 2 cores
    engine = LLM(model=str(ensure_tiny_model()), dtype="float32", max_model_len=128, max_num_seqs=4,
                 kv_cache_memory_bytes=64 * 2**20, enforce_eager=True, skip_tokenizer_init=True, seed=0,
                 worker_extension_cls="workers.inference.vllm_ext.WeightReloadExtension", distributed_executor_backend="uni")
    try:
        yield engine
    finally:
        engine.llm_engine.engine_core.shutdown()
        if old is None:
            os.environ.pop(MP_ENV, None)
        else:
            os.environ[MP_ENV] = old


def engine_logprobs(llm) -> list[float]:
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    out = llm.generate([TokensPrompt(prompt_token_ids=PROBE)], params, use_tqdm=False)[0]
    return [float(out.prompt_logprobs[t][PROBE[t]].logprob) for t in range(1, len(PROBE))]


@torch.no_grad()
def perturbed_model(seed: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(Path(ensure_tiny_model()), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    ref = hf_token_logprobs(model, PROBE)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, ref


def push(llm, backend: str, version: int, seed: int) -> list[float]:
    """Join a fresh group of `backend`, push perturbed weights as `version`, return the HF reference."""
    sd, ref = perturbed_model(seed)
    info = new_group_info(backend, 1, timeout_s=T_TIMEOUT_S)
    sender: dict = {}
    errors: list[BaseException] = []

    def send() -> None:
        try:
            sender["t"] = open_transport(info, 0)  # gloo: blocks until the engine joined
            sender["ready"].set()
            sender["report"] = send_weights(sender["t"], specs_of(sd), sd.items(), version=version, bucket_bytes=2**20)
        except BaseException as e:  # surfaced by the assertion below
            errors.append(e)
            sender["ready"].set()

    sender["ready"] = threading.Event()
    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    if backend == "shm":  # the store lives in the sender: let it start before the engine connects
        assert sender["ready"].wait(T_TIMEOUT_S)
    assert llm.collective_rpc("join_weight_sync_group", args=(info, 1)) == [1]
    counts = llm.collective_rpc("receive_weights_broadcast", args=(version, version - 1))
    thread.join(T_TIMEOUT_S)
    assert not errors, errors
    assert counts == [len(sd)] and sender["report"].num_buckets > 1
    assert llm.reset_prefix_cache()
    llm.collective_rpc("leave_weight_sync_group")
    sender["t"].close()
    return ref


def test_vllm_engine_serves_the_broadcast_weights(llm):
    before = engine_logprobs(llm)
    ref1 = push(llm, "shm", version=1, seed=1)
    after1 = engine_logprobs(llm)
    assert max(abs(a - b) for a, b in zip(before, ref1)) > 100 * LOGPROB_ATOL  # the push changed something
    assert after1 == pytest.approx(ref1, abs=LOGPROB_ATOL)
    ref2 = push(llm, "gloo", version=2, seed=2)
    assert engine_logprobs(llm) == pytest.approx(ref2, abs=LOGPROB_ATOL)
