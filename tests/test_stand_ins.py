"""The shared stand-ins (tests/stand_ins.py, tests/conftest.py) do what the tests built on them
assume: virtual time moves only when told, builders refuse misaligned rows, the in-memory store
keeps partitions apart, the scripted chat server answers over a real socket, the reference log-probs are next-token
log-probs."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from stand_ins import (
    REPO,
    InThread,
    ManualVersions,
    MemoryStore,
    ScriptedChatServer,
    chat_completion,
    hf_token_logprobs,
    load_module,
    make_group,
    make_row,
    make_sample,
    new_session_id,
    random_qwen2,
    until,
    wait_until,
)
from workers.core.types import GenerateRequest


async def test_fake_clock_moves_only_by_sleep_and_tick(fake_clock):
    assert fake_clock.now() == fake_clock() == 1000.0
    await fake_clock.sleep(2.5)
    assert fake_clock.now() == 1002.5 and fake_clock.slept == [2.5]
    ticking = type(fake_clock)(0.0, tick_s=1.5)
    assert [ticking(), ticking.now()] == [1.5, 3.0]  # each reading 1.5 s after the last


def test_make_row_aligns_prompt_and_generated_tokens():
    row = make_row((5,), (6, 7), logprobs=(-0.5, -0.7), versions=(0, 1))
    assert row.token_ids == (5, 6, 7) and row.loss_mask == (0, 1, 1)
    assert row.rollout_logprobs == (0.0, -0.5, -0.7) and row.versions == (-1, 0, 1)
    assert make_row((1, 2), (3,)).rollout_logprobs == (0.0, 0.0, -0.5)
    with pytest.raises(ValueError, match="2 generated tokens, 1 log-probs"):
        make_row((1,), (2, 3), logprobs=(-0.1,))


def test_make_sample_and_group():
    failed = make_sample(3, 1, 0.5, status="failed")
    assert (failed.session_id, failed.input_id, failed.reward, failed.status) == ("s-3-1", "in-3", None, "failed")
    assert make_sample(0, 0, rows=()).rows == ()
    group = make_group(7, [1.0, 0.0])
    assert group.group_id == 7 and [s.reward for s in group.samples] == [1.0, 0.0]
    assert [s.rows[0].num_generated for s in group.samples] == [3, 4]  # default rows: 3 + index tokens


def test_manual_versions_and_session_ids():
    versions = ManualVersions(2)
    versions.v += 1
    assert versions.current() == 3
    a, b = new_session_id("x"), new_session_id("x")
    assert a != b and a.startswith("x-") and 33 <= len(a) <= 256


async def test_memory_store_keeps_partitions_apart():
    store = MemoryStore()
    await store.put([make_sample(0, 0), make_sample(1, 0)], "a")
    await store.put([make_sample(0, 1)], "b")
    assert [s.session_id for s in store.partitions["a"]] == ["s-0-0", "s-1-0"]
    assert store.read_rows("a", ["s-1-0/0"]) == list(make_sample(1, 0).rows)
    await store.clear_samples("a", [make_sample(0, 0).info()])
    assert [s.session_id for s in store.partitions["a"]] == ["s-1-0"]
    with pytest.raises(AssertionError):  # the product clears keys it was handed: a sample not stored is a bug
        await store.clear_samples("a", [make_sample(0, 0).info()])
    await store.clear("b")
    assert store.cleared == ["b"] and list(store.partitions) == ["a"]


def test_wait_until_returns_the_value_or_gives_up():
    assert wait_until(lambda: 42, timeout_s=1) == 42
    t0 = time.monotonic()
    assert wait_until(lambda: None, timeout_s=0.2, every_s=0.05) is None
    assert time.monotonic() - t0 >= 0.2


async def test_in_thread_runs_blocking_calls_off_the_loop():
    release = threading.Event()

    class Blocking:
        def wait(self, timeout_s: float) -> bool:
            return release.wait(timeout_s)

    waiting = asyncio.create_task(InThread(Blocking()).wait(10))
    await asyncio.sleep(0.01)
    assert not waiting.done()  # the loop is free while the call blocks
    release.set()
    assert await asyncio.wait_for(waiting, 5)
    await asyncio.wait_for(until(waiting.done), 1)


async def test_zero_cost_engine_fixture_answers_the_default_reply(zero_cost_engine):
    engine = zero_cost_engine(version=4)
    req = GenerateRequest(request_id="r", prompt_ids=(1,), max_tokens=8)
    out = await engine.generate(req)
    assert (out.output_ids, out.policy_version, engine.requests) == ((7, 8, 2), 4, [req])


def test_scripted_chat_server_answers_and_records():
    def answer(body: dict):
        if body["messages"][-1]["content"] == "error":
            return 500, {"error": {"message": "boom"}}
        return 200, chat_completion(body, {"role": "assistant", "content": "hi"})

    def post(url: str, body: dict) -> tuple[int, dict]:
        req = urllib.request.Request(url, json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", "Authorization": "Bearer t"})
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    with ScriptedChatServer(answer) as server:
        status, body = post(f"{server.base_url}/chat/completions",
                            {"model": "m", "messages": [{"role": "user", "content": "hello"}]})
        assert status == 200 and body["choices"][0]["message"]["content"] == "hi" and body["model"] == "m"
        assert body["usage"]["total_tokens"] == 9
        status, body = post(f"{server.base_url}/chat/completions",
                            {"model": "m", "messages": [{"role": "user", "content": "error"}]})
        assert status == 500 and body["error"]["message"] == "boom"
        assert [r["auth"] for r in server.requests] == ["Bearer t", "Bearer t"]


def test_random_qwen2_is_seeded(random_qwen2_dir, tmp_path):
    again = Path(random_qwen2(tmp_path / "again"))
    for name in ("config.json", "model.safetensors"):
        assert (Path(random_qwen2_dir) / name).read_bytes() == (again / name).read_bytes(), name


def test_hf_token_logprobs_is_each_next_token_under_the_model(random_qwen2_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(random_qwen2_dir, dtype=torch.float32).eval()
    ids = [3, 17, 42, 99, 5]
    got = hf_token_logprobs(model, ids, temperature=2.0)
    for t in range(1, len(ids)):  # one position at a time, from the prefix alone
        with torch.no_grad():
            last = model(input_ids=torch.tensor([ids[:t]])).logits[0, -1].float() / 2.0
        assert got[t - 1] == pytest.approx(float(torch.log_softmax(last, -1)[ids[t]]), abs=1e-5)


def test_load_module_imports_a_file_by_path():
    reward = load_module(REPO / "examples/agents/letters_agent/reward.py")
    assert reward.__name__ == "reward_under_test" and callable(reward.score)


def test_tiny_renderer_renders_a_chat(tiny_renderer):
    text = tiny_renderer.render_text([{"role": "user", "content": "hi"}])
    assert text.startswith("<|im_start|>user\nhi<|im_end|>") and text.endswith("<|im_start|>assistant\n")
    assert tiny_renderer.tokenizer.decode(tiny_renderer.render([{"role": "user", "content": "hi"}])) == text


def test_the_heavy_xdist_group_names_existing_modules_and_keeps_the_others_whole():
    """conftest.py's xdist units: every HEAVY_MODULES name is a test file (a renamed e2e module
    would leave the group silently and run beside another), they share one unit (the late ones
    one unit each, queued last), any other test stays with its module."""
    conftest = load_module(REPO / "tests" / "conftest.py", "conftest_under_test")
    assert all((REPO / "tests" / name).is_file() for name in conftest.HEAVY_MODULES)
    assert conftest.LATE_HEAVY_MODULES < conftest.HEAVY_MODULES
    early = conftest.HEAVY_MODULES - conftest.LATE_HEAVY_MODULES
    assert {conftest._xdist_group(f"tests/{name}::test_x[a@b]") for name in early} == {"heavy"}
    late = {conftest._xdist_group(f"tests/{name}::t") for name in conftest.LATE_HEAVY_MODULES}
    assert late == {f"heavy-late:{name}" for name in conftest.LATE_HEAVY_MODULES}  # one unit each
    assert "test_e2e.py" in early  # the Ctrl-C tests' time bounds: never beside another heavy test
    order = [conftest._unit_order(f"tests/{m}::t")
             for m in ("test_e2e.py", "test_config.py", "test_grading.py", "test_eval_e2e.py")]
    assert order == sorted(order) and len(set(order)) == 4  # heavy, long unit, other unit, late heavy
    assert all((REPO / "tests" / name).is_file() for name in conftest.LONG_UNIT_MODULES)
    assert conftest._xdist_group("tests/test_config.py::test_y[p]") == "tests/test_config.py"
