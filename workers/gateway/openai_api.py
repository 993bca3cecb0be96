"""OpenAI Chat Completions wire format: request parsing, answer, stream-chunk and error shapes.

Pure functions over JSON-like values (no aiohttp): `ChatRequest.parse` turns a request body into
a typed request or raises `ApiError` naming the bad parameter; `chat_completion_body`,
`chat_completion_chunks` and `error_body` build the JSON the official SDK expects
(https://platform.openai.com/docs/api-reference/chat/create, .../chat-streaming, .../errors).

Supported: messages (text content or lists of text parts; assistant `tool_calls`; `tool` results;
the `developer` role is rendered as `system`, the only name chat templates know),
model, max_tokens / max_completion_tokens, temperature, top_p, seed, stop (up to MAX_STOP strings; a
single-token string stops the engine, a longer one is applied to the output, see turns.py),
tools, tool_choice ("auto", "none", "required", or a named function), stream (+ stream_options.
include_usage), logprobs (the sampled token's log-prob; top_logprobs must be 0),
chat_template_kwargs (vLLM's extension, e.g. `{"enable_thinking": false}`), n == 1. Other fields
are accepted and ignored. `ChatRequest` is also what anthropic_api.py converts Messages requests to.

Template input: an assistant message's `tool_calls[].function.arguments` JSON string is parsed
into an object before rendering (as vLLM does), so templates write it with `tojson` exactly as the
model's own call was written and a tool-call turn's prompt extends the previous one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from workers.gateway.tool_parsers import ToolCall

ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_CHOICES = ("auto", "none", "required")
MAX_STOP = 16  # stop strings per request (OpenAI allows 4; Anthropic more)


class ApiError(Exception):
    """An error answered in the API's shape: HTTP status plus message, type, param and code.

    retry: whether the SDKs should retry it (sent as the `x-should-retry` header they honour).
    anthropic_message: the message under `/messages` when Anthropic words it differently (None: `message`).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
        retry: bool | None = None,
        anthropic_message: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry = retry
        self.anthropic_message = anthropic_message


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def error_body(err: ApiError) -> dict[str, Any]:
    """`{"error": {"message", "type", "param", "code"}}` as OpenAI answers it."""
    return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}


def number_param(body: dict, key: str, lo: float, hi: float) -> float | None:
    """body[key] as a float in [lo, hi], None when absent. Raises ApiError(400)."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"'{key}' must be a number, got {type(value).__name__}", param=key)
    if not lo <= value <= hi:
        raise bad_request(f"'{key}' must be in [{lo}, {hi}], got {value}", param=key)
    return float(value)


def int_param(body: dict, key: str, lo: int) -> int | None:
    """body[key] as an int >= lo, None when absent. Raises ApiError(400)."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{key}' must be an integer, got {type(value).__name__}", param=key)
    if value < lo:
        raise bad_request(f"'{key}' must be >= {lo}, got {value}", param=key)
    return value


def _text(content: Any, param: str) -> str:
    """A string, or the concatenated text of a list of `{"type": "text", "text": ...}` parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"{param}[{j}]: only text parts are supported", param=f"{param}[{j}]")
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request(f"{param} must be a string or a list of text parts", param=param)


def _tool_calls_for_template(raw: Any, param: str) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        raise bad_request(f"{param} must be a list", param=param)
    out = []
    for j, call in enumerate(raw):
        p = f"{param}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"{p}.function.name is required", param=p)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                pass  # not JSON: the template gets the string as it is
        out.append({"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def _message(raw: Any, i: int) -> dict[str, Any]:
    param = f"messages[{i}]"
    if not isinstance(raw, dict):
        raise bad_request(f"{param} must be an object", param=param)
    role = raw.get("role")
    if role not in ROLES:
        raise bad_request(f"{param}.role must be one of {ROLES}, got {role!r}", param=f"{param}.role")
    # "developer" is OpenAI's newer name for the system role; chat templates only know "system"
    msg: dict[str, Any] = {"role": "system" if role == "developer" else role}
    content = raw.get("content")
    if content is None:
        if role != "assistant":
            raise bad_request(f"{param}.content is required for role {role!r}", param=f"{param}.content")
        msg["content"] = ""
    else:
        msg["content"] = _text(content, f"{param}.content")
    if role == "assistant" and raw.get("tool_calls"):
        msg["tool_calls"] = _tool_calls_for_template(raw["tool_calls"], f"{param}.tool_calls")
    if role == "tool" and raw.get("tool_call_id") is not None:
        msg["tool_call_id"] = str(raw["tool_call_id"])
    for key in ("name", "reasoning_content"):
        if isinstance(raw.get(key), str):
            msg[key] = raw[key]
    return msg


def _tools(raw: Any) -> tuple[dict[str, Any], ...] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise bad_request("'tools' must be a list of objects", param="tools")
    for j, t in enumerate(raw):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise bad_request(f"tools[{j}] must be {{'type': 'function', 'function': {{...}}}}", param=f"tools[{j}]")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"tools[{j}].function.name must be a non-empty string", param=f"tools[{j}].function.name")
    return tuple(raw) or None


def _tool_choice(raw: Any) -> str:
    """"auto" | "none" | "required" | the forced function's name."""
    if raw is None:
        return "auto"
    if isinstance(raw, str) and raw in TOOL_CHOICES:
        return raw
    fn = raw.get("function") if isinstance(raw, dict) else None
    if isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"]:
        return fn["name"]
    raise bad_request(
        f"'tool_choice' must be one of {TOOL_CHOICES} or {{'type': 'function', 'function': {{'name': ...}}}}",
        param="tool_choice",
    )


@dataclass(frozen=True)
class ChatRequest:
    """A parsed chat request (OpenAI's, or an Anthropic one converted); None means "not given".

    tool_choice: "auto", "none", "required" or a function name (see turns.py for how the last two
    are checked; the gateway cannot force decoding).
    """

    messages: tuple[dict[str, Any], ...]
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    tools: tuple[dict[str, Any], ...] | None = None
    tool_choice: str = "auto"
    chat_template_kwargs: dict[str, Any] | None = None
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False

    @staticmethod
    def parse(body: Any) -> ChatRequest:
        """Validate a request body. Raises ApiError(400) naming the first bad parameter."""
        if not isinstance(body, dict):
            raise bad_request("request body must be a JSON object")
        n = int_param(body, "n", 1)
        if n is not None and n != 1:
            raise bad_request(f"only n=1 is supported, got n={n}", param="n")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise bad_request("'model' is required", param="model")
        raw_messages = body.get("messages")
        if not isinstance(raw_messages, list) or not raw_messages:
            raise bad_request("'messages' must be a non-empty list", param="messages")
        messages = tuple(_message(m, i) for i, m in enumerate(raw_messages))
        max_completion = int_param(body, "max_completion_tokens", 1)
        max_tokens = max_completion if max_completion is not None else int_param(body, "max_tokens", 1)
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise bad_request("'seed' must be an integer", param="seed")
        stop = body.get("stop")
        if stop is None:
            stops: tuple[str, ...] = ()
        elif isinstance(stop, str):
            stops = (stop,)
        elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
            stops = tuple(stop)
        else:
            raise bad_request("'stop' must be a string or a list of strings", param="stop")
        if len(stops) > MAX_STOP:
            raise bad_request(f"'stop' may hold at most {MAX_STOP} strings, got {len(stops)}", param="stop")
        template_kwargs = body.get("chat_template_kwargs")
        if template_kwargs is not None and not isinstance(template_kwargs, dict):
            raise bad_request("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
        stream = body.get("stream") or False
        if not isinstance(stream, bool):
            raise bad_request("'stream' must be a boolean", param="stream")
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise bad_request("'stream_options' must be an object", param="stream_options")
        logprobs = body.get("logprobs") or False
        if not isinstance(logprobs, bool):
            raise bad_request("'logprobs' must be a boolean", param="logprobs")
        if int_param(body, "top_logprobs", 0):
            raise bad_request("top_logprobs > 0 is not supported (the engine returns the sampled token's only)", param="top_logprobs")
        return ChatRequest(
            messages=messages,
            model=model,
            max_tokens=max_tokens,
            temperature=number_param(body, "temperature", 0.0, 2.0),
            top_p=number_param(body, "top_p", 0.0, 1.0),
            seed=seed,
            stop=stops,
            tools=_tools(body.get("tools")),
            tool_choice=_tool_choice(body.get("tool_choice")),
            chat_template_kwargs=dict(template_kwargs) if template_kwargs else None,
            stream=stream,
            include_usage=bool(options and options.get("include_usage")),
            logprobs=logprobs,
        )


def finish_reason_of(finish_reason: str, tool_calls: tuple[ToolCall, ...]) -> str:
    """OpenAI's finish_reason: "tool_calls" when the turn ended with calls, else stop / length."""
    if tool_calls and finish_reason == "stop":
        return "tool_calls"
    return "length" if finish_reason == "length" else "stop"


def usage_body(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def tool_calls_body(calls: tuple[ToolCall, ...]) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_json}} for c in calls]


def logprobs_body(token_texts: list[str], logprobs: tuple[float, ...]) -> dict[str, Any]:
    """`choices[].logprobs`: one entry per generated token (stop token included), in order."""
    return {
        "content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8")), "top_logprobs": []}
            for t, lp in zip(token_texts, logprobs)
        ]
    }


def chat_completion_body(
    *,
    completion_id: str,
    created_s: int,
    model: str,
    content: str,
    tool_calls: tuple[ToolCall, ...] = (),
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    logprobs: dict[str, Any] | None = None,
    reasoning: str | None = None,
) -> dict[str, Any]:
    """A non-streaming `chat.completion` object with one choice and `usage`; `reasoning` (gpt-oss's
    analysis channel) goes in the message's `reasoning_content`, vLLM's field, which an agent sends
    back so the template can render it."""
    message: dict[str, Any] = {"role": "assistant", "content": content or (None if tool_calls else "")}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls_body(tool_calls)
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created_s,
        "model": model,
        "choices": [
            {"index": 0, "message": message, "finish_reason": finish_reason_of(finish_reason, tool_calls), "logprobs": logprobs}
        ],
        "usage": usage_body(prompt_tokens, completion_tokens),
    }


def chat_completion_chunks(
    *,
    completion_id: str,
    created_s: int,
    model: str,
    content: str,
    tool_calls: tuple[ToolCall, ...] = (),
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    include_usage: bool,
    logprobs: dict[str, Any] | None = None,
    reasoning: str | None = None,
) -> list[dict[str, Any]]:
    """The `chat.completion.chunk` objects of one streamed answer, in order (without `[DONE]`).

    Role chunk, reasoning chunk (`reasoning_content`, if any), content chunk (if any), one chunk
    per tool call, finish chunk. Usage: a last chunk
    with `choices: []` when include_usage (OpenAI's contract), else on the finish chunk itself.
    """

    def chunk(delta: dict[str, Any], finish: str | None = None, lp: dict[str, Any] | None = None) -> dict[str, Any]:
        return {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created_s,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": lp}],
        }

    chunks = [chunk({"role": "assistant", "content": ""})]
    if reasoning is not None:
        chunks.append(chunk({"reasoning_content": reasoning}))
    if content:
        chunks.append(chunk({"content": content}, lp=logprobs))
    for i, c in enumerate(tool_calls):
        chunks.append(
            chunk({"tool_calls": [{"index": i, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_json}}]})
        )
    last = chunk({}, finish_reason_of(finish_reason, tool_calls))
    usage = usage_body(prompt_tokens, completion_tokens)
    if include_usage:
        chunks.append(last)
        chunks.append({**chunk({}), "choices": [], "usage": usage})
    else:
        chunks.append({**last, "usage": usage})
    return chunks


def models_body(model_id: str, created_s: int) -> dict[str, Any]:
    """`GET /v1/models` answer listing the one served model."""
    return {
        "object": "list",
        "data": [{"id": model_id, "object": "model", "created": created_s, "owned_by": "acr-rl-orchestrator"}],
    }
