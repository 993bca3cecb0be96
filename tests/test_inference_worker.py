"""InferenceWorker on the real vLLM CPU engine with the tiny model, and the CPU weight sync.

One engine is shared by the module (startup dominates the cost). The weight-sync probe proves a
reload takes effect everywhere, the output layer included: after `push`, the engine's prompt
log-probs equal a Hugging Face fp32 forward pass over the same perturbed weights.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from safetensors.torch import save_file

from stand_ins import hf_token_logprobs, until
from workers.core.types import GenerateRequest
from workers.inference.engine import KvCacheUsage
from workers.inference.worker import InferenceSettings, InferenceWorker, WeightsGate
from workers.inference.settings import DEFAULT_KV_CACHE_BYTES
from workers.weight_sync.file import FileWeightSync

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROBE = [1, 17, 42, 99, 5, 230, 211, 8, 64, 128, 7, 250, 2, 45, 90, 11]  # ids < 259 exist in any vocab
LOGPROB_ATOL = 1e-4  # fp32 engine vs fp32 HF: only summation order differs
T_TIMEOUT_S = 60


def _req(prompt: list[int], max_tokens: int, **kw) -> GenerateRequest:
    return GenerateRequest(request_id=uuid.uuid4().hex, prompt_ids=tuple(prompt), max_tokens=max_tokens, **kw)


def _hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


@torch.no_grad()
def _perturb_and_save(model, path: Path, seed: int, only: str | None = None) -> None:
    """Add seeded Gaussian noise (std 0.05) to every parameter (or those whose name contains
    `only`), in place, and write the full state dict as one safetensors file (trainer format)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if only is None or only in name:
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def worker(tiny_model_dir):
    # 32-token blocks (vLLM CPU's default is 128): inference.block_size reaches the engine
    w = InferenceWorker(InferenceSettings(model_path=str(tiny_model_dir), max_model_len=512, max_num_seqs=64,
                                          block_size=32))
    info = await asyncio.wait_for(w.start(), timeout=180)
    print(f"\nengine startup: {info.startup_s:.1f} s")
    try:
        yield w
    finally:
        await w.shutdown()


async def test_generate_returns_aligned_ids_logprobs_and_version(worker):
    prompts = [[1, 20 + i, 30 + i, 40] for i in range(16)]
    t0 = time.perf_counter()
    results = await asyncio.wait_for(
        asyncio.gather(*(worker.generate(_req(p, 32, seed=i)) for i, p in enumerate(prompts))), T_TIMEOUT_S
    )
    dt = time.perf_counter() - t0
    n_tokens = sum(len(r.output_ids) for r in results)
    print(f"\ngenerate: {n_tokens} tokens, 16 concurrent requests, {n_tokens / dt:.0f} tokens/s")
    for r in results:
        assert r.finish_reason == "length"  # no stop ids given: the engine's EOS must not stop it
        assert len(r.output_ids) == len(r.logprobs) == 32
        assert all(math.isfinite(lp) and lp <= 0.0 for lp in r.logprobs)
        assert r.policy_version == 0


async def test_sampled_logprobs_match_hf_under_temperature(worker, tiny_model_dir):
    """logprobs are log π_rollout of the distribution sampled from: log_softmax(logits / T)."""
    prompt = [1, 50, 60, 70, 80]
    temperature = 0.7
    r = await asyncio.wait_for(worker.generate(_req(prompt, 24, temperature=temperature, seed=3)), T_TIMEOUT_S)
    ref = hf_token_logprobs(_hf_model(tiny_model_dir), prompt + list(r.output_ids), temperature)
    assert r.logprobs == pytest.approx(ref[len(prompt) - 1 :], abs=LOGPROB_ATOL)
    # and the engine's own prefill at T=1 agrees with HF at T=1 on the same sequence
    engine_t1 = await worker.prompt_logprobs(prompt + list(r.output_ids))
    ref_t1 = hf_token_logprobs(_hf_model(tiny_model_dir), prompt + list(r.output_ids))
    assert engine_t1 == pytest.approx(ref_t1, abs=LOGPROB_ATOL)


async def test_stop_token_ends_generation_with_stop(worker):
    prompt = [1, 33, 44, 55]
    free = await asyncio.wait_for(worker.generate(_req(prompt, 16, seed=7)), T_TIMEOUT_S)
    stop_tok = free.output_ids[5]
    first = free.output_ids.index(stop_tok)
    stopped = await asyncio.wait_for(
        worker.generate(_req(prompt, 16, seed=7, stop_token_ids=(stop_tok,))), T_TIMEOUT_S
    )
    assert stopped.finish_reason == "stop"
    assert stopped.output_ids == free.output_ids[: first + 1]  # same seed, cut after the stop id


async def test_update_waits_for_in_flight_request(worker, tiny_model_dir, tmp_path):
    """A request running when an update arrives finishes on the old weights and says so; a
    request issued after the update was requested waits and reports the new version."""
    v0 = worker.policy_version()
    path = tmp_path / "same.safetensors"
    save_file({k: v.contiguous() for k, v in _hf_model(tiny_model_dir).state_dict().items()}, str(path))
    long_req = asyncio.create_task(worker.generate(_req([1, 2, 3], 128, seed=1)))
    await asyncio.wait_for(until(lambda: worker.num_in_flight() == 1), 10)
    update = asyncio.create_task(worker.update_weights(str(path), v0 + 1))
    await asyncio.wait_for(until(worker.update_pending), 10)
    assert not long_req.done()  # the update now waits for it
    late_req = asyncio.create_task(worker.generate(_req([1, 2, 3], 4, seed=1)))
    old, new = await asyncio.wait_for(asyncio.gather(long_req, late_req), T_TIMEOUT_S)
    await asyncio.wait_for(update, T_TIMEOUT_S)
    assert old.policy_version == v0 and len(old.output_ids) == 128
    assert new.policy_version == v0 + 1
    assert worker.policy_version() == v0 + 1


async def test_weight_sync_probe_matches_hf_after_update(worker, tiny_model_dir, tmp_path):
    """THE weight-sync probe: the engine serves exactly the pushed weights, lm_head included."""
    sync = FileWeightSync([worker], initial_version=worker.policy_version())
    base = sync.version()
    pre = await worker.prompt_logprobs(PROBE)

    model = _hf_model(tiny_model_dir)
    path1 = tmp_path / "v1.safetensors"
    _perturb_and_save(model, path1, seed=123)
    report = await asyncio.wait_for(sync.push(str(path1), base + 1), T_TIMEOUT_S)
    assert report.version == base + 1 and report.num_replicas == 1
    post = await worker.prompt_logprobs(PROBE)
    assert post == pytest.approx(hf_token_logprobs(model, PROBE), abs=LOGPROB_ATOL)
    assert max(abs(a - b) for a, b in zip(pre, post)) > 1e-2  # the reload took effect

    # change only the output layer: a stale packed lm_head would keep serving `post`
    path2 = tmp_path / "v2.safetensors"
    _perturb_and_save(model, path2, seed=456, only="lm_head")
    await asyncio.wait_for(sync.push(str(path2), base + 2), T_TIMEOUT_S)
    post2 = await worker.prompt_logprobs(PROBE)
    assert post2 == pytest.approx(hf_token_logprobs(model, PROBE), abs=LOGPROB_ATOL)
    assert max(abs(a - b) for a, b in zip(post, post2)) > 1e-2

    r = await asyncio.wait_for(worker.generate(_req(PROBE[:4], 4, seed=0)), T_TIMEOUT_S)
    assert r.policy_version == base + 2 == sync.version()

    with pytest.raises(ValueError, match="must increase"):
        await sync.push(str(path2), base + 2)
    with pytest.raises(ValueError, match="must increase"):
        await worker.update_weights(str(path2), base + 1)
    assert sync.version() == worker.policy_version() == base + 2


async def test_failed_replica_leaves_sync_version_unchanged(worker, tmp_path):
    sync = FileWeightSync([worker], initial_version=worker.policy_version())
    before = sync.version()
    with pytest.raises(RuntimeError, match="failed on 1/1 replicas"):
        await sync.push(str(tmp_path / "missing.safetensors"), before + 1)
    assert sync.version() == before == worker.policy_version()


# --- WeightsGate alone (no engine) ---------------------------------------------------------


async def test_gate_update_waits_for_running_request_and_blocks_new_ones():
    gate = WeightsGate()
    order: list[str] = []
    release = asyncio.Event()

    async def request(name: str, hold: asyncio.Event | None = None) -> None:
        async with gate.request():
            order.append(f"{name}:start")
            if hold is not None:
                await hold.wait()
            order.append(f"{name}:end")

    async def update() -> None:
        async with gate.update():
            order.append("update")

    running = asyncio.create_task(request("a", release))
    await asyncio.sleep(0)
    assert gate.num_in_flight() == 1
    upd = asyncio.create_task(update())
    await asyncio.sleep(0)
    late = asyncio.create_task(request("b"))
    await asyncio.sleep(0)
    assert gate.update_pending() and order == ["a:start"]  # b waits behind the pending update
    release.set()
    await asyncio.wait_for(asyncio.gather(running, upd, late), 5)
    assert order == ["a:start", "a:end", "update", "b:start", "b:end"]


async def test_gate_cancelled_update_reopens_admission():
    gate = WeightsGate()
    hold = asyncio.Event()

    async def held_request() -> None:
        async with gate.request():
            await hold.wait()

    running = asyncio.create_task(held_request())
    await asyncio.sleep(0)
    upd = asyncio.create_task(gate.update().__aenter__())
    await asyncio.sleep(0)
    assert gate.update_pending()
    upd.cancel()
    await asyncio.gather(upd, return_exceptions=True)
    assert not gate.update_pending()

    async def quick() -> None:
        async with gate.request():
            pass

    await asyncio.wait_for(quick(), 5)  # admitted although `running` still holds its slot
    hold.set()
    await asyncio.wait_for(running, 5)


async def test_probe_after_a_real_trainer_update_matches_the_trainers_logprobs(worker, tiny_model_dir, tmp_path):
    """The sync path end to end: TrainerWorker (FSDP2, gloo) takes a real PPO step, exports its
    weights, the engine reloads them; then the engine's log-probs on a probe sequence equal the
    trainer's own recompute (π_old path) to 1e-4 in fp32, and differ from the engine's before."""
    from workers.core.algorithms.batch import TrainBatch
    from workers.core.types import TrajectoryRow
    from workers.trainer.worker import TrainerSettings, TrainerWorker

    trainer = TrainerWorker(TrainerSettings(model_path=str(tiny_model_dir), lr=5e-2, seed=0, micro_batch_size=4))
    try:
        probe_row = TrajectoryRow(tuple(PROBE), (0,) + (1,) * (len(PROBE) - 1), (0.0,) * len(PROBE),
                                  (-1,) + (0,) * (len(PROBE) - 1))
        probe = TrainBatch.from_rows([probe_row], [0.0], pad_id=0)
        # one big step that favours the probe's tokens (rollout log-probs = the trainer's: on-policy)
        before = trainer.compute_logprobs(probe)[0]
        row = TrajectoryRow(tuple(PROBE), probe_row.loss_mask, tuple(before.tolist()), probe_row.versions)
        metrics = trainer.train_batch(TrainBatch.from_rows([row, row], [1.0, 1.0], pad_id=0))
        assert metrics["actor/grad_norm"] > 0
        path = trainer.export_weights(str(tmp_path / "policy.safetensors"))
        version = worker.policy_version() + 1
        await asyncio.wait_for(worker.update_weights(path, version), timeout=T_TIMEOUT_S)
        engine = await worker.prompt_logprobs(PROBE)
        theirs = trainer.compute_logprobs(probe)[0, 1:].tolist()
        assert max(abs(a - b) for a, b in zip(engine, theirs)) < LOGPROB_ATOL
        assert max(abs(a - b) for a, b in zip(engine, before[1:].tolist())) > 1e-2  # the update took effect
        assert sum(engine) > float(before[1:].sum())  # and moved toward the favoured tokens
    finally:
        trainer.close()


async def test_a_burst_of_seeded_long_prompts_never_splits_a_prompt_on_cpu(worker):
    # 64 seeded prompts of 400 tokens (25,600 prefill tokens) exceed any step's token budget: with
    # chunked prefill vLLM's CPU build splits a prompt across steps and then dies rewinding its
    # seeded sampler ("CPU Generator does not use offset"); the CPU engine runs without it.
    results = await asyncio.wait_for(asyncio.gather(*(
        worker.generate(_req([(7 * i + j) % 200 + 3 for j in range(400)], 2, seed=i)) for i in range(64))), T_TIMEOUT_S)
    assert all(len(r.output_ids) >= 1 for r in results)


async def test_block_size_sets_the_engines_kv_block(worker):
    block, blocks = worker.kv_cache_blocks()
    assert block == 32
    # the default cache of the tiny model (2 KiB of K and V per token) in 64 KiB blocks
    assert blocks == DEFAULT_KV_CACHE_BYTES // (32 * 2048)


async def test_kv_cache_usage_is_reported_per_interval(worker):
    worker.kv_cache_usage()  # reset the interval
    await asyncio.wait_for(asyncio.gather(*(worker.generate(_req([1, 5, 9, 13], 24, seed=i)) for i in range(8))),
                           T_TIMEOUT_S)
    usage = worker.kv_cache_usage()
    assert 0.0 < usage < 1.0  # blocks were in use during decoding, fraction of the explicit cache
    await asyncio.sleep(0.5)
    worker.kv_cache_usage()  # the last step's record (0 after freeing) may land just after generate returns
    await asyncio.sleep(0.2)
    assert worker.kv_cache_usage() == 0.0  # an idle engine holds no blocks: idle time averages in as 0
    load = worker.engine_load()
    assert load.kv_usage_integral_s > 0 and load.clock_s is not None


async def test_kv_cache_usage_is_a_time_average_not_a_mean_over_steps():
    t = [100.0]
    kv = KvCacheUsage(clock=lambda: t[0])
    t[0] = 101.0
    kv.add(0.8)  # step at 101: 0.8 held from here
    t[0] = 104.0
    kv.add(0.0)  # the last request freed at 104
    t[0] = 111.0  # 7 idle seconds, no step
    # ∫ = 0 x 1 + 0.8 x 3 + 0 x 7 = 2.4 over 11 s (a mean over the two steps would say 0.4)
    assert kv.take_mean() == pytest.approx(2.4 / 11)
    assert kv.integral() == (pytest.approx(2.4), 111.0)
    kv.add(0.5)
    t[0] = 113.0
    assert kv.take_mean() == pytest.approx(0.5)  # a new window from the last read
    assert math.isnan(kv.take_mean())  # no time passed


async def test_kv_cache_usage_counts_the_blocks_a_step_held_while_it_ran():
    # vLLM reports a step's usage after freeing its finished requests: a step of 0.1 s that ran
    # 4 of 5 blocks and finished 2 of them reports 0.4. The interval it ran counts 0.8; after an
    # idle gap only the step's own time (the recent back-to-back step time) does.
    t = [0.0]
    kv = KvCacheUsage(clock=lambda: t[0])
    t[0] = 1.0
    kv.add(0.8, running=4, waiting=2)  # first step after 1 s idle: no step time known yet, gap counts 0
    t[0] = 1.1
    kv.add(0.4, running=2, waiting=0, freed=0.4)  # back to back: 0.1 s at 0.8; step time 0.1 s
    t[0] = 1.2
    kv.add(0.0, running=0, waiting=0, freed=0.4)  # the last two finish: 0.1 s at 0.4, then idle
    t[0] = 3.2
    kv.add(0.2, running=1, waiting=0, freed=0.0)  # a request arrived after 2 s idle: its step ~0.1 s at 0.2
    assert kv.integral() == (pytest.approx(0.8 * 0.1 + 0.4 * 0.1 + 0.2 * 0.1), 3.2)
    assert kv.waiting_integral() == pytest.approx(2 * 0.1)  # 2 waited from the first record to the next
    assert kv.step_s == pytest.approx(0.1)
    t[0] = 5.2  # a 2-s pause (a weight update) with the request's block held, then a step of 0.1 s at 0.4
    kv.add(0.2, running=1, waiting=0, freed=0.2)
    assert kv.integral()[0] == pytest.approx(0.14 + 0.2 * 1.9 + 0.4 * 0.1)
    assert kv.step_s == pytest.approx(0.1)  # the pause is not a step


async def test_freed_fraction_counts_each_finished_requests_blocks():
    from types import SimpleNamespace as R

    from workers.inference.engine import freed_fraction

    done = [R(num_prompt_tokens=19, num_generation_tokens=6), R(num_prompt_tokens=120, num_generation_tokens=20)]
    # 24 KV tokens -> 1 block of 128; 139 -> 2 blocks; a 6-block cache has 5 usable (vLLM's null block)
    assert freed_fraction(done, 128, 6) == pytest.approx(3 / 5)
    assert freed_fraction(done, None, None) == 0.0 and freed_fraction([], 128, 6) == 0.0


async def test_settings_module_imports_without_vllm_or_torch():
    """The config layer imports `workers.inference.settings` (IN_FLIGHT_MODES, InferenceSettings): it
    must stay light, so a fresh interpreter that imports it has loaded neither vLLM nor torch."""
    import subprocess
    import sys

    code = ("import sys, workers.inference.settings as s; "
            "assert s.IN_FLIGHT_MODES == ('drain', 'continue', 'abort_resume'); "
            "print(sorted(m for m in ('vllm', 'torch', 'ray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=str(Path(__file__).resolve().parents[1]))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(("temperature", "top_p"), [(0.5, 1.0), (0.7, 1.0), (1.0, 1.0), (0.7, 0.9)])
async def test_trainer_scores_the_distribution_the_engine_sampled_from(worker, tiny_model_dir, tmp_path, temperature,
                                                                      top_p):
    """Regression (issue 12, item 9): at rollout.temperature=0.5 the engine's log-probs were of the
    tempered distribution and the trainer's of the untempered one (on-policy KL ~0.12, is_mean
    ~0.93). The trainer's scoring (workers/trainer/helpers.token_logprobs with the rollout's
    temperature and top_p) must give on-policy KL < 1e-4 and mean IS weight within 1e-3 of 1."""
    from workers.core.algorithms.rollout_correction import offpolicy_metrics
    from workers.trainer.helpers import token_logprobs

    # the module's engine may hold perturbed weights from an earlier test: load the tiny model's again
    path = tmp_path / "tiny.safetensors"
    save_file({k: v.contiguous() for k, v in _hf_model(tiny_model_dir).state_dict().items()}, str(path))
    await asyncio.wait_for(worker.update_weights(str(path), worker.policy_version() + 1), T_TIMEOUT_S)
    prompts = [[1, 50 + i, 60, 70 + i] for i in range(8)]
    results = await asyncio.wait_for(asyncio.gather(*(
        worker.generate(_req(p, 32, temperature=temperature, top_p=top_p, seed=i)) for i, p in enumerate(prompts))),
        T_TIMEOUT_S)
    ids = torch.tensor([p + list(r.output_ids) for p, r in zip(prompts, results)])
    rollout = torch.tensor([r.logprobs for r in results])
    mask = torch.ones_like(rollout)
    with torch.no_grad():
        logits = _hf_model(tiny_model_dir)(input_ids=ids).logits
    scored = {}
    for name, t, p in (("matched", temperature, top_p), ("untempered", 1.0, 1.0)):
        lp, _ = token_logprobs(logits, ids, with_entropy=False, temperature=t, top_p=p)
        scored[name] = lp[:, len(prompts[0]):]
    m = offpolicy_metrics(scored["matched"], rollout, mask)
    is_mean = torch.exp(scored["matched"] - rollout).mean().item()
    assert abs(m["kl"]) < 1e-4 and m["k3_kl"] < 1e-4 and abs(is_mean - 1) < 1e-3, (m["kl"], m["k3_kl"], is_mean)
    if (temperature, top_p) != (1.0, 1.0):  # the old scoring does not match: the test can fail
        assert abs(offpolicy_metrics(scored["untempered"], rollout, mask)["kl"]) > 1e-3
