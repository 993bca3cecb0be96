"""Acceptance: the real gateway in front of vLLM's CPU engine with the tiny model, driven over
loopback by the official `openai` and `anthropic` SDKs (plain, streaming, tool turns, errors).

One engine and one gateway for the module (engine startup dominates the cost). The model's text
is whatever it samples; the tests check what the gateway guarantees whatever the text: the row
holds exactly the served prompt plus the generated ids, log-probs and usage agree with the row,
tool turns render and record, errors come in each API's shape.
"""

from __future__ import annotations

import asyncio
import json

import anthropic
import openai
import pytest
import pytest_asyncio

from workers.gateway.config import GatewayConfig
from workers.gateway.server import GatewayServer
from workers.inference.worker import InferenceSettings, InferenceWorker
from workers.embedded.tiny_model import ensure_tiny_model

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL_ID = "tiny-qwen2"
TIMEOUT_S = 60
CALC = {
    "type": "function",
    "function": {"name": "calculator", "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}},
}
_n = 0


def sid() -> str:
    global _n
    _n += 1
    return f"gw-vllm-session-{_n:04d}-" + "0" * 24


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway():
    path = str(ensure_tiny_model())
    worker = InferenceWorker(InferenceSettings(model_path=path, max_model_len=512, max_num_seqs=16))
    await asyncio.wait_for(worker.start(), timeout=180)
    server = GatewayServer(
        GatewayConfig(model_path=path, served_model_name=MODEL_ID, max_context_tokens=512, max_tokens=24), [worker]
    )
    await asyncio.wait_for(server.start(), TIMEOUT_S)
    try:
        yield server
    finally:
        await server.stop()
        await worker.shutdown()


def oai(server: GatewayServer, token: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key=token, max_retries=0, timeout=TIMEOUT_S)


async def test_openai_multi_turn_row_logprobs_and_usage(gateway):
    s = sid()
    token = await gateway.open_session(s)
    msgs = [{"role": "user", "content": "Repeat the letter q 4 times."}]
    async with oai(gateway, token) as c:
        r1 = await c.chat.completions.create(model=MODEL_ID, messages=msgs, logprobs=True, seed=1)
        msgs += [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "Again."}]
        r2 = await c.chat.completions.create(model=MODEL_ID, messages=msgs, seed=2)
    cap = await gateway.close_session(s)
    first = cap.rows[0]
    n1 = r1.usage.completion_tokens
    gen = [i for i, m in enumerate(first.loss_mask) if m == 1]
    assert gen[:n1] == list(range(r1.usage.prompt_tokens, r1.usage.prompt_tokens + n1))  # prompt, then output
    assert [first.rollout_logprobs[i] for i in gen[:n1]] == pytest.approx([e.logprob for e in r1.choices[0].logprobs.content])
    assert all(lp <= 0.0 for lp in first.rollout_logprobs)
    assert cap.num_turns == 2 and sum(r.num_generated for r in cap.rows) == n1 + r2.usage.completion_tokens
    # the model's text round-trips through the template in this tokenizer: one CLEAN row
    assert len(cap.rows) == 1 and len(first.token_ids) == r2.usage.prompt_tokens + r2.usage.completion_tokens


async def test_openai_stream_and_errors(gateway):
    s = sid()
    token = await gateway.open_session(s, max_context_tokens=64)
    async with oai(gateway, token) as c:
        stream = await c.chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": "Repeat the letter b 2 times."}],
            stream=True, stream_options={"include_usage": True},
        )
        chunks = [ch async for ch in stream]
        with pytest.raises(openai.BadRequestError) as too_long:
            await c.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "b " * 80}])
        with pytest.raises(openai.BadRequestError) as n2:
            await c.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "b"}], n=2)
    async with oai(gateway, "sk-not-a-session") as bad:
        with pytest.raises(openai.AuthenticationError):
            await bad.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "b"}])
    assert too_long.value.code == "context_length_exceeded" and n2.value.param == "n"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    usage = chunks[-1].usage
    cap = await gateway.close_session(s)
    assert cap.num_turns == 1 and len(cap.rows[0].token_ids) == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens + usage.completion_tokens <= 64  # max_tokens clamped to the budget
    assert isinstance(text, str)


async def test_openai_tool_turns_render_record_and_parse(gateway):
    """Whatever the tiny model says, a tools request is rendered with the tools, a tool result turn
    is served, and a parse failure (if any) is counted, not hidden."""
    s = sid()
    token = await gateway.open_session(s)
    msgs = [
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": json.dumps({"expression": "2+3"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]
    before = gateway.metrics()
    async with oai(gateway, token) as c:
        r = await c.chat.completions.create(model=MODEL_ID, messages=msgs, tools=[CALC])
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    cap = await gateway.close_session(s)
    after = gateway.metrics()
    assert cap.num_turns == 1 and after.turns_ill_formed - before.turns_ill_formed == cap.num_ill_formed_turns


async def test_anthropic_plain_stream_and_tool_result(gateway):
    s = sid()
    token = await gateway.open_session(s)
    async with anthropic.AsyncAnthropic(base_url=gateway.base_url, api_key=token, max_retries=0, timeout=TIMEOUT_S) as c:
        m1 = await c.messages.create(model=MODEL_ID, max_tokens=16, messages=[{"role": "user", "content": "Repeat the letter z 3 times."}])
        async with c.messages.stream(model=MODEL_ID, max_tokens=16, messages=[{"role": "user", "content": "Repeat z."}]) as st:
            m2 = await st.get_final_message()
        m3 = await c.messages.create(
            model=MODEL_ID, max_tokens=16, tools=[{"name": "calculator", "input_schema": {"type": "object"}}],
            messages=[
                {"role": "user", "content": "2+3?"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "calculator", "input": {"expression": "2+3"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "5"}]},
            ],
        )
    for m in (m1, m2, m3):
        assert m.stop_reason in ("end_turn", "max_tokens", "tool_use") and 1 <= m.usage.output_tokens <= 16
    cap = await gateway.close_session(s)
    assert cap.num_turns == 3
    assert sum(r.num_generated for r in cap.rows) == sum(m.usage.output_tokens for m in (m1, m2, m3))
