"""Token fidelity of the gateway: exact served ids, tool-call formats, reasoning templates.

- SegmentEncoder (cached per-piece tokenization) gives exactly the tokenizer's ids (hypothesis).
- Tool-call parsers: hermes JSON and qwen3_coder XML, typed XML values, ill-formed outputs.
- A Qwen3-Coder-style XML template end to end: calls parsed with typed arguments, and the tool
  turn re-renders the call exactly (one CLEAN row).
- A reasoning template that drops earlier `<think>` blocks: the next turn is a new row (FORK) and
  no generated token is recorded twice.
"""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stand_ins import reply_ids
from workers.gateway.chat_template import ChatRenderer, SegmentEncoder
from workers.gateway.config import GatewayConfig
from workers.gateway.server import GatewayServer
from workers.embedded.sim_engine import ScriptedEngine
from workers.gateway.tool_parsers import detect_tool_format, parse_tool_calls
from workers.embedded.tiny_model import CHAT_TEMPLATE, ensure_tiny_model

MODEL_ID = "tiny-qwen2"
SESSION = "gw-fidelity-session-" + "0" * 24
TIMEOUT_S = 20

# Qwen3-Coder's tool-call rendering (XML), reduced to what the test needs, on ChatML.
XML_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}"
    "{{- '<|im_start|>assistant\\n' }}{%- if m.content %}{{- m.content + '\\n' }}{%- endif %}"
    "{%- for tc in m.tool_calls %}{%- set tc = tc.function if tc.function is defined else tc %}"
    "{{- '<tool_call>\\n<function=' + tc.name + '>\\n' }}"
    "{%- for k, v in tc.arguments.items() %}"
    "{{- '<parameter=' + k + '>\\n' }}{{- v if v is string else v | tojson }}{{- '\\n</parameter>\\n' }}"
    "{%- endfor %}{{- '</function>\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen3's rule: earlier assistant turns lose their <think>...</think> block when re-rendered.
THINK_DROPPING_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- set c = m.content %}"
    "{%- if m.role == 'assistant' and '</think>' in c %}{%- set c = c.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>' + m.role + '\\n' + c + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}, "precision": {"type": "integer"}},
        },
    },
}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ensure_tiny_model()))


# -- segment-cached tokenization ---------------------------------------------------------------

PIECES = st.sampled_from(["<|im_start|>", "<|im_end|>", "<|endoftext|>", "\n", " ", "user", "<tool_call>", "é", "12"])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(st.one_of(PIECES, st.text(max_size=12)), max_size=12))
def test_segment_encoder_equals_whole_text_encoding(tokenizer, parts):
    enc = SegmentEncoder(tokenizer)
    assert enc.segmented  # the tiny tokenizer qualifies (fast, non-stripping added tokens)
    text = "".join(parts)
    expected = tuple(tokenizer.encode(text, add_special_tokens=False))
    assert enc.encode(text) == expected
    assert enc.encode(text) == expected  # second time from the cache


# -- parsers -----------------------------------------------------------------------------------


def test_detect_format_from_template():
    assert detect_tool_format(CHAT_TEMPLATE) == "hermes"
    assert detect_tool_format(XML_TEMPLATE) == "qwen3_coder"
    assert detect_tool_format(THINK_DROPPING_TEMPLATE) is None


def test_hermes_parses_several_calls_and_flags_broken_ones():
    text = 'Sure.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": "{\\"y\\": [2]}"}\n</tool_call>'
    p = parse_tool_calls(text, "hermes")
    assert p.content == "Sure." and not p.ill_formed
    assert [(c.name, c.arguments()) for c in p.tool_calls] == [("a", {"x": 1}), ("b", {"y": [2]})]
    assert len({c.id for c in p.tool_calls}) == 2
    for broken in (
        '<tool_call>\n{"name": "a", "arguments": {"x": 1}\n</tool_call>',  # bad JSON
        '<tool_call>\n{"name": "a", "arguments": {"x": 1}}',  # never closed (cut by max_tokens)
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "a", "arguments": [1]}\n</tool_call>',  # arguments not an object
    ):
        p = parse_tool_calls(broken, "hermes")
        assert p.ill_formed and p.content == broken and p.tool_calls == ()
    # issue 42: a call followed by text is returned (as vLLM's parser does), the text kept in `unparsed`
    p = parse_tool_calls('<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call> trailing words', "hermes")
    assert [c.name for c in p.tool_calls] == ["a"] and not p.ill_formed and p.unparsed == " trailing words"
    assert parse_tool_calls("plain answer", "hermes").content == "plain answer"


def test_xml_values_are_typed_by_the_tool_schema():
    text = (
        "<tool_call>\n<function=calculator>\n<parameter=expression>\n2 + 3\n</parameter>\n"
        "<parameter=precision>\n2\n</parameter>\n</function>\n</tool_call>"
    )
    p = parse_tool_calls(text, "qwen3_coder", (TOOL,))
    assert p.tool_calls[0].arguments() == {"expression": "2 + 3", "precision": 2}
    bad_int = text.replace("\n2\n", "\ntwo\n")
    assert parse_tool_calls(bad_int, "qwen3_coder", (TOOL,)).ill_formed
    assert parse_tool_calls("<tool_call>\n<function=f>\n</tool_call>", "qwen3_coder").ill_formed


# -- end to end --------------------------------------------------------------------------------


async def serve(renderer: ChatRenderer, engine: ScriptedEngine) -> GatewayServer:
    cfg = GatewayConfig(model_path=str(ensure_tiny_model()), served_model_name=MODEL_ID, max_context_tokens=1024)
    server = GatewayServer(cfg, [engine], renderer=renderer)
    await asyncio.wait_for(server.start(), TIMEOUT_S)
    return server


async def test_xml_tool_calls_round_trip_through_the_template(tokenizer, tmp_path):
    path = tmp_path / "xml.jinja"
    path.write_text(XML_TEMPLATE)
    renderer = ChatRenderer.from_pretrained(ensure_tiny_model(), chat_template_path=str(path))
    assert renderer.tool_format == "qwen3_coder"
    call = (
        "<tool_call>\n<function=calculator>\n<parameter=expression>\n2+3\n</parameter>\n"
        "<parameter=precision>\n2\n</parameter>\n</function>\n</tool_call>"
    )
    out1, out2 = reply_ids(tokenizer, call), reply_ids(tokenizer, "5.00")
    engine = ScriptedEngine([out1, out2])
    server = await serve(renderer, engine)
    try:
        token = await server.open_session(SESSION)
        msgs = [{"role": "user", "content": "2+3 to 2 places"}]
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key=token, max_retries=0) as c:
            r1 = await c.chat.completions.create(model=MODEL_ID, messages=msgs, tools=[TOOL])
            tc = r1.choices[0].message.tool_calls[0]
            assert json.loads(tc.function.arguments) == {"expression": "2+3", "precision": 2}
            msgs += [r1.choices[0].message, {"role": "tool", "tool_call_id": tc.id, "content": "5.00"}]
            await c.chat.completions.create(model=MODEL_ID, messages=msgs, tools=[TOOL])
        cap = await server.close_session(SESSION)
        assert len(cap.rows) == 1 and cap.rows[0].token_ids == engine.requests[1].prompt_ids + out2
    finally:
        await server.stop()


async def test_reasoning_template_dropping_think_forks_without_duplicating_tokens(tokenizer):
    """Regression (public bug reports): a template that drops earlier <think> blocks makes the next
    prompt diverge from the recorded tokens. Appending it anyway duplicates or corrupts tokens; the
    turn must start a new row instead, and each generated token appears once with mask 1."""
    renderer = ChatRenderer(tokenizer, chat_template=THINK_DROPPING_TEMPLATE)
    out1, out2 = reply_ids(tokenizer, "<think>\nadd them\n</think>\n\n4"), reply_ids(tokenizer, "<think>\nagain\n</think>\n\n8")
    engine = ScriptedEngine([out1, out2], version=4)
    server = await serve(renderer, engine)
    try:
        token = await server.open_session(SESSION)
        msgs = [{"role": "user", "content": "2+2?"}]
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key=token, max_retries=0) as c:
            r1 = await c.chat.completions.create(model=MODEL_ID, messages=msgs)
            msgs += [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "4+4?"}]
            await c.chat.completions.create(model=MODEL_ID, messages=msgs)
        p1, p2 = (r.prompt_ids for r in engine.requests)
        assert "<think>" not in tokenizer.decode(p2)  # the template dropped it
        cap = await server.close_session(SESSION)
        assert len(cap.rows) == 2  # FORK
        first, second = cap.rows
        assert first.token_ids == p1 + out1 and second.token_ids == p2 + out2
        assert first.num_generated + second.num_generated == len(out1) + len(out2)  # nothing twice
        assert second.loss_mask == (0,) * len(p2) + (1,) * len(out2)
        assert server.metrics().turns_fork == 1
    finally:
        await server.stop()


def test_llama3_json_calls_plain_answers_and_broken_calls():
    p = parse_tool_calls('{"name": "a", "parameters": {"x": 1}}', "llama3_json")
    assert p.content == "" and [(c.name, c.arguments()) for c in p.tool_calls] == [("a", {"x": 1})]
    p = parse_tool_calls('<|python_tag|>{"name":"a","parameters":{}}; {"name": "b", "arguments": {"y": 2}}', "llama3_json")
    assert [(c.name, c.arguments()) for c in p.tool_calls] == [("a", {}), ("b", {"y": 2})]
    assert parse_tool_calls("The answer is 5.", "llama3_json").content == "The answer is 5."
    for broken in ('{"name": "a", "parameters": {"x": 1}', '{"parameters": {}}'):
        p = parse_tool_calls(broken, "llama3_json")
        assert p.ill_formed and p.content == broken and p.tool_calls == ()
    p = parse_tool_calls('{"name": "a"} trailing', "llama3_json")  # issue 42: the call, then text
    assert [c.name for c in p.tool_calls] == ["a"] and not p.ill_formed and p.unparsed == "trailing"
