"""gpt-oss (harmony) through the Anthropic Messages route and the offline vocabulary file.

The OpenAI route is in the template matrix (tests/test_gateway_templates.py). Here: the official
`anthropic` SDK runs the same tool chain (analysis, call, analysis, call, analysis, final): the
analysis comes back as a `thinking` block, the SDK sends it back, and the session is one row
whose tokens are the served ids (streamed and not); an OpenAI stream carries the reasoning as
`reasoning_content` deltas and the call. And the `o200k_base` file openai-harmony
loads is written from the real gpt-oss tokenizer, byte-exact to openai-harmony's pinned sha256,
while a tokenizer of another family is refused with the mismatch named.
"""

from __future__ import annotations

import asyncio
import hashlib
import json

import anthropic
import pytest

from workers.embedded.sim_engine import ScriptedEngine
from workers.gateway.capture import TurnKind
from workers.gateway.chat_template import ChatRenderer
from workers.gateway.config import GatewayConfig
from workers.gateway.harmony_vocab import O200K_BASE_SHA256, VOCAB_FILE, HarmonyVocabError, encodings_dir
from workers.gateway.server import GatewayServer

MODEL_ID = "gpt-oss"
SESSION = "gw-harmony-session-" + "0" * 24
TIMEOUT_S = 30
TOOLS = [{"name": "calculator", "description": "Evaluate arithmetic.",
          "input_schema": {"type": "object", "properties": {"expression": {"type": "string"}}}},
         {"name": "get_time", "description": "The time now.", "input_schema": {"type": "object", "properties": {}}}]
CALLS = [("calculator", {"expression": "2+3"}), ("get_time", {})]
RESULTS = ["5", "12:00"]
THINK = "I use a tool."
FINAL = "2+3 = 5, and it is 12:00."


def _tokenizer(name: str):
    from transformers import AutoTokenizer

    from workers.embedded.real_tokenizers import tokenizer_dir

    return AutoTokenizer.from_pretrained(str(tokenizer_dir(name)))


@pytest.fixture(scope="module")
def gpt_oss(real_tokenizers) -> ChatRenderer:
    return ChatRenderer(_tokenizer("gptoss"))


def answers() -> list[str]:
    calls = [f"<|channel|>commentary to=functions.{n} <|constrain|>json<|message|>{json.dumps(a)}<|call|>"
             for n, a in CALLS]
    final = f"<|channel|>final<|message|>{FINAL}<|return|>"
    return [f"<|channel|>analysis<|message|>{THINK}<|end|><|start|>assistant{o}" for o in (*calls, final)]


@pytest.mark.parametrize("stream", [False, True])
async def test_anthropic_tool_chain_on_gpt_oss_is_one_row(gpt_oss, stream):
    tok = gpt_oss.tokenizer
    outputs = [tuple(tok.encode(a, add_special_tokens=False)) for a in answers()]
    engine = ScriptedEngine(outputs)
    server = GatewayServer(GatewayConfig(model_path="unused", served_model_name=MODEL_ID, max_context_tokens=8192),
                           [engine], renderer=gpt_oss)
    await asyncio.wait_for(server.start(), TIMEOUT_S)
    kinds, msgs = [], [{"role": "user", "content": "What is 2+3, and what time is it?"}]
    try:
        token = await server.open_session(SESSION)
        async with anthropic.AsyncAnthropic(base_url=server.base_url, api_key=token, max_retries=0) as c:
            for i in range(3):
                before = server.metrics().turns_clean
                if stream:
                    async with c.messages.stream(model=MODEL_ID, max_tokens=256, messages=msgs, tools=TOOLS) as s:
                        msg = await s.get_final_message()
                else:
                    msg = await c.messages.create(model=MODEL_ID, max_tokens=256, messages=msgs, tools=TOOLS)
                kinds.append(TurnKind.CLEAN if server.metrics().turns_clean == before + 1 else None)
                thinking = [b for b in msg.content if b.type == "thinking"]
                assert [b.thinking for b in thinking] == [THINK]
                msgs.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]})
                uses = [b for b in msg.content if b.type == "tool_use"]
                if i < 2:
                    assert [(u.name, u.input) for u in uses] == [CALLS[i]] and msg.stop_reason == "tool_use"
                    msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                              "content": RESULTS[i]}]})
                else:
                    assert not uses and msg.content[-1].text == FINAL and msg.stop_reason == "end_turn"
        cap = await server.close_session(SESSION)
    finally:
        await server.stop()
    assert kinds[1:] == [TurnKind.CLEAN, TurnKind.CLEAN]
    (row,) = cap.rows
    assert row.token_ids == engine.requests[2].prompt_ids + outputs[2]
    assert [t for t, m in zip(row.token_ids, row.loss_mask) if m] == [t for o in outputs for t in o]


def test_o200k_base_file_is_written_from_the_tokenizer_and_checked(gpt_oss, tmp_path, monkeypatch):
    monkeypatch.delenv("TIKTOKEN_ENCODINGS_BASE", raising=False)
    folder = encodings_dir(gpt_oss.tokenizer, tmp_path / "enc")
    data = (folder / VOCAB_FILE).read_bytes()
    assert hashlib.sha256(data).hexdigest() == O200K_BASE_SHA256 and data.count(b"\n") == 199_998
    with pytest.raises(HarmonyVocabError, match="o200k_base"):
        encodings_dir(_tokenizer("qwen3"), tmp_path / "other")
    assert not (tmp_path / "other" / VOCAB_FILE).exists()  # nothing written for a wrong vocabulary
    monkeypatch.setenv("TIKTOKEN_ENCODINGS_BASE", str(tmp_path / "empty"))
    with pytest.raises(HarmonyVocabError, match="TIKTOKEN_ENCODINGS_BASE"):
        encodings_dir(gpt_oss.tokenizer)


async def test_openai_stream_carries_the_reasoning_and_the_call(gpt_oss):
    import openai

    outputs = [tuple(gpt_oss.tokenizer.encode(answers()[0], add_special_tokens=False))]
    engine = ScriptedEngine(outputs)
    server = GatewayServer(GatewayConfig(model_path="unused", served_model_name=MODEL_ID, max_context_tokens=8192),
                           [engine], renderer=gpt_oss)
    await asyncio.wait_for(server.start(), TIMEOUT_S)
    tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                               "parameters": t["input_schema"]}} for t in TOOLS]
    try:
        token = await server.open_session(SESSION)
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key=token, max_retries=0) as c:
            stream = await c.chat.completions.create(model=MODEL_ID, tools=tools, stream=True,
                                                     messages=[{"role": "user", "content": "What is 2+3?"}])
            chunks = [ch async for ch in stream]
    finally:
        await server.stop()
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == THINK
    (call,) = [tc for d in deltas for tc in d.tool_calls or ()]
    assert (call.function.name, json.loads(call.function.arguments)) == CALLS[0]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["tool_calls"]
