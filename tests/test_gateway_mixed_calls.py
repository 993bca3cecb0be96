"""Issue 42 item 4: no tool call lost to its neighbour, for every parser family.

Tried on 2026-12-06 with the real Qwen3 tokenizer and templates: a generation with one well-formed
call followed by a malformed one came back with **no** call (the raw text as content), in the JSON
(`hermes`) and the XML (`qwen3_coder`) formats, and a well-formed call followed by any text was
dropped as ill-formed where vLLM's own parser returns the call. Now every well-formed call is
returned; the turn counts ill-formed when any part is malformed (trailing text alone is not).

Through the real gateway with the real tokenizer and template of each family (cached:
workers/embedded/real_tokenizers.py) and a scripted engine: HTTP 200 (the SDK call returns), the
well-formed calls, the ill-formed count, and the row equal to the served ids. Harmony (gpt-oss) is
parsed from ids: its engine stops at `<|call|>`, so a malformed part can only come before the call
in one generation; a generation holding more (an engine without that stop) is checked on the codec.
"""

from __future__ import annotations

import asyncio

import openai
import pytest

from test_gateway_templates import CASES, TOOLS, call_text, renderer_for, scripted
from workers.embedded.sim_engine import ScriptedEngine
from workers.gateway.config import GatewayConfig
from workers.gateway.server import GatewayServer
from workers.gateway.tool_parsers import parse_tool_calls

SESSION = "gw-mixed-session-" + "0" * 24
TIMEOUT_S = 30
CASE = {c.name: c for c in CASES}
GOOD = ("calculator", {"expression": "2+3"})
BAD = {  # one malformed call per format
    "hermes": '<tool_call>\n{"name": "get_time", "arguments": {"tz": UTC}}\n</tool_call>',  # bad JSON
    # a parameter never closed
    "qwen3_coder": "<tool_call>\n<function=get_time>\n<parameter=tz>\nUTC\n</function>\n</tool_call>",
    "llama3_json": '{"name": "get_time", "parameters": {"tz": ',  # cut mid-object
    "harmony": "<|channel|>commentary to=browser.search <|constrain|>json<|message|>{}<|end|>",
}
TRAILING = "\nI will wait for the result."


def good(fmt: str) -> str:
    return call_text(fmt, *GOOD, "canonical")


# (case, generated text, ill-formed?): each returns exactly the one well-formed calculator call
GENERATIONS = [
    ("qwen3_think", f"<think>\nTwo tools.\n</think>\n\n{good('hermes')}\n{BAD['hermes']}", True),
    ("qwen3_think", f"<think>\nOne.\n</think>\n\n{BAD['hermes']}\n{good('hermes')}", True),  # malformed first
    ("qwen3_think", f"<think>\nOne.\n</think>\n\n{good('hermes')}{TRAILING}", False),  # vLLM returns the call
    ("qwen3_think", f"<think>\nOne.\n</think>\n\n{good('hermes')}\n<think>\nstill thinking", False),  # open think
    ("qwen3_think", f"<think>\nOne.\n</think>\n\n{good('hermes')}\n{BAD['hermes']}{TRAILING}", True),
    ("qwen3_think", f"<think>\nOne.\n</think>\n\n{good('hermes')}\n<tool_call>\n{{\"name\": \"get_ti", True),  # cut
    ("qwen3_5_xml_nothink", f"{good('qwen3_coder')}\n{BAD['qwen3_coder']}", True),
    ("qwen3_5_xml_nothink", f"{good('qwen3_coder')}{TRAILING}", False),
    ("qwen3_5_xml_nothink", f"{BAD['qwen3_coder']}\n{good('qwen3_coder')}{TRAILING}", True),
    ("llama3_2", f"{good('llama3_json')}; {BAD['llama3_json']}", True),
    ("llama3_2", f"<|python_tag|>{good('llama3_json')}{TRAILING}", False),
    ("gpt_oss", f"{BAD['harmony']}<|start|>assistant{good('harmony')}", True),
]


@pytest.mark.parametrize("name, text, ill", GENERATIONS, ids=[f"{g[0]}-{i}" for i, g in enumerate(GENERATIONS)])
async def test_well_formed_calls_survive_their_neighbours_through_the_gateway(name, text, ill, real_tokenizers):
    case = CASE[name]
    renderer = renderer_for(case, real_tokenizers)
    output = scripted(renderer, text)
    engine = ScriptedEngine([output])
    cfg = GatewayConfig(model_path="unused", served_model_name="real", max_context_tokens=8192)
    server = GatewayServer(cfg, [engine], renderer=renderer)
    await asyncio.wait_for(server.start(), TIMEOUT_S)
    try:
        token = await server.open_session(SESSION)
        extra = {"chat_template_kwargs": case.kwargs} if case.kwargs else None
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key=token, max_retries=0) as c:
            r = await asyncio.wait_for(c.chat.completions.create(
                model="real", messages=[{"role": "user", "content": "What is 2+3?"}], tools=TOOLS, extra_body=extra),
                TIMEOUT_S)  # HTTP 200: the SDK raises on any other status
        msg = r.choices[0].message
        assert [(tc.function.name, tc.function.arguments) for tc in msg.tool_calls or ()] == [
            ("calculator", '{"expression": "2+3"}')], (msg.content, text)
        assert r.choices[0].finish_reason == "tool_calls"
        assert server.metrics().turns_ill_formed == int(ill)
        cap = await server.close_session(SESSION)
        [row] = cap.rows
        [req] = engine.requests
        assert row.token_ids == (*req.prompt_ids, *output)  # the row is the served ids, exactly
        assert row.loss_mask == (0,) * len(req.prompt_ids) + (1,) * len(output)
        assert cap.num_ill_formed_turns == int(ill)
    finally:
        await server.stop()


def test_every_text_family_keeps_all_well_formed_calls_in_order():
    """Pure parser: two good calls around a malformed one; what is neither content nor a call is
    `unparsed` (nothing lost); no good call: the raw text is the content, as before."""
    for fmt in ("hermes", "qwen3_coder"):
        t = "Sure.\n" + good(fmt) + "\n" + BAD[fmt] + "\n" + call_text(fmt, "get_time", {}, "canonical") + TRAILING
        p = parse_tool_calls(t, fmt, tuple(TOOLS))
        assert [c.name for c in p.tool_calls] == ["calculator", "get_time"] and p.ill_formed, fmt
        assert p.content == "Sure." and BAD[fmt] in p.unparsed and TRAILING in p.unparsed
        only_bad = parse_tool_calls(BAD[fmt] + TRAILING, fmt, tuple(TOOLS))
        assert only_bad.content == BAD[fmt] + TRAILING and not only_bad.tool_calls and only_bad.ill_formed
        clean = parse_tool_calls(good(fmt), fmt, tuple(TOOLS))
        assert not clean.ill_formed and clean.unparsed == "" and len(clean.tool_calls) == 1
    p = parse_tool_calls(f"{good('llama3_json')}; {call_text('llama3_json', 'get_time', {}, 'compact')}; "
                         f"{BAD['llama3_json']}", "llama3_json")
    assert [c.name for c in p.tool_calls] == ["calculator", "get_time"] and p.ill_formed
    assert p.unparsed == BAD["llama3_json"].strip()


def test_harmony_returns_the_calls_beside_a_malformed_message(real_tokenizers):
    """An engine without the `<|call|>` stop: a good call, a call to a tool not offered, arguments
    that are no object, text after the call; each good call is returned, the turn ill-formed."""
    renderer = renderer_for(CASE["gpt_oss"], real_tokenizers)
    tok, h = renderer.tokenizer, renderer.harmony
    second = call_text("harmony", "get_time", {}, "canonical")
    bad_args = "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>[1]<|call|>"
    for text, names in (
        (f"{good('harmony')}<|start|>assistant{bad_args}<|start|>assistant{second}", ["calculator", "get_time"]),
        (f"{BAD['harmony']}<|start|>assistant{good('harmony')}", ["calculator"]),
        (f"{good('harmony')} and then some words", ["calculator"]),  # text outside a message: rejected there
    ):
        p = h.parse(tok.encode(text, add_special_tokens=False))
        assert [c.name for c in p.tool_calls] == names and p.ill_formed, text
    only_bad = h.parse(tok.encode(bad_args, add_special_tokens=False))
    assert only_bad.ill_formed and not only_bad.tool_calls and only_bad.content == bad_args.removesuffix("<|call|>")
