"""OpenAI contract of the gateway for tool agents, streaming, budgets, lifecycle, auth and routing.

The real GatewayServer on 127.0.0.1, the tiny model's real tokenizer and chat template (Qwen2.5
style, hermes `<tool_call>` format), the official `openai` SDK. The engine is
workers.embedded.sim_engine.ScriptedEngine (zero-cost, at the InferenceEngine seam) so a test can
script what the "model" says, tool calls included; tests/test_gateway_vllm.py runs the same SDK
paths against vLLM.
"""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
import openai
import pytest

from stand_ins import reply_ids
from workers.gateway.chat_template import ChatRenderer
from workers.gateway.config import GatewayConfig
from workers.gateway.server import GatewayServer
from workers.embedded.sim_engine import ScriptedEngine
from workers.embedded.tiny_model import ensure_tiny_model

MODEL_ID = "tiny-qwen2"
SESSION = "gw-tools-session-" + "0" * 24
TIMEOUT_S = 20
CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
CALL_TEXT = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'


async def start(renderer: ChatRenderer, engines: list[ScriptedEngine], **cfg_kw) -> GatewayServer:
    cfg = GatewayConfig(model_path=str(ensure_tiny_model()), served_model_name=MODEL_ID, max_context_tokens=1024, **cfg_kw)
    server = GatewayServer(cfg, engines, renderer=renderer)
    await asyncio.wait_for(server.start(), TIMEOUT_S)
    return server


@pytest.fixture
async def engine(tiny_renderer) -> ScriptedEngine:
    return ScriptedEngine([reply_ids(tiny_renderer.tokenizer, "The answer is 5")], version=3)


@pytest.fixture
async def gateway(tiny_renderer, engine):
    server = await start(tiny_renderer, [engine])
    try:
        yield server
    finally:
        await asyncio.wait_for(server.stop(), TIMEOUT_S)


def client(server: GatewayServer, token: str, retries: int = 0) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key=token, max_retries=retries, timeout=TIMEOUT_S)


# -- tools -------------------------------------------------------------------------------------


async def test_tool_call_round_trip_keeps_one_row_and_the_separator_token(gateway, tiny_renderer, engine):
    """Regression (public bug reports): a separator token lost at the assistant -> tool boundary
    makes every tool turn a new row. The generated <|im_end|> must stay in the row, followed by
    the tool turn's prompt extension, and the second turn must be CLEAN."""
    out1, out2 = reply_ids(tiny_renderer.tokenizer, CALL_TEXT), reply_ids(tiny_renderer.tokenizer, "The answer is 5")
    engine.script(out1, out2)
    token = await gateway.open_session(SESSION)
    messages = [{"role": "user", "content": "What is 2+3?"}]
    async with client(gateway, token) as c:
        r1 = await c.chat.completions.create(model=MODEL_ID, messages=messages, tools=[CALC])
        msg = r1.choices[0].message
        assert r1.choices[0].finish_reason == "tool_calls"
        assert msg.content is None and len(msg.tool_calls) == 1
        call = msg.tool_calls[0]
        assert call.function.name == "calculator" and call.id.startswith("call_")
        assert json.loads(call.function.arguments) == {"expression": "2+3"}  # arguments round-trip
        messages += [msg, {"role": "tool", "tool_call_id": call.id, "content": "5"}]  # the SDK idiom
        r2 = await c.chat.completions.create(model=MODEL_ID, messages=messages, tools=[CALC])
    assert r2.choices[0].message.content == "The answer is 5" and r2.choices[0].finish_reason == "stop"
    p1, p2 = engine.requests[0].prompt_ids, engine.requests[1].prompt_ids
    assert p2[: len(p1) + len(out1)] == p1 + out1  # re-rendered history == served tokens
    cap = await gateway.close_session(SESSION)
    assert cap.num_turns == 2 and len(cap.rows) == 1 and cap.num_ill_formed_turns == 0
    row = cap.rows[0]
    assert row.token_ids == p2 + out2
    boundary = len(p1) + len(out1) - 1
    assert row.token_ids[boundary] == tiny_renderer.tokenizer.eos_token_id and row.loss_mask[boundary] == 1
    assert row.loss_mask[boundary + 1] == 0  # "\n<|im_start|>user\n<tool_response>..." is prompt
    m = gateway.metrics()
    assert (m.turns_first, m.turns_clean, m.tool_calls, m.turns_ill_formed) == (1, 1, 1, 0)


async def test_ill_formed_tool_call_returns_raw_text_and_is_counted(gateway, tiny_renderer, engine):
    bad = '<tool_call>\n{"name": "calculator", "arguments": {"expression": 2+3}\n</tool_call>'
    engine.script(reply_ids(tiny_renderer.tokenizer, bad))
    token = await gateway.open_session(SESSION)
    async with client(gateway, token) as c:
        r = await c.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "2+3?"}], tools=[CALC])
    assert r.choices[0].message.content == bad and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    assert gateway.metrics().turns_ill_formed == 1
    cap = await gateway.close_session(SESSION)
    assert cap.num_ill_formed_turns == 1


async def test_tool_choice_none_skips_parsing_and_required_flags_a_missing_call(gateway, tiny_renderer, engine):
    engine.script(reply_ids(tiny_renderer.tokenizer, CALL_TEXT), reply_ids(tiny_renderer.tokenizer, "no call"))
    token = await gateway.open_session(SESSION)
    msgs = [{"role": "user", "content": "2+3?"}]
    async with client(gateway, token) as c:
        r1 = await c.chat.completions.create(model=MODEL_ID, messages=msgs, tools=[CALC], tool_choice="none")
        r2 = await c.chat.completions.create(model=MODEL_ID, messages=msgs, tools=[CALC], tool_choice="required")
    assert r1.choices[0].message.content == CALL_TEXT and not r1.choices[0].message.tool_calls
    assert r2.choices[0].message.content == "no call"
    assert gateway.metrics().turns_ill_formed == 1  # "required" was not honoured
    await gateway.close_session(SESSION)


async def test_tools_for_a_model_without_a_tool_format_are_refused(tiny_renderer):
    """Offering tools to a model whose format is unknown must fail loudly, not never parse a call."""
    engine = ScriptedEngine([reply_ids(tiny_renderer.tokenizer, "hi")])
    plain = ChatRenderer(tiny_renderer.tokenizer, tool_call_parser="none")
    cfg = GatewayConfig(model_path=str(ensure_tiny_model()), served_model_name=MODEL_ID)
    server = GatewayServer(cfg, [engine], renderer=plain)
    await server.start()
    try:
        token = await server.open_session(SESSION)
        async with client(server, token) as c:
            with pytest.raises(openai.BadRequestError) as err:
                await c.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "x"}], tools=[CALC])
            assert err.value.code == "tools_unsupported" and err.value.param == "tools"
            ok = await c.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "x"}])
        assert ok.choices[0].message.content == "hi" and len(engine.requests) == 1
    finally:
        await server.stop()


# -- streaming and logprobs --------------------------------------------------------------------


async def test_streaming_text_with_usage_chunk(gateway, tiny_renderer, engine):
    token = await gateway.open_session(SESSION)
    msgs = [{"role": "user", "content": "hi"}]
    async with client(gateway, token) as c:
        stream = await c.chat.completions.create(
            model=MODEL_ID, messages=msgs, stream=True, stream_options={"include_usage": True}
        )
        chunks = [ch async for ch in stream]
        plain = [ch async for ch in await c.chat.completions.create(model=MODEL_ID, messages=msgs, stream=True)]
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == "The answer is 5"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(reply_ids(tiny_renderer.tokenizer, text))
    assert chunks[-1].usage.prompt_tokens == len(engine.requests[0].prompt_ids)
    assert plain[-1].choices[0].finish_reason == "stop" and plain[-1].usage.total_tokens > 0  # usage on the final chunk
    assert (await gateway.close_session(SESSION)).num_turns == 2


async def test_streaming_tool_call_deltas(gateway, tiny_renderer, engine):
    engine.script(reply_ids(tiny_renderer.tokenizer, CALL_TEXT))
    token = await gateway.open_session(SESSION)
    async with client(gateway, token) as c:
        stream = await c.chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": "2+3?"}], tools=[CALC], stream=True
        )
        chunks = [ch async for ch in stream]
    deltas = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert [d.function.name for d in deltas] == ["calculator"]
    assert json.loads(deltas[0].function.arguments) == {"expression": "2+3"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    await gateway.close_session(SESSION)


async def test_logprobs_are_aligned_with_their_tokens(gateway, tiny_renderer, engine):
    token = await gateway.open_session(SESSION)
    async with client(gateway, token) as c:
        r = await c.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "hi"}], logprobs=True)
    out = engine.requests[0]
    entries = r.choices[0].logprobs.content
    served = reply_ids(tiny_renderer.tokenizer, "The answer is 5")
    assert [e.token for e in entries] == [tiny_renderer.tokenizer.decode([i]) for i in served]
    assert [e.logprob for e in entries] == pytest.approx([-0.01 * (i + 1) for i in range(len(served))])
    row = (await gateway.close_session(SESSION)).rows[0]
    gen_lp = [lp for m, lp in zip(row.loss_mask, row.rollout_logprobs) if m == 1]
    assert gen_lp == [e.logprob for e in entries]  # what the agent saw is what the trainer gets
    assert row.token_ids[len(out.prompt_ids) :] == served


# -- budgets and lifecycle ---------------------------------------------------------------------


async def test_turn_cap_is_429_and_not_retried(gateway, engine):
    token = await gateway.open_session(SESSION, max_turns=1)
    msgs = [{"role": "user", "content": "hi"}]
    async with client(gateway, token, retries=2) as c:
        await c.chat.completions.create(model=MODEL_ID, messages=msgs)
        with pytest.raises(openai.RateLimitError) as err:
            await c.chat.completions.create(model=MODEL_ID, messages=msgs)
    assert err.value.code == "turn_limit_exceeded"
    assert gateway.metrics().turn_limit_refused == 1  # x-should-retry: false stopped the SDK's retries
    assert len(engine.requests) == 1
    await gateway.close_session(SESSION)


async def test_client_disconnect_cancels_the_engine_request(gateway, engine):
    token = await gateway.open_session(SESSION)
    engine.gate = asyncio.Event()
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as http:
        call = asyncio.create_task(
            http.post(f"{gateway.base_url}/chat/completions", json=body, headers={"Authorization": f"Bearer {token}"})
        )
        await asyncio.wait_for(engine.started.wait(), TIMEOUT_S)
        call.cancel()  # the client gives up: its connection closes
        await asyncio.wait_for(engine.cancel_seen.wait(), TIMEOUT_S)
    assert engine.cancelled == [engine.requests[0].request_id]
    assert gateway.metrics().turns_cancelled == 1
    assert (await gateway.close_session(SESSION)).num_turns == 0


async def test_failed_replica_is_taken_out_and_turns_go_elsewhere(tiny_renderer):
    down, up = ScriptedEngine([reply_ids(tiny_renderer.tokenizer, "from a")]), ScriptedEngine([reply_ids(tiny_renderer.tokenizer, "from b")])
    down.fail = True
    server = await start(tiny_renderer, [down, up])
    try:
        for k in range(2):
            sid = f"{SESSION}-{k}"
            token = await server.open_session(sid)
            async with client(server, token) as c:
                r = await c.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "x"}])
            assert r.choices[0].message.content == "from b"
            assert (await server.close_session(sid)).num_turns == 1
        assert len(down.requests) == 1 and len(up.requests) == 2  # tried once, then out of rotation
        m = server.metrics()
        assert (m.replica_failures, m.turns_served, m.server_errors) == (1, 2, 0)
        async with aiohttp.ClientSession() as http:
            async with http.get(server.base_url.removesuffix("/v1") + "/health") as h:
                assert (await h.json())["healthy_replicas"] == 1
    finally:
        await server.stop()


# -- auth and safety ---------------------------------------------------------------------------


async def test_body_limit_and_auth_before_body(tiny_renderer, engine):
    server = await start(tiny_renderer, [engine], max_body_bytes=4096)
    try:
        token = await server.open_session(SESSION)
        big = {"model": MODEL_ID, "messages": [{"role": "user", "content": "x" * 8192}]}
        async with aiohttp.ClientSession() as http:
            url = f"{server.base_url}/chat/completions"
            async with http.post(url, json=big, headers={"Authorization": f"Bearer {token}"}) as r:
                assert r.status == 413 and set((await r.json())["error"]) == {"message", "type", "param", "code"}
            async with http.post(url, json=big, headers={"Authorization": "Bearer nope"}) as r:
                assert r.status == 401  # refused before the body is read
        assert engine.requests == []
    finally:
        await server.stop()


async def test_tokens_never_appear_in_logs_and_default_host_is_loopback(gateway, caplog):
    assert gateway.base_url.startswith("http://127.0.0.1:")
    caplog.set_level(logging.DEBUG)
    token = await gateway.open_session(SESSION)
    async with client(gateway, token) as c:
        await c.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "hi"}])
    async with client(gateway, token + "x") as bad:
        with pytest.raises(openai.AuthenticationError) as err:
            await bad.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "hi"}])
    assert token not in caplog.text and token not in str(err.value.body)
    assert len(token) >= 43  # 32 random bytes (256 bits), urlsafe base64
    await gateway.close_session(SESSION)


async def test_developer_role_is_rendered_as_system(gateway, tiny_renderer, engine):
    """OpenAI's newer clients send `developer` instead of `system`; templates only know `system`,
    and the tiny one would silently drop an unknown role."""
    token = await gateway.open_session(SESSION)
    async with client(gateway, token) as c:
        await c.chat.completions.create(
            model=MODEL_ID, messages=[{"role": "developer", "content": "Be terse."}, {"role": "user", "content": "hi"}]
        )
    assert "<|im_start|>system\nBe terse.<|im_end|>" in tiny_renderer.tokenizer.decode(engine.requests[0].prompt_ids)
    await gateway.close_session(SESSION)
