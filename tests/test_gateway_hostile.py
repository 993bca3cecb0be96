"""Property test: malformed and hostile requests never crash the gateway, never get a 5xx (the
engine here cannot fail), and nothing is served without a valid session token.

The real GatewayServer runs on its own event loop in a background thread (hypothesis drives
synchronous examples); a ScriptedEngine (zero-cost, at the InferenceEngine seam) counts what
reaches the engine. Requests go over loopback with httpx (the `openai` SDK's HTTP client).
"""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workers.gateway.config import GatewayConfig
from workers.gateway.server import GatewayServer
from workers.embedded.sim_engine import ScriptedEngine
from workers.embedded.tiny_model import ensure_tiny_model

SESSION = "gw-hostile-session-" + "0" * 24
PATHS = ["/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens", "/v1/models", "/chat/completions", "/v1/v1/messages"]
TIMEOUT_S = 20


class Background:
    """A GatewayServer on an event loop in a daemon thread; `call` runs a coroutine there."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(TIMEOUT_S)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(TIMEOUT_S)
        self.loop.close()


@pytest.fixture(scope="module")
def served():
    from transformers import AutoTokenizer

    path = str(ensure_tiny_model())
    tok = AutoTokenizer.from_pretrained(path)
    bg = Background()
    engine_box: dict = {}

    async def boot():
        engine = ScriptedEngine([(*tok.encode("ok", add_special_tokens=False), tok.eos_token_id)])
        server = GatewayServer(GatewayConfig(model_path=path, max_context_tokens=256, max_body_bytes=64 * 1024), [engine])
        await server.start()
        engine_box["engine"] = engine
        return server

    server = bg.call(boot())
    token = bg.call(server.open_session(SESSION, max_turns=1_000_000))
    root = server.base_url.removesuffix("/v1")
    with httpx.Client(base_url=root, timeout=TIMEOUT_S) as http:
        yield http, token, engine_box["engine"], server, bg
    bg.call(server.stop())
    bg.close()


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
ROLE = st.sampled_from(["user", "assistant", "system", "tool", "developer", "bogus", None, 3])
CONTENT = st.one_of(
    st.text(max_size=40),
    st.none(),
    st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image", "tool_result", "tool_use"])}, optional={"text": JSON, "content": JSON, "tool_use_id": JSON, "input": JSON, "name": JSON}), max_size=3),
    JSON,
)
MESSAGE = st.fixed_dictionaries({"role": ROLE}, optional={"content": CONTENT, "tool_calls": JSON, "tool_call_id": JSON})
NEAR_VALID = st.fixed_dictionaries(
    {"model": st.one_of(st.just("m"), JSON), "messages": st.one_of(st.lists(MESSAGE, min_size=1, max_size=4), JSON)},
    optional={
        "max_tokens": st.one_of(st.integers(-5, 10**20), JSON),
        "max_completion_tokens": st.integers(-5, 3000),
        "temperature": st.one_of(st.floats(allow_nan=False), JSON),
        "top_p": st.floats(allow_nan=False),
        "n": st.integers(-1, 3),
        "stream": st.one_of(st.booleans(), JSON),
        "stop": JSON,
        "tools": st.one_of(st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": JSON}), max_size=2), JSON),
        "tool_choice": JSON,
        "system": JSON,
        "stop_sequences": JSON,
        "chat_template_kwargs": JSON,
        "logprobs": JSON,
        "stream_options": JSON,
    },
)
BODY = st.one_of(
    NEAR_VALID.map(lambda b: json.dumps(b).encode()),
    JSON.map(lambda b: json.dumps(b).encode()),
    st.binary(max_size=200),
    st.just(b'{"model": "m", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"),  # deep nesting
)
AUTH = st.sampled_from(["valid-bearer", "valid-x-api-key", "none", "garbage", "prefix", "huge", "basic"])


def headers_for(kind: str, token: str) -> dict[str, str]:
    return {
        "valid-bearer": {"Authorization": f"Bearer {token}"},
        "valid-x-api-key": {"x-api-key": token},
        "none": {},
        "garbage": {"Authorization": "Bearer sk-garbage"},
        "prefix": {"Authorization": f"Bearer {token[:-1]}"},
        "huge": {"x-api-key": "k" * 5000},
        "basic": {"Authorization": f"Basic {token}"},
    }[kind]


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(path=st.sampled_from(PATHS), body=BODY, auth=AUTH)
def test_hostile_bodies_never_5xx_and_never_served_without_a_token(served, path, body, auth):
    http, token, engine, server, bg = served
    before = len(engine.requests)
    method = "GET" if path.endswith("/models") else "POST"
    r = http.request(method, path, content=body, headers={"Content-Type": "application/json", **headers_for(auth, token)})
    assert r.status_code < 500, r.text
    if not auth.startswith("valid"):
        assert r.status_code == 401, r.text
        assert len(engine.requests) == before  # nothing reached the engine
    if r.status_code != 200:
        err = r.json()
        assert isinstance(err["error"]["message"], str)  # the API's own error shape
        assert token not in r.text


def test_gateway_still_healthy_after_the_storm(served):
    http, token, engine, server, bg = served
    assert http.get("/health").json()["status"] == "ok"
    assert server.metrics().server_errors == 0
    r = http.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                  headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"
