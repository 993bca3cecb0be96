"""Evaluation: the pass@k estimator against enumeration, held-out splits, the summary's accounting,
validation in both loops (simulated parts at the seams), and the payload without a served model."""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import statistics
from math import comb

import pytest

from orchestrator.loop.batching import RolloutLedger
from orchestrator.loop.async_loop import AsyncLoopSettings, run_async
from orchestrator.loop.common import LoopParts
from orchestrator.loop.sync_loop import SyncLoopSettings, run_sync
from orchestrator.loop.prompts import PromptCycle
from orchestrator.loop.validation import (EvalRecord, EvalSettings, ValidationLane, Validator, evaluate_rows, summarize,
                                     val_metrics)
from stand_ins import ListLogger, MemoryStore, RecordingTrainer, SimReplica, SimRollouts, alternating_reward
from workers.core.passk import mean_and_sem, mean_pass_at_k, pass_at_k, percentile
from workers.core.tasks import letters
from workers.core.types import RolloutRequest
from workers.rollout.worker import RolloutSettings, build_payload
from workers.core.types import RolloutResult, SampleInfo

# --- pass@k ------------------------------------------------------------------------------------------


def test_pass_at_k_equals_the_fraction_of_k_subsets_with_a_correct_sample():
    """Chen et al. 2021 eq. 1 against brute force: enumerate every k-subset of n labelled samples."""
    rng = random.Random(11)
    for _ in range(200):
        n = rng.randint(1, 9)
        labels = [rng.random() < rng.random() for _ in range(n)]
        c = sum(labels)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(range(n), k))
            brute = sum(any(labels[i] for i in s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12)
            assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k), abs=1e-12)


def test_pass_at_k_edges_and_bad_arguments():
    assert pass_at_k(5, 0, 3) == 0.0 and pass_at_k(5, 5, 1) == 1.0
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the fraction correct
    for bad in [(3, 4, 1), (3, 1, 0), (3, 1, 4), (3, -1, 1)]:
        with pytest.raises(ValueError):
            pass_at_k(*bad)
    # prompts with fewer samples than k are left out; none left gives nan
    assert mean_pass_at_k([(4, 2), (1, 1)], 2) == pytest.approx(1 - comb(2, 2) / comb(4, 2))
    assert math.isnan(mean_pass_at_k([(1, 1)], 2))


def test_mean_sem_and_percentile_match_the_statistics_module():
    rng = random.Random(5)
    xs = [rng.random() for _ in range(37)]
    m, sem = mean_and_sem(xs)
    assert m == pytest.approx(statistics.fmean(xs))
    assert sem == pytest.approx(statistics.stdev(xs) / math.sqrt(len(xs)))
    assert percentile(xs, 50) == pytest.approx(statistics.median(xs))
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 99) == pytest.approx(4.96)  # 4 + 0.96 * (5 - 4)
    assert all(math.isnan(v) for v in (*mean_and_sem([]), percentile([], 50)))


# --- splits ------------------------------------------------------------------------------------------


def test_letters_test_prompts_are_never_drawn_for_training():
    """Held-out pairs: whatever the seeds, no train row shares a (letter, count) with a test row,
    yet every letter and every count is trained on."""
    test_pairs = set(letters.split_pairs("test"))
    assert len(test_pairs) == len(letters.LETTERS)  # one held-out count per letter
    assert not test_pairs & set(letters.split_pairs("train"))
    for seed in range(5):
        train = letters.make_rows(600, seed, "train")
        test = letters.make_rows(100, seed, "test")
        assert not {(r["letter"], r["count"]) for r in train} & {(r["letter"], r["count"]) for r in test}
        assert {(r["letter"], r["count"]) for r in test} <= test_pairs
        assert {r["letter"] for r in train} == set(letters.LETTERS)
        assert {r["count"] for r in train} == set(range(letters.MIN_COUNT, letters.MAX_COUNT + 1))
        assert not {r["input_id"] for r in train} & {r["input_id"] for r in test}
    with pytest.raises(ValueError, match="split"):
        letters.make_rows(3, 0, "val")


def test_task_registry_reads_the_gsm8k_test_file_for_the_test_split():
    from orchestrator.config import TaskConfig
    from orchestrator.tasks import TASKS

    t = TaskConfig(name="gsm8k", data_path="examples/data/gsm8k/train.jsonl", num_prompts=None,
                   val_data_path="examples/data/gsm8k/test.jsonl", val_num_prompts=None, max_turns=2)
    train, test = TASKS["gsm8k"].rows(t, "train"), TASKS["gsm8k"].rows(t, "test")
    assert len(train) == 256 and len(test) == 128  # the shipped sample's sizes
    assert all(r["input_id"].startswith("gsm8k-test-") for r in test)
    assert not {r["question"] for r in train} & {r["question"] for r in test}


# --- summary -----------------------------------------------------------------------------------------


def rec(p, s, reward, reason=None, latency_s=1.0):
    return EvalRecord(p, s, f"p{p}", "completed" if reason is None else "failed", reward, reason, reason, 5, 3, 1,
                      latency_s, 0)


def test_summary_accounts_for_every_rollout_and_never_scores_a_failure():
    records = [rec(0, 0, 1.0), rec(0, 1, 0.0), rec(0, 2, None, "timeout"),
               rec(1, 0, 1.0), rec(1, 1, 1.0), rec(1, 2, None, "bad_result")]
    s = summarize(records, n=3, pass_threshold=1.0, wall_s=2.0)
    assert s["rollouts"] == 6 == s["completed"] + s["failed"] and s["failed"] == 2
    assert s["failed/timeout"] == 1 and s["failed/bad_result"] == 1
    assert s["reward/mean"] == pytest.approx(0.75)  # failures are not zeros: (1 + 0 + 1 + 1) / 4
    # pass@1 per prompt over its 2 completed samples: 1/2 and 1 -> 0.75; pass@2: 1 and 1
    assert s["pass@1"] == pytest.approx(0.75) and s["pass@2"] == pytest.approx(1.0)
    assert math.isnan(s["pass@3"])  # no prompt has 3 completed samples
    assert s["tokens_out_per_s"] == pytest.approx(6 * 3 / 2.0) and s["rollouts_per_s"] == pytest.approx(3.0)
    assert set(val_metrics(s, 7)) >= {"val/reward/mean", "val/pass@1", "val/pass@3", "val/policy_version"}


# --- validation in the loops (simulated parts) -----------------------------------------------------------


class VersionedPool:
    """An evaluation pool seam: reward = min(1, 0.1 x the replica's version), real RolloutResults;
    records what it ran and the partitions it was handed."""

    def __init__(self, engine, store=None):
        self.engine, self.store, self.input_ids, self.partitions = engine, store, [], []

    async def run_all(self, reqs, partition):
        await asyncio.sleep(0.002)
        self.partitions.append(partition)
        self.input_ids += [r.input_id for r in reqs]
        v = self.engine.served
        return [RolloutResult(SampleInfo(f"v-{r.group_id}-{r.sample_index}", r.group_id, r.input_id, r.sample_index,
                                         "completed", min(1.0, 0.1 * v), 0.01, num_generated_tokens=2, min_version=v,
                                         max_version=v)) for r in reqs]


def validator(pool, store, **kw):
    rows = letters.make_rows(6, 0, "test")
    return Validator(pool=pool, store=store, rows=rows, settings=EvalSettings(n=2), clock=asyncio.get_running_loop().time,
                     **{"test_freq": 2, "val_before_train": True, **kw})


async def test_sync_loop_validates_before_training_and_every_test_freq_steps():
    store, engine, logger = MemoryStore(), SimReplica(), ListLogger()
    rows = [{"input_id": f"p{i}", "prompt": "x"} for i in range(10)]
    val_store = MemoryStore()
    v = validator(VersionedPool(engine), val_store)
    parts = LoopParts(prompts=PromptCycle(rows, seed=0),
                      rollouts=SimRollouts(store, engine, random.Random(0), alternating_reward, 0.001), store=store,
                      trainer=RecordingTrainer(engine, store), weights=engine, logger=logger, ledger=RolloutLedger(),
                      validator=v)
    await run_sync(parts, SyncLoopSettings(total_steps=5, batch_size=2, n=4, sync_every=1, filter_zero_variance=False))
    val = [(s, m["val/policy_version"], round(m["val/reward/mean"], 9)) for s, m in logger.steps if "val/reward/mean" in m]
    # step 0 before training, then steps 2 and 4, and the last step 5; each on the weights just synced
    assert val == [(0, 0.0, 0.0), (2, 2.0, 0.2), (4, 4.0, 0.4), (5, 5.0, 0.5)]
    assert v.initial_final() == pytest.approx({"val/reward/initial": 0.0, "val/reward/final": 0.5,
                                               "val/policy_version/initial": 0.0, "val/policy_version/final": 5.0})
    assert val_store.cleared == ["val-1", "val-2", "val-3", "val-4"]  # nothing left in the buffer
    assert logger.steps[0] == (0, logger.steps[0][1]) and "reward/mean" not in logger.steps[0][1]


async def test_async_validation_lane_never_feeds_the_trainer_and_takes_no_admission_slot():
    store, engine, logger = MemoryStore(), SimReplica(), ListLogger()
    rows = [{"input_id": f"p{i}", "prompt": "x"} for i in range(50)]
    pool = VersionedPool(engine)
    trainer = RecordingTrainer(engine, store)
    rollouts = SimRollouts(store, engine, random.Random(1), alternating_reward, 0.005)
    parts = LoopParts(prompts=PromptCycle(rows, seed=0), rollouts=rollouts, store=store, trainer=trainer,
                      weights=engine, logger=logger, ledger=RolloutLedger(), validator=validator(pool, MemoryStore()))
    report = await asyncio.wait_for(run_async(parts, AsyncLoopSettings(
        total_steps=6, groups_per_update=2, n=4, sync_every=1, max_staleness=1, on_stale="drop",
        filter_zero_variance=False, drain_timeout_s=10)), timeout=60)
    val_ids = set(pool.input_ids)
    assert val_ids and not val_ids & {s.input_id for _, s in trainer.trained}
    # the ledger (admission, staleness) saw only training rollouts
    assert report.counts["rollout/dispatched"] == rollouts.dispatched
    versions = [m["val/policy_version"] for _, m in logger.steps if "val/policy_version" in m]
    assert versions[0] == 0.0 and versions[-1] == 6.0  # the first and the final weights are measured
    assert logger.steps[-1][0] == 6 and logger.steps[-1][1]["val/reward/mean"] == pytest.approx(0.6)


async def test_validation_lane_runs_the_newest_due_version_after_the_one_in_flight():
    engine = SimReplica()
    v = validator(VersionedPool(engine), None, test_freq=1, val_before_train=False)
    lane = ValidationLane(v, total_steps=3)
    for step in (1, 2, 3):  # three due versions while the first still runs: 2 is replaced by 3
        engine.served = step
        lane.on_version(step, step)
    await lane.finish()
    assert [ver for ver, _ in v.history] == [1, 3]


async def test_evaluate_rows_keeps_failures_apart_and_clears_its_partition():
    class Flaky:
        async def run_all(self, reqs, partition):
            return [RolloutResult(SampleInfo(f"s{r.group_id}{r.sample_index}", r.group_id, r.input_id, r.sample_index,
                                             "failed" if r.sample_index == 0 else "completed",
                                             None if r.sample_index == 0 else 1.0, 0.1, "boom"),
                                  reason="timeout" if r.sample_index == 0 else None) for r in reqs]

    store = MemoryStore()
    rows = letters.make_rows(5, 1, "test")
    records, _ = await evaluate_rows(Flaky(), store, rows, EvalSettings(n=3, max_prompts=4), "eval",
                                     asyncio.get_running_loop().time)
    assert len(records) == 4 * 3 and store.cleared == ["eval"]
    assert [r.input_id for r in records[::3]] == [r["input_id"] for r in rows[:4]]
    s = summarize(records, n=3, pass_threshold=1.0, wall_s=1.0)
    assert (s["completed"], s["failed"], s["failed/timeout"], s["reward/mean"]) == (8, 4, 4, 1.0)


# --- no served model ------------------------------------------------------------------------------------


def test_payload_without_a_served_model_names_no_model_endpoint():
    from orchestrator.config import EvalConfig, eval_rollout_settings

    base = RolloutSettings(exp_id="exp-r", agent_runtime_arn="arn", qualifier=None, s3_bucket="b",
                           gateway_base_url="http://127.0.0.1:1/v1", model_id="policy", max_tokens=8,
                           temperature=1.0, top_p=1.0, timeout_s=5.0, max_context_tokens=64)
    req = RolloutRequest(group_id=0, input_id="i0", sample_index=0, row={"input_id": "i0", "prompt": "x"})
    served = build_payload(req, eval_rollout_settings(EvalConfig(temperature=0.6), base), "sid", "tok")["_rollout"]
    assert served["base_url"] == "http://127.0.0.1:1/v1" and served["api_key"] == "tok"
    assert served["temperature"] == 0.6
    own = build_payload(req, eval_rollout_settings(EvalConfig(serve_model=False), base), "sid", "")["_rollout"]
    assert not {"base_url", "api_key", "model_id"} & own.keys()
    assert own["s3_bucket"] == "b" and own["session_id"] == "sid"


# --- config ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, key", [
    (["eval.n=0"], "eval.n"),
    (["eval.temperature=0"], "eval.temperature"),
    (["eval.serve_model=false"], "eval.serve_model"),  # training needs the served policy
    (["task.split=val"], "task.split"),
    (["task=gsm8k", "trainer.test_freq=5", "task.val_data_path=null"], "task.val_data_path"),
    (["+rollout.acr.faults={crash: 2}"], "rollout.acr.faults"),
])
def test_bad_eval_value_names_the_key(overrides, key):
    from orchestrator.config import ConfigError
    from stand_ins import compose_config

    with pytest.raises(ConfigError, match=rf"^{key.replace('.', chr(92) + '.')}"):
        compose_config(overrides)


def test_mode_eval_composes_with_its_outputs_settings():
    from stand_ins import compose_config

    cfg = compose_config(["mode=eval", "task=gsm8k", "task.split=test", "eval.n=4", "eval.temperature=0.6",
                          "eval.serve_model=false"])
    assert (cfg.mode.name, cfg.task.split, cfg.eval.n, cfg.eval.temperature) == ("eval", "test", 4, 0.6)
    assert cfg.task.val_data_path == "examples/data/gsm8k/test.jsonl"


def test_an_agent_without_a_served_model_uses_its_own(monkeypatch):
    """The example agents' side of eval.serve_model=false: no base_url in `_rollout` -> the model
    endpoint the agent is deployed with (env AGENT_MODEL_*); neither -> a clear error."""
    from stand_ins import REPO, load_module

    contract = load_module(REPO / "examples/agents/agent_common/rollout_contract.py", "agent_contract_under_test")
    payload = {"prompt": "x", "_rollout": {"exp_id": "e", "input_id": "i", "s3_bucket": "b", "temperature": 0.5}}
    for name in contract.MODEL_FIELDS_ENV.values():
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="base_url"):
        contract.RolloutSpec.parse(payload)
    monkeypatch.setenv("AGENT_MODEL_BASE_URL", "http://prod.example/v1")
    monkeypatch.setenv("AGENT_MODEL_ID", "prod-model")
    monkeypatch.setenv("AGENT_MODEL_API_KEY", "k")
    spec = contract.RolloutSpec.parse(payload)
    assert (spec.base_url, spec.model_id, spec.api_key, spec.temperature) == ("http://prod.example/v1", "prod-model",
                                                                              "k", 0.5)
    served = {**payload["_rollout"], "base_url": "http://gw/v1", "model_id": "policy", "api_key": "tok"}
    assert contract.RolloutSpec.parse({**payload, "_rollout": served}).base_url == "http://gw/v1"  # the gateway wins


def test_console_line_shows_the_validation_and_the_version_it_measured():
    import io

    from orchestrator.watch.progress import ProgressSink

    out = io.StringIO()
    ProgressSink(60, out, tty=False).log(0, {"val/reward/mean": 0.154, "val/policy_version": 0.0})
    assert out.getvalue() == "[validation @ step 0] val=0.154@v0\n"
