"""Contract tests of the rollout gateway against the official `openai` SDK.

The real GatewayServer listens on 127.0.0.1; prompts are rendered with the tiny model's real
tokenizer and chat template. The only stand-in is the zero-cost `ScriptedEngine` (conftest's
`zero_cost_engine`) at the InferenceEngine seam (same protocol the vLLM InferenceWorker
implements): it answers every request with the same token ids, per-position log-probs
(-0.01·(i+1)) and policy version, and keeps the requests it saw.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest

from workers.gateway.capture import SamplingDefaults
from workers.gateway.chat_template import ChatRenderer
from workers.gateway.config import GatewayConfig
from workers.gateway.server import GatewayServer
from workers.embedded.sim_engine import ScriptedEngine

MODEL_ID = "tiny-qwen2"
REPLY = "The answer is 4"
VERSION = 7
SESSION = "gw-test-session-" + "0" * 24  # ACR-length session id
TIMEOUT_S = 20


def engine_logprobs(n: int) -> tuple[float, ...]:
    """The zero-cost engine's log-probs of its first n output tokens."""
    return tuple(-0.01 * (i + 1) for i in range(n))


@pytest.fixture
def engine(tiny_renderer, zero_cost_engine) -> ScriptedEngine:
    tok = tiny_renderer.tokenizer
    return zero_cost_engine([*tok.encode(REPLY, add_special_tokens=False), tok.eos_token_id], version=VERSION)


@pytest.fixture
async def gateway(tiny_model_dir: Path, tiny_renderer: ChatRenderer, engine: ScriptedEngine):
    cfg = GatewayConfig(model_path=str(tiny_model_dir), served_model_name=MODEL_ID, max_context_tokens=512)
    server = GatewayServer(cfg, [engine], renderer=tiny_renderer)
    await asyncio.wait_for(server.start(), TIMEOUT_S)
    try:
        yield server
    finally:
        await asyncio.wait_for(server.stop(), TIMEOUT_S)


async def _client(server: GatewayServer, token: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key=token, max_retries=0, timeout=TIMEOUT_S)


def _prompt_ids(renderer: ChatRenderer, messages: list[dict]) -> tuple[int, ...]:
    return renderer.render(messages)


async def test_chat_completion_text_usage_and_recorded_row(gateway, tiny_renderer, engine):
    token = await gateway.open_session(SESSION)
    messages = [{"role": "user", "content": "Write the letter q 4 times."}]
    async with await _client(gateway, token) as client:
        resp = await client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=32)
    prompt = _prompt_ids(tiny_renderer, messages)
    assert resp.choices[0].message.content == REPLY  # eos left out of the text
    assert resp.choices[0].finish_reason == "stop"
    assert resp.model == MODEL_ID
    assert resp.usage.prompt_tokens == len(prompt)
    assert resp.usage.completion_tokens == len(engine.replies[0])  # eos counted: it was generated
    assert resp.usage.total_tokens == len(prompt) + len(engine.replies[0])
    assert engine.requests[0].prompt_ids == prompt
    assert engine.requests[0].max_tokens == 32
    assert tiny_renderer.tokenizer.eos_token_id in engine.requests[0].stop_token_ids
    cap = await gateway.close_session(SESSION)
    assert cap.num_turns == 1 and len(cap.rows) == 1
    row = cap.rows[0]
    assert row.token_ids == prompt + tuple(engine.replies[0])  # eos kept in the recorded ids
    assert row.loss_mask == (0,) * len(prompt) + (1,) * len(engine.replies[0])
    assert row.rollout_logprobs[len(prompt) :] == engine_logprobs(len(engine.replies[0]))
    assert row.generated_versions() == [VERSION] * len(engine.replies[0])
    m = gateway.metrics()
    assert (m.turns_served, m.turns_first, m.tokens_generated) == (1, 1, len(engine.replies[0]))


async def test_extended_conversation_is_clean_and_edited_history_forks(gateway, tiny_renderer, engine):
    token = await gateway.open_session(SESSION)
    turn1 = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "count"}]
    async with await _client(gateway, token) as client:
        r1 = await client.chat.completions.create(model=MODEL_ID, messages=turn1)
        turn2 = [*turn1, {"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "again"}]
        await client.chat.completions.create(model=MODEL_ID, messages=turn2)
        snapshot = gateway.metrics()
        edited = [*turn1, {"role": "assistant", "content": "The answer is 5"}, {"role": "user", "content": "again"}]
        await client.chat.completions.create(model=MODEL_ID, messages=edited)
    assert (snapshot.turns_first, snapshot.turns_clean, snapshot.turns_fork) == (1, 1, 0)
    cap = await gateway.close_session(SESSION)
    assert cap.num_turns == 3 and len(cap.rows) == 2
    clean, fork = cap.rows
    p1, p2, p3 = (_prompt_ids(tiny_renderer, m) for m in (turn1, turn2, edited))
    out = tuple(engine.replies[0])
    # row 0: turn1 prompt + output, then turn2's prompt extension (mask 0) + output
    assert clean.token_ids[: len(p1) + len(out)] == p1 + out
    assert clean.token_ids == p2 + out
    assert clean.num_generated == 2 * len(out)
    assert clean.loss_mask[len(p1) + len(out) : len(p2)] == (0,) * (len(p2) - len(p1) - len(out))
    # row 1: the edited history starts over (whole prompt mask 0)
    assert fork.token_ids == p3 + out
    assert fork.num_generated == len(out)
    m = gateway.metrics()
    assert (m.turns_first, m.turns_clean, m.turns_fork, m.turns_served) == (1, 1, 1, 3)


async def test_bad_keys_are_401_and_closed_keys_409_in_openai_shape(gateway):
    token = await gateway.open_session(SESSION)
    msgs = [{"role": "user", "content": "hi"}]
    async with await _client(gateway, "not-a-session-token") as bad:
        with pytest.raises(openai.AuthenticationError) as err:
            await bad.chat.completions.create(model=MODEL_ID, messages=msgs)
    assert err.value.status_code == 401
    assert err.value.code == "invalid_api_key"
    assert err.value.body["type"] == "invalid_request_error"  # OpenAI's `error` object fields
    await gateway.close_session(SESSION)
    async with await _client(gateway, token) as closed:
        with pytest.raises(openai.ConflictError) as err:
            await closed.chat.completions.create(model=MODEL_ID, messages=msgs)
    assert err.value.code == "session_closed"
    m = gateway.metrics()
    assert (m.unauthorized, m.closed_session_requests, m.turns_served) == (1, 1, 0)


async def test_models_list_names_the_served_model(gateway):
    token = await gateway.open_session(SESSION)
    async with await _client(gateway, token) as client:
        models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL_ID]
    await gateway.close_session(SESSION)


async def test_n2_is_a_bad_request(gateway, engine):
    token = await gateway.open_session(SESSION)
    msgs = [{"role": "user", "content": "hi"}]
    async with await _client(gateway, token) as client:
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(model=MODEL_ID, messages=msgs, n=2)
        assert err.value.param == "n"
    assert engine.requests == []  # nothing reached the engine
    assert (await gateway.close_session(SESSION)).num_turns == 0


async def test_max_tokens_clamped_to_the_session_context_budget(gateway, tiny_renderer, engine):
    msgs = [{"role": "user", "content": "hi"}]
    prompt = _prompt_ids(tiny_renderer, msgs)
    budget = len(prompt) + 2  # room for 2 generated tokens only
    token = await gateway.open_session(SESSION, max_context_tokens=budget)
    async with await _client(gateway, token) as client:
        resp = await client.chat.completions.create(model=MODEL_ID, messages=msgs, max_completion_tokens=100)
        assert engine.requests[-1].max_tokens == 2
        assert resp.choices[0].finish_reason == "length"
        assert resp.usage.completion_tokens == 2
        long_msgs = [{"role": "user", "content": "hi " * budget}]
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(model=MODEL_ID, messages=long_msgs)
        assert err.value.code == "context_length_exceeded"
    cap = await gateway.close_session(SESSION)
    assert cap.num_turns == 1 and len(cap.rows[0].token_ids) == budget


async def test_sampling_params_reach_the_engine(gateway, engine):
    token = await gateway.open_session(SESSION)
    msgs = [{"role": "user", "content": "hi"}]
    async with await _client(gateway, token) as client:
        await client.chat.completions.create(model=MODEL_ID, messages=msgs, temperature=0.5, top_p=0.8, seed=3)
        await client.chat.completions.create(model=MODEL_ID, messages=msgs)
    explicit, defaults = engine.requests
    assert (explicit.temperature, explicit.top_p, explicit.seed) == (0.5, 0.8, 3)
    assert (defaults.temperature, defaults.top_p, defaults.seed) == (1.0, 1.0, None)  # gateway defaults
    await gateway.close_session(SESSION)


async def test_aborted_turn_is_503_and_not_recorded(gateway, engine):
    token = await gateway.open_session(SESSION)
    engine.abort = True
    async with await _client(gateway, token) as client:
        with pytest.raises(openai.InternalServerError) as err:
            await client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "hi"}])
    assert err.value.status_code == 503
    assert (await gateway.close_session(SESSION)).num_turns == 0
    m = gateway.metrics()
    assert (m.turns_aborted, m.turns_served, m.server_errors) == (1, 0, 1)


async def test_session_closed_while_turn_runs_is_409_and_counted(gateway, engine):
    """The rollout worker closed the session while the agent's call was still generating."""
    token = await gateway.open_session(SESSION)
    engine.gate = asyncio.Event()
    async with await _client(gateway, token) as client:
        call = asyncio.create_task(
            client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "hi"}])
        )
        await asyncio.wait_for(engine.started.wait(), TIMEOUT_S)
        cap = await gateway.close_session(SESSION)
        engine.gate.set()
        with pytest.raises(openai.ConflictError, match="closed"):
            await asyncio.wait_for(call, TIMEOUT_S)
    assert cap.num_turns == 0
    assert gateway.metrics().turns_unrecorded_closed == 1


async def test_tools_are_rendered_into_the_prompt(gateway, tiny_renderer, engine):
    token = await gateway.open_session(SESSION)
    tool = {
        "type": "function",
        "function": {"name": "calculator", "description": "evaluate", "parameters": {"type": "object"}},
    }
    async with await _client(gateway, token) as client:
        await client.chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": "1+2?"}], tools=[tool]
        )
    prompt_text = tiny_renderer.tokenizer.decode(engine.requests[0].prompt_ids)
    assert "<tools>" in prompt_text and '"calculator"' in prompt_text
    await gateway.close_session(SESSION)


async def test_raw_http_errors_use_openai_shape_and_health_is_open(gateway):
    import aiohttp

    token = await gateway.open_session(SESSION)
    root = gateway.base_url.removesuffix("/v1")
    auth = {"Authorization": f"Bearer {token}"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as http:
        async with http.get(f"{root}/health", headers=auth) as r:  # an open session's token sees the count
            assert r.status == 200 and (await r.json())["open_sessions"] == 1
        async with http.post(f"{gateway.base_url}/chat/completions", data=b"{not json", headers=auth) as r:
            body = await r.json()
            assert r.status == 400 and set(body["error"]) == {"message", "type", "param", "code"}
        async with http.post(f"{gateway.base_url}/chat/completions", json={"model": MODEL_ID}, headers=auth) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "messages"
        async with http.get(f"{gateway.base_url}/nope", headers=auth) as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "not_found"
        async with http.get(f"{gateway.base_url}/models") as r:  # no key at all
            assert r.status == 401
    await gateway.close_session(SESSION)


async def test_health_hides_the_open_session_count_from_callers_without_a_session_token(gateway):
    """Issue 29: /health answered anyone with the number of running rollouts. Liveness stays open;
    the count goes only to a caller whose token authenticates (none, unknown, closed: no count)."""
    import aiohttp

    token = await gateway.open_session(SESSION)
    root = gateway.base_url.removesuffix("/v1")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as http:
        for headers in ({}, {"Authorization": "Bearer not-a-session-token"}, {"x-api-key": "k" * 600}):
            async with http.get(f"{root}/health", headers=headers) as r:
                body = await r.json()
                assert r.status == 200 and body["status"] == "ok" and "open_sessions" not in body, headers
        async with http.get(f"{root}/health", headers={"x-api-key": token}) as r:
            assert (await r.json())["open_sessions"] == 1
        await gateway.close_session(SESSION)
        async with http.get(f"{root}/health", headers={"x-api-key": token}) as r:  # closed: liveness only
            assert "open_sessions" not in await r.json()


async def test_an_over_long_token_is_reported_as_malformed_not_missing(gateway):
    """Issue 29: a 600-character key got 401 "missing session token"; the caller did send one."""
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as http:
        async with http.get(f"{gateway.base_url}/models", headers={"Authorization": f"Bearer {'t' * 600}"}) as r:
            message = (await r.json())["error"]["message"]
            assert r.status == 401 and "missing" not in message
            assert "malformed session token: 600 characters, longer than any session token (at most 512)" in message
            assert "t" * 50 not in message  # the value is never echoed
        async with http.get(f"{gateway.base_url}/models") as r:  # none at all is still "missing"
            assert r.status == 401 and "missing session token" in (await r.json())["error"]["message"]


async def test_enforced_session_sampling_overrides_the_agent(gateway, engine):
    """On-policy sampling: the rollout worker fixes temperature/top_p whatever the agent asks."""
    sampling = SamplingDefaults(temperature=0.9, top_p=0.95, max_tokens=3, enforce=True)
    token = await gateway.open_session(SESSION, sampling=sampling)
    async with await _client(gateway, token) as client:
        await client.chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": "hi"}], temperature=0.1, top_p=0.5
        )
    req = engine.requests[0]
    assert (req.temperature, req.top_p, req.max_tokens) == (0.9, 0.95, 3)  # max_tokens: session default
    await gateway.close_session(SESSION)


async def test_seeded_session_samples_each_turn_with_its_own_seed_over_the_agents(gateway, engine):
    """Determinism across resume (issue 14): a session with a seed samples turn t with
    turn_seed(seed, t), whatever seed the agent sends (enforced), the same in any session with that
    seed (no dependence on the random session id); a session without one passes the agent's."""
    from workers.core.seeds import session_seed, turn_seed

    base = session_seed(0, "letters-0-3", 5, 1)
    assert base == session_seed(0, "letters-0-3", 5, 1) != session_seed(0, "letters-0-3", 5, 0)
    assert session_seed(1, "letters-0-3", 5, 1) != base and 0 <= base < 2**31
    msgs = [{"role": "user", "content": "hi"}]
    for sid in (SESSION, SESSION[:-1] + "1"):  # two sessions, same seed: the same seeds
        token = await gateway.open_session(sid, sampling=SamplingDefaults(enforce=True, seed=base))
        async with await _client(gateway, token) as client:
            await client.chat.completions.create(model=MODEL_ID, messages=msgs, seed=3)
            await client.chat.completions.create(model=MODEL_ID, messages=msgs)
        await gateway.close_session(sid)
    token = await gateway.open_session(SESSION, sampling=SamplingDefaults(enforce=True))
    async with await _client(gateway, token) as client:
        await client.chat.completions.create(model=MODEL_ID, messages=msgs, seed=3)
    await gateway.close_session(SESSION)
    seeds = [r.seed for r in engine.requests]
    assert seeds == [turn_seed(base, 1), turn_seed(base, 2)] * 2 + [3]
    assert turn_seed(base, 1) != turn_seed(base, 2)


async def test_chat_template_kwargs_reach_the_template(gateway, tiny_model_dir, engine):
    """vLLM's `chat_template_kwargs` extension (e.g. Qwen3's enable_thinking) is rendered; the
    arguments the gateway owns cannot be overridden."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tok.chat_template += "{%- if enable_thinking is defined and not enable_thinking %}{{- 'NOTHINK' }}{%- endif %}"
    thinking_renderer = ChatRenderer(tok)
    msgs = [{"role": "user", "content": "hi"}]
    plain = thinking_renderer.render(msgs)
    no_think = thinking_renderer.render(msgs, template_kwargs={"enable_thinking": False})
    assert tok.decode(no_think[len(plain) :]) == "NOTHINK"
    token = await gateway.open_session(SESSION)
    async with await _client(gateway, token) as client:
        with pytest.raises(openai.BadRequestError, match="may not set"):
            await client.chat.completions.create(
                model=MODEL_ID, messages=msgs, extra_body={"chat_template_kwargs": {"tokenize": False}}
            )
        await client.chat.completions.create(
            model=MODEL_ID, messages=msgs, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
        )
    assert engine.requests[-1].prompt_ids == plain  # the tiny template ignores enable_thinking
    await gateway.close_session(SESSION)


async def test_single_token_stop_strings_become_stop_ids(gateway, tiny_renderer, engine):
    token = await gateway.open_session(SESSION)
    msgs = [{"role": "user", "content": "hi"}]
    im_start = tiny_renderer.tokenizer.convert_tokens_to_ids("<|im_start|>")
    async with await _client(gateway, token) as client:
        await client.chat.completions.create(model=MODEL_ID, messages=msgs, stop=["<|im_start|>"])
        with pytest.raises(openai.BadRequestError, match="non-empty"):
            await client.chat.completions.create(model=MODEL_ID, messages=msgs, stop=[""])
    assert engine.requests[0].stop_token_ids == (tiny_renderer.tokenizer.eos_token_id, im_start)
    assert len(engine.requests) == 1
    await gateway.close_session(SESSION)


async def test_multi_token_stop_string_cuts_answer_and_record_alike(gateway, tiny_renderer, engine):
    """The engine stops on ids only. A stop string of several tokens is applied after generation:
    the text ends before it, and the row keeps exactly the tokens up to the one completing it
    (what the agent's next prompt will hold), not the tokens generated after it."""
    token = await gateway.open_session(SESSION)
    msgs = [{"role": "user", "content": "hi"}]
    async with await _client(gateway, token) as client:
        r = await client.chat.completions.create(model=MODEL_ID, messages=msgs, stop=["answer is", "zzz zzz"])
    assert r.choices[0].message.content == "The " and r.choices[0].finish_reason == "stop"
    tok = tiny_renderer.tokenizer
    kept = r.usage.completion_tokens
    assert "answer is" in tok.decode(engine.replies[0][:kept]) and "answer is" not in tok.decode(engine.replies[0][: kept - 1])
    row = (await gateway.close_session(SESSION)).rows[0]
    assert row.token_ids == engine.requests[0].prompt_ids + tuple(engine.replies[0][:kept])
    assert row.rollout_logprobs[-kept:] == engine_logprobs(kept)
