"""The gateway as it is deployed: GatewayServer wrapped as an async Ray actor, the inference
replica another Ray actor (handle passed to `set_engines`), the agent a plain synchronous
`openai.OpenAI` client in the driver process.

Starts its own local Ray instance (`address="local"`) and shuts down only that one.
"""

from __future__ import annotations

import sys

import openai
import pytest

ray = pytest.importorskip("ray")

from stand_ins import REPO, own_ray  # noqa: E402
from workers.core.types import GenerateRequest, GenerateResult  # noqa: E402
from workers.gateway.config import GatewayConfig  # noqa: E402
from workers.gateway.server import GatewayServer  # noqa: E402
from workers.embedded.tiny_model import ensure_tiny_model  # noqa: E402

SESSION = "gw-ray-session-" + "1" * 24
TIMEOUT_S = 60


class CountingEngine:
    """Zero-cost replica: answers `reply` (+ eos), tagged with the replica's policy version."""

    def __init__(self, reply: list[int], version: int) -> None:
        self.reply = reply
        self.version = version
        self.served = 0

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        self.served += 1
        out = tuple(self.reply[: req.max_tokens])
        return GenerateResult(output_ids=out, logprobs=(-0.1,) * len(out), finish_reason="stop", policy_version=self.version)

    async def num_served(self) -> int:
        return self.served


@pytest.fixture(scope="module")
def local_ray():
    with own_ray(ship=[sys.modules[__name__]], runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}}):
        yield


def test_gateway_actor_serves_a_sync_openai_client_through_a_ray_engine(local_ray):
    from transformers import AutoTokenizer

    model_dir = ensure_tiny_model()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    reply = tok.encode("q q q q", add_special_tokens=False) + [tok.eos_token_id]
    engine = ray.remote(num_cpus=0)(CountingEngine).remote(reply, 5)
    gateway = ray.remote(num_cpus=0)(GatewayServer).remote(
        GatewayConfig(model_path=str(model_dir), served_model_name="tiny")
    )
    base_url = ray.get(gateway.start.remote(), timeout=TIMEOUT_S)
    ray.get(gateway.set_engines.remote([engine]), timeout=TIMEOUT_S)
    token = ray.get(gateway.open_session.remote(SESSION), timeout=TIMEOUT_S)

    client = openai.OpenAI(base_url=base_url, api_key=token, max_retries=0, timeout=TIMEOUT_S)
    msgs = [{"role": "user", "content": "Write the letter q 4 times."}]
    r1 = client.chat.completions.create(model="tiny", messages=msgs)
    assert r1.choices[0].message.content == "q q q q"
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "again"}]
    client.chat.completions.create(model="tiny", messages=msgs)

    cap = ray.get(gateway.close_session.remote(SESSION), timeout=TIMEOUT_S)
    assert cap.session_id == SESSION and cap.num_turns == 2
    assert len(cap.rows) == 1  # second turn extended the first: CLEAN
    assert cap.rows[0].generated_versions() == [5] * (2 * len(reply))
    assert ray.get(engine.num_served.remote(), timeout=TIMEOUT_S) == 2
    metrics = ray.get(gateway.metrics.remote(), timeout=TIMEOUT_S)
    assert (metrics.turns_served, metrics.turns_clean) == (2, 1)
    with pytest.raises(openai.ConflictError):
        client.chat.completions.create(model="tiny", messages=msgs)
    ray.get(gateway.stop.remote(), timeout=TIMEOUT_S)


class StallingEngine:
    """A replica that never answers; counts the requests it got and those cancelled."""

    def __init__(self) -> None:
        self.started = 0
        self.cancelled = 0

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        import asyncio

        self.started += 1
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        raise AssertionError("unreachable")

    async def counts(self) -> tuple[int, int]:
        return self.started, self.cancelled


def test_client_disconnect_cancels_the_ray_replica_task(local_ray):
    """An agent that gives up (timeout, crash) must not leave its request generating: the gateway
    actor cancels the replica's actor task (ray.cancel), which cancels the engine call."""
    import time

    import httpx

    model_dir = ensure_tiny_model()
    engine = ray.remote(num_cpus=0)(StallingEngine).remote()
    gateway = ray.remote(num_cpus=0)(GatewayServer).remote(GatewayConfig(model_path=str(model_dir), served_model_name="tiny"))
    base_url = ray.get(gateway.start.remote(), timeout=TIMEOUT_S)
    ray.get(gateway.set_engines.remote([engine]), timeout=TIMEOUT_S)
    token = ray.get(gateway.open_session.remote(SESSION + "-stall"), timeout=TIMEOUT_S)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base_url}/chat/completions", json=body, headers={"Authorization": f"Bearer {token}"}, timeout=3.0)
    deadline = time.monotonic() + TIMEOUT_S
    while ray.get(engine.counts.remote(), timeout=TIMEOUT_S) != (1, 1) and time.monotonic() < deadline:
        time.sleep(0.1)  # across processes there is no event to wait on; bounded poll
    assert ray.get(engine.counts.remote(), timeout=TIMEOUT_S) == (1, 1)
    assert ray.get(gateway.metrics.remote(), timeout=TIMEOUT_S).turns_cancelled == 1
    ray.get(gateway.stop.remote(), timeout=TIMEOUT_S)
