"""Faults under the rollout pool: a rollout actor SIGKILLed while its rollouts are in flight
(issue 14, item 4), the ACR emulator or the S3 server restarted mid-run (item 5).

Real parts: LocalStack (moto S3 + the ACR emulator + `stub_agent` processes), the named limit
actors, RolloutActor Ray actors with their AsyncAcrClients, and a collector actor with the
buffer's `put` / `sample_infos`. The victim's process is killed with SIGKILL by its PID while
every rollout is still waiting for its agent. Checked: `run_all` still returns one outcome per
request; every request has exactly one stored sample (re-dispatched under a new session id, or
failed `actor_lost` when no re-dispatch is allowed); the dead actor's ACR sessions are stopped and
its session-cap slots given back; the pool replaced the actor. A server restart: rollouts
dispatched while it is down fail `acr_unavailable` / `s3_unavailable`, those whose agents died
with the emulator fail `timeout`, the next batch completes once it is back, and no slot stays held.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
import uuid

import pytest

ray = pytest.importorskip("ray")

from stand_ins import REPO, STUB_AGENT, own_ray  # noqa: E402
from workers.acr.client import AcrClientConfig  # noqa: E402
from workers.acr.journal import JournalWriter, SessionJournal  # noqa: E402
from workers.acr.limits import AcrLimitsConfig, limit_stats, start_limit_actors  # noqa: E402
from workers.core.types import SampleInfo  # noqa: E402
from workers.core.types import RolloutRequest, Sample  # noqa: E402
from workers.rollout.actor import PoolOptions, rollout_actor_spawner  # noqa: E402
from workers.rollout.pool import PoolRecovery, RolloutPool  # noqa: E402
from workers.rollout.worker import RolloutSettings  # noqa: E402

AGENT_DELAY_S = 3.0  # each agent answers this late: the kill lands while all rollouts are in flight
TIMEOUT_S = 60


class Collector:
    """The buffer's `put` and `sample_infos` as a Ray actor that keeps every sample."""

    def __init__(self) -> None:
        self.samples: list[tuple[str, Sample]] = []

    def put(self, samples: list[Sample], partition: str) -> None:
        self.samples.extend((partition, s) for s in samples)

    def sample_infos(self, partition: str) -> list[SampleInfo]:
        return [s.info() for p, s in self.samples if p == partition]

    def all(self, partition: str) -> list[Sample]:
        return [s for p, s in self.samples if p == partition]


@pytest.fixture(scope="module")
def stack(local_stack):
    return local_stack(STUB_AGENT, num_agents=2, session_rate_per_s=1e6, session_burst=10**6, startup_timeout_s=180)


@pytest.fixture(scope="module")
def cluster(stack):
    with own_ray(ship=[sys.modules[__name__]], configure_logging=False,
                 runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}}):
        yield


async def _pool(stack, redispatch: int, timeout_s: float = 30.0, journal: JournalWriter | None = None):
    sink = ray.remote(num_cpus=0)(Collector).remote()
    limits = await start_limit_actors(AcrLimitsConfig(requests_per_s=300.0, max_open_sessions=64),
                                suffix=f"-{uuid.uuid4().hex[:6]}")
    exp_id = f"lost-{uuid.uuid4().hex[:6]}"
    s = RolloutSettings(exp_id=exp_id, agent_runtime_arn=stack.agent_runtime_arn, qualifier=None,
                        s3_bucket=stack.bucket, gateway_base_url="", model_id="none", max_tokens=8, temperature=1.0,
                        top_p=1.0, timeout_s=timeout_s, max_context_tokens=256)
    opts = PoolOptions(limits=limits, acr=AcrClientConfig(max_attempts=3, retry_initial_s=0.02, retry_max_s=0.2))
    spawn = rollout_actor_spawner(s, None, sink, options=opts, runtime_env={"env_vars": stack.env})
    actors, names = zip(*(spawn() for _ in range(2)))
    pool = RolloutPool(list(actors), names=names, recovery=PoolRecovery(
        spawn=spawn, store=sink, exp_id=exp_id, sessions_cap=limits.sessions, max_redispatch=redispatch),
        journal=journal)
    return pool, list(actors), sink, limits


async def _kill_while_running(stack, pool, victim, reqs, partition, journal: SessionJournal | None = None):
    run = asyncio.ensure_future(pool.run_all(reqs, partition))
    deadline = time.monotonic() + TIMEOUT_S
    while stack.stats().sessions_open < len(reqs):  # every rollout invoked: all in flight
        assert time.monotonic() < deadline and not run.done(), "rollouts never all started"
        await asyncio.sleep(0.05)
    if journal is not None:  # journaled before dispatch: what a driver killed now would leave
        assert len(journal.entries()) == len(reqs)
    pid = await victim.__ray_call__.remote(lambda self: os.getpid())
    os.kill(pid, signal.SIGKILL)
    return await asyncio.wait_for(run, TIMEOUT_S)


def _reqs(n: int, delay_s: float = AGENT_DELAY_S) -> list[RolloutRequest]:
    return [RolloutRequest(group_id=i // 2, input_id=f"row-{i // 2}", sample_index=i % 2,
                           row={"prompt": "p", "delay_s": delay_s, "reward": 1.0}) for i in range(n)]


async def _settled(stack, limits) -> None:
    deadline = time.monotonic() + 10
    while stack.stats().sessions_open or (await limit_stats(limits))[1].in_use:
        assert time.monotonic() < deadline, (stack.stats().sessions_open, (await limit_stats(limits))[1])
        await asyncio.sleep(0.1)


async def test_lost_actor_rollouts_rerun_once_under_new_sessions(stack, cluster, tmp_path):
    journal = SessionJournal(tmp_path)
    pool, actors, sink, limits = await _pool(stack, redispatch=1, journal=JournalWriter(
        journal, stack.agent_runtime_arn, None, local=True))
    reqs = _reqs(8)
    outcomes = await _kill_while_running(stack, pool, actors[0], reqs, "p1", journal)
    assert [(o.sample.group_id, o.sample.sample_index) for o in outcomes] == [(r.group_id, r.sample_index) for r in reqs]
    assert {o.sample.status for o in outcomes} == {"completed"}  # the 4 lost ones ran again and finished
    stored = await sink.all.remote("p1")
    assert sorted((s.group_id, s.sample_index) for s in stored) == sorted((r.group_id, r.sample_index) for r in reqs)
    assert len({s.session_id for s in stored}) == 8
    counts = await pool.rollout_counts()
    assert counts["rollout/actors_lost"] == 1 and counts["rollout/redispatched"] == 4
    assert counts["rollout/lost_sessions_stopped"] == 4  # the dead actor's open ACR sessions
    assert counts["rollout/slots_released"] == 4  # the session-cap slots it held
    await _settled(stack, limits)  # no ACR session or slot left behind
    assert journal.entries() == []  # every session, the lost and the re-dispatched, known stopped
    await pool.shutdown()


async def test_without_redispatch_lost_rollouts_fail_actor_lost(stack, cluster):
    pool, actors, sink, limits = await _pool(stack, redispatch=0)
    reqs = _reqs(4)
    outcomes = await _kill_while_running(stack, pool, actors[1], reqs, "p2")
    lost = [o for o in outcomes if o.sample.status == "failed"]
    assert len(lost) == 2 and {o.reason for o in lost} == {"actor_lost"}
    stored = await sink.all.remote("p2")
    assert len(stored) == 4
    assert sorted(s.status for s in stored) == ["completed", "completed", "failed", "failed"]
    assert all(s.reward is None and not s.rows for s in stored if s.status == "failed")  # never trained
    assert (await pool.rollout_counts())["rollout/failed/actor_lost"] == 2
    await _settled(stack, limits)
    await pool.shutdown()


async def test_server_restarts_fail_in_flight_rollouts_with_a_named_reason_and_the_run_goes_on(stack, cluster):
    pool, _, _, limits = await _pool(stack, redispatch=1, timeout_s=6.0)
    in_flight = asyncio.ensure_future(pool.run_all(_reqs(2), "r1"))
    deadline = time.monotonic() + TIMEOUT_S
    while stack.stats().sessions_open < 2:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    stack.stop_server("emulator")  # its agents and sessions die with it
    down = await asyncio.wait_for(pool.run_all(_reqs(2, 0.0), "r2"), TIMEOUT_S)
    assert [o.reason for o in down] == ["acr_unavailable"] * 2
    stack.start_server("emulator")  # same port: the clients' endpoint is valid again
    lost = await asyncio.wait_for(in_flight, TIMEOUT_S)
    # their agents died with the emulator: failed `timeout`, unless one wrote its result just before
    assert all((o.sample.status, o.reason) in {("failed", "timeout"), ("completed", None)} for o in lost), lost
    back = await asyncio.wait_for(pool.run_all(_reqs(2, 0.0), "r3"), TIMEOUT_S)
    assert [o.sample.status for o in back] == ["completed"] * 2

    os.kill(stack.pids()["moto"], signal.SIGKILL)  # a crash: what the run's ServerWatch restarts
    down = await asyncio.wait_for(pool.run_all(_reqs(2, 0.0), "r4"), TIMEOUT_S)
    assert {o.reason for o in down} <= {"s3_unavailable", "agent_error"}, down  # the agent may fail first
    assert stack.restart_exited() == ["moto"]  # on its old port, with its bucket
    back = await asyncio.wait_for(pool.run_all(_reqs(2, 0.0), "r5"), TIMEOUT_S)
    assert [o.sample.status for o in back] == ["completed"] * 2
    await _settled(stack, limits)  # the stops that failed while it was down were retried: no slot held
    await pool.shutdown()
