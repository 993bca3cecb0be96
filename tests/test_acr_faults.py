"""500 rollouts with 20 % injected faults of every kind through the production rollout path.

Real parts: LocalStack (moto S3 + the ACR emulator + `workers.embedded.stub_agent` processes that
obey the emulator's fault header), two RolloutActor Ray actors with AsyncAcrClients, the two
named cluster-wide limit actors (request rate, open sessions), each actor's result server (the
stub agent POSTs its S3 result there), and a GatewayServer Ray actor in front of a zero-cost
engine. The stub agent has no model, so `TurnRecordingGateway` makes one real chat call through
the gateway's own HTTP route when a session opens: every rollout, failed or not, carries
captured tokens. The sink is a small collector actor with the buffer's `put` signature.

Half the rollouts speak the S3 contract, half the HTTP contract. Each rollout's fault is known
in advance (`FaultPlan.fault_for(session_id)`), so the test checks every rollout's terminal state
and reason against its own fault, then the run-level invariants: counts add up (also in the
pool's metrics), no ACR session or session slot is left, the emulator's measured peak request
rate and peak open sessions stay within the configured limits, and no failed sample with
captured tokens carries a reward.
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from collections import Counter

import aiohttp
import pytest

ray = pytest.importorskip("ray")

from stand_ins import REPO, STUB_AGENT, own_ray  # noqa: E402
from workers.core.types import RolloutRequest, Sample  # noqa: E402
from workers.acr.client import AcrClientConfig  # noqa: E402
from workers.embedded.faults import FaultPlan, FaultRates  # noqa: E402
from workers.acr.limits import AcrLimitsConfig, limit_stats, start_limit_actors  # noqa: E402
from workers.embedded.sim_engine import ScriptedEngine  # noqa: E402
from workers.gateway.config import GatewayConfig  # noqa: E402
from workers.gateway.server import GatewayServer  # noqa: E402
from workers.rollout.worker import ContractError, RolloutSettings  # noqa: E402
from workers.rollout.actor import PoolOptions, start_rollout_actors  # noqa: E402
from workers.rollout.pool import RolloutPool  # noqa: E402
from workers.embedded.tiny_model import ensure_tiny_model  # noqa: E402

N_PER_CONTRACT = 250
RATES = FaultRates.uniform(0.2, seed=11)  # 2.5 % of each of the 8 kinds
LIMITS = AcrLimitsConfig(requests_per_s=300.0, max_open_sessions=48)  # bucket 240/s, burst 30
PUSH_GRACE_S = 2.0  # S3 polling starts this late once a POST arrived: the POST is what wakes the worker
ROLLOUT_TIMEOUT_S = 15.0  # slow agents (STUB_SLOW_S 60 s) and S3 no_result hit it; nothing else should, even with
# another test loading both cores (6 s was hit by plain rollouts once, under an e2e test on the other worker)
TIMEOUT_S = 80  # bound on each phase of the test itself
MODEL_ID = "tiny-qwen2"

# fault -> (status, reason) per contract; emulator-side faults are retried until they succeed
EXPECTED = {
    None: ("completed", None),
    "throttle": ("completed", None),  # 429 once: botocore retries
    "server_error": ("completed", None),  # 500 once: botocore retries
    "runtime_client_error": ("completed", None),  # 424 once: tenacity re-invokes
    "crash": ("failed", "agent_error"),  # S3: toolkit error object; HTTP: `interrupted` record
    "malformed_result": ("failed", "bad_result"),
    "nan_reward": ("failed", "bad_result"),
    "slow": ("failed", "timeout"),
}
NO_RESULT = {"s3": ("failed", "timeout"), "http": ("failed", "bad_result")}  # HTTP: completed with result {}


class TurnRecordingGateway(GatewayServer):
    """The real gateway; on open, one real chat call on the agent's behalf (the stub has no model)."""

    async def open_session(self, session_id, max_context_tokens=None, sampling=None):
        token = await super().open_session(session_id, max_context_tokens, sampling)
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{self.base_url}/chat/completions", headers={"Authorization": f"Bearer {token}"},
                                 json={"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}]}) as r:
                assert r.status == 200, await r.text()
        return token


class SampleCollector:
    """The buffer's `put(samples, partition)` as a Ray actor that keeps everything."""

    def __init__(self) -> None:
        self.samples: list[Sample] = []

    def put(self, samples: list[Sample], partition: str) -> None:
        self.samples.extend(samples)

    def all(self) -> list[Sample]:
        return self.samples


@pytest.fixture(scope="module")
def stack(local_stack):
    return local_stack(STUB_AGENT, num_agents=2, session_rate_per_s=1e6, session_burst=10**6, faults=RATES,
                       agent_env={"STUB_SLOW_S": "60"})


@pytest.fixture(scope="module")
def cluster(stack):
    with own_ray(ship=[sys.modules[__name__]], configure_logging=False,  # workers cannot import tests/
                 runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}}):
        yield


@pytest.fixture(scope="module")
def parts(stack, cluster):
    model_dir = str(ensure_tiny_model())
    gateway = ray.remote(num_cpus=0, max_concurrency=1000)(TurnRecordingGateway).remote(
        GatewayConfig(model_path=model_dir, served_model_name=MODEL_ID, max_context_tokens=256), [ScriptedEngine([(7, 8, 2)])])
    base_url = ray.get(gateway.start.remote(), timeout=60)
    sink = ray.remote(num_cpus=0)(SampleCollector).remote()
    limits = asyncio.run(start_limit_actors(LIMITS, suffix=f"-{uuid.uuid4().hex[:6]}"))
    yield gateway, base_url, sink, limits
    ray.get(gateway.stop.remote(), timeout=30)


def _pool(stack, parts, contract: str, actors: int = 2, **settings) -> RolloutPool:
    gateway, base_url, sink, limits = parts
    s = RolloutSettings(
        exp_id=f"faults-{contract}", agent_runtime_arn=stack.agent_runtime_arn, qualifier=None, s3_bucket=stack.bucket,
        gateway_base_url=base_url, model_id=MODEL_ID, max_tokens=8, temperature=1.0, top_p=1.0,
        timeout_s=ROLLOUT_TIMEOUT_S, max_context_tokens=256, contract=contract, push_grace_s=PUSH_GRACE_S,
        **settings)  # fmt: skip
    opts = PoolOptions(limits=limits, acr=AcrClientConfig(max_attempts=6, retry_initial_s=0.02, retry_max_s=0.5,
                                                          max_pool_connections=128))
    return RolloutPool(start_rollout_actors(actors, s, gateway, sink, options=opts, runtime_env={"env_vars": stack.env}))


def _reqs(contract: str, n: int) -> list[RolloutRequest]:
    return [RolloutRequest(group_id=i // 4, input_id=f"{contract}-row-{i // 4}", sample_index=i % 4,
                           row={"prompt": "p", "delay_s": 0.01}) for i in range(n)]


async def test_500_rollouts_with_20_percent_faults_all_end_terminal_within_limits(stack, parts):
    gateway, _, sink, limits = parts
    plan = FaultPlan(RATES)
    t0 = time.monotonic()
    outcomes, expected, pool_counts = [], [], Counter()
    for contract in ("s3", "http"):
        pool = _pool(stack, parts, contract)
        try:
            reqs = _reqs(contract, N_PER_CONTRACT)
            outs = await asyncio.wait_for(pool.run_all(reqs, "faults"), TIMEOUT_S)
            # one outcome per request, in request order
            assert [(o.sample.group_id, o.sample.sample_index) for o in outs] == [(r.group_id, r.sample_index) for r in reqs]
            pool_counts.update(await pool.rollout_counts())
            acr = await pool.acr_stats()
            assert acr["sessions_open"] == 0
        finally:
            await pool.shutdown()
        for o in outs:
            fault = plan.fault_for(o.session_id)
            expected.append((fault, NO_RESULT[contract] if fault == "no_result" else EXPECTED[fault]))
        outcomes.extend(outs)
    wall_s = time.monotonic() - t0
    n = 2 * N_PER_CONTRACT

    # every rollout: exactly one terminal state, the one its injected fault calls for, with a reason
    mismatches = [(f, want, (o.sample.status, o.reason), o.sample.error) for o, (f, want) in zip(outcomes, expected)
                  if (o.sample.status, o.reason) != want]
    assert not mismatches, mismatches[:5]
    faults_seen = Counter(f for f, _ in expected)
    assert set(faults_seen) == {None, *RATES.rates()}, faults_seen  # every kind was injected
    assert len({o.session_id for o in outcomes}) == n

    # fast completion: most S3-contract results came by the agent's POST, not by polling S3 (a loaded
    # machine may let a poll win now and then: polling starts PUSH_GRACE_S after the invoke)
    s3_completed = sum(o.sample.status == "completed" for o in outcomes[:N_PER_CONTRACT])
    assert pool_counts["rollout/results_pushed"] >= s3_completed // 2, (pool_counts["rollout/results_pushed"],
                                                                       s3_completed)

    # the stored samples: one per rollout, same status; a failed one keeps its tokens, never a reward
    samples = ray.get(sink.all.remote(), timeout=30)
    assert sorted(s.session_id for s in samples) == sorted(o.session_id for o in outcomes)
    by_sid = {o.session_id: o for o in outcomes}
    for s in samples:
        assert s.info() == by_sid[s.session_id].sample  # the result is exactly what the buffer holds
        assert s.num_generated_tokens == 3  # the recorded turn
        if s.status != "completed":
            assert s.reward is None and s.error

    # counts add up, in the pool's metrics too (terminal states and reasons)
    statuses = Counter(o.sample.status for o in outcomes)
    reasons = Counter(o.reason for o in outcomes if o.reason)
    assert statuses["completed"] + statuses["failed"] == n
    assert sum(reasons.values()) == statuses["failed"]
    assert pool_counts["rollout/completed"] == statuses["completed"]
    assert pool_counts["rollout/failed"] == statuses["failed"]
    assert {k.removeprefix("rollout/failed/"): v for k, v in pool_counts.items()
            if k.startswith("rollout/failed/")} == dict(reasons)

    # nothing left open, and the emulator never saw more than the limits allow
    emu = await asyncio.to_thread(stack.stats)
    assert emu.sessions_open == 0 and emu.sessions_expired == 0
    deadline = time.monotonic() + 10
    while (await limit_stats(limits))[1].in_use and time.monotonic() < deadline:
        await asyncio.sleep(0.05)  # releases are flushed in the background
    rate, sessions = await limit_stats(limits)
    assert sessions.in_use == 0
    assert emu.peak_open <= LIMITS.max_open_sessions and sessions.peak_in_use <= LIMITS.max_open_sessions
    assert emu.peak_request_rate <= LIMITS.requests_per_s, emu.peak_request_rate  # calls in any 1 s window
    assert rate.granted >= emu.requests - 0  # every request the emulator saw took a token
    print(f"\n{n} rollouts in {wall_s:.1f}s: {dict(statuses)} {dict(reasons)}; emulator peak rate "
          f"{emu.peak_request_rate}/s (limit {LIMITS.requests_per_s}), peak open {emu.peak_open}")


async def test_http_background_start_then_get_polls_to_the_result(stack, parts):
    plan = FaultPlan(RATES)
    before = await asyncio.to_thread(stack.stats)
    pool = _pool(stack, parts, "http", actors=1, http_background=True, poll_initial_s=0.05)
    try:
        reqs = [RolloutRequest(group_id=0, input_id="row-bg", sample_index=i, row={"prompt": "p", "delay_s": 0.3})
                for i in range(8)]
        outs = await asyncio.wait_for(pool.run_all(reqs, "background"), TIMEOUT_S)
    finally:
        await pool.shutdown()
    for o in outs:
        f = plan.fault_for(o.session_id)
        assert (o.sample.status, o.reason) == (NO_RESULT["http"] if f == "no_result" else EXPECTED[f]), o.sample.error
    after = await asyncio.to_thread(stack.stats)
    assert after.invocations - before.invocations > 2 * len(reqs)  # start + at least one `get` each
    assert after.sessions_open == 0


async def test_reserved_key_stops_the_run_through_ray(stack, parts):
    pool = _pool(stack, parts, "s3", actors=1)
    try:
        bad = [RolloutRequest(group_id=0, input_id="row-bad", sample_index=0, row={"prompt": "p", "_rollout": {}})]
        with pytest.raises(ContractError, match=r"input_id='row-bad' has reserved field\(s\) \['_rollout'\]"):
            await asyncio.wait_for(pool.run_all(bad, "contract"), TIMEOUT_S)
    finally:
        await pool.shutdown()


async def test_a_streak_of_bad_results_stops_the_run(stack, parts):
    """An agent that never reports a usable reward is a contract break, not bad luck: with
    max_consecutive_bad_results=3 the run stops once 3 results in a row are unusable."""
    pool = _pool(stack, parts, "http", actors=1, max_consecutive_bad_results=3)
    try:
        reqs = [RolloutRequest(group_id=0, input_id="row-nan", sample_index=i, row={"prompt": "p", "reward": "nan"})
                for i in range(8)]
        # the last of the 3 is a NaN reward, or now and then (2.5 % of sessions) the stack's own
        # malformed_result fault, which has no reward at all or a body cut short (non-JSON): all are
        # bad results
        with pytest.raises(ContractError, match=r"3 agent results in a row .*('reward' (is not finite|field)|non-JSON)"):
            await asyncio.wait_for(pool.run_all(reqs, "streak"), TIMEOUT_S)
    finally:
        await pool.shutdown()
    assert (await asyncio.to_thread(stack.stats)).sessions_open == 0


async def test_limit_actors_are_shared_by_name_and_refuse_other_limits(cluster):
    suffix = f"-{uuid.uuid4().hex[:6]}"
    a = await start_limit_actors(LIMITS, suffix=suffix)
    b = await start_limit_actors(LIMITS, suffix=suffix)
    assert a.rate._actor_id == b.rate._actor_id and a.sessions._actor_id == b.sessions._actor_id
    with pytest.raises(ValueError, match="already run with"):
        await start_limit_actors(AcrLimitsConfig(requests_per_s=1.0, max_open_sessions=1), suffix=suffix)
