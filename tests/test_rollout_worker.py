"""RolloutWorker end to end over real parts: one ACR invocation per sample, joined with the capture.

Real parts: `LocalStack` (moto S3 + the ACR emulator + two `tests/rollout_behaviour_agent.py`
processes, a BedrockAgentCoreApp whose result is chosen by the row's `behaviour`), the
`AsyncAcrClient`, and the `GatewayServer` in-process on 127.0.0.1 rendering with the tiny model's
tokenizer. The agent reaches the gateway with the official `openai` SDK, so the gateway records
real token rows for each session. Stand-ins at the seams only: the zero-cost `ScriptedEngine`
(an InferenceEngine answering fixed token ids) and `RecordingSink` (records `put` calls; the
trajectory buffer is tested in test_buffer.py).

Each behaviour test defends the module invariant: one terminal outcome; the stored sample has the
outcome's status and error, carries the captured rows, and a failed one has reward None; the ACR
session was stopped (emulator and worker both count 0 open) and the gateway session closed.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from stand_ins import BEHAVIOUR_AGENT, until
from workers.core.types import RolloutRequest, Sample
from workers.acr.client import AsyncAcrClient
from workers.embedded.local_stack import LocalStack
from workers.embedded.sim_engine import ScriptedEngine
from workers.gateway.chat_template import ChatRenderer
from workers.gateway.config import GatewayConfig
from workers.gateway.server import GatewayServer
from workers.rollout.worker import (
    RESERVED_KEYS,
    BadResult,
    ContractError,
    RolloutSettings,
    RolloutWorker,
    build_payload,
    new_session_id,
    parse_reward,
    result_key,
)

MODEL_ID = "tiny-qwen2"
REPLY = "q q q q"
VERSION = 3
EXP_ID = "exp-rollout-test"
PARTITION = "train-step-0"
TIMEOUT_S = 30  # bound on every await of the test itself
SHORT_TIMEOUT_S = 3.0  # rollout timeout of the cases that must time out
AGENT_SLEEP_S = 6.0  # how long slow agents hold back their result: well past SHORT_TIMEOUT_S
ROLLOUT_KEYS = {"exp_id", "input_id", "s3_bucket", "base_url", "model_id", "api_key"}


@dataclass
class RecordingSink:
    """SampleSink that keeps every `put` call as (samples, partition)."""

    puts: list[tuple[list[Sample], str]]

    async def put(self, samples: list[Sample], partition: str) -> None:
        self.puts.append((list(samples), partition))

    @property
    def samples(self) -> list[Sample]:
        return [s for batch, _ in self.puts for s in batch]


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def stack(local_stack):
    s = local_stack(BEHAVIOUR_AGENT, num_agents=2, session_rate_per_s=200)
    with pytest.MonkeyPatch.context() as mp:
        for k, v in s.env.items():  # the AsyncAcrClient in this process reaches moto + emulator
            mp.setenv(k, v)
        yield s


def make_engine(renderer: ChatRenderer) -> ScriptedEngine:
    tok = renderer.tokenizer
    return ScriptedEngine([[*tok.encode(REPLY, add_special_tokens=False), tok.eos_token_id]], version=VERSION)


@dataclass
class Rig:
    stack: LocalStack
    gateway: GatewayServer
    engine: ScriptedEngine
    acr: AsyncAcrClient
    sink: RecordingSink
    settings: RolloutSettings

    def worker(self, timeout_s: float) -> RolloutWorker:
        return RolloutWorker(replace(self.settings, timeout_s=timeout_s), self.gateway, self.acr, self.sink)

    async def emulator_stats(self):
        return await asyncio.to_thread(self.stack.stats)

    async def echo(self, session_id: str) -> dict:
        """What the agent saw for `session_id` (its `_rollout` dict, the session header, the reply)."""
        echo = await self.acr.wait_for_result(self.stack.bucket, f"_echo/{session_id}.json", timeout_s=5)
        assert echo is not None, f"agent wrote no echo for {session_id}"
        return echo


async def _rig(stack: LocalStack, model_dir: Path, renderer: ChatRenderer):
    engine = make_engine(renderer)
    cfg = GatewayConfig(model_path=str(model_dir), served_model_name=MODEL_ID, max_context_tokens=512)
    gateway = GatewayServer(cfg, [engine], renderer=renderer)
    base_url = await asyncio.wait_for(gateway.start(), TIMEOUT_S)
    settings = RolloutSettings(
        exp_id=EXP_ID, agent_runtime_arn=stack.agent_runtime_arn, qualifier=None, s3_bucket=stack.bucket,
        gateway_base_url=base_url, model_id=MODEL_ID, max_tokens=32, temperature=1.0, top_p=1.0,
        timeout_s=TIMEOUT_S, max_context_tokens=512,
    )  # fmt: skip
    acr = await AsyncAcrClient().start()
    return Rig(stack, gateway, engine, acr, RecordingSink([]), settings)


@pytest.fixture
async def rig(stack, tiny_model_dir, tiny_renderer):
    r = await _rig(stack, tiny_model_dir, tiny_renderer)
    try:
        yield r
    finally:
        await r.acr.close()
        await asyncio.wait_for(r.gateway.stop(), TIMEOUT_S)


def req(behaviour: str, input_id: str, group_id: int = 0, sample_index: int = 0, **row) -> RolloutRequest:
    return RolloutRequest(group_id=group_id, input_id=input_id, sample_index=sample_index,
                          row={"behaviour": behaviour, "prompt": "Repeat the letter q 4 times.", **row})


# ----------------------------------------------------------------------------- context overflow (issue 28 item 3)


@pytest.mark.parametrize("overflow,reward", [("train_zero", 0.0), ("drop", None), ("train_reward", 0.75)])
async def test_an_agent_that_overflows_the_context_on_turn_3_ends_truncated(rig: Rig, overflow: str, reward):
    """The agent's third turn does not fit the session's 512-token context: the gateway answers 400
    context_length_exceeded, the agent still reports 0.75, and the rollout ends `truncated` with the
    reward rollout.overflow gives it; its two served turns are one exact row; everything released."""
    worker = RolloutWorker(replace(rig.settings, overflow=overflow), rig.gateway, rig.acr, rig.sink)
    out = await asyncio.wait_for(worker.run(req("overflow", f"row-overflow-{overflow}"), PARTITION), TIMEOUT_S)
    assert (out.sample.status, out.sample.reward, out.reason) == ("truncated", reward, None), out.sample.error
    assert out.sample.error.startswith("context_length_exceeded: ") and f"rollout.overflow={overflow}" in out.sample.error
    assert "agent reward 0.75" in out.sample.error
    [sample] = rig.sink.samples
    assert (sample.status, sample.reward, sample.trainable) == ("truncated", reward, reward is not None)
    assert out.sample.num_turns == sample.num_turns == 2 and len(rig.engine.requests) == 2  # turn 3 never reached it
    [row] = sample.rows
    assert row.num_generated == 2 * len(rig.engine.replies[0])
    assert worker.rollout_counts()["rollout/truncated"] == 1 and "rollout/failed" not in worker.rollout_counts()
    assert rig.gateway.metrics().turns_context_exceeded == 1
    assert worker.sessions_open == 0 and rig.gateway.num_open_sessions() == 0


def test_rollout_overflow_must_name_a_policy():
    s = RolloutSettings(exp_id="e", agent_runtime_arn="arn", qualifier=None, s3_bucket="b", gateway_base_url="",
                        model_id="m", max_tokens=8, temperature=1.0, top_p=1.0, timeout_s=1.0, max_context_tokens=64)
    assert s.overflow == "train_zero"
    with pytest.raises(ValueError, match=r"rollout.overflow must be one of \['train_zero', 'drop', 'train_reward'\]"):
        replace(s, overflow="zero")


# ----------------------------------------------------------------------------- one rollout per behaviour

# behaviour -> (status, reward, fragment the error must contain, rollout timeout_s)
CASES = {
    "ok": ("completed", 0.75, None, TIMEOUT_S),
    "list": ("completed", 0.6, None, TIMEOUT_S),  # last item of [0.1, 0.6]
    "nan": ("failed", None, "'rewards' is not finite: nan", TIMEOUT_S),
    "missing": ("failed", None, "agent reported status_code 500", TIMEOUT_S),  # the toolkit's error object
    "not_number": ("failed", None, "'rewards' is not a number: 'high'", TIMEOUT_S),
    "crash": ("failed", None, "RuntimeClientError", TIMEOUT_S),  # agent HTTP 500 -> ACR 424, retried
    "no_result": ("failed", None, f"timeout after {SHORT_TIMEOUT_S}s", SHORT_TIMEOUT_S),
    "slow": ("failed", None, f"timeout after {SHORT_TIMEOUT_S}s", SHORT_TIMEOUT_S),  # invoke itself hangs
    "slow_result": ("failed", None, f"timeout after {SHORT_TIMEOUT_S}s", SHORT_TIMEOUT_S),  # ack, late S3
}


@pytest.mark.parametrize("behaviour", list(CASES))
async def test_each_agent_behaviour_ends_in_one_terminal_sample(rig: Rig, behaviour: str):
    status, reward, error_part, timeout_s = CASES[behaviour]
    worker = rig.worker(timeout_s)
    before = await rig.emulator_stats()
    input_id = f"row-{behaviour}"
    r = req(behaviour, input_id, group_id=5, sample_index=2, sleep_s=AGENT_SLEEP_S)

    out = await asyncio.wait_for(worker.run(r, PARTITION), TIMEOUT_S)

    # the outcome: terminal, with the right reward or a useful error
    assert (out.sample.status, out.sample.reward) == (status, reward), out.sample.error
    assert (out.sample.group_id, out.sample.sample_index) == (5, 2)
    key = f"s3://{rig.stack.bucket}/{EXP_ID}/{input_id}/{out.session_id}.json"
    if error_part is None:
        assert out.sample.error is None
    else:
        assert error_part in out.sample.error, out.sample.error
        if out.sample.error.startswith("bad_result: "):
            assert out.reason == "bad_result"
            assert key in out.sample.error  # names the exact result object that broke the contract
    if timeout_s == SHORT_TIMEOUT_S:  # bounded by the rollout timeout, not by the slow agent
        assert SHORT_TIMEOUT_S <= out.sample.latency_s < AGENT_SLEEP_S, out.sample.latency_s

    # the stored sample: same status and error, the captured tokens, a reward only if completed
    assert len(rig.sink.puts) == 1
    [sample], partition = rig.sink.puts[0]
    assert partition == PARTITION
    assert (sample.session_id, sample.input_id, sample.group_id, sample.sample_index) == (
        out.session_id, input_id, 5, 2)
    assert (sample.status, sample.reward, sample.error) == (out.sample.status, out.sample.reward, out.sample.error)
    # one chat call per invocation: only a 424 (crash) is re-invoked, runtime_error_attempts times
    attempts = rig.acr.cfg.runtime_error_attempts if behaviour == "crash" else 1
    assert len(rig.engine.requests) == attempts
    assert sample.num_generated_tokens == attempts * len(rig.engine.replies[0]) > 0
    assert out.sample.num_generated_tokens == sample.num_generated_tokens
    assert [v for r in sample.rows for v in r.generated_versions()] == [VERSION] * sample.num_generated_tokens
    if status == "failed":
        assert sample.reward is None  # captured tokens, but never trained as if rewarded

    # every session released: ACR (emulator and worker counters) and gateway
    after = await rig.emulator_stats()
    assert after.sessions_open == 0 and worker.sessions_open == 0
    assert (after.sessions_created - before.sessions_created, after.sessions_stopped - before.sessions_stopped) == (1, 1)
    assert rig.gateway.num_open_sessions() == 0

    # what reached the agent: the `_rollout` contract and ACR's session header
    echo = await rig.echo(out.session_id)
    assert ROLLOUT_KEYS <= set(echo["rollout"])
    ro = echo["rollout"]
    assert (ro["exp_id"], ro["input_id"], ro["s3_bucket"]) == (EXP_ID, input_id, rig.stack.bucket)
    assert (ro["base_url"], ro["model_id"]) == (rig.gateway.base_url, MODEL_ID)
    assert isinstance(ro["api_key"], str) and ro["api_key"]  # it authenticated: tokens were captured
    assert echo["session_id"] == ro["session_id"] == out.session_id
    assert echo["reply"] == REPLY


async def test_an_agent_that_could_not_reach_s3_fails_s3_unavailable_not_agent_error(rig: Rig):
    """Issue 47 (item 6): killing moto mid-run was reported as the agent's fault: the agent's write of
    its reward failed (S3 unreachable, or the restarted moto without its bucket yet: NoSuchBucket, as
    a real run showed), it wrote the toolkit's error object once moto answered, and the rollout failed
    `agent_error` (whose hint points at the agent). The object store is the broken part: the rollout
    fails `s3_unavailable`, its error names S3 and the result's key; an agent's own error object
    stays `agent_error`."""
    worker = rig.worker(TIMEOUT_S)
    for behaviour, says in (("store_down", "could not be reached"), ("bucket_gone", "refused the agent's write")):
        down = await asyncio.wait_for(worker.run(req(behaviour, f"row-{behaviour}"), PARTITION), TIMEOUT_S)
        key = f"s3://{rig.stack.bucket}/{EXP_ID}/row-{behaviour}/{down.session_id}.json"
        assert (down.sample.status, down.reason, down.sample.reward) == ("failed", "s3_unavailable", None), down.sample.error
        assert down.sample.error.startswith("s3_unavailable: ") and f"S3 (the result store) {says}" in down.sample.error
        assert key in down.sample.error and "not the agent at fault" in down.sample.error
    own = await asyncio.wait_for(worker.run(req("missing", "row-own-error"), PARTITION), TIMEOUT_S)
    assert (own.sample.status, own.reason) == ("failed", "agent_error"), own.sample.error
    counts = worker.rollout_counts()
    assert (counts["rollout/failed/s3_unavailable"], counts["rollout/failed/agent_error"]) == (2, 1)
    assert worker.sessions_open == 0 and rig.gateway.num_open_sessions() == 0


async def test_a_turn_no_replica_could_serve_fails_the_rollout_engine_lost(rig: Rig):
    """Issue 14: the only replica died under a turn (the gateway answered 503 and marked the
    session); whatever the agent then reports, the rollout fails `engine_lost`, never trained."""
    rig.engine.fail = True  # every generate raises: the gateway takes the replica out, none is left
    out = await asyncio.wait_for(rig.worker(TIMEOUT_S).run(req("ok", "row-lost", group_id=8), "p-lost"), TIMEOUT_S)
    assert (out.sample.status, out.reason, out.sample.reward) == ("failed", "engine_lost", None)
    assert rig.sink.samples[-1].reward is None and "engine_lost" in rig.sink.samples[-1].error
    assert rig.gateway.metrics().turns_engine_lost >= 1  # the crashed agent is re-invoked (424): each try 503s


async def test_run_seed_samples_each_rollout_with_its_identity_seed(rig: Rig):
    """Determinism across resume (issue 14): with `seed` set, the rollout's model turn samples with
    turn_seed(session_seed(seed, input_id, group_id, sample_index), 1), not a random session id's."""
    from workers.core.seeds import session_seed, turn_seed

    worker = RolloutWorker(replace(rig.settings, seed=7), rig.gateway, rig.acr, rig.sink)
    out = await asyncio.wait_for(worker.run(req("ok", "row-seed", group_id=4, sample_index=1), "p-seed"), TIMEOUT_S)
    assert out.sample.status == "completed"
    assert rig.engine.requests[-1].seed == turn_seed(session_seed(7, "row-seed", 4, 1), 1)


@pytest.mark.parametrize("delete", [True, False])
async def test_delete_results_removes_each_result_object_once_read(rig: Rig, delete: bool):
    """Soak finding: moto kept every result in memory (+22 MB per 100 steps). With
    `rollout.acr.delete_results` the worker deletes the object it read; without, S3 keeps it."""
    worker = RolloutWorker(replace(rig.settings, delete_results=delete), rig.gateway, rig.acr, rig.sink)
    out = await asyncio.wait_for(worker.run(req("ok", f"row-del-{delete}"), "p-del"), TIMEOUT_S)
    assert out.sample.status == "completed" and out.sample.reward == 0.75
    key = result_key(EXP_ID, f"row-del-{delete}", out.session_id)
    listed = lambda: rig.acr.s3.list_objects_v2(Bucket=rig.stack.bucket, Prefix=key)  # noqa: E731
    if delete:
        async with asyncio.timeout(TIMEOUT_S):
            while (await listed()).get("KeyCount", 0):
                await asyncio.sleep(0.01)
        assert worker.counts["result_delete_failed"] == 0
    else:
        assert (await listed())["KeyCount"] == 1


async def test_reserved_key_in_row_raises_contract_error_and_closes_gateway_session(rig: Rig):
    worker = rig.worker(TIMEOUT_S)
    before = await rig.emulator_stats()
    bad = req("ok", "row-with-config", _config={"lr": 1.0})
    with pytest.raises(ContractError) as err:
        await asyncio.wait_for(worker.run(bad, PARTITION), TIMEOUT_S)
    assert "row-with-config" in str(err.value) and "_config" in str(err.value)
    assert rig.gateway.num_open_sessions() == 0  # checked before any session is opened
    assert worker.sessions_open == 0 and rig.sink.puts == [] and rig.engine.requests == []
    after = await rig.emulator_stats()
    assert after.invocations == before.invocations  # the agent was never invoked


async def test_cancelled_rollout_still_stops_acr_session_and_closes_gateway_session(rig: Rig):
    """The driver may cancel a rollout (shutdown, an aborted step): the invariant's cancellation
    path. The agent is mid-invocation (`slow`), the ACR call is in flight when the task is cancelled."""
    worker = rig.worker(TIMEOUT_S)
    before = await rig.emulator_stats()
    task = asyncio.ensure_future(worker.run(req("slow", "row-cancel", sleep_s=AGENT_SLEEP_S), PARTITION))
    await asyncio.wait_for(rig.engine.started.wait(), TIMEOUT_S)  # the agent is running
    assert worker.sessions_open == 1 and rig.gateway.num_open_sessions() == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, TIMEOUT_S)
    after = await rig.emulator_stats()
    assert after.sessions_open == 0 and after.sessions_stopped - before.sessions_stopped == 1
    assert worker.sessions_open == 0 and rig.gateway.num_open_sessions() == 0
    assert rig.sink.puts == []  # a cancelled rollout stores nothing and returns no outcome


async def test_sixteen_concurrent_rollouts_all_end_in_distinct_sessions(stack, tiny_model_dir, tiny_renderer):
    n = 16
    r = await _rig(stack, tiny_model_dir, tiny_renderer)
    r.engine.gate = asyncio.Event()  # no chat answers until all 16 have asked

    async def open_gate_once_all_asked() -> None:
        await until(lambda: len(r.engine.requests) >= n)
        r.engine.gate.set()

    try:
        worker = r.worker(TIMEOUT_S)
        reqs = [req("ok", f"row-c{g}", group_id=g, sample_index=i) for g in range(4) for i in range(4)]
        outs, _ = await asyncio.wait_for(asyncio.gather(
            asyncio.gather(*(worker.run(q, PARTITION) for q in reqs)), open_gate_once_all_asked()), TIMEOUT_S)
        assert [o.sample.status for o in outs] == ["completed"] * n, [o.sample.error for o in outs]
        assert [(o.sample.group_id, o.sample.sample_index) for o in outs] == [(q.group_id, q.sample_index) for q in reqs]
        assert len({o.session_id for o in outs}) == n
        assert len(r.engine.requests) == n  # the gate let them through: 16 were in flight at once
        assert sorted(s.session_id for s in r.sink.samples) == sorted(o.session_id for o in outs)
        assert all(s.reward == 0.75 and s.num_generated_tokens == len(r.engine.replies[0]) for s in r.sink.samples)
        st = await r.emulator_stats()
        assert st.sessions_open == 0 and st.peak_open >= n and worker.sessions_open == 0
        assert r.gateway.num_open_sessions() == 0
    finally:
        await r.acr.close()
        await asyncio.wait_for(r.gateway.stop(), TIMEOUT_S)


# ----------------------------------------------------------------------------- pure helpers


def test_parse_reward_accepts_numbers_and_lists_last_item_counts():
    assert parse_reward({"rewards": 0.5}, "w") == 0.5
    assert parse_reward({"rewards": 1}, "w") == 1.0 and isinstance(parse_reward({"rewards": 1}, "w"), float)
    assert parse_reward({"rewards": [0.1, -2.0]}, "w") == -2.0


@pytest.mark.parametrize(
    "result, message",
    [
        ({"status_code": 200}, "no 'rewards' field"),
        ({"rewards": []}, "empty list"),
        ({"rewards": "high"}, "not a number"),
        ({"rewards": True}, "not a number"),  # bool is an int subclass: refused on purpose
        ({"rewards": None}, "not a number"),
        ({"rewards": [0.1, "x"]}, "not a number"),
        ({"rewards": math.nan}, "not finite"),
        ({"rewards": [0.0, math.inf]}, "not finite"),
    ],
)
def test_parse_reward_refuses_what_cannot_be_trained(result, message):
    with pytest.raises(BadResult, match=message) as err:  # fails the rollout, not the run
        parse_reward(result, "s3://b/exp/row-1/sid.json")
    assert str(err.value).startswith("s3://b/exp/row-1/sid.json: ")


@pytest.mark.parametrize("exp_id", ["", "e", "exp-1", "x" * 300])
def test_new_session_id_is_within_acr_bounds_and_unique(exp_id):
    ids = {new_session_id(exp_id, 123456789, 987654321) for _ in range(50)}
    assert len(ids) == 50
    for sid in ids:
        assert 33 <= len(sid) <= 256, len(sid)
        assert sid.startswith(f"{exp_id[:64]}-g123456789-s987654321-")


def test_result_key_follows_the_toolkit_layout():
    assert result_key("exp-1", "row-7", "sid-abc") == "exp-1/row-7/sid-abc.json"


def _settings() -> RolloutSettings:
    return RolloutSettings(
        exp_id="exp-1", agent_runtime_arn="arn:aws:bedrock-agentcore:us-west-2:1:runtime/x", qualifier=None,
        s3_bucket="bucket", gateway_base_url="http://127.0.0.1:9/v1", model_id="m", max_tokens=64,
        temperature=0.7, top_p=0.9, timeout_s=60, max_context_tokens=1024,
    )  # fmt: skip


def test_build_payload_keeps_the_row_and_adds_rollout():
    row = {"prompt": "p", "answer": 3}
    r = RolloutRequest(group_id=1, input_id="row-7", sample_index=0, row=row)
    p = build_payload(r, _settings(), "sid-1", "secret")
    assert {k: v for k, v in p.items() if k != "_rollout"} == row
    assert row == {"prompt": "p", "answer": 3}  # the dataset row is not mutated
    assert p["_rollout"] == {
        "exp_id": "exp-1", "input_id": "row-7", "session_id": "sid-1", "s3_bucket": "bucket",
        "base_url": "http://127.0.0.1:9/v1", "model_id": "m", "api_key": "secret",
        "max_tokens": 64, "temperature": 0.7, "top_p": 0.9,
    }  # fmt: skip


@pytest.mark.parametrize("key", RESERVED_KEYS)
def test_build_payload_refuses_reserved_keys(key):
    r = RolloutRequest(group_id=0, input_id="row-9", sample_index=0, row={"prompt": "p", key: {}})
    with pytest.raises(ContractError, match=rf"input_id='row-9' has reserved field\(s\) \['{key}'\]"):
        build_payload(r, _settings(), "sid", "k")
