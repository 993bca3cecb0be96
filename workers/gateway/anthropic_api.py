"""Anthropic Messages wire format: request conversion, answer, stream-event and error shapes.

Pure functions over JSON-like values (no aiohttp). `parse_messages_request` converts a Messages
body (https://docs.anthropic.com/en/api/messages) into the gateway's `ChatRequest` (OpenAI-style
messages, which is what chat templates take):
  system (string or text blocks)           -> a leading system message
  user text / tool_result blocks           -> user message / one `tool` message per result
                                              (results first, as Anthropic puts them first)
  assistant text / tool_use / thinking     -> assistant message with content, tool_calls (input as
                                              the arguments object), reasoning_content
  tools [{name, description, input_schema}] -> OpenAI function tools
  tool_choice {type: auto|any|tool|none}   -> "auto" | "required" | the tool's name | "none"
`message_body` and `message_events` shape the answer (a `thinking` block when the format keeps the
reasoning apart, gpt-oss's analysis channel, with an empty signature: the gateway signs nothing;
then text and tool_use blocks; stop_reason end_turn / max_tokens / tool_use); `error_body` gives `{"type": "error", "error": {...}}`.

Invariant: a converted request carries every text and tool block of the original (nothing is
silently dropped; an unsupported block type is a 400 naming it).
"""

from __future__ import annotations

import json
from typing import Any

from workers.gateway.openai_api import MAX_STOP, ApiError, ChatRequest, bad_request, int_param, number_param
from workers.gateway.tool_parsers import ToolCall

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(err: ApiError) -> dict[str, Any]:
    """`{"type": "error", "error": {"type", "message"}}` as Anthropic answers it."""
    kind = ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.anthropic_message or err.message}}


def _text_blocks(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{param} must be a string or a list of text blocks", param=param)
    out = []
    for j, b in enumerate(content):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise bad_request(f"{param}[{j}] must be a text block", param=f"{param}[{j}]")
        out.append(b["text"])
    return "".join(out)


def _user_messages(content: Any, param: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise bad_request(f"{param} must be a string or a list of content blocks", param=param)
    tools, texts = [], []
    for j, b in enumerate(content):
        p = f"{param}[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            texts.append(b["text"])
        elif kind == "tool_result":
            if not isinstance(b.get("tool_use_id"), str):
                raise bad_request(f"{p}.tool_use_id is required", param=p)
            result = _text_blocks(b.get("content", ""), f"{p}.content")
            tools.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": result})
        else:
            raise bad_request(f"{p}: unsupported content block type {kind!r} (text and tool_result only)", param=p)
    out = tools
    if texts:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _assistant_message(content: Any, param: str) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise bad_request(f"{param} must be a string or a list of content blocks", param=param)
    texts, calls, thinking = [], [], []
    for j, b in enumerate(content):
        p = f"{param}[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            texts.append(b["text"])
        elif kind == "tool_use":
            if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                raise bad_request(f"{p} needs a string name and an object input", param=p)
            calls.append({"id": b.get("id"), "type": "function", "function": {"name": b["name"], "arguments": b.get("input", {})}})
        elif kind == "thinking" and isinstance(b.get("thinking"), str):
            thinking.append(b["thinking"])
        else:
            raise bad_request(f"{p}: unsupported content block type {kind!r}", param=p)
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        msg["tool_calls"] = calls
    if thinking:
        msg["reasoning_content"] = "".join(thinking)
    return msg


def _tools(raw: Any) -> tuple[dict[str, Any], ...] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise bad_request("'tools' must be a list", param="tools")
    out = []
    for j, t in enumerate(raw):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not t["name"]:
            raise bad_request(f"tools[{j}] needs a non-empty string name", param=f"tools[{j}]")
        schema = t.get("input_schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise bad_request(f"tools[{j}].input_schema must be an object", param=f"tools[{j}].input_schema")
        fn = {"name": t["name"], "parameters": schema}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return tuple(out) or None


def _tool_choice(raw: Any) -> str:
    if raw is None:
        return "auto"
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(raw.get("name"), str) and raw["name"]:
        return raw["name"]
    raise bad_request("'tool_choice' must be {type: auto|any|none} or {type: tool, name}", param="tool_choice")


def parse_messages_request(body: Any, *, require_max_tokens: bool = True) -> ChatRequest:
    """Convert a Messages (or count_tokens) body. Raises ApiError(400) naming the bad field."""
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required", param="model")
    max_tokens = int_param(body, "max_tokens", 1)
    if require_max_tokens and max_tokens is None:
        raise bad_request("'max_tokens' is required", param="max_tokens")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_request("'messages' must be a non-empty list", param="messages")
    messages: list[dict[str, Any]] = []
    if body.get("system") is not None:
        messages.append({"role": "system", "content": _text_blocks(body["system"], "system")})
    for i, m in enumerate(raw):
        p = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role == "user":
            messages.extend(_user_messages(m.get("content"), f"{p}.content"))
        elif role == "assistant":
            messages.append(_assistant_message(m.get("content"), f"{p}.content"))
        else:
            raise bad_request(f"{p}.role must be 'user' or 'assistant', got {role!r}", param=f"{p}.role")
    stops = body.get("stop_sequences")
    if stops is not None and (not isinstance(stops, list) or not all(isinstance(s, str) for s in stops)):
        raise bad_request("'stop_sequences' must be a list of strings", param="stop_sequences")
    if stops and len(stops) > MAX_STOP:
        raise bad_request(f"'stop_sequences' may hold at most {MAX_STOP} strings", param="stop_sequences")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean", param="stream")
    return ChatRequest(
        messages=tuple(messages),
        model=model,
        max_tokens=max_tokens,
        temperature=number_param(body, "temperature", 0.0, 1.0),
        top_p=number_param(body, "top_p", 0.0, 1.0),
        stop=tuple(stops or ()),
        tools=_tools(body.get("tools")),
        tool_choice=_tool_choice(body.get("tool_choice")),
        stream=stream,
    )


def stop_reason_of(finish_reason: str, tool_calls: tuple[ToolCall, ...], stop_sequence: str | None = None) -> str:
    if stop_sequence is not None:
        return "stop_sequence"
    if tool_calls and finish_reason == "stop":
        return "tool_use"
    return "max_tokens" if finish_reason == "length" else "end_turn"


def _blocks(content: str, tool_calls: tuple[ToolCall, ...], reasoning: str | None = None) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = [] if reasoning is None else [{"type": "thinking", "thinking": reasoning,
                                                                   "signature": ""}]
    blocks += [{"type": "text", "text": content}] if content or not tool_calls else []
    blocks += [{"type": "tool_use", "id": c.id, "name": c.name, "input": json.loads(c.arguments_json)} for c in tool_calls]
    return blocks


def message_body(
    *, message_id: str, model: str, content: str, tool_calls: tuple[ToolCall, ...], finish_reason: str,
    input_tokens: int, output_tokens: int, stop_sequence: str | None = None, reasoning: str | None = None,
) -> dict[str, Any]:
    """A non-streaming `message` object."""
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": _blocks(content, tool_calls, reasoning),
        "stop_reason": stop_reason_of(finish_reason, tool_calls, stop_sequence),
        "stop_sequence": stop_sequence,
        "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens},
    }


def message_events(
    *, message_id: str, model: str, content: str, tool_calls: tuple[ToolCall, ...], finish_reason: str,
    input_tokens: int, output_tokens: int, stop_sequence: str | None = None, reasoning: str | None = None,
) -> list[tuple[str, dict[str, Any]]]:
    """The (event name, data) pairs of a streamed answer: message_start, per block
    content_block_start / _delta / _stop, message_delta (stop_reason, usage), message_stop."""
    start = message_body(
        message_id=message_id, model=model, content="", tool_calls=(), finish_reason="stop",
        input_tokens=input_tokens, output_tokens=0,
    )
    start.update(content=[], stop_reason=None)
    events: list[tuple[str, dict[str, Any]]] = [("message_start", {"type": "message_start", "message": start})]
    for i, block in enumerate(_blocks(content, tool_calls, reasoning)):
        if block["type"] == "thinking":
            first = {"type": "thinking", "thinking": "", "signature": ""}
            delta = {"type": "thinking_delta", "thinking": block["thinking"]}
        elif block["type"] == "text":
            first, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
        else:
            first = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}
        events.append(("content_block_start", {"type": "content_block_start", "index": i, "content_block": first}))
        events.append(("content_block_delta", {"type": "content_block_delta", "index": i, "delta": delta}))
        events.append(("content_block_stop", {"type": "content_block_stop", "index": i}))
    events.append((
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason_of(finish_reason, tool_calls, stop_sequence), "stop_sequence": stop_sequence},
            "usage": {"output_tokens": output_tokens},
        },
    ))
    events.append(("message_stop", {"type": "message_stop"}))
    return events
