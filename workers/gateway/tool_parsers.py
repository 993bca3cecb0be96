"""Tool-call parsing of generated text, in the format the model's chat template teaches.

Four formats (the names are vLLM's `--tool-call-parser` names, gpt-oss's is "openai" there):
  "hermes"       Qwen2.5 / Hermes JSON: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
  "qwen3_coder"  Qwen3-Coder XML: `<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n
                 </function>\\n</tool_call>`
  "llama3_json"  Llama 3.1/3.2: the whole answer is `{"name": ..., "parameters": {...}}` (optionally
                 after `<|python_tag|>`; several calls separated by `;`)
  "harmony"      gpt-oss: calls are messages to `functions.NAME`; parsed from the generated token
                 ids by openai-harmony (workers/gateway/harmony.py), not from text here
`detect_tool_format(template)` picks one from the chat template's text (template_registry.py;
None: the template renders no known tool-call format, and the gateway refuses requests that offer
tools instead of silently never parsing a call).

Parse what can be parsed (vLLM's parsers return a well-formed call whatever follows it): every
well-formed call is returned, in order, whatever text or malformed call stands beside it.
- `content` is the text before the first call, trailing whitespace removed (so re-rendering the
  assistant message of a clean output reproduces the generated text);
- `ill_formed` is True when any part of the output opened a call it did not complete as a
  well-formed one: a block whose body does not parse, a `<tool_call>` never closed, a Llama
  object that is not a call; text after or between calls that opens no call is not ill-formed;
- an ill-formed output with no well-formed call gives the whole raw text as `content`, no calls.

Invariant: parsing never loses text and never invents a call: `content`, the returned calls' blocks
and `unparsed` (malformed blocks and text after the first call that is no call) make up the output,
up to the whitespace around blocks; a call is returned only when its whole block parses.

Pure functions (no tokenizer, no HTTP). Callers: workers/gateway/turns.py.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any, Literal, get_args

from workers.gateway.template_registry import identify

ToolFormat = Literal["hermes", "qwen3_coder", "llama3_json", "harmony"]
# `model.tool_call_parser`: detect from the template ("auto"), a ToolFormat, or "none" (tools refused)
TOOL_CALL_PARSERS: tuple[str, ...] = ("auto", *get_args(ToolFormat), "none")
TOOL_FORMATS: tuple[ToolFormat, ...] = get_args(ToolFormat)
TEXT_FORMATS: tuple[ToolFormat, ...] = ("hermes", "qwen3_coder", "llama3_json")  # parse_tool_calls reads these

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3.x: starts a tool call
_XML_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One parsed call. arguments_json: the arguments object as a JSON string (OpenAI's shape)."""

    id: str
    name: str
    arguments_json: str

    def arguments(self) -> dict[str, Any]:
        """The arguments as a dict (always an object: parsing rejects anything else)."""
        return json.loads(self.arguments_json)


@dataclass(frozen=True)
class ParsedOutput:
    """Generated text split into the assistant's content and its tool calls.

    reasoning: the model's reasoning when the format keeps it apart from the content (harmony's
    analysis channel, returned as `reasoning_content`); None otherwise.
    """

    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    ill_formed: bool = False
    reasoning: str | None = None
    unparsed: str = ""  # text after the first call that is not a returned call (malformed blocks, trailing text)


def new_call_id() -> str:
    """`call_` + 24 hex chars, the shape OpenAI's ids have."""
    return "call_" + secrets.token_hex(12)


def detect_tool_format(chat_template: str | None) -> ToolFormat | None:
    """The tool-call format a chat template renders, or None when it renders no known one."""
    return identify(chat_template).tool_format  # type: ignore[return-value]


def parse_tool_calls(
    text: str, fmt: ToolFormat, tools: tuple[dict[str, Any], ...] | None = None
) -> ParsedOutput:
    """Split `text` into content and tool calls in format `fmt` (see the module docstring).

    tools: the request's OpenAI tool definitions; the XML format uses their parameter schemas to
    type values (`"3"` -> 3 for an integer parameter). Raises ValueError for an unknown format
    or "harmony" (parsed from token ids: workers/gateway/harmony.py).
    """
    if fmt not in TEXT_FORMATS:
        raise ValueError(f"tool-call format {fmt!r} is not parsed from text here; text formats: {TEXT_FORMATS}")
    if fmt == "llama3_json":
        return _parse_llama3(text)
    start = text.find(TOOL_CALL_OPEN)
    if start < 0:
        return ParsedOutput(content=text)
    schemas = _schemas(tools) if fmt == "qwen3_coder" else {}
    calls: list[ToolCall] = []
    unparsed: list[str] = []
    ill_formed = False
    # each `<tool_call>` opens one candidate, ended by the first `</tool_call>` after it (a block
    # never holds another opening: a call left open before the next one is malformed on its own)
    for segment in text[start:].split(TOOL_CALL_OPEN)[1:]:
        body, closed, after = segment.partition(TOOL_CALL_CLOSE)
        try:
            if not closed:
                raise ValueError("a <tool_call> is never closed")
            calls.append(_json_call(json.loads(body)) if fmt == "hermes" else _xml_call(body, schemas))
        except (ValueError, TypeError):
            ill_formed = True
            unparsed.append(TOOL_CALL_OPEN + body + closed)
        if after.strip():
            unparsed.append(after)
    if not calls:
        return ParsedOutput(content=text, ill_formed=ill_formed)
    return ParsedOutput(content=text[:start].rstrip(), tool_calls=tuple(calls), ill_formed=ill_formed,
                        unparsed="".join(unparsed))


def _json_call(obj: Any) -> ToolCall:
    """One `{"name": ..., "arguments" | "parameters": {...}}` object as a ToolCall."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise ValueError("a tool call must be an object with a non-empty string 'name'")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        args = json.loads(args)
    if not isinstance(args, dict):
        raise ValueError("tool-call arguments must be a JSON object")
    return ToolCall(id=new_call_id(), name=obj["name"], arguments_json=json.dumps(args, ensure_ascii=False))


def _parse_llama3(text: str) -> ParsedOutput:
    """Llama 3.x: an answer that is (after `<|python_tag|>`) JSON objects with a "name" is calls,
    separated by `;` or whitespace.

    Text that does not start with `{` is content. The calls are read in order; an object that is
    bad JSON or no call makes the turn ill-formed and ends the reading (what follows cannot be
    delimited); text after a call that does not start another object ends it too (trailing text,
    not ill-formed). No call read and ill-formed: the whole text is the content.
    """
    body = text.strip()
    body = body[len(PYTHON_TAG):].lstrip() if body.startswith(PYTHON_TAG) else body
    if not body.startswith("{"):
        return ParsedOutput(content=text)
    decoder, calls, at, ill_formed = json.JSONDecoder(), [], 0, False
    while at < len(body) and body[at] == "{":
        try:
            obj, end = decoder.raw_decode(body, at)
            calls.append(_json_call(obj))
        except (ValueError, TypeError):
            ill_formed = True
            break
        at = len(body) - len(body[end:].lstrip().removeprefix(";").lstrip())
    if not calls:
        return ParsedOutput(content=text, ill_formed=ill_formed)
    return ParsedOutput(content="", tool_calls=tuple(calls), ill_formed=ill_formed, unparsed=body[at:])


def _schemas(tools: tuple[dict[str, Any], ...] | None) -> dict[str, dict[str, Any]]:
    """name -> JSON-schema `properties` of each offered function."""
    out: dict[str, dict[str, Any]] = {}
    for t in tools or ():
        fn = t.get("function") if isinstance(t, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            props = params.get("properties") if isinstance(params, dict) else None
            out[fn["name"]] = props if isinstance(props, dict) else {}
    return out


def _xml_value(raw: str, schema: Any) -> Any:
    """A parameter's value: raw text for strings, JSON for other declared (or undeclared) types."""
    value = raw[1:] if raw.startswith("\n") else raw
    value = value[:-1] if value.endswith("\n") else value
    declared = schema.get("type") if isinstance(schema, dict) else None
    if declared == "string":
        return value
    try:
        return json.loads(value)
    except ValueError:
        if declared in ("integer", "number", "boolean", "object", "array"):
            raise ValueError(f"parameter value {value[:40]!r} is not a valid {declared}") from None
        return value


def _xml_call(block: str, schemas: dict[str, dict[str, Any]]) -> ToolCall:
    """One `<function=NAME>` block body as a ToolCall. Raises ValueError when it is not exactly one
    function of `<parameter>` blocks, or a typed value does not parse."""
    m = _XML_FUNCTION.fullmatch(block.strip())
    if m is None:
        raise ValueError("a tool-call block must hold one <function=NAME>...</function>")
    name = m.group(1).strip()
    body = m.group(2)
    if _XML_PARAMETER.sub("", body).strip():
        raise ValueError("text outside <parameter> blocks")
    props = schemas.get(name, {})
    args = {p.strip(): _xml_value(v, props.get(p.strip())) for p, v in _XML_PARAMETER.findall(body)}
    return ToolCall(id=new_call_id(), name=name, arguments_json=json.dumps(args, ensure_ascii=False))
