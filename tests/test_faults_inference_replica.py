"""An inference replica SIGKILLed while it generates (issue 14, item 1).

Real parts: Ray actors for the replicas (a slow zero-cost engine with the InferenceWorker surface
the supervisor and the weight sync use: start, generate, policy_version, update_weights), the
GatewayServer as an async Ray actor serving real HTTP turns, `FileWeightSync` and the
`ReplicaSupervisor`. A replica's process is killed with SIGKILL by its PID while a turn waits on
it. Checked: the turn is retried on the other replica (recorded once, 200) or, with no replica
left, waits for the replacement; the replacement loads the current weights file and version
before the gateway sees it; later pushes reach it; `inference/restarts` counts it; a turn that
finds no replica in time fails 503 and marks its session `engine_lost`; past
`max_restarts` the supervisor stops the run.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import aiohttp
import pytest

ray = pytest.importorskip("ray")

from stand_ins import REPO, own_ray  # noqa: E402
from orchestrator.control.supervise import ReplicaSupervisor, ReplicasExhausted  # noqa: E402
from workers.core.types import GenerateRequest, GenerateResult  # noqa: E402
from workers.embedded.tiny_model import ensure_tiny_model  # noqa: E402
from workers.gateway.config import GatewayConfig  # noqa: E402
from workers.gateway.server import GatewayServer  # noqa: E402
from workers.weight_sync.file import FileWeightSync  # noqa: E402

TIMEOUT_S = 60
GEN_DELAY_S = 3.0  # a turn is in flight this long: the kill lands in the middle


class SlowReplica:
    """A replica with InferenceWorker's surface: every turn takes `delay_s`; loads are recorded."""

    def __init__(self, version: int, delay_s: float) -> None:
        self.version = version
        self.delay_s = delay_s
        self.loads: list[tuple[str, int]] = []
        self.in_flight = 0

    async def start(self) -> None:
        return None

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        self.in_flight += 1
        await asyncio.sleep(self.delay_s)
        self.in_flight -= 1
        return GenerateResult(output_ids=(9, 9, 2), logprobs=(-0.1, -0.2, -0.3), finish_reason="stop",
                              policy_version=self.version)

    def policy_version(self) -> int:
        return self.version

    async def update_weights(self, path: str, version: int) -> None:
        self.loads.append((path, version))
        self.version = version

    def state(self) -> tuple[int, list[tuple[str, int]], int]:
        return self.version, self.loads, self.in_flight

    def pid(self) -> int:
        return os.getpid()


@pytest.fixture(scope="module")
def cluster():
    with own_ray(ship=[sys.modules[__name__]], runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}}):
        yield


async def _setup(num: int, *, replica_wait_s: float, max_restarts: int):
    cls = ray.remote(num_cpus=0, max_concurrency=100)(SlowReplica)
    spawn = lambda i: cls.remote(0, GEN_DELAY_S)  # noqa: E731 - the run's initial weights: version 0
    replicas = [spawn(i) for i in range(num)]
    gateway = ray.remote(num_cpus=0, max_concurrency=100)(GatewayServer).remote(
        GatewayConfig(model_path=str(ensure_tiny_model()), served_model_name="tiny", replica_wait_s=replica_wait_s))
    base_url = await gateway.start.remote()
    await gateway.set_engines.remote(replicas)
    weights = FileWeightSync(replicas)
    await weights.push("/weights/policy-v1.safetensors", 1)
    sup = ReplicaSupervisor(replicas, spawn=spawn, weights=weights, gateway=gateway, loaded_version=0,
                            max_restarts=max_restarts, check_every_s=0.2)
    return replicas, gateway, base_url, weights, sup


async def _turn(base_url: str, token: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{base_url}/chat/completions", headers={"Authorization": f"Bearer {token}"},
                             json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}) as r:
            return r.status, await r.json()


async def _kill_when_busy(replica) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while (await replica.state.remote())[2] == 0:
        assert time.monotonic() < deadline, "the turn never reached the replica"
        await asyncio.sleep(0.05)
    os.kill(await replica.pid.remote(), signal.SIGKILL)


async def test_turn_on_a_killed_replica_is_retried_and_a_replacement_gets_current_weights(cluster):
    replicas, gateway, base_url, weights, sup = await _setup(2, replica_wait_s=0.0, max_restarts=1)
    first = replicas[0]
    token = await gateway.open_session.remote("sess-retry-" + "0" * 24)
    turn = asyncio.ensure_future(_turn(base_url, token))
    await _kill_when_busy(first)  # the router sends a new session to replica 0 (least in flight, lowest index)
    status, body = await asyncio.wait_for(turn, TIMEOUT_S)
    assert status == 200, body  # retried on replica 1: nothing of the turn had been recorded
    capture = await gateway.close_session.remote("sess-retry-" + "0" * 24)
    assert capture.num_turns == 1 and not capture.engine_lost
    assert [v for r in capture.rows for v in r.generated_versions()] == [1, 1, 1]

    deadline = time.monotonic() + TIMEOUT_S
    while not await sup.check():  # the supervisor finds the dead replica and replaces it
        assert time.monotonic() < deadline
        await asyncio.sleep(0.2)
    assert replicas[0] is not first and (await sup.metrics()) == {"inference/restarts": 1.0}
    version, loads, _ = await replicas[0].state.remote()
    assert (version, loads) == (1, [("/weights/policy-v1.safetensors", 1)])  # current weights before serving
    await weights.push("/weights/policy-v2.safetensors", 2)  # later pushes reach the replacement
    assert (await replicas[0].state.remote())[0] == 2 and weights.lost() == frozenset()
    await gateway.stop.remote()


async def test_with_no_replica_left_a_turn_waits_for_the_replacement_or_fails_engine_lost(cluster):
    replicas, gateway, base_url, weights, sup = await _setup(1, replica_wait_s=20.0, max_restarts=1)
    watch = asyncio.ensure_future(sup.run())
    token = await gateway.open_session.remote("sess-wait-" + "0" * 24)
    turn = asyncio.ensure_future(_turn(base_url, token))
    await _kill_when_busy(replicas[0])
    status, body = await asyncio.wait_for(turn, TIMEOUT_S)
    assert status == 200, body  # served by the replacement, at the current version
    capture = await gateway.close_session.remote("sess-wait-" + "0" * 24)
    assert not capture.engine_lost and [v for r in capture.rows for v in r.generated_versions()] == [1, 1, 1]

    token = await gateway.open_session.remote("sess-lost-" + "0" * 24)
    turn = asyncio.ensure_future(_turn(base_url, token))
    await _kill_when_busy(replicas[0])  # a second death: max_restarts=1 is used up
    with pytest.raises(ReplicasExhausted, match="max_restarts=1"):
        await asyncio.wait_for(watch, TIMEOUT_S)  # the run stops (run_watched cancels the loop)
    await gateway.stop.remote()  # the waiting turn is cut: the agent sees an error, nothing recorded
    turn.cancel()
    capture = await gateway.close_session.remote("sess-lost-" + "0" * 24)
    assert capture.num_turns == 0


async def test_no_replica_within_the_wait_fails_the_turn_and_marks_the_session_engine_lost(cluster):
    replicas, gateway, base_url, weights, sup = await _setup(1, replica_wait_s=0.5, max_restarts=0)
    token = await gateway.open_session.remote("sess-503-" + "0" * 24)
    turn = asyncio.ensure_future(_turn(base_url, token))
    await _kill_when_busy(replicas[0])
    status, body = await asyncio.wait_for(turn, TIMEOUT_S)
    assert status == 503 and body["error"]["code"] == "engine_failed"
    capture = await gateway.close_session.remote("sess-503-" + "0" * 24)
    assert capture.engine_lost and capture.num_turns == 0  # the rollout fails engine_lost, never trained
    assert (await gateway.metrics.remote()).turns_engine_lost == 1
    await gateway.stop.remote()
