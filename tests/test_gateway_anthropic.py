"""Anthropic Messages contract of the gateway, driven by the official `anthropic` SDK.

Real GatewayServer on 127.0.0.1, the tiny model's tokenizer and template, a ScriptedEngine at the
InferenceEngine seam (vLLM-backed runs: tests/test_gateway_vllm.py).
"""

from __future__ import annotations

import asyncio

import aiohttp
import anthropic
import pytest

from stand_ins import reply_ids
from workers.gateway.config import GatewayConfig
from workers.gateway.server import GatewayServer
from workers.embedded.sim_engine import ScriptedEngine
from workers.embedded.tiny_model import ensure_tiny_model

MODEL_ID = "tiny-qwen2"
SESSION = "gw-anthropic-session-" + "0" * 24
TIMEOUT_S = 20
CALC = {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression.",
    "input_schema": {"type": "object", "properties": {"expression": {"type": "string"}}},
}
CALL_TEXT = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'


@pytest.fixture
def engine(tiny_renderer) -> ScriptedEngine:
    return ScriptedEngine([reply_ids(tiny_renderer.tokenizer, "Hello there")], version=2)


@pytest.fixture
async def gateway(tiny_renderer, engine):
    cfg = GatewayConfig(model_path=str(ensure_tiny_model()), served_model_name=MODEL_ID, max_context_tokens=1024)
    server = GatewayServer(cfg, [engine], renderer=tiny_renderer)
    await asyncio.wait_for(server.start(), TIMEOUT_S)
    try:
        yield server
    finally:
        await asyncio.wait_for(server.stop(), TIMEOUT_S)


def client(base_url: str, token: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=base_url, api_key=token, max_retries=0, timeout=TIMEOUT_S)


@pytest.mark.parametrize("with_v1", [True, False])
async def test_messages_with_either_base_url_form(gateway, engine, with_v1):
    """The rollout hands agents `http://host:port/v1`; the Anthropic SDK appends `/v1/messages`
    itself. Both base-URL forms must reach the route (no 404 on `/v1/v1/messages`)."""
    base = gateway.base_url if with_v1 else gateway.base_url.removesuffix("/v1")
    token = await gateway.open_session(SESSION)
    async with client(base, token) as c:
        msg = await c.messages.create(
            model=MODEL_ID, max_tokens=64, system="Be brief.", messages=[{"role": "user", "content": "hi"}]
        )
    assert msg.type == "message" and msg.role == "assistant" and msg.model == MODEL_ID
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == "Hello there"
    assert msg.stop_reason == "end_turn"
    prompt = engine.requests[0].prompt_ids
    assert (msg.usage.input_tokens, msg.usage.output_tokens) == (len(prompt), len(engine.replies[0]))
    assert engine.requests[0].max_tokens == 64
    cap = await gateway.close_session(SESSION)
    assert cap.rows[0].token_ids == prompt + engine.replies[0]


async def test_streaming_events_and_final_message(gateway, engine):
    token = await gateway.open_session(SESSION)
    async with client(gateway.base_url, token) as c:
        async with c.messages.stream(model=MODEL_ID, max_tokens=32, messages=[{"role": "user", "content": "hi"}]) as s:
            kinds = [ev.type async for ev in s]
            final = await s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(kinds)
    assert final.content[0].text == "Hello there" and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == len(engine.replies[0])
    await gateway.close_session(SESSION)


async def test_tool_use_then_tool_result_is_one_clean_row(gateway, tiny_renderer, engine):
    out1, out2 = reply_ids(tiny_renderer.tokenizer, CALL_TEXT), reply_ids(tiny_renderer.tokenizer, "It is 42")
    engine.script(out1, out2)
    token = await gateway.open_session(SESSION)
    msgs = [{"role": "user", "content": "What is 6*7?"}]
    async with client(gateway.base_url, token) as c:
        m1 = await c.messages.create(model=MODEL_ID, max_tokens=64, tools=[CALC], messages=msgs)
        assert m1.stop_reason == "tool_use"
        (use,) = [b for b in m1.content if b.type == "tool_use"]
        assert (use.name, use.input) == ("calculator", {"expression": "6*7"})
        msgs += [
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m1.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "42"}]},
        ]
        async with c.messages.stream(model=MODEL_ID, max_tokens=64, tools=[CALC], messages=msgs) as s:
            m2 = await s.get_final_message()
    assert m2.content[0].text == "It is 42"
    cap = await gateway.close_session(SESSION)
    assert cap.num_turns == 2 and len(cap.rows) == 1  # the tool_result turn extended the row
    assert cap.rows[0].token_ids == engine.requests[1].prompt_ids + out2


async def test_streamed_tool_use_block(gateway, tiny_renderer, engine):
    engine.script(reply_ids(tiny_renderer.tokenizer, CALL_TEXT))
    token = await gateway.open_session(SESSION)
    async with client(gateway.base_url, token) as c:
        async with c.messages.stream(
            model=MODEL_ID, max_tokens=64, tools=[CALC], messages=[{"role": "user", "content": "6*7?"}]
        ) as s:
            final = await s.get_final_message()
    (use,) = final.content
    assert use.type == "tool_use" and use.input == {"expression": "6*7"} and final.stop_reason == "tool_use"
    await gateway.close_session(SESSION)


async def test_count_tokens_matches_the_served_prompt(gateway, engine):
    token = await gateway.open_session(SESSION)
    msgs = [{"role": "user", "content": "count me"}]
    async with client(gateway.base_url, token) as c:
        counted = await c.messages.count_tokens(model=MODEL_ID, messages=msgs, tools=[CALC])
        await c.messages.create(model=MODEL_ID, max_tokens=8, messages=msgs, tools=[CALC])
    assert counted.input_tokens == len(engine.requests[0].prompt_ids)
    assert (await gateway.close_session(SESSION)).num_turns == 1  # counting is not a turn


async def test_errors_use_anthropic_shape(gateway, engine):
    token = await gateway.open_session(SESSION)
    msgs = [{"role": "user", "content": "hi"}]
    async with client(gateway.base_url, "wrong-key") as bad:
        with pytest.raises(anthropic.AuthenticationError) as err:
            await bad.messages.create(model=MODEL_ID, max_tokens=8, messages=msgs)
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "authentication_error"
    async with aiohttp.ClientSession() as http:
        async with http.post(
            f"{gateway.base_url}/messages", json={"model": MODEL_ID, "messages": msgs}, headers={"x-api-key": token}
        ) as r:
            body = await r.json()
    assert r.status == 400 and body["error"] == {"type": "invalid_request_error", "message": "'max_tokens' is required"}
    await gateway.close_session(SESSION)
    async with client(gateway.base_url, token) as closed:
        with pytest.raises(anthropic.ConflictError):
            await closed.messages.create(model=MODEL_ID, max_tokens=8, messages=msgs)
    assert engine.requests == []


async def test_stop_sequence_is_reported(gateway, engine):
    token = await gateway.open_session(SESSION)
    async with client(gateway.base_url, token) as c:
        msg = await c.messages.create(
            model=MODEL_ID, max_tokens=32, stop_sequences=["there"], messages=[{"role": "user", "content": "hi"}]
        )
    assert (msg.content[0].text, msg.stop_reason, msg.stop_sequence) == ("Hello ", "stop_sequence", "there")
    row = (await gateway.close_session(SESSION)).rows[0]
    assert row.num_generated == msg.usage.output_tokens < len(engine.replies[0])  # eos after it not kept


async def test_single_token_stop_sequence_is_reported(gateway, tiny_renderer, engine):
    tok = tiny_renderer.tokenizer
    single = next(t for t in ("Hello", " there", "!") if len(tok.encode(t, add_special_tokens=False)) == 1)
    engine.script(reply_ids(tiny_renderer.tokenizer, "Hi! Hello again"))
    token = await gateway.open_session(SESSION)
    async with client(gateway.base_url, token) as c:
        msg = await c.messages.create(
            model=MODEL_ID, max_tokens=32, stop_sequences=[single], messages=[{"role": "user", "content": "hi"}]
        )
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", single)
    assert tok.encode(single, add_special_tokens=False)[0] in engine.requests[0].stop_token_ids
    await gateway.close_session(SESSION)
