"""OpenAI Chat Completions wire format: request parsing, answer and error shapes.

Pure functions over JSON-like values (no aiohttp): `ChatRequest.parse` turns a request body into
a typed request or raises `ApiError` naming the bad parameter; `chat_completion_body` and
`error_body` build the JSON the official SDK expects
(https://platform.openai.com/docs/api-reference/chat/create, .../errors).

Supported in v1: messages (text content, or lists of text parts), model, max_tokens /
max_completion_tokens, temperature, top_p, seed, stop, tools (rendered into the prompt, not parsed
back), chat_template_kwargs (vLLM's extension, e.g. `{"enable_thinking": false}`), n == 1,
stream == false. Other fields are accepted and ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")
FINISH_REASONS = {"stop": "stop", "length": "length"}


class ApiError(Exception):
    """An error answered in OpenAI's shape: HTTP status plus `{"error": {...}}` fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def error_body(err: ApiError) -> dict[str, Any]:
    """`{"error": {"message", "type", "param", "code"}}` as OpenAI answers it."""
    return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}


def _number(body: dict, key: str, lo: float, hi: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"'{key}' must be a number, got {type(value).__name__}", param=key)
    if not lo <= value <= hi:
        raise bad_request(f"'{key}' must be in [{lo}, {hi}], got {value}", param=key)
    return float(value)


def _int(body: dict, key: str, lo: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{key}' must be an integer, got {type(value).__name__}", param=key)
    if value < lo:
        raise bad_request(f"'{key}' must be >= {lo}, got {value}", param=key)
    return value


def _message(raw: Any, i: int) -> dict[str, Any]:
    param = f"messages[{i}]"
    if not isinstance(raw, dict):
        raise bad_request(f"{param} must be an object", param=param)
    role = raw.get("role")
    if role not in ROLES:
        raise bad_request(f"{param}.role must be one of {ROLES}, got {role!r}", param=f"{param}.role")
    msg = dict(raw)
    content = raw.get("content")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(
                    f"{param}.content[{j}]: only text parts are supported", param=f"{param}.content[{j}]"
                )
            texts.append(part["text"])
        msg["content"] = "".join(texts)
    elif content is None:
        if role != "assistant":
            raise bad_request(f"{param}.content is required for role {role!r}", param=f"{param}.content")
        msg["content"] = ""
    elif not isinstance(content, str):
        raise bad_request(f"{param}.content must be a string or a list of text parts", param=f"{param}.content")
    return msg


@dataclass(frozen=True)
class ChatRequest:
    """A parsed chat-completion request; None means "not given by the client"."""

    messages: tuple[dict[str, Any], ...]
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    tools: tuple[dict[str, Any], ...] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @staticmethod
    def parse(body: Any) -> ChatRequest:
        """Validate a request body. Raises ApiError(400) naming the first bad parameter."""
        if not isinstance(body, dict):
            raise bad_request("request body must be a JSON object")
        if body.get("stream"):
            raise bad_request("streaming is not supported by this gateway yet; send stream=false", param="stream")
        n = _int(body, "n", 1)
        if n is not None and n != 1:
            raise bad_request(f"only n=1 is supported, got n={n}", param="n")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise bad_request("'model' is required", param="model")
        raw_messages = body.get("messages")
        if not isinstance(raw_messages, list) or not raw_messages:
            raise bad_request("'messages' must be a non-empty list", param="messages")
        messages = tuple(_message(m, i) for i, m in enumerate(raw_messages))
        max_completion = _int(body, "max_completion_tokens", 1)
        max_tokens = max_completion if max_completion is not None else _int(body, "max_tokens", 1)
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
        tools = body.get("tools")
        if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
            raise bad_request("'tools' must be a list of objects", param="tools")
        template_kwargs = body.get("chat_template_kwargs")
        if template_kwargs is not None and not isinstance(template_kwargs, dict):
            raise bad_request("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
        return ChatRequest(
            messages=messages,
            model=model,
            max_tokens=max_tokens,
            temperature=_number(body, "temperature", 0.0, 2.0),
            top_p=_number(body, "top_p", 0.0, 1.0),
            seed=seed,
            stop=stops,
            tools=tuple(tools) if tools else None,
            chat_template_kwargs=dict(template_kwargs) if template_kwargs else None,
        )


def chat_completion_body(
    *,
    completion_id: str,
    created_s: int,
    model: str,
    text: str,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, Any]:
    """A non-streaming `chat.completion` object with one choice and `usage`."""
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created_s,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": FINISH_REASONS[finish_reason],
                "logprobs": None,
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def models_body(model_id: str, created_s: int) -> dict[str, Any]:
    """`GET /v1/models` answer listing the one served model."""
    return {
        "object": "list",
        "data": [{"id": model_id, "object": "model", "created": created_s, "owned_by": "acr-rl-orchestrator"}],
    }
