"""Gateway fidelity on real tokenizers and chat templates (Qwen2.5, Qwen3, Qwen3.5+/Qwen3-Coder,
Llama 3.1/3.2, gpt-oss harmony), fetched once into the cache (workers/embedded/real_tokenizers.py).

Each family runs one multi-turn tool conversation through the real gateway and the official
OpenAI SDK: a calculator call, a zero-argument call, a final answer. A scripted engine emits
exactly the tokens the template's tool-call format implies (`canonical`: the call written as the
template re-renders it) or a model's compact JSON (`compact`: `{"name":"calculator",...}`).
Asserted per family:
- tool calls parsed (the zero-argument one too), arguments round-trip as JSON;
- token-exact capture: the row is the engine's prompts and outputs, loss mask 1 exactly on the
  generated tokens, nothing recorded twice;
- CLEAN where the template extends the previous tokens, FORK where it rewrites history (Qwen3 with
  thinking off drops the empty think block of earlier answers);
- the row decodes to the template's own rendering of the conversation (canonical style), so the
  assistant -> tool separator is kept; Llama's tool results go in the `ipython` role;
- compact JSON: FORK on every tool turn without token continuity, CLEAN with it;
- `gateway.history_mode=linear`: every family, canonical or compact calls, is one row whose
  tokens are the served ids (Qwen3 thinking-off included: healed instead of FORK);
- gpt-oss (harmony) in the same matrix (analysis before each action, calls to `functions.*` parsed
  from the ids by openai-harmony, `reasoning_content` sent back and re-rendered); besides: a call
  on the `analysis` channel, a cut-off generation (mid-answer and mid-call), a two-call turn
  (parsed from one generation; rendered as the call/result chain), and a second user turn, which
  the format requires to drop the analysis (a new row in both history modes).
The chat-template registry recognises each real template by content (both Qwen3 revisions).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from workers.embedded.sim_engine import ScriptedEngine
from workers.gateway.capture import TurnKind
from workers.gateway.chat_template import ChatRenderer
from workers.gateway.config import GatewayConfig
from workers.gateway.openai_api import ChatRequest
from workers.gateway.server import GatewayServer
from workers.gateway.template_registry import identify

MODEL_ID = "real"
SESSION = "gw-templates-session-" + "0" * 24
TIMEOUT_S = 30
TOOLS = [
    {"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                      "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                                                     "required": ["expression"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "The time now.",
                                      "parameters": {"type": "object", "properties": {}}}},
]
CALLS = [("calculator", {"expression": "2+3"}), ("get_time", {})]
FINAL = "2+3 = 5, and it is 12:00."
TOOL_RESULTS = ["5", "12:00"]


@dataclass(frozen=True)
class Case:
    """One family: tokenizer, template (None: the tokenizer's own), template kwargs, expectations."""

    name: str
    tokenizer: str
    template: str | None
    family: str
    fmt: str
    kwargs: dict | None = None
    think: str | None = None  # reasoning the model writes before each answer (after `<think>\n`)
    think_in_prompt: bool = False  # the generation prompt already opened `<think>\n`
    rewrites_history: bool = False  # the template drops something of earlier answers: FORK


CASES = [
    Case("qwen2_5", "qwen2_5", None, "qwen2_5", "hermes"),
    Case("qwen3_think", "qwen3", None, "qwen3", "hermes", think="I use a tool."),
    Case("qwen3_nothink", "qwen3", None, "qwen3", "hermes", kwargs={"enable_thinking": False}, rewrites_history=True),
    Case("qwen3_trl_revision", "qwen3", "qwen3", "qwen3", "hermes", think="I use a tool."),
    Case("qwen3_5_xml", "qwen3", "qwen3_5_think", "qwen3_coder", "qwen3_coder", think="I use a tool.",
         think_in_prompt=True),
    Case("qwen3_5_xml_nothink", "qwen3", "qwen3_5_nothink", "qwen3_coder", "qwen3_coder"),
    Case("qwen3_6_xml", "qwen3", "qwen3_6", "qwen3_coder", "qwen3_coder", think="Tool.", think_in_prompt=True),
    Case("llama3_1", "llama3_2", "llama3_1", "llama3", "llama3_json"),
    Case("llama3_2", "llama3_2", None, "llama3", "llama3_json"),
    Case("gpt_oss", "gptoss", None, "harmony", "harmony", think="I use a tool."),
]
HARMONY_CALL_END, HARMONY_FINAL_END = "<|call|>", "<|return|>"


def call_text(fmt: str, name: str, args: dict, style: str) -> str:
    """A tool call as the model writes it in `fmt` (canonical: as the template renders it)."""
    sep = (",", ":") if style == "compact" else (", ", ": ")
    if fmt == "harmony":  # canonical: as openai-harmony renders it; compact: a header variant models sample
        ctype = " json" if style == "compact" else " <|constrain|>json"
        return (f"<|channel|>commentary to=functions.{name}{ctype}<|message|>" + json.dumps(args, separators=sep)
                + HARMONY_CALL_END)
    if fmt == "hermes":
        return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}, separators=sep) + "\n</tool_call>"
    if fmt == "llama3_json":
        return json.dumps({"name": name, "parameters": args}, separators=sep)
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def answer_texts(case: Case, style: str) -> list[str]:
    """The three answers of the conversation, as generated text (without the end token)."""
    outs = [call_text(case.fmt, n, a, style) for n, a in CALLS] + [FINAL]
    if case.fmt == "harmony":  # analysis, then the action; the end token is part of the text
        outs[-1] = f"<|channel|>final<|message|>{FINAL}{HARMONY_FINAL_END}"
        return [f"<|channel|>analysis<|message|>{case.think}<|end|><|start|>assistant{o}" for o in outs]
    if case.think_in_prompt:
        return [f"{case.think}\n</think>\n\n{o}" for o in outs]
    if case.think:
        return [f"<think>\n{case.think}\n</think>\n\n{o}" for o in outs]
    return outs


_TOKENIZERS: dict[str, object] = {}


def renderer_for(case: Case, root: Path) -> ChatRenderer:
    """A ChatRenderer for the case (each tokenizer is loaded once per module: ~3 s each)."""
    from transformers import AutoTokenizer

    from workers.embedded.real_tokenizers import tokenizer_dir, trl_template

    if case.tokenizer not in _TOKENIZERS:
        _TOKENIZERS[case.tokenizer] = AutoTokenizer.from_pretrained(str(tokenizer_dir(case.tokenizer)))
    return ChatRenderer(_TOKENIZERS[case.tokenizer], chat_template=trl_template(case.template) if case.template else None)


@dataclass
class Conversation:
    responses: list
    prompts: list[tuple[int, ...]]
    outputs: list[tuple[int, ...]]
    rows: tuple
    kinds: list[TurnKind]
    messages: list
    metrics: object


def scripted(renderer: ChatRenderer, answer: str) -> tuple[int, ...]:
    """The ids of an answer, ended by the template's end token unless the text writes its own."""
    ids = tuple(renderer.tokenizer.encode(answer, add_special_tokens=False))
    return ids if ids and ids[-1] in renderer.base_stop_ids else (*ids, renderer.base_stop_ids[0])


async def converse(renderer: ChatRenderer, answers: list[str], *, continuity: bool, kwargs: dict | None,
                   history_mode: str = "tree", max_tokens: tuple[int | None, ...] = (None, None, None)) -> Conversation:
    outputs = [scripted(renderer, a) for a in answers]
    engine = ScriptedEngine(outputs)
    cfg = GatewayConfig(model_path="unused", served_model_name=MODEL_ID, max_context_tokens=8192,
                        token_continuity=continuity, history_mode=history_mode)
    server = GatewayServer(cfg, [engine], renderer=renderer)
    await asyncio.wait_for(server.start(), TIMEOUT_S)
    try:
        token = await server.open_session(SESSION)
        msgs: list = [{"role": "user", "content": "What is 2+3, and what time is it?"}]
        extra = {"chat_template_kwargs": kwargs} if kwargs else None
        responses, kinds = [], []
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key=token, max_retries=0) as c:
            for i in range(3):
                before = server.metrics()
                limit = {"max_tokens": max_tokens[i]} if max_tokens[i] else {}
                r = await asyncio.wait_for(
                    c.chat.completions.create(model=MODEL_ID, messages=msgs, tools=TOOLS, extra_body=extra, **limit),
                    TIMEOUT_S)
                kinds.append(last_kind(before, server.metrics()))
                responses.append(r)
                msg = r.choices[0].message
                msgs.append(msg)
                for tc in msg.tool_calls or ():
                    msgs.append({"role": "tool", "tool_call_id": tc.id, "content": TOOL_RESULTS[i]})
        cap = await server.close_session(SESSION)
        served = [o[:m] if m else o for o, m in zip(outputs, max_tokens)]  # the engine stops at max_tokens
        return Conversation(responses, [r.prompt_ids for r in engine.requests], served, cap.rows, kinds, msgs,
                            server.metrics())
    finally:
        await server.stop()


def as_template_input(messages: list) -> tuple[dict, ...]:
    """The messages as the gateway gives them to the template (SDK objects dumped, arguments parsed)."""
    raw = [m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else m for m in messages]
    return ChatRequest.parse({"model": MODEL_ID, "messages": raw}).messages


def last_kind(before, after) -> TurnKind:
    """How the turn served between two metrics snapshots was recorded."""
    for kind, field in ((TurnKind.FIRST, "turns_first"), (TurnKind.CLEAN, "turns_clean"), (TurnKind.FORK, "turns_fork")):
        if getattr(after, field) == getattr(before, field) + 1:
            return kind
    raise AssertionError("no turn recorded")


def mask_positions(row) -> list[int]:
    return [i for i, m in enumerate(row.loss_mask) if m == 1]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_tool_conversation_on_real_template(case, real_tokenizers):
    renderer = renderer_for(case, real_tokenizers)
    assert renderer.info.family == case.family and renderer.tool_format == case.fmt
    conv = await converse(renderer, answer_texts(case, "canonical"), continuity=True, kwargs=case.kwargs)
    tok = renderer.tokenizer

    # tool calls parsed, zero-argument included; arguments round-trip; the final answer is text
    for r, (name, args) in zip(conv.responses[:2], CALLS):
        (tc,) = r.choices[0].message.tool_calls
        assert tc.function.name == name and json.loads(tc.function.arguments) == args
        assert r.choices[0].finish_reason == "tool_calls"
    assert not conv.responses[2].choices[0].message.tool_calls
    assert conv.responses[2].choices[0].message.content.endswith(FINAL)

    if case.rewrites_history:
        assert conv.kinds == [TurnKind.FIRST, TurnKind.FORK, TurnKind.FORK]
        assert len(conv.rows) == 3
        for row, p, o in zip(conv.rows, conv.prompts, conv.outputs):  # each row exact, nothing twice
            assert row.token_ids == p + o and row.loss_mask == (0,) * len(p) + (1,) * len(o)
        return

    assert conv.kinds == [TurnKind.FIRST, TurnKind.CLEAN, TurnKind.CLEAN]
    (row,) = conv.rows
    assert row.token_ids == conv.prompts[2] + conv.outputs[2]  # token-exact: the served ids
    for p, prev_p, prev_o in zip(conv.prompts[1:], conv.prompts, conv.outputs):
        assert p[: len(prev_p) + len(prev_o)] == prev_p + prev_o  # each prompt extends the last turn
    generated = [t for o in conv.outputs for t in o]
    assert [row.token_ids[i] for i in mask_positions(row)] == generated  # mask 1 = generated, once each
    # the row is the template's own rendering with the generated answers: separators kept
    final_prompt = renderer.render_text(as_template_input(conv.messages[:-1]), TOOLS, case.kwargs)
    assert tok.decode(row.token_ids) == final_prompt + tok.decode(conv.outputs[2])
    if case.family == "llama3":
        assert '<|start_header_id|>ipython<|end_header_id|>\n\n"5"<|eot_id|>' in final_prompt  # tojson of a str


@pytest.mark.parametrize("case", [c for c in CASES if c.fmt != "qwen3_coder"], ids=lambda c: c.name)
async def test_compact_json_calls_continue_the_recorded_tokens(case, real_tokenizers):
    """Regression (issue 12, item 2): a model writes `{"name":"calculator",...}`, the SDK sends it
    back parsed, the template re-renders it with spaces; without continuity every tool turn is a
    new row (FORK). With it, the next prompt is the recorded tokens plus the rendered new text."""
    renderer = renderer_for(case, real_tokenizers)
    answers = answer_texts(case, "compact")
    before = await converse(renderer, answers, continuity=False, kwargs=case.kwargs)
    after = await converse(renderer, answers, continuity=True, kwargs=case.kwargs)
    assert before.kinds == [TurnKind.FIRST, TurnKind.FORK, TurnKind.FORK]
    expected = TurnKind.FORK if case.rewrites_history else TurnKind.CLEAN
    assert after.kinds == [TurnKind.FIRST, expected, expected]
    for conv in (before, after):
        generated = sum(len(o) for o in conv.outputs)
        assert sum(r.num_generated for r in conv.rows) == generated  # nothing recorded twice
        masked = [row.token_ids[i] for row in conv.rows for i in mask_positions(row)]
        assert masked == [t for o in conv.outputs for t in o]  # mask 1 = generated tokens, in order
    if not case.rewrites_history:
        (row,) = after.rows
        assert row.token_ids == after.prompts[2] + after.outputs[2]
        assert [row.token_ids[i] for i in mask_positions(row)] == [t for o in after.outputs for t in o]
        text = renderer.tokenizer.decode(row.token_ids)
        own = (call_text("harmony", "get_time", {}, "compact") if case.fmt == "harmony" else
               json.dumps({"name": "get_time", ("parameters" if case.fmt == "llama3_json" else "arguments"): {}},
                          separators=(",", ":")))
        assert own in text  # the model's own tokens, not the re-render
        assert after.metrics.turns_continued == 2


@pytest.mark.parametrize("style", ["canonical", "compact"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_linear_history_keeps_every_template_one_row(case, style, real_tokenizers):
    """Issue 28 item 2: with `history_mode=linear` the 3-turn tool conversation is one row on every
    family, including Qwen3 thinking-off (FORK on every tool turn in tree mode): each prompt is the
    previous prompt and answer as served, then the template's rendering of the new tool result."""
    renderer = renderer_for(case, real_tokenizers)
    conv = await converse(renderer, answer_texts(case, style), continuity=True, kwargs=case.kwargs,
                          history_mode="linear")
    assert conv.kinds == [TurnKind.FIRST, TurnKind.CLEAN, TurnKind.CLEAN]
    (row,) = conv.rows
    assert row.token_ids == conv.prompts[2] + conv.outputs[2]
    for p, prev_p, prev_o in zip(conv.prompts[1:], conv.prompts, conv.outputs):
        assert p[: len(prev_p) + len(prev_o)] == prev_p + prev_o
    assert [row.token_ids[i] for i in mask_positions(row)] == [t for o in conv.outputs for t in o]
    m = conv.metrics
    assert m.turns_nonlinear == 0 and m.turns_healed <= 2
    if case.rewrites_history or (style == "compact" and case.fmt != "qwen3_coder"):  # XML calls: no JSON spacing
        assert m.turns_healed == 2 and m.healed_prefix_tokens == sum(len(p) + len(o) for p, o in
                                                                     zip(conv.prompts[:2], conv.outputs[:2]))
    # the tail is the template's own: the last prompt ends as the plain render of the conversation does
    final_prompt = renderer.render_text(as_template_input(conv.messages[:-1]), TOOLS, case.kwargs)
    last_result = final_prompt[final_prompt.rindex(TOOL_RESULTS[1]):]
    assert renderer.tokenizer.decode(conv.prompts[2]).endswith(last_result)


@pytest.mark.parametrize("on_nonlinear", ["reset", "error", "passthrough"])
async def test_linear_history_on_an_edited_history_does_what_on_nonlinear_says(on_nonlinear, real_tokenizers):
    """A request that edits an earlier tool result is not linear: `reset` starts a new row and heals
    on from it (turn 4 CLEAN), `error` answers 400 `nonlinear_history` and generates nothing,
    `passthrough` serves the rest of the session in tree mode (Qwen3 thinking-off: turn 4 FORKs)."""
    case = next(c for c in CASES if c.name == "qwen3_nothink")
    renderer = renderer_for(case, real_tokenizers)
    tok = renderer.tokenizer
    texts = [call_text(case.fmt, *CALLS[0], "canonical"), call_text(case.fmt, *CALLS[1], "canonical"),
             call_text(case.fmt, *CALLS[0], "canonical"), FINAL]
    outputs = [(*tok.encode(a, add_special_tokens=False), renderer.base_stop_ids[0]) for a in texts]
    engine = ScriptedEngine(outputs)
    cfg = GatewayConfig(model_path="unused", served_model_name=MODEL_ID, max_context_tokens=8192,
                        history_mode="linear", on_nonlinear=on_nonlinear)
    server = GatewayServer(cfg, [engine], renderer=renderer)
    await asyncio.wait_for(server.start(), TIMEOUT_S)
    kinds, extra = [], {"chat_template_kwargs": case.kwargs}
    try:
        token = await server.open_session(SESSION)
        msgs: list = [{"role": "user", "content": "What is 2+3, and what time is it?"}]
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key=token, max_retries=0) as c:
            for i in range(4):
                before = server.metrics()
                try:
                    r = await c.chat.completions.create(model=MODEL_ID, messages=msgs, tools=TOOLS, extra_body=extra)
                except openai.BadRequestError as e:
                    kinds.append(e.code)
                    break
                kinds.append(last_kind(before, server.metrics()))
                msg = r.choices[0].message
                msgs += [msg, *({"role": "tool", "tool_call_id": tc.id, "content": f"result {i}"}
                                for tc in msg.tool_calls or ())]
                if i == 1:
                    msgs[2] = {**msgs[2], "content": "6"}  # the first tool result, edited
        cap = await server.close_session(SESSION)
        m = server.metrics()
    finally:
        await server.stop()
    assert m.turns_nonlinear == 1 and m.turns_healed == (2 if on_nonlinear == "reset" else 1)
    if on_nonlinear == "error":
        assert kinds == [TurnKind.FIRST, TurnKind.CLEAN, "nonlinear_history"] and len(engine.requests) == 2
        assert cap.nonlinear  # the rollout fails `nonlinear_history` whatever the agent does with the 400
        return
    assert not cap.nonlinear
    fourth = TurnKind.CLEAN if on_nonlinear == "reset" else TurnKind.FORK
    assert kinds == [TurnKind.FIRST, TurnKind.CLEAN, TurnKind.FORK, fourth]
    assert len(cap.rows) == (2 if on_nonlinear == "reset" else 3)
    assert sum(r.num_generated for r in cap.rows) == sum(len(o) for o in outputs)  # nothing twice, nothing lost


@pytest.mark.parametrize(
    ("template", "family", "fmt"),
    [("qwen2_5", "qwen2_5", "hermes"), ("qwen3", "qwen3", "hermes"), ("qwen3_instruct_2507", "chatml", "hermes"),
     ("qwen3_5_think", "qwen3_coder", "qwen3_coder"), ("qwen3_5_nothink", "qwen3_coder", "qwen3_coder"),
     ("qwen3_6", "qwen3_coder", "qwen3_coder"), ("qwen3_8", "qwen3_coder", "qwen3_coder"),
     ("llama3_1", "llama3", "llama3_json"), ("llama3_2", "llama3", "llama3_json"), ("llama3", "llama3", None),
     ("gptoss", "harmony", "harmony")],
)
def test_registry_recognises_real_templates_by_content(template, family, fmt, real_tokenizers):
    from workers.embedded.real_tokenizers import trl_template

    info = identify(trl_template(template))
    assert (info.family, info.tool_format) == (family, fmt)
    assert info.final_tokens == (("<|return|>",) if family == "harmony" else ())


def test_registry_recognises_both_qwen3_revisions(real_tokenizers):
    """The original Qwen3 template (the tokenizer's) and TRL's revision differ in text (non-string
    content handling) but are the same family."""
    from workers.embedded.real_tokenizers import tokenizer_dir, trl_template

    original = json.loads((tokenizer_dir("qwen3") / "tokenizer_config.json").read_text())["chat_template"]
    revised = trl_template("qwen3")
    assert original != revised
    assert identify(original) == identify(revised) and identify(original).family == "qwen3"
    assert identify(original).reasoning


@pytest.mark.parametrize("edit", ["edited_tool_result", "dropped_call"])
async def test_diverging_history_still_forks_with_continuity(edit, real_tokenizers):
    """Continuity applies only when the history matches the recorded turns message by message: an
    edited tool result or a dropped turn is a real divergence and starts a new row (FORK)."""
    case = next(c for c in CASES if c.name == "qwen2_5")
    renderer = renderer_for(case, real_tokenizers)
    tok = renderer.tokenizer
    outputs = [(*tok.encode(a, add_special_tokens=False), tok.eos_token_id) for a in answer_texts(case, "compact")]
    engine = ScriptedEngine(outputs)
    server = GatewayServer(GatewayConfig(model_path="unused", served_model_name=MODEL_ID, max_context_tokens=8192),
                           [engine], renderer=renderer)
    await asyncio.wait_for(server.start(), TIMEOUT_S)
    try:
        token = await server.open_session(SESSION)
        msgs: list = [{"role": "user", "content": "What is 2+3, and what time is it?"}]
        kinds = []
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key=token, max_retries=0) as c:
            for i in range(3):
                before = server.metrics()
                r = await c.chat.completions.create(model=MODEL_ID, messages=msgs, tools=TOOLS)
                kinds.append(last_kind(before, server.metrics()))
                msg = r.choices[0].message
                msgs += [msg, *({"role": "tool", "tool_call_id": tc.id, "content": TOOL_RESULTS[i]}
                                for tc in msg.tool_calls or ())]
                if i == 1 and edit == "edited_tool_result":
                    msgs[2] = {**msgs[2], "content": "6"}
                elif i == 1:
                    msgs = msgs[:1] + msgs[3:]  # the first call and its result are gone
        cap = await server.close_session(SESSION)
    finally:
        await server.stop()
    assert kinds == [TurnKind.FIRST, TurnKind.CLEAN, TurnKind.FORK]
    assert len(cap.rows) == 2 and cap.rows[1].token_ids == engine.requests[2].prompt_ids + outputs[2]
    assert sum(r.num_generated for r in cap.rows) == sum(len(o) for o in outputs)


# --- gpt-oss (harmony) beyond the matrix ----------------------------------------------------------

GPT_OSS = next(c for c in CASES if c.fmt == "harmony")


def harmony_text(*parts: str) -> str:
    """Harmony messages of one generation: the first follows the prompt's `<|start|>assistant`."""
    return "<|start|>assistant".join(parts)


def analysis(text: str) -> str:
    return f"<|channel|>analysis<|message|>{text}<|end|>"


async def test_gpt_oss_call_on_the_analysis_channel_is_parsed_and_continued(real_tokenizers):
    """gpt-oss may address a function from the analysis channel: it is a call all the same, and
    the turn after it still extends the row (the template re-renders it on `commentary`; the
    recorded tokens are continued)."""
    renderer = renderer_for(GPT_OSS, real_tokenizers)
    on_analysis = call_text("harmony", *CALLS[0], "canonical").replace("<|channel|>commentary", "<|channel|>analysis")
    answers = [on_analysis] + answer_texts(GPT_OSS, "canonical")[1:]
    conv = await converse(renderer, answers, continuity=True, kwargs=None)
    (tc,) = conv.responses[0].choices[0].message.tool_calls
    assert (tc.function.name, json.loads(tc.function.arguments)) == CALLS[0]
    assert conv.kinds == [TurnKind.FIRST, TurnKind.CLEAN, TurnKind.CLEAN] and conv.metrics.turns_continued >= 1
    (row,) = conv.rows
    assert row.token_ids == conv.prompts[2] + conv.outputs[2]
    assert [row.token_ids[i] for i in mask_positions(row)] == [t for o in conv.outputs for t in o]
    assert "<|channel|>analysis to=functions.calculator" in renderer.tokenizer.decode(row.token_ids)  # the model's own
    assert conv.metrics.turns_ill_formed == 0


async def test_gpt_oss_cut_off_answer_is_parsed_and_recorded(real_tokenizers):
    """max_tokens ends the final answer mid-message: the text so far is the content, the analysis
    the reasoning, finish_reason `length`; the row holds exactly what was served."""
    renderer = renderer_for(GPT_OSS, real_tokenizers)
    answers = answer_texts(GPT_OSS, "canonical")
    cut = len(scripted(renderer, answers[2])) - 5
    conv = await converse(renderer, answers, continuity=True, kwargs=None, max_tokens=(None, None, cut))
    choice = conv.responses[2].choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert choice.message.content and FINAL.startswith(choice.message.content) and choice.message.content != FINAL
    assert choice.message.model_extra["reasoning_content"] == GPT_OSS.think
    (row,) = conv.rows
    assert len(conv.outputs[2]) == cut and row.token_ids == conv.prompts[2] + conv.outputs[2]
    assert [row.token_ids[i] for i in mask_positions(row)] == [t for o in conv.outputs for t in o]
    assert conv.metrics.turns_ill_formed == 0


async def test_gpt_oss_call_cut_mid_arguments_is_a_truncation_not_a_malformed_call(real_tokenizers):
    renderer = renderer_for(GPT_OSS, real_tokenizers)
    answers = answer_texts(GPT_OSS, "canonical")
    ids = scripted(renderer, answers[0])
    cut = len(ids) - 3  # inside {"expression": "2+3"}
    conv = await converse(renderer, answers, continuity=True, kwargs=None, max_tokens=(cut, None, None))
    choice = conv.responses[0].choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls and not choice.message.content
    assert choice.message.model_extra["reasoning_content"] == GPT_OSS.think
    assert conv.metrics.turns_ill_formed == 0
    assert sum(r.num_generated for r in conv.rows) == sum(len(o) for o in conv.outputs)  # nothing lost or twice


def test_gpt_oss_two_calls_in_one_generation_are_both_parsed(real_tokenizers):
    """openai-harmony stops an action at `<|call|>`, so an engine returns one call per turn; an
    output that holds two call messages (an engine without that stop) still gives both, in order,
    and a reply that is not JSON, or to a built-in tool that was not offered, is ill-formed."""
    renderer = renderer_for(GPT_OSS, real_tokenizers)
    tok = renderer.tokenizer
    calls = [call_text("harmony", n, a, "canonical") for n, a in CALLS]
    parsed = renderer.harmony.parse(tok.encode(harmony_text(analysis("Two tools."), *calls), add_special_tokens=False))
    assert [(c.name, c.arguments()) for c in parsed.tool_calls] == CALLS and not parsed.ill_formed
    assert parsed.reasoning == "Two tools." and parsed.content == ""
    assert len({c.id for c in parsed.tool_calls}) == 2
    for bad in ("<|channel|>commentary to=functions.calculator <|constrain|>json<|message|>[1]<|call|>",
                "<|channel|>commentary to=browser.search <|constrain|>json<|message|>{}<|call|>"):
        out = renderer.harmony.parse(tok.encode(bad, add_special_tokens=False))
        assert out.ill_formed and not out.tool_calls and out.content == bad.removesuffix("<|call|>")


async def test_gpt_oss_two_call_turn_is_rendered_as_the_call_result_chain(real_tokenizers):
    """An assistant message with two parallel calls (results sent back in the other order) is
    rendered as harmony writes it: each call followed by its own result, named after its function;
    the next answer is generated on that prompt and recorded exactly."""
    renderer = renderer_for(GPT_OSS, real_tokenizers)
    final = analysis("Both done.") + "<|start|>assistant<|channel|>final<|message|>" + FINAL + HARMONY_FINAL_END
    engine = ScriptedEngine([scripted(renderer, final)])
    server = GatewayServer(GatewayConfig(model_path="unused", served_model_name=MODEL_ID, max_context_tokens=8192),
                           [engine], renderer=renderer)
    await asyncio.wait_for(server.start(), TIMEOUT_S)
    calls = [{"id": f"call_{n}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}} for n, a in CALLS]
    msgs = [{"role": "user", "content": "What is 2+3, and what time is it?"},
            {"role": "assistant", "content": None, "reasoning_content": "Two tools.", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "call_get_time", "content": TOOL_RESULTS[1]},
            {"role": "tool", "tool_call_id": "call_calculator", "content": TOOL_RESULTS[0]}]
    try:
        token = await server.open_session(SESSION)
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key=token, max_retries=0) as c:
            r = await c.chat.completions.create(model=MODEL_ID, messages=msgs, tools=TOOLS)
        cap = await server.close_session(SESSION)
    finally:
        await server.stop()
    assert r.choices[0].message.content == FINAL and r.choices[0].finish_reason == "stop"
    prompt = renderer.tokenizer.decode(engine.requests[0].prompt_ids)
    chain = "".join(f"<|start|>assistant<|channel|>commentary to=functions.{n} <|constrain|>json<|message|>"
                    f"{json.dumps(a)}<|call|><|start|>functions.{n} to=assistant<|channel|>commentary<|message|>"
                    f"{json.dumps(res)}<|end|>" for (n, a), res in zip(CALLS, TOOL_RESULTS))
    assert prompt.endswith(analysis("Two tools.") + chain + "<|start|>assistant")
    (row,) = cap.rows
    assert row.token_ids == engine.requests[0].prompt_ids + scripted(renderer, final)


@pytest.mark.parametrize("history_mode", ["tree", "linear"])
async def test_gpt_oss_session_rows_follow_the_format(history_mode, real_tokenizers):
    """What a gpt-oss session looks like in rows: a tool-call chain (call, call, final) is one row;
    a second user turn after the final answer starts a second row, because the format drops the
    chain's analysis and writes `<|end|>` for the sampled `<|return|>`; in linear mode that is not
    a non-linear history (no 400 even with on_nonlinear=error)."""
    renderer = renderer_for(GPT_OSS, real_tokenizers)
    answers = answer_texts(GPT_OSS, "canonical") + [harmony_text(analysis("Easy."), "<|channel|>final<|message|>4"
                                                                 + HARMONY_FINAL_END)]
    outputs = [scripted(renderer, a) for a in answers]
    engine = ScriptedEngine(outputs)
    cfg = GatewayConfig(model_path="unused", served_model_name=MODEL_ID, max_context_tokens=8192,
                        history_mode=history_mode, on_nonlinear="error")
    server = GatewayServer(cfg, [engine], renderer=renderer)
    await asyncio.wait_for(server.start(), TIMEOUT_S)
    kinds, msgs = [], [{"role": "user", "content": "What is 2+3, and what time is it?"}]
    try:
        token = await server.open_session(SESSION)
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key=token, max_retries=0) as c:
            for i in range(4):
                before = server.metrics()
                r = await c.chat.completions.create(model=MODEL_ID, messages=msgs, tools=TOOLS)
                kinds.append(last_kind(before, server.metrics()))
                msg = r.choices[0].message
                msgs += [msg, *({"role": "tool", "tool_call_id": tc.id, "content": TOOL_RESULTS[i]}
                                for tc in msg.tool_calls or ())]
                if i == 2:
                    msgs.append({"role": "user", "content": "And 2+2?"})
        cap = await server.close_session(SESSION)
        m = server.metrics()
    finally:
        await server.stop()
    assert kinds == [TurnKind.FIRST, TurnKind.CLEAN, TurnKind.CLEAN, TurnKind.FORK] and m.turns_nonlinear == 0
    first, second = cap.rows
    assert first.token_ids == engine.requests[2].prompt_ids + outputs[2]
    assert second.token_ids == engine.requests[3].prompt_ids + outputs[3]
    text = renderer.tokenizer.decode(engine.requests[3].prompt_ids)
    assert GPT_OSS.think not in text and HARMONY_FINAL_END not in text  # analysis dropped, <|return|> -> <|end|>
    assert f"<|channel|>final<|message|>{FINAL}<|end|><|start|>user<|message|>And 2+2?<|end|>" in text


async def test_gpt_oss_session_date_is_pinned_at_its_first_turn(real_tokenizers):
    """The template writes "Current date:"; a session that runs past midnight keeps its first
    turn's date (else its second prompt would not extend the first: a new row)."""
    import datetime

    from workers.gateway.capture import CaptureStore
    from workers.gateway.metrics import Counters
    from workers.gateway.router import ReplicaRouter
    from workers.gateway.turns import TurnRunner

    renderer = renderer_for(GPT_OSS, real_tokenizers)
    answers = answer_texts(GPT_OSS, "canonical")
    engine = ScriptedEngine([scripted(renderer, a) for a in answers])
    days = iter([datetime.datetime(2025, 6, 28, 23, 59), datetime.datetime(2025, 6, 29, 0, 1)])
    capture = CaptureStore(default_max_context_tokens=8192)
    session = capture.authenticate(capture.open(SESSION))
    runner = TurnRunner(capture, ReplicaRouter([engine]), renderer, Counters(), now=lambda: next(days))
    msgs: list = [{"role": "user", "content": "What is 2+3?"}]
    first = await runner.run(session, ChatRequest.parse({"model": MODEL_ID, "messages": msgs, "tools": TOOLS}))
    (call,) = first.parsed.tool_calls
    msgs += [{"role": "assistant", "content": None, "reasoning_content": first.parsed.reasoning,
              "tool_calls": [{"id": call.id, "type": "function",
                              "function": {"name": call.name, "arguments": call.arguments_json}}]},
             {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    second = await runner.run(session, ChatRequest.parse({"model": MODEL_ID, "messages": msgs, "tools": TOOLS}))
    assert "Current date: 2025-06-28" in renderer.tokenizer.decode(second.prompt_ids)
    assert second.record.kind == TurnKind.CLEAN and len(capture.close(SESSION).rows) == 1
