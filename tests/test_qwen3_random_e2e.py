"""model=qwen3_random end to end: the main job with the real Qwen3 tokenizer and chat template.

The random-init small Qwen3 (workers/embedded/qwen3_random.py) serves the GSM8K tool agent through
vLLM CPU, the gateway, the ACR emulator and the trainer (+experiment=qwen3_random_gsm8k). Checked:
the run exits 0; the tools are rendered by the real Qwen3 template (each episode's first-turn
prompt is the Qwen3 tokenizer's count of the prompt with the tools block); sync mode is on-policy,
so the recorded log-probs match the trainer's (|log-ppl gap| < 1e-3) only if the tokens over the
real 151,669-token vocabulary were captured exactly; every dispatched rollout reaches one terminal
state (dispatched = completed + failed + filtered + expired).
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
DATA = "examples/data/gsm8k/test.jsonl"
EPISODE = re.compile(r"input_id=(\S+): gsm8k episode turns=(\d+) tool_calls=(\d+) prompt_tokens=([\d,]+) end=(\w+)")


@pytest.mark.timeout(900)
def test_qwen3_random_runs_the_gsm8k_agent_with_the_real_template(tmp_path, real_tokenizers):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator.main", "+experiment=qwen3_random_gsm8k", "trainer.total_steps=2",
         f"task.data_path={DATA}", "task.num_prompts=8", "rollout.batch_size=2", "rollout.n=2",
         "rollout.max_tokens=24", "rollout.temperature=0.7", "rollout.timeout_s=120", "logger=console",
         f"run_dir={run_dir}"],
        cwd=REPO, capture_output=True, text=True, timeout=870, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    summary = json.loads((run_dir / "summary.json").read_text())
    terminal = sum(summary[f"rollout/{k}"] for k in ("completed", "failed", "filtered", "expired"))
    assert summary["rollout/dispatched"] == terminal == 2 * 2 * 2
    assert summary["rollout/completed"] == 8, proc.stdout[-4000:]
    # on-policy at T=0.7: the trainer scores the tempered distribution the engine sampled from
    assert all(abs(s["rollout_corr/log_ppl_abs_diff"]) < 1e-3 for s in steps), steps

    from transformers import AutoTokenizer

    from workers.core.tasks import gsm8k
    from workers.embedded.real_tokenizers import tokenizer_dir

    sys.path.insert(0, str(REPO / "examples/agents/gsm8k_agent"))
    from calculator import TOOL_SPEC
    from tool_loop import SYSTEM_PROMPT

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir("qwen3")))
    questions = {r["input_id"]: r["question"] for r in gsm8k.load_rows(DATA, None, seed=0, max_turns=1)}
    episodes = EPISODE.findall((run_dir / "logs" / "emulator.log").read_text())
    assert len(episodes) == summary["rollout/dispatched"]
    for input_id, _turns, _calls, prompt_tokens, _end in episodes:
        msgs = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": questions[input_id]}]
        text = tok.apply_chat_template(msgs, tools=[TOOL_SPEC], add_generation_prompt=True, tokenize=False)
        assert "<tools>" in text and int(prompt_tokens.split(",")[0]) == len(tok.encode(text, add_special_tokens=False))
