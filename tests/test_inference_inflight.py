"""Weight updates while generation is in flight (InferenceSettings.in_flight), on the real vLLM CPU
engine with the tiny model.

One engine per mode, shared by the module: "continue", "abort_resume", and "abort_resume" with
`resume_aborted=False` (that one with max_num_seqs=1, so a request can be held queued inside the
engine behind a long one). Weights are three seeded perturbations A -> B -> C of the tiny model,
kept as Hugging Face fp32 models: the reference log-probs of each token come from the model its
version names, so a token labelled with the wrong version, or computed on a stale KV cache, fails.

A generation is "mid-way" when a short request sent after it has finished (event, not sleep): the
engine batches them, so the long one has produced at least as many tokens by then.
"""

from __future__ import annotations

import asyncio
import copy
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import pytest_asyncio
import torch
from safetensors.torch import save_file

from stand_ins import hf_token_logprobs, until
from workers.core.types import GenerateRequest, GenerateResult
from workers.gateway.config import GatewayConfig
from workers.gateway.server import GatewayServer
from workers.inference.worker import InferenceSettings, InferenceWorker
from workers.inference.segments import SegmentedGeneration, versions_from_spans

on_module_loop = pytest.mark.asyncio(loop_scope="module")  # the engines live on the module's loop

PROMPT = (1, 17, 42, 99, 5)
LONG_TOKENS = 400  # 1-4 s alone on the tiny model (2 shared CPU cores); max_model_len 512
LOGPROB_ATOL = 1e-4  # fp32 engine vs fp32 HF: only summation order differs
T_TIMEOUT_S = 90
SESSION = "inflight-test-session-" + "0" * 16  # ACR-length session id


@dataclass(frozen=True)
class Weights:
    """A weights file and the HF model holding the same values (the reference)."""

    path: str
    model: torch.nn.Module


def _req(prompt, max_tokens: int, **kw) -> GenerateRequest:
    return GenerateRequest(request_id=uuid.uuid4().hex, prompt_ids=tuple(prompt), max_tokens=max_tokens, **kw)


def _output_logprobs_under(model, prompt, result: GenerateResult) -> list[float]:
    """[n_out] reference log-probs of the result's tokens under `model`."""
    return hf_token_logprobs(model, list(prompt) + list(result.output_ids))[len(prompt) - 1 :]


def _change_points(versions: tuple[int, ...]) -> list[int]:
    return [i for i in range(1, len(versions)) if versions[i] != versions[i - 1]]


async def _mid_way(worker: InferenceWorker) -> None:
    """Return once a request sent now has produced 8 tokens: anything running before it has too."""
    await asyncio.wait_for(worker.generate(_req(PROMPT, 8, seed=99)), T_TIMEOUT_S)


@pytest.fixture(scope="module")
def weights(tiny_model_dir, tmp_path_factory) -> dict[str, Weights]:
    """A, B, C: each adds seeded Gaussian noise (std 0.05) to every parameter of the previous."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    out: dict[str, Weights] = {}
    folder = tmp_path_factory.mktemp("inflight-weights")
    with torch.no_grad():
        for seed, name in enumerate("ABC", start=1):
            gen = torch.Generator().manual_seed(seed)
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
            path = folder / f"{name}.safetensors"
            save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
            out[name] = Weights(str(path), copy.deepcopy(model))
    return out


async def _started(path: Path, **kw) -> InferenceWorker:
    w = InferenceWorker(InferenceSettings(model_path=str(path), max_model_len=512, **kw))
    info = await asyncio.wait_for(w.start(), timeout=180)
    print(f"\nengine ({kw}) startup: {info.startup_s:.1f} s")
    return w


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def continue_worker(tiny_model_dir):
    w = await _started(tiny_model_dir, in_flight="continue")
    try:
        yield w
    finally:
        await w.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def resume_worker(tiny_model_dir):
    w = await _started(tiny_model_dir, in_flight="abort_resume")
    try:
        yield w
    finally:
        await w.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def no_resume_worker(tiny_model_dir):
    w = await _started(tiny_model_dir, in_flight="abort_resume", resume_aborted=False, max_num_seqs=1)
    try:
        yield w
    finally:
        await w.shutdown()


async def _load(worker: InferenceWorker, w: Weights) -> int:
    """Load `w` as the next version (nothing in flight); return that version."""
    version = worker.policy_version() + 1
    await asyncio.wait_for(worker.update_weights(w.path, version), T_TIMEOUT_S)
    return version


def test_settings_reject_unknown_in_flight_mode(tiny_model_dir):
    with pytest.raises(ValueError, match="inference.in_flight"):
        InferenceSettings(model_path=str(tiny_model_dir), in_flight="pause")  # type: ignore[arg-type]


def test_generate_result_checks_token_versions():
    with pytest.raises(ValueError, match="non-decreasing"):
        GenerateResult((1, 2), (-0.1, -0.2), "length", 1, token_versions=(2, 1))
    with pytest.raises(ValueError, match="last token"):
        GenerateResult((1, 2), (-0.1, -0.2), "length", 1, token_versions=(1, 2))
    assert GenerateResult((1, 2), (-0.1, -0.2), "length", 3).versions() == (3, 3)


def test_capture_records_the_version_of_each_token_of_a_turn():
    """A turn split by a weight update lands in the row with one version per generated token."""
    from workers.core.types import PROMPT_VERSION
    from workers.gateway.capture import CaptureStore

    store = CaptureStore(default_max_context_tokens=64)
    store.open("s")
    turn = GenerateResult((5, 6, 7), (-0.1, -0.2, -0.3), "stop", 4, token_versions=(3, 3, 4))
    record = store.record_turn("s", (1, 2), turn)
    assert record.policy_version == 4
    (row,) = store.close("s").rows
    assert row.versions == (PROMPT_VERSION, PROMPT_VERSION, 3, 3, 4)
    assert row.rollout_logprobs == (0.0, 0.0, -0.1, -0.2, -0.3)


@dataclass(frozen=True)
class _Span:
    version: str
    start: int
    end: int


def test_segments_concatenate_and_pin_the_token_budget():
    seg = SegmentedGeneration("r", max_tokens=5)
    seg.add([7, 8], [-0.1, -0.2], versions_from_spans("r", [_Span("3", 0, 2)], 2), "abort")
    assert (seg.remaining_tokens(), seg.next_segment_id()) == (3, "r-resume1")
    with pytest.raises(RuntimeError, match="exceeds the remaining budget"):
        seg.add([1, 2, 3, 4], [0.0] * 4, [4] * 4, "length")
    with pytest.raises(RuntimeError, match="go backwards"):
        seg.add([1], [0.0], [2], "length")
    seg.add([9, 10, 11], [-0.3, -0.4, -0.5], versions_from_spans("r", [_Span("3", 0, 1), _Span("4", 1, 3)], 3), "length")
    r = seg.result(version_if_empty=0)
    assert r.output_ids == (7, 8, 9, 10, 11) and r.logprobs == (-0.1, -0.2, -0.3, -0.4, -0.5)
    assert r.versions() == (3, 3, 3, 4, 4) and r.policy_version == 4 and r.finish_reason == "length"
    with pytest.raises(RuntimeError, match="after one that finished"):
        seg.add([], [], [], "abort")
    with pytest.raises(RuntimeError, match="cover 1 of 2"):
        versions_from_spans("r", [_Span("1", 0, 1)], 2)
    empty = SegmentedGeneration("e", max_tokens=4)
    empty.add([], [], [], "abort")
    assert empty.result(version_if_empty=6).policy_version == 6


@on_module_loop
async def test_continue_switches_version_once_and_logprobs_follow_the_weights(continue_worker, weights):
    """Tokens before the swap are labelled and scored by A, tokens after by B (whose KV cache was
    recomputed: the engine's own prompt log-probs under B match the post-swap tokens)."""
    w = continue_worker
    va = await _load(w, weights["A"])
    long_req = asyncio.create_task(w.generate(_req(PROMPT, LONG_TOKENS, seed=1)))
    await _mid_way(w)
    await asyncio.wait_for(w.update_weights(weights["B"].path, va + 1), T_TIMEOUT_S)
    r = await asyncio.wait_for(long_req, T_TIMEOUT_S)

    assert r.finish_reason == "length" and len(r.output_ids) == LONG_TOKENS
    (k,) = _change_points(r.versions())  # exactly one switch
    assert r.versions() == (va,) * k + (va + 1,) * (LONG_TOKENS - k)
    assert k >= 8 and r.policy_version == va + 1  # switched mid-way; last token's version

    engine_b = await w.prompt_logprobs(list(PROMPT) + list(r.output_ids))  # B is loaded now
    post = engine_b[len(PROMPT) - 1 :][k:]
    assert r.logprobs[k:] == pytest.approx(post, abs=LOGPROB_ATOL)
    assert r.logprobs[:k] == pytest.approx(_output_logprobs_under(weights["A"].model, PROMPT, r)[:k], abs=LOGPROB_ATOL)
    diff_pre = max(abs(a - b) for a, b in zip(r.logprobs[:k], engine_b[len(PROMPT) - 1 :][:k]))
    assert diff_pre > 1e-2  # pre-swap tokens really were scored by other weights than B


@on_module_loop
async def test_a_bad_weights_file_is_refused_before_requests_are_touched(continue_worker, tmp_path):
    """Regression: a reload that failed inside the engine (here: a corrupt file) left meta tensors
    behind and the engine died at its next step, taking the paused requests with it. The file is
    now checked before the pause; the running request finishes on its version, the engine lives."""
    w = continue_worker
    v = w.policy_version()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    running = asyncio.create_task(w.generate(_req(PROMPT, 64, seed=5)))
    await _mid_way(w)
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        await asyncio.wait_for(w.update_weights(str(bad), v + 1), T_TIMEOUT_S)
    r = await asyncio.wait_for(running, T_TIMEOUT_S)
    assert len(r.output_ids) == 64 and set(r.versions()) == {v} and w.policy_version() == v
    assert not w.update_pending()


@on_module_loop
async def test_abort_resume_concatenates_segments_within_the_token_budget(resume_worker, weights):
    """Two swaps during one request: it is aborted and resumed twice, never exceeds max_tokens,
    and each segment's log-probs are those of the weights its version names (A, B, C)."""
    w = resume_worker
    va = await _load(w, weights["A"])
    long_req = asyncio.create_task(w.generate(_req(PROMPT, LONG_TOKENS, seed=2)))
    await _mid_way(w)
    await asyncio.wait_for(w.update_weights(weights["B"].path, va + 1), T_TIMEOUT_S)
    await _mid_way(w)
    await asyncio.wait_for(w.update_weights(weights["C"].path, va + 2), T_TIMEOUT_S)
    r = await asyncio.wait_for(long_req, T_TIMEOUT_S)

    assert r.finish_reason == "length"
    assert len(r.output_ids) == len(r.logprobs) == len(r.versions()) == LONG_TOKENS  # budget pinned
    k1, k2 = _change_points(r.versions())
    assert r.versions() == (va,) * k1 + (va + 1,) * (k2 - k1) + (va + 2,) * (LONG_TOKENS - k2)
    for (lo, hi), name in zip([(0, k1), (k1, k2), (k2, LONG_TOKENS)], "ABC"):
        ref = _output_logprobs_under(weights[name].model, PROMPT, r)
        assert r.logprobs[lo:hi] == pytest.approx(ref[lo:hi], abs=LOGPROB_ATOL), f"segment under {name}"


@pytest.mark.parametrize("mode", ["continue", "abort_resume"])
@on_module_loop
async def test_every_concurrent_request_returns_one_full_result(mode, continue_worker, resume_worker, weights):
    """No request is lost or over budget when a swap lands in the middle of a busy batch."""
    w = continue_worker if mode == "continue" else resume_worker
    v = w.policy_version()
    budgets = [20, 60, 100, 150, 200, 250, 250, 250]
    tasks = [asyncio.create_task(w.generate(_req(PROMPT, n, seed=i))) for i, n in enumerate(budgets)]
    await _mid_way(w)
    await asyncio.wait_for(w.update_weights(weights["C"].path, v + 1), T_TIMEOUT_S)
    results = await asyncio.wait_for(asyncio.gather(*tasks), T_TIMEOUT_S)
    assert [len(r.output_ids) for r in results] == budgets
    assert all(r.finish_reason == "length" and set(r.versions()) <= {v, v + 1} for r in results)
    assert any(len(set(r.versions())) == 2 for r in results)  # the swap landed mid-request
    assert w.num_in_flight() == 0


@pytest.mark.parametrize("mode", ["continue", "abort_resume"])
@on_module_loop
async def test_sync_is_bounded_while_a_long_generation_runs(mode, continue_worker, resume_worker, weights):
    """update_weights returns after one engine step + reload, long before the generation ends;
    a "drain" update would have waited for all of it."""
    w = continue_worker if mode == "continue" else resume_worker
    v = w.policy_version()
    t_start = time.perf_counter()
    long_req = asyncio.create_task(w.generate(_req(PROMPT, LONG_TOKENS, seed=3)))
    await _mid_way(w)
    t0 = time.perf_counter()
    await asyncio.wait_for(w.update_weights(weights["A"].path, v + 1), T_TIMEOUT_S)
    update_s = time.perf_counter() - t0
    assert not long_req.done()  # the update did not wait for the generation
    r = await asyncio.wait_for(long_req, T_TIMEOUT_S)
    rest_s = time.perf_counter() - t0 - update_s
    print(f"\n{mode}: update_weights {update_s * 1e3:.0f} ms during a {LONG_TOKENS}-token generation "
          f"({time.perf_counter() - t_start:.2f} s in all, {rest_s:.2f} s left after the update)")
    assert len(r.output_ids) == LONG_TOKENS and set(r.versions()) == {v, v + 1}
    assert update_s < 1.0 and update_s < rest_s


@on_module_loop
async def test_without_resumption_the_request_ends_aborted_and_the_gateway_records_nothing(
    no_resume_worker, weights, tiny_model_dir
):
    """resume_aborted=False: the running request returns "abort" with its partial tokens (all of
    the old version); a chat turn queued in the same engine is aborted too, the gateway answers
    503 and records no turn; the next turn after the update is served and recorded."""
    w = no_resume_worker  # max_num_seqs=1: the chat turn waits in the engine behind `blocker`
    v = w.policy_version()
    cfg = GatewayConfig(model_path=str(tiny_model_dir), max_context_tokens=512, max_tokens=16)
    server = GatewayServer(cfg, [w])
    await asyncio.wait_for(server.start(), T_TIMEOUT_S)
    try:
        token = await server.open_session(SESSION)
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key=token, max_retries=0, timeout=T_TIMEOUT_S) as client:
            blocker = asyncio.create_task(w.generate(_req(PROMPT, LONG_TOKENS, seed=4)))
            messages = [{"role": "user", "content": "Repeat the letter q 4 times."}]
            chat = asyncio.create_task(client.chat.completions.create(model=cfg.model_id, messages=messages))
            await asyncio.wait_for(until(lambda: w.num_in_flight() == 2), T_TIMEOUT_S)
            # the chat request was handed to the engine microseconds ago; give the message a wide
            # margin to arrive (the blocker holds the only slot for ~3 s, so the turn stays queued)
            await asyncio.sleep(0.3)
            assert not blocker.done() and not chat.done()
            await asyncio.wait_for(w.update_weights(weights["B"].path, v + 1), T_TIMEOUT_S)
            r = await asyncio.wait_for(blocker, T_TIMEOUT_S)
            with pytest.raises(openai.InternalServerError) as err:
                await asyncio.wait_for(chat, T_TIMEOUT_S)
            assert err.value.status_code == 503

            assert r.finish_reason == "abort" and 0 < len(r.output_ids) < LONG_TOKENS
            assert set(r.versions()) == {v} and len(r.logprobs) == len(r.output_ids)
            m = server.metrics()
            assert (m.turns_aborted, m.turns_served) == (1, 0)

            ok = await client.chat.completions.create(model=cfg.model_id, messages=messages)
            assert ok.choices[0].finish_reason in ("stop", "length")
        cap = await server.close_session(SESSION)
        assert cap.num_turns == 1 and len(cap.rows) == 1  # only the turn served after the update
        assert set(cap.rows[0].generated_versions()) == {v + 1}
    finally:
        await server.stop()
