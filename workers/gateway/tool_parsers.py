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

Invariant: parsing never loses text. A well-formed output gives `content` (the text before the
first call, trailing whitespace removed so that re-rendering the assistant message reproduces the
generated text) and the calls; an output that opens a call it cannot parse gives the whole raw
text as `content`, no calls, and `ill_formed=True`.

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
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
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
    try:
        calls = _parse_hermes(text[start:]) if fmt == "hermes" else _parse_xml(text[start:], _schemas(tools))
    except (ValueError, TypeError):
        return ParsedOutput(content=text, ill_formed=True)
    return ParsedOutput(content=text[:start].rstrip(), tool_calls=calls)


def _check_only_calls(rest: str, blocks: re.Pattern[str]) -> None:
    """Everything after the first `<tool_call>` must be calls separated by whitespace."""
    leftover = blocks.sub("", rest)
    if leftover.strip():
        raise ValueError(f"text outside tool-call blocks: {leftover.strip()[:80]!r}")


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


def _parse_hermes(rest: str) -> tuple[ToolCall, ...]:
    _check_only_calls(rest, _HERMES_BLOCK)
    calls = tuple(_json_call(json.loads(body)) for body in _HERMES_BLOCK.findall(rest))
    if not calls:
        raise ValueError("no complete tool-call block")
    return calls


def _parse_llama3(text: str) -> ParsedOutput:
    """Llama 3.x: an answer that is (after `<|python_tag|>`) JSON objects with a "name" is calls.

    Text that does not start with `{` is content; text that starts with `{` but is not a list of
    call objects (bad JSON, no name) is ill-formed (the model opened a call it did not finish).
    """
    body = text.strip()
    body = body[len(PYTHON_TAG):].lstrip() if body.startswith(PYTHON_TAG) else body
    if not body.startswith("{"):
        return ParsedOutput(content=text)
    try:
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(body):
            obj, at = decoder.raw_decode(body, at)
            calls.append(_json_call(obj))
            at = len(body) - len(body[at:].lstrip().removeprefix(";").lstrip())
    except (ValueError, TypeError):
        return ParsedOutput(content=text, ill_formed=True)
    return ParsedOutput(content="", tool_calls=tuple(calls))


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


def _parse_xml(rest: str, schemas: dict[str, dict[str, Any]]) -> tuple[ToolCall, ...]:
    _check_only_calls(rest, _HERMES_BLOCK)
    calls = []
    for block in _HERMES_BLOCK.findall(rest):
        m = _XML_FUNCTION.fullmatch(block.strip())
        if m is None:
            raise ValueError("a tool-call block must hold one <function=NAME>...</function>")
        name = m.group(1).strip()
        body = m.group(2)
        if _XML_PARAMETER.sub("", body).strip():
            raise ValueError("text outside <parameter> blocks")
        props = schemas.get(name, {})
        args = {p.strip(): _xml_value(v, props.get(p.strip())) for p, v in _XML_PARAMETER.findall(body)}
        calls.append(ToolCall(id=new_call_id(), name=name, arguments_json=json.dumps(args, ensure_ascii=False)))
    if not calls:
        raise ValueError("no complete tool-call block")
    return tuple(calls)
