"""mode=eval end to end, as a subprocess of the real main job: the tiny model served through the
gateway and vLLM (CPU) on a few held-out prompts, and an agent with its own model (no gateway,
no engine) under injected ACR faults, where every rollout must still be accounted for."""

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parent.parent


def run_eval(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "orchestrator.main", "mode=eval", "logger=console",
                           f"run_dir={run_dir}", *args], cwd=REPO, capture_output=True, text=True, timeout=560,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


def outputs(run_dir: Path) -> tuple[list[dict], dict]:
    records = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    return records, json.loads((run_dir / "eval_summary.json").read_text())


@pytest.mark.timeout(600)
def test_eval_scores_the_served_tiny_model_on_held_out_prompts(tmp_path):
    run_dir = tmp_path / "eval"
    proc = run_eval(run_dir, "task.split=test", "eval.max_prompts=4", "eval.n=3", "eval.progress=lines")
    records, s = outputs(run_dir)
    assert len(records) == 4 * 3 == s["rollouts"] == s["completed"] + s["failed"]
    assert s["failed"] == 0 and s["acr/sessions_open_at_exit"] == 0
    assert {r["input_id"] for r in records} <= {f"letters-test-0-{i}" for i in range(4)}
    assert all(r["tokens_out"] > 0 and r["turns"] == 1 and r["policy_version"] == 0 for r in records)
    assert 0.0 <= s["reward/mean"] <= 1.0 and {"pass@1", "pass@2", "pass@3", "latency_s/p99"} <= s.keys()
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "weights").exists()  # no trainer
    assert "[eval] 12/12 done" in proc.stderr


@pytest.mark.timeout(600)
def test_eval_without_a_served_model_accounts_for_every_rollout_under_faults(tmp_path):
    run_dir = tmp_path / "own-model"
    run_eval(run_dir, "eval.serve_model=false", "eval.n=4", "eval.max_prompts=25", "rollout.timeout_s=6",
             f"rollout.acr.agent_cmd='{sys.executable} -m workers.embedded.stub_agent'",
             "+rollout.acr.faults={crash: 0.05, no_result: 0.05, malformed_result: 0.05, throttle: 0.05, seed: 3}")
    records, s = outputs(run_dir)
    assert len(records) == 100 == s["rollouts"] == s["completed"] + s["failed"]
    assert s["failed"] == sum(v for k, v in s.items() if k.startswith("failed/"))
    assert s["failed"] > 0 and s["completed"] > 0  # the agent faults fail rollouts; throttling is retried
    assert all(r["reward"] is None for r in records if r["status"] == "failed")  # never a silent 0
    assert all(r["tokens_out"] == 0 and r["policy_version"] is None for r in records)  # no gateway recorded
    assert s["acr/sessions_open_at_exit"] == 0
    started = json.loads((run_dir / "pids.json").read_text())
    assert not [p for p in started.values() if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
