"""One agent's huge prompt must not freeze every other rollout (issue 47, item 1).

The gateway rendered and tokenized on its event loop: two 12 MB prompts of one agent held every other
session's model calls for 27 s. Now prompts are rendered on render threads (the Rust tokenizer
releases the GIL on long pieces) and a body past `max_body_bytes` is a 413 naming the limit. The real
GatewayServer on 127.0.0.1 with the tiny model's tokenizer; the zero-cost engine at the engine seam.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import httpx
import pytest

from workers.gateway.config import GatewayConfig
from workers.gateway.server import GatewayServer

TIMEOUT_S = 120
SMALL_TURNS = 10


@pytest.fixture
async def gateway(tiny_model_dir: Path, tiny_renderer, zero_cost_engine):
    tok = tiny_renderer.tokenizer
    engine = zero_cost_engine([*tok.encode("ok", add_special_tokens=False), tok.eos_token_id])
    cfg = GatewayConfig(model_path=str(tiny_model_dir), max_context_tokens=512, max_body_bytes=8 * 2**20)
    server = GatewayServer(cfg, [engine], renderer=tiny_renderer)
    await asyncio.wait_for(server.start(), TIMEOUT_S)
    try:
        yield server
    finally:
        await asyncio.wait_for(server.stop(), TIMEOUT_S)


def _words(n_chars: int, seed: int = 0) -> str:
    rng = random.Random(seed)  # varied words: a BPE cannot collapse them, so the encode takes seconds
    out, size = [], 0
    while size < n_chars:
        w = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        out.append(w)
        size += len(w) + 1
    return " ".join(out)


async def _turn(http: httpx.AsyncClient, url: str, token: str, text: str) -> httpx.Response:
    return await http.post(f"{url}/chat/completions", headers={"Authorization": f"Bearer {token}"},
                           json={"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 4})


async def test_small_sessions_are_served_while_another_sends_a_huge_prompt(gateway):
    huge_token = await gateway.open_session("gw-huge-session-" + "0" * 24)
    small_token = await gateway.open_session("gw-small-session-" + "0" * 24)
    huge_text = _words(2 * 2**20)
    async with httpx.AsyncClient(timeout=TIMEOUT_S) as http:
        started = time.monotonic()
        huge = asyncio.ensure_future(_turn(http, gateway.base_url, huge_token, huge_text))
        await asyncio.sleep(0.2)  # the huge body is being rendered by now
        small_done = []
        for i in range(SMALL_TURNS):
            r = await _turn(http, gateway.base_url, small_token, f"what is {i} + 1?")
            assert r.status_code == 200, r.text
            small_done.append(time.monotonic() - started)
        assert not huge.done(), "the huge prompt finished first: the test did not overlap them"
        answer = await huge
        huge_s = time.monotonic() - started
    # the huge prompt is far past the 512-token context: a 400 after its render, its session marked
    assert answer.status_code == 400 and "context" in answer.text
    # on the event loop, every small turn waited for the huge render (finished after it)
    assert max(small_done) < huge_s, (small_done, huge_s)


async def test_a_body_past_the_limit_is_a_413_naming_it(tiny_model_dir, tiny_renderer, zero_cost_engine):
    cfg = GatewayConfig(model_path=str(tiny_model_dir), max_context_tokens=512, max_body_bytes=4096)
    server = GatewayServer(cfg, [zero_cost_engine()], renderer=tiny_renderer)
    await asyncio.wait_for(server.start(), TIMEOUT_S)
    try:
        token = await server.open_session("gw-limit-session-" + "0" * 24)
        async with httpx.AsyncClient(timeout=TIMEOUT_S) as http:
            r = await _turn(http, server.base_url, token, "x" * 8192)
            ok = await _turn(http, server.base_url, token, "small")
    finally:
        await asyncio.wait_for(server.stop(), TIMEOUT_S)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"
    assert "gateway.max_body_bytes=4096" in r.json()["error"]["message"]
    assert ok.status_code == 200
