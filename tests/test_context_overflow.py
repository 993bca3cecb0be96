"""Issue 28 item 3: context overflow is a result, not a crash.

Gateway part: the real GatewayServer on 127.0.0.1 with the tiny model's tokenizer and template, the
zero-cost ScriptedEngine at the InferenceEngine seam, driven by the official `openai` and
`anthropic` SDKs: an agent whose third turn does not fit the session's context gets the API's own
error (OpenAI 400 `context_length_exceeded`, Anthropic 400 `invalid_request_error` "prompt is too
long"), its first two turns stay recorded as one exact row, and the session's capture says
`context_exceeded`; a generation cut at max_tokens is `finish_reason=length` and counted.

Driver part: the sync loop we ship, fed rollouts of which some ran out of context, under each
`rollout.overflow` choice: the run goes on, the ledger closes them `truncated` (its identity
includes it), and what the trainer receives is what the choice says. The rollout worker's own
truncated terminal state over real ACR parts is in tests/test_rollout_worker.py.
"""

from __future__ import annotations

import asyncio
import dataclasses

import anthropic
import openai
import pytest

from orchestrator.loop.batching import RolloutLedger, assemble
from orchestrator.loop.common import LoopParts
from orchestrator.loop.prompts import PromptCycle
from orchestrator.loop.sync_loop import SyncLoopSettings, run_sync
from stand_ins import ListLogger, MemoryStore, SimReplica, make_row, make_sample
from workers.core.types import RolloutResult, Sample
from workers.embedded.sim_engine import ScriptedEngine
from workers.rollout.overflow import OVERFLOW_POLICIES, truncation

MODEL_ID = "tiny-qwen2"
REPLY = "q q q q"
TIMEOUT_S = 20


@pytest.fixture
async def gateway(tiny_gateway):
    async with tiny_gateway(REPLY, version=1, max_context_tokens=512) as started:
        yield started


def three_turns(reply: str) -> list[list[dict]]:
    """An agent's three requests: two short turns, then a tool result far longer than the context."""
    m1 = [{"role": "user", "content": "Repeat the letter q 4 times."}]
    m2 = [*m1, {"role": "assistant", "content": reply}, {"role": "user", "content": "Again."}]
    m3 = [*m2, {"role": "assistant", "content": reply}, {"role": "user", "content": "q " * 400}]
    return [m1, m2, m3]


async def test_openai_agent_that_overflows_on_turn_3_gets_context_length_exceeded(gateway, tiny_renderer):
    server, engine = gateway
    m1, m2, m3 = three_turns(REPLY)
    budget = len(tiny_renderer.render(m2)) + 40  # turns 1-2 fit with room; turn 3's 400 q's do not
    token = await server.open_session("overflow-openai", max_context_tokens=budget)
    async with openai.AsyncOpenAI(base_url=server.base_url, api_key=token, max_retries=0, timeout=TIMEOUT_S) as c:
        r1 = await c.chat.completions.create(model=MODEL_ID, messages=m1, max_tokens=32)
        r2 = await c.chat.completions.create(model=MODEL_ID, messages=m2, max_tokens=32)
        with pytest.raises(openai.BadRequestError) as err:
            await c.chat.completions.create(model=MODEL_ID, messages=m3, max_tokens=32)
    n3 = len(tiny_renderer.render(m3))
    assert err.value.status_code == 400 and err.value.code == "context_length_exceeded"
    assert err.value.param == "messages" and err.value.type == "invalid_request_error"
    assert f"maximum context length is {budget} tokens" in err.value.message and f"{n3} tokens" in err.value.message
    assert (r1.choices[0].finish_reason, r2.choices[0].finish_reason) == ("stop", "stop")
    assert len(engine.requests) == 2  # the refused turn never reached the engine
    cap = await server.close_session("overflow-openai")
    assert cap.context_exceeded and cap.num_turns == 2 and not cap.engine_lost
    [row] = cap.rows  # the two served turns: one exact row (CLEAN)
    assert row.token_ids == tiny_renderer.render(m2) + engine.replies[0]
    assert row.num_generated == 2 * len(engine.replies[0])
    m = server.metrics()
    assert (m.turns_context_exceeded, m.turns_served, m.turns_length) == (1, 2, 0)


async def test_anthropic_agent_gets_prompt_is_too_long(gateway, tiny_renderer):
    server, engine = gateway
    m1, m2, m3 = three_turns(REPLY)
    budget = len(tiny_renderer.render(m2)) + 40
    token = await server.open_session("overflow-anthropic", max_context_tokens=budget)
    async with anthropic.AsyncAnthropic(base_url=server.base_url, api_key=token, max_retries=0,
                                        timeout=TIMEOUT_S) as c:
        for msgs in (m1, m2):
            await c.messages.create(model=MODEL_ID, messages=msgs, max_tokens=32)
        with pytest.raises(anthropic.BadRequestError) as err:
            await c.messages.create(model=MODEL_ID, messages=m3, max_tokens=32)
    n3 = len(tiny_renderer.render(m3))
    body = err.value.body
    assert err.value.status_code == 400 and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"] == f"prompt is too long: {n3} tokens > {budget - 1} maximum"  # Anthropic's words
    cap = await server.close_session("overflow-anthropic")
    assert cap.context_exceeded and cap.num_turns == 2 and len(cap.rows) == 1


async def test_a_generation_cut_at_max_tokens_is_length_and_counted(gateway, tiny_renderer):
    """Cut by the agent's max_tokens far from the context's end: `length`, counted, not an overflow;
    cut at the context's end: the session is out of room (context_exceeded)."""
    server, engine = gateway
    m1 = three_turns(REPLY)[0]
    token = await server.open_session("cut-by-max-tokens")
    async with openai.AsyncOpenAI(base_url=server.base_url, api_key=token, max_retries=0, timeout=TIMEOUT_S) as c:
        r = await c.chat.completions.create(model=MODEL_ID, messages=m1, max_tokens=2)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 2
    assert not (await server.close_session("cut-by-max-tokens")).context_exceeded
    token = await server.open_session("cut-by-context", max_context_tokens=len(tiny_renderer.render(m1)) + 2)
    async with anthropic.AsyncAnthropic(base_url=server.base_url, api_key=token, max_retries=0,
                                        timeout=TIMEOUT_S) as c:
        a = await c.messages.create(model=MODEL_ID, messages=m1, max_tokens=100)
    assert a.stop_reason == "max_tokens" and a.usage.output_tokens == 2  # Anthropic's name for `length`
    assert (await server.close_session("cut-by-context")).context_exceeded
    m = server.metrics()
    assert (m.turns_length, m.turns_context_exceeded) == (2, 1)


# ------------------------------------------------------------------------- the driver: ledger and loop

AGENT_REWARD = 0.75


class OverflowRollouts:
    """The rollout seam: sample 3 of every group ran out of context (its agent still reported
    AGENT_REWARD), stored as the rollout worker stores it under `policy`; the others completed
    with reward sample_index % 2 (a group has reward variance either way)."""

    def __init__(self, store: MemoryStore, policy: str) -> None:
        self.store, self.policy = store, policy

    async def run_all(self, reqs, partition):
        out = []
        for r in reqs:
            s = make_sample(r.group_id, r.sample_index, float(r.sample_index % 2))
            if r.sample_index == 3:
                cut = truncation(self.policy, AGENT_REWARD, None)  # type: ignore[arg-type]
                s = Sample(s.session_id, r.group_id, s.input_id, 3, (make_row([1, 2], [3, 4, 5]),), cut.reward,
                           "truncated", 0.01, error=cut.error)
            out.append(s)
        await self.store.put(out, partition)
        return [RolloutResult(s.info()) for s in out]


class Trainer:
    """Takes each order's samples from the store, as a rank reads them."""

    def __init__(self, store: MemoryStore) -> None:
        self.store = store
        self.samples: list[Sample] = []

    async def update(self, order):
        taken = [self.store.sample(order.partition, s.session_id) for s in order.samples]
        self.samples += taken
        return {"actor/num_tokens": float(sum(s.num_generated_tokens for s in taken))}


class Push(SimReplica):
    """A weight sync that only counts versions."""


@pytest.mark.parametrize("policy", OVERFLOW_POLICIES)
async def test_truncated_rollouts_close_truncated_and_train_as_rollout_overflow_says(policy):
    store, logger = MemoryStore(), ListLogger()
    trainer = Trainer(store)
    rows = [{"input_id": f"p{i}", "prompt": "x"} for i in range(4)]
    parts = LoopParts(prompts=PromptCycle(rows, seed=0), rollouts=OverflowRollouts(store, policy), store=store,
                      trainer=trainer, weights=Push(), logger=logger, ledger=RolloutLedger())
    report = await run_sync(parts, SyncLoopSettings(total_steps=3, batch_size=2, n=4, sync_every=1,
                                                    filter_zero_variance=True))
    c = report.counts
    # 3 steps x 2 groups x 4 samples, one truncated per group: the run went on to its last step
    assert report.stopped is None and report.steps == 3 and not parts.ledger.open_rollouts()
    assert c["rollout/truncated"] == 6 and c["rollout/completed"] == 18
    assert c["rollout/dispatched"] == sum(c[f"rollout/{k}"] for k in
                                          ("completed", "failed", "filtered", "expired", "truncated")) == 24
    truncated = [s for s in trainer.samples if s.status == "truncated"]
    expected = {"train_zero": [0.0] * 6, "drop": [], "train_reward": [AGENT_REWARD] * 6}[policy]
    assert [s.reward for s in truncated] == expected
    assert len(trainer.samples) == 18 + len(expected)  # the completed ones train in every case
    assert all(m["rollout/step_truncated"] == 2.0 and m["rollout/truncated_share"] == 0.25 for _, m in logger.steps)
    assert [m["alarm/truncated_share"] for _, m in logger.steps] == [0.0] * 3  # 3 steps: the 5-step window is not full


def test_a_dropped_truncated_sample_leaves_its_group_baseline():
    """rollout.overflow=drop: the truncated sample is `dropped`, the group trains on the other three;
    train_zero: it stays in the group at reward 0 (the baseline counts it)."""
    done = [make_sample(0, i, float(i % 2)) for i in range(3)]
    for policy, members, dropped in (("drop", 3, 1), ("train_zero", 4, 0), ("train_reward", 4, 0)):
        cut = truncation(policy, AGENT_REWARD, None)  # type: ignore[arg-type]
        t = Sample("s-0-3", 0, "in-0", 3, (make_row([1], [2]),), cut.reward, "truncated", 0.0, error=cut.error)
        batch = assemble([*done, t], filter_zero_variance=True)
        assert (sum(len(g.samples) for g in batch.trainable), len(batch.dropped), len(batch.failed)) == (
            members, dropped, 0), policy


def test_the_ledger_identity_includes_truncated():
    ledger = RolloutLedger()
    for k in ("a", "b", "c"):
        ledger.on_dispatched(k)
    ledger.on_terminal("a", "truncated")
    ledger.on_terminal("b", "completed")
    c = ledger.counts()
    assert c["rollout/truncated"] == 1 and c["rollout/open"] == 1
    assert c["rollout/dispatched"] == c["rollout/open"] + sum(
        c[f"rollout/{k}"] for k in ("completed", "failed", "filtered", "expired", "truncated"))
    restored = RolloutLedger()
    restored.restore(ledger.settled_counts())
    assert restored.counts()["rollout/truncated"] == 1 and restored.dispatched == 2
    with pytest.raises(ValueError, match="do not add up"):  # a checkpoint that lost its truncated count
        RolloutLedger().restore({**ledger.settled_counts(), "rollout/truncated": 0})


def test_truncation_reward_and_error_per_policy():
    assert truncation("train_zero", 0.75, None).reward == 0.0
    assert truncation("drop", 0.75, None).reward is None
    assert truncation("train_reward", 0.75, None).reward == 0.75
    no_reward = truncation("train_reward", None, "timeout: after 3s")
    assert no_reward.reward is None and "no agent reward (timeout: after 3s)" in no_reward.error
    assert truncation("train_zero", 0.75, None).error.startswith("context_length_exceeded: ")
    with pytest.raises(ValueError, match="rollout.overflow must be one of"):
        truncation("zero", 0.75, None)  # type: ignore[arg-type]


def test_a_multi_turn_row_is_never_cut_at_the_per_turn_cap():
    """rLLM PR #575: a merged multi-turn row was padded/truncated to the per-turn generation cap,
    dropping later turns. Here three turns of 16 generated tokens (rollout.max_tokens=16) plus tool
    tokens make a 62-token row: the train batch holds all of it, every generated token trained."""
    from workers.trainer.train_batch import build_train_batch

    max_tokens = 16
    ids, mask = [1, 2], [0, 0]
    for turn in range(3):
        ids += [10 + turn] * max_tokens + [7] * 4  # generated turn, then 4 tool-result tokens
        mask += [1] * max_tokens + [0] * 4
    from workers.core.types import TrajectoryRow

    row = TrajectoryRow(tuple(ids), tuple(mask), tuple(-0.1 * m for m in mask), tuple(0 if m else -1 for m in mask))
    batch = build_train_batch((make_sample(0, 0, 1.0, rows=[row]), make_sample(0, 1, 0.0)), pad_id=0,
                              norm_adv_by_std=True)
    assert batch.seq_len == len(ids) == 62 and batch.input_ids[0].tolist() == ids
    assert int(batch.loss_mask[0].sum()) == 3 * max_tokens


def truncating_rollouts(policy: str, *args):
    """The rollout seam, storing sample 3 of every group as the rollout worker stores a rollout that
    ran out of context under `policy` (its agent reported AGENT_REWARD)."""
    from stand_ins import SimRollouts

    class Truncating(SimRollouts):
        def shape(self, sample: Sample) -> Sample:
            if sample.sample_index != 3:
                return sample
            cut = truncation(policy, AGENT_REWARD, None)  # type: ignore[arg-type]
            return dataclasses.replace(sample, status="truncated", reward=cut.reward, error=cut.error)

    return Truncating(*args)


@pytest.mark.parametrize("policy", OVERFLOW_POLICIES)
async def test_the_async_loop_goes_on_and_closes_truncated_rollouts_once(policy):
    """mode=async with staleness dropping (η = 1) and seeded latencies: every dispatched rollout
    reaches one terminal state, truncated among them; the truncated rollouts the steps took are
    exactly the ledger's `rollout/truncated` (even the stale ones: truncated wins over expired), and
    the trainer sees them only under train_zero (reward 0) or train_reward (the agent's)."""
    import random

    from orchestrator.loop.async_loop import AsyncLoopSettings, run_async
    from stand_ins import RecordingTrainer, SimReplica, alternating_reward

    store, engine = MemoryStore(), SimReplica()
    rollouts = truncating_rollouts(policy, store, engine, random.Random(7), alternating_reward, 0.05)
    trainer, logger = RecordingTrainer(engine, store), ListLogger()
    rows = [{"input_id": f"p{i}", "prompt": "x"} for i in range(50)]
    parts = LoopParts(prompts=PromptCycle(rows, seed=7), rollouts=rollouts, store=store, trainer=trainer,
                      weights=engine, logger=logger, ledger=RolloutLedger())
    report = await asyncio.wait_for(run_async(parts, AsyncLoopSettings(
        total_steps=4, groups_per_update=2, n=4, sync_every=1, max_staleness=1, on_stale="drop",
        filter_zero_variance=True, drain_timeout_s=10)), timeout=60)
    c = report.counts
    assert report.stopped is None and report.steps == 4 and not parts.ledger.open_rollouts()
    assert c["rollout/dispatched"] == rollouts.dispatched == sum(
        c[f"rollout/{k}"] for k in ("completed", "failed", "filtered", "expired", "truncated"))
    assert c["rollout/truncated"] == sum(m["rollout/step_truncated"] for _, m in logger.steps) >= 4
    trained = [s for _, s in trainer.trained if s.status == "truncated"]
    if policy == "drop":
        assert not trained
    else:
        assert trained and {s.reward for s in trained} == {0.0 if policy == "train_zero" else AGENT_REWARD}
