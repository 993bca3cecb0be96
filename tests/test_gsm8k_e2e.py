"""task=gsm8k end to end on every real part: the main job as a subprocess with the GSM8K agent.

Ray, vLLM (CPU) serving the tiny model, the gateway (tools rendered by the chat template, tool
calls parsed back), the ACR emulator running examples/agents/gsm8k_agent, moto S3, TransferQueue
and the trainer. The tiny model was never taught GSM8K, so rewards are ~0; what is checked is that
the run completes, every rollout reaches the agent's reward and is trained (zero-variance
groups kept), the captured tokens match the trainer's log-probs, and the gateway really served the
calculator tool: each episode's first-turn `usage.prompt_tokens` (logged by the agent) equals the
tokenizer's count of the system prompt + question rendered WITH the tools block, which is ~400
tokens longer than without it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DATA = "examples/data/gsm8k/test.jsonl"  # the in-repository sample (128 rows)
EPISODE = re.compile(r"input_id=(\S+): gsm8k episode turns=(\d+) tool_calls=(\d+) prompt_tokens=([\d,]+) end=(\w+)")


@pytest.mark.timeout(600)  # ~60-90 s on an idle 2-core machine; Ray + vLLM startup dominates
def test_gsm8k_task_runs_end_to_end_with_the_tool_agent(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator.main", "task=gsm8k", "trainer.total_steps=2", f"task.data_path={DATA}",
         "task.num_prompts=16", "rollout.batch_size=2", "rollout.n=2", "rollout.max_tokens=32",
         "rollout.timeout_s=60", "algorithm.filter_zero_variance=false", "logger=console", f"run_dir={run_dir}"],
        cwd=REPO, capture_output=True, text=True, timeout=570, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rollout/dispatched"] == 2 * 2 * 2
    assert summary["rollout/failed"] == 0, proc.stdout[-4000:]  # every episode wrote its reward
    # zero-variance groups are kept (rewards are ~0), so the trainer consumes every tool-prompt sample;
    # sync mode is on-policy: the recorded log-probs match the trainer's only if tokens were captured exactly
    assert summary["rollout/completed"] == 8
    assert all(s["perf/trained_tokens"] > 0 for s in steps)
    assert all(abs(s["rollout_corr/log_ppl_abs_diff"]) < 1e-3 for s in steps)

    log = (run_dir / "logs" / "emulator.log").read_text()
    episodes = EPISODE.findall(log)
    assert len(episodes) == summary["rollout/dispatched"], log[-3000:]

    from transformers import AutoTokenizer

    from workers.core.tasks import gsm8k

    sys.path.insert(0, str(REPO / "examples/agents/gsm8k_agent"))
    from calculator import TOOL_SPEC
    from tool_loop import SYSTEM_PROMPT

    from workers.embedded.tiny_model import ensure_tiny_model

    tok = AutoTokenizer.from_pretrained(str(ensure_tiny_model()))  # the run's model (model.path unset)
    questions = {r["input_id"]: r["question"] for r in gsm8k.load_rows(DATA, None, seed=0, max_turns=1)}

    def prompt_len(question: str, tools: list | None) -> int:
        msgs = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
        ids = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=True)
        return len(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    for input_id, turns, _calls, prompt_tokens, end in episodes:
        first = int(prompt_tokens.split(",")[0])
        with_tools, without = prompt_len(questions[input_id], [TOOL_SPEC]), prompt_len(questions[input_id], None)
        assert first == with_tools > without + 300, (input_id, first, with_tools, without)
        assert end in ("answer", "max_turns", "context_exceeded") and int(turns) >= 1
