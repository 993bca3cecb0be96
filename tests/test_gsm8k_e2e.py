"""task=gsm8k end to end on every real part, on model=qwen3_random: the main job as a subprocess with
the GSM8K tool agent and the real Qwen3 tokenizer and chat template.

Ray, vLLM (CPU) serving the random-init small Qwen3 (workers/embedded/qwen3_random.py; the embedded
tiny model when the real-tokenizer cache cannot be had, so the GSM8K path is still run), the gateway
(tools rendered by the chat template, tool calls parsed back), the ACR emulator running
examples/agents/gsm8k_agent, moto S3, TransferQueue and the trainer (+experiment=qwen3_random_gsm8k).
Random weights earn reward 0, so zero-variance groups are kept. Checked: the run completes, every
dispatched rollout reaches one terminal state and every one is completed and trained; sync mode is
on-policy at T=0.7, so the recorded log-probs match the trainer's (|log-ppl gap| < 1e-3) only if the
tokens over the real 151,669-token vocabulary were captured exactly; the gateway really served the
calculator tool through the real template: each episode's first-turn `usage.prompt_tokens` (logged
by the agent) equals the run tokenizer's count of the system prompt + question rendered WITH the
tools block (`<tools>`), which is well over 100 tokens longer than without it.
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


@pytest.fixture
def run_model(request) -> tuple[list[str], str]:
    """(overrides, tokenizer dir) of the run: model=qwen3_random with the real Qwen3 template when the
    real-tokenizer cache is there or can be fetched, else the embedded tiny model."""
    try:
        request.getfixturevalue("real_tokenizers")
    except pytest.skip.Exception as why:  # no npm / registry: the GSM8K path still runs, on the tiny model
        print(f"model=qwen3_random unavailable ({why}); running task=gsm8k on the tiny model")
        from workers.embedded.tiny_model import ensure_tiny_model

        return ["task=gsm8k", "algorithm.filter_zero_variance=false"], str(ensure_tiny_model())
    from workers.embedded.real_tokenizers import tokenizer_dir

    return ["+experiment=qwen3_random_gsm8k"], str(tokenizer_dir("qwen3"))


@pytest.mark.timeout(900)  # ~60-90 s on an idle 2-core machine; Ray + vLLM startup dominates
def test_gsm8k_task_runs_end_to_end_with_the_tool_agent_and_the_real_template(tmp_path, run_model):
    overrides, tokenizer = run_model
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator.main", *overrides, "trainer.total_steps=2", f"task.data_path={DATA}",
         "task.num_prompts=8", "rollout.batch_size=2", "rollout.n=2", "rollout.max_tokens=24",
         "rollout.temperature=0.7", "rollout.timeout_s=120", "logger=console", f"run_dir={run_dir}"],
        cwd=REPO, capture_output=True, text=True, timeout=870, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    summary = json.loads((run_dir / "summary.json").read_text())
    terminal = sum(summary[f"rollout/{k}"] for k in ("completed", "failed", "filtered", "expired", "truncated"))
    assert summary["rollout/dispatched"] == terminal == 2 * 2 * 2
    assert summary["rollout/failed"] == 0, proc.stdout[-4000:]  # every episode wrote its reward
    # zero-variance groups are kept (rewards are ~0), so the trainer consumes every tool-prompt sample;
    # sync mode is on-policy at T=0.7: the trainer scores the tempered distribution the engine sampled
    # from, and the recorded log-probs match its recompute only if tokens were captured exactly
    assert summary["rollout/completed"] + summary["rollout/truncated"] == 8  # truncated: trained at reward 0
    assert all(s["perf/trained_tokens"] > 0 for s in steps)
    assert all(abs(s["rollout_corr/log_ppl_abs_diff"]) < 1e-3 for s in steps), steps

    log = (run_dir / "logs" / "emulator.log").read_text()
    episodes = EPISODE.findall(log)
    assert len(episodes) == summary["rollout/dispatched"], log[-3000:]

    from transformers import AutoTokenizer

    from workers.core.tasks import gsm8k

    sys.path.insert(0, str(REPO / "examples/agents/gsm8k_agent"))
    from calculator import TOOL_SPEC
    from tool_loop import SYSTEM_PROMPT

    tok = AutoTokenizer.from_pretrained(tokenizer)  # the run's tokenizer and chat template
    questions = {r["input_id"]: r["question"] for r in gsm8k.load_rows(DATA, None, seed=0, max_turns=1)}

    def rendered(question: str, tools: list | None) -> str:
        msgs = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
        return tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False)

    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False))

    for input_id, turns, _calls, prompt_tokens, end in episodes:
        first = int(prompt_tokens.split(",")[0])
        with_tools = rendered(questions[input_id], [TOOL_SPEC])
        assert "<tools>" in with_tools, with_tools[:500]  # the template's own tools block
        without = count(rendered(questions[input_id], None))
        assert first == count(with_tools) > without + 100, (input_id, first, count(with_tools), without)
        assert end in ("answer", "max_turns", "context_exceeded") and int(turns) >= 1
