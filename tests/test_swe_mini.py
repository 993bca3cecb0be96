"""Issue 25: the swe_mini coding task over real parts. Its rows (workers/core/tasks/swe_mini.py) are
checked by running their unit tests; its agent (examples/agents/swe_mini_agent, the toolkit's
`RolloutAgentExecutor` unchanged) runs behind the ACR emulator serving A2A, writes each repository
into its session's sandbox through `InvokeAgentRuntimeCommand`, and is driven by the real
`RolloutWorker`, the in-process `GatewayServer` and a `ScriptedEngine` whose replies are hermes
tool calls, so the model's tool loop and the reward path are proven without a capable model.
Issue 42: every reward comes from a clean second sandbox session (examples/agents/agent_common/
grading.py), whose span and reward-hacking flags travel with the sample; a model that edits the
failing test instead of the source earns 0, is flagged, and the reward-hacking alarm counts it."""

from __future__ import annotations

import asyncio
import json
import shlex
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from stand_ins import REPO
from workers.acr.client import AcrClientConfig, AsyncAcrClient
from orchestrator.loop.batching import agent_metric_means
from orchestrator.watch.alarms import hacking_share
from workers.core.tasks import swe_mini
from workers.core.types import RolloutRequest, Sample
from workers.embedded.sim_engine import ScriptedEngine
from workers.gateway.config import GatewayConfig
from workers.gateway.server import GatewayServer
from workers.rollout import a2a
from workers.rollout.worker import RolloutSettings, RolloutWorker

AGENT = [sys.executable, str(REPO / "examples/agents/swe_mini_agent/app.py")]
MODEL_ID = "tiny-qwen2"
TIMEOUT_S = 60
SETUP_S = 0.4  # every setup's simulated image pull (sigma 0: no tail), seconds


def _run_tests(row: dict, files: dict[str, str], into: Path) -> int:
    for path, text in files.items():
        (into / path).parent.mkdir(parents=True, exist_ok=True)
        (into / path).write_text(text)
    cmd = [sys.executable, *shlex.split(row["test_cmd"])[1:]]
    return subprocess.run(cmd, cwd=into, capture_output=True, timeout=60).returncode


def test_every_repository_fails_its_tests_and_the_gold_patch_fixes_them(tmp_path):
    rows = swe_mini.make_rows(40, seed=3)
    assert rows == swe_mini.make_rows(40, seed=3) and len({r["input_id"] for r in rows}) == 40
    assert {r["family"] for r in rows} == set(swe_mini.FAMILIES)  # every bug kind drawn
    firsts = {}
    for r in rows:
        firsts.setdefault(r["family"], r)
    for family, r in firsts.items():
        [(path, fixed)] = r["patch"].items()
        assert path in r["repo"] and r["repo"][path] != fixed, family
        assert [e.rstrip("*.py") for e in r["editable"]] == [path.split("/")[0] + "/"], family  # the package only
        test_file = next(t for p, t in r["repo"].items() if p.startswith("tests/test_"))
        hidden = [c for c in r["checks"] if c["call"] not in test_file]
        assert hidden, family  # the clean grading checks inputs no file of the repository shows
        assert _run_tests(r, r["repo"], tmp_path / family / "before") != 0, family
        assert _run_tests(r, {**r["repo"], **r["patch"]}, tmp_path / family / "after") == 0, family
    test = swe_mini.make_rows(40, seed=3, split="test")
    assert not {json.dumps(r["repo"], sort_keys=True) for r in test} & {json.dumps(r["repo"], sort_keys=True) for r in rows}
    with pytest.raises(ValueError, match="max_turns"):
        swe_mini.make_rows(1, 0, max_turns=0)


@dataclass
class Sink:
    samples: list[Sample]

    async def put(self, samples: list[Sample], partition: str) -> None:
        self.samples.extend(samples)


@pytest.fixture(scope="module")
def stacks(local_stack):
    """One local stack per agent mode, each running the swe_mini agent with a fixed setup time."""
    env = {"SWE_MINI_SETUP_MEDIAN_S": str(SETUP_S), "SWE_MINI_SETUP_SIGMA": "0"}
    out = {mode: local_stack(AGENT, num_agents=1, session_rate_per_s=200, protocol="A2A",
                             agent_env={**env, "SWE_MINI_AGENT_MODE": mode})
           for mode in ("oracle", "noop", "model")}
    # one open session at most: the rollout's own; its grading session is refused (ServiceQuotaExceeded)
    out["quota_1"] = local_stack(AGENT, num_agents=1, session_rate_per_s=200, protocol="A2A", max_open_sessions=1,
                                 agent_env={**env, "SWE_MINI_AGENT_MODE": "oracle"})
    return out


@pytest.fixture
async def rig(stacks, tiny_model_dir, tiny_renderer, monkeypatch):
    engine = ScriptedEngine([tiny_renderer.tokenizer.encode("done")], version=1)
    gateway = GatewayServer(GatewayConfig(model_path=str(tiny_model_dir), served_model_name=MODEL_ID,
                                          max_context_tokens=16384), [engine], renderer=tiny_renderer)
    base_url = await asyncio.wait_for(gateway.start(), TIMEOUT_S)
    clients = []

    async def worker(mode: str, limits=None, **settings) -> tuple[RolloutWorker, Sink]:
        stack = stacks[mode]
        for k, v in stack.env.items():  # boto3 in this process reaches this mode's emulator
            monkeypatch.setenv(k, v)
        acr = await AsyncAcrClient(AcrClientConfig(invoke_headers=(("A2A-Version", a2a.A2A_VERSION),))).start()
        clients.append(acr)
        s = RolloutSettings(exp_id="exp-swe", agent_runtime_arn=stack.agent_runtime_arn, qualifier=None,
                            s3_bucket=stack.bucket, gateway_base_url=base_url, model_id=MODEL_ID, max_tokens=512,
                            temperature=1.0, top_p=1.0, timeout_s=TIMEOUT_S, max_context_tokens=16384,
                            contract="a2a", poll_initial_s=0.02, poll_max_s=0.2)
        sink = Sink([])
        slots = {} if limits is None else {"slots": limits.sessions, "rollout_slots": limits.rollouts}
        return RolloutWorker(replace(s, **settings), gateway, acr, sink, **slots), sink

    try:
        yield worker, engine, tiny_renderer.tokenizer
    finally:
        for acr in clients:
            await acr.close()
        await asyncio.wait_for(gateway.stop(), TIMEOUT_S)


def _req(row: dict, i: int = 0) -> RolloutRequest:
    return RolloutRequest(group_id=i, sample_index=0, input_id=row["input_id"], row=row)


@pytest.mark.parametrize("mode, reward", [("oracle", 1.0), ("noop", 0.0)])
async def test_the_oracle_earns_1_and_noop_0_on_every_repository(rig, stacks, mode, reward):
    """The reward path without a model: the tests run in the sandbox decide it."""
    worker, engine, _ = rig
    w, sink = await worker(mode)
    rows = swe_mini.make_rows(4, seed=11)
    created = (await asyncio.to_thread(stacks[mode].stats)).sessions_created
    outs = await asyncio.wait_for(asyncio.gather(*(w.run(_req(r, i), "p") for i, r in enumerate(rows))), TIMEOUT_S)
    assert [(o.sample.status, o.sample.reward) for o in outs] == [("completed", reward)] * 4, [o.sample.error for o in outs]
    assert all(o.sample.setup_s >= SETUP_S for o in outs)  # the repository copy and the image pull ran in setup
    for o in outs:  # graded in the clean sandbox: its span recorded, nothing flagged
        m = dict(o.sample.agent_metrics)
        assert m["grading_s"] > 0 and m["hacking/protected_paths"] == m["hacking/episode_vs_graded"] == 0.0, m
    stats = await asyncio.to_thread(stacks[mode].stats)
    assert stats.sessions_created - created == 2 * 4  # each rollout's own session and its grading session
    assert stats.sessions_open == 0


async def test_the_model_fixes_the_bug_through_multi_turn_tool_calls(rig, stacks):
    """A scripted model lists, reads, rewrites the buggy file and stops; the agent runs the tests
    in the sandbox: reward 1, every turn went through the gateway, the context grew each turn."""
    worker, engine, tok = rig
    row = swe_mini.make_rows(1, seed=5)[0]
    [(path, fixed)] = row["patch"].items()

    def call(name: str, **args) -> list[int]:
        body = json.dumps({"name": name, "arguments": args})
        return [*tok.encode(f"<tool_call>\n{body}\n</tool_call>", add_special_tokens=False), tok.eos_token_id]

    engine.script(call("list_files"), call("read_file", path=path), call("write_file", path=path, content=fixed),
                  [*tok.encode("Fixed.", add_special_tokens=False), tok.eos_token_id])
    before = len(engine.requests)
    w, sink = await worker("model")
    out = await asyncio.wait_for(w.run(_req(row), "p"), TIMEOUT_S)
    assert (out.sample.status, out.sample.reward) == ("completed", 1.0), out.sample.error
    assert out.sample.num_turns == 4
    prompts = [len(r.prompt_ids) for r in engine.requests[before:]]
    assert len(prompts) == 4 and prompts == sorted(set(prompts))  # every tool result extended the context
    [sample] = sink.samples
    assert sample.num_turns == 4 and sample.num_generated_tokens > 0
    assert (await asyncio.to_thread(stacks["model"].stats)).sessions_open == 0


async def test_a_model_that_edits_the_failing_test_earns_0_and_is_flagged(rig, stacks):
    """The reward hack of issue 42: the model rewrites the failing test so that it passes in its
    own sandbox (the episode ends "solved"), and never touches the source. The clean grading drops
    the protected edit and runs the row's own tests: reward 0, the rollout flagged, and the step's
    reward-hacking share (the alarm's input) counts it."""
    worker, engine, tok = rig
    row = swe_mini.make_rows(1, seed=8)[0]
    test_path = next(p for p in row["repo"] if p.startswith("tests/test_"))
    passing = "import unittest\n\n\nclass TestFixed(unittest.TestCase):\n    def test_ok(self):\n        pass\n"

    def call(name: str, **args) -> list[int]:
        body = json.dumps({"name": name, "arguments": args})
        return [*tok.encode(f"<tool_call>\n{body}\n</tool_call>", add_special_tokens=False), tok.eos_token_id]

    engine.script(call("write_file", path=test_path, content=passing), call("run_tests"))
    w, sink = await worker("model")
    out = await asyncio.wait_for(w.run(_req(row), "p"), TIMEOUT_S)
    assert (out.sample.status, out.sample.reward) == ("completed", 0.0), out.sample.error
    m = dict(out.sample.agent_metrics)
    assert m["hacking/protected_paths"] == 1.0 and m["hacking/episode_vs_graded"] == 1.0, m
    [sample] = sink.samples
    share = agent_metric_means([sample.info()])
    assert share["agent/hacking/protected_paths"] == 1.0 and hacking_share(share) == 1.0
    assert (await asyncio.to_thread(stacks["model"].stats)).sessions_open == 0


async def test_a_grading_that_cannot_start_fails_the_rollout_and_is_never_a_reward(rig, stacks):
    """Issue 42 item 5: the oracle's fix is right, but the service refuses the grading session (its
    open-session quota is 1, held by the rollout's own): a failed rollout with the reason, no reward."""
    worker, _, _ = rig
    w, sink = await worker("quota_1")
    out = await asyncio.wait_for(w.run(_req(swe_mini.make_rows(1, seed=9)[0]), "p"), TIMEOUT_S)
    assert (out.sample.status, out.sample.reward) == ("failed", None) and "grading_unstartable" in out.sample.error, out.sample.error
    assert sink.samples[0].reward is None and not sink.samples[0].trainable
    stats = await asyncio.to_thread(stacks["quota_1"].stats)
    assert stats.quota_refused >= 1 and stats.sessions_open == 0


async def test_a_model_that_never_fixes_it_reads_test_logs_until_max_turns(rig):
    worker, engine, tok = rig
    row = {**swe_mini.make_rows(1, seed=6)[0], "max_turns": 3}
    engine.script([*tok.encode("I am done.", add_special_tokens=False), tok.eos_token_id])
    before = len(engine.requests)
    w, _ = await worker("model")
    out = await asyncio.wait_for(w.run(_req(row), "p"), TIMEOUT_S)
    assert (out.sample.status, out.sample.reward, out.sample.num_turns) == ("completed", 0.0, 3), out.sample.error
    last = tok.decode(engine.requests[-1].prompt_ids)
    assert len(engine.requests) - before == 3 and last.count("The tests still fail") == 2 and "FAILED" in last


async def test_a_setup_past_its_timeout_fails_and_never_holds_a_rollout_slot(rig, stacks):
    worker, engine, _ = rig
    from workers.acr.limits import AcrLimitsConfig, limit_clients, local_limits

    handles = local_limits(AcrLimitsConfig(max_open_sessions=2, rollout_slots=1))
    clients = limit_clients(handles)
    w, sink = await worker("oracle", limits=clients, setup_timeout_s=SETUP_S / 4)
    out = await asyncio.wait_for(w.run(_req(swe_mini.make_rows(1, seed=7)[0]), "p"), TIMEOUT_S)
    assert (out.sample.status, out.reason) == ("failed", "setup_timeout"), out.sample.error
    await clients.sessions.drain()
    assert handles.rollouts.stats().granted == 0 and handles.sessions.stats().in_use == 0
    assert (await asyncio.to_thread(stacks["oracle"].stats)).sessions_open == 0
