"""A complete agent for your own task, written with agentcore-rl-toolkit (docs/agents.md: "Train your own agent").

The task: add two numbers. Each dataset row (examples/data/arith/train.jsonl) is
`{"prompt": "What is 17 + 25? ...", "answer": 42}`; the orchestrator (task=custom) sends the row
as it is, plus `_rollout` = {exp_id, input_id, s3_bucket, base_url, model_id, api_key,
max_tokens, temperature, top_p, ...}. The agent asks the policy through `base_url` with the
official `openai` SDK (the `api_key` is the gateway's session token), scores the reply (1.0 when
its last integer equals `answer`) and returns `{"rewards": r}`; the toolkit's
`@rollout_entrypoint` answers the invocation at once and writes the returned dict to
`s3://{s3_bucket}/{exp_id}/{input_id}/{session_id}.json`, where the orchestrator reads it.

The same file runs locally (`rollout.acr.agent_cmd='python examples/agents/arith_agent/app.py'`,
the emulator sets PORT) and as an ACR container on AWS (port 8080). It imports nothing from the
orchestrator.
"""

from __future__ import annotations

import os
import re

from agentcore_rl_toolkit import AgentCoreRLApp
from openai import OpenAI

app = AgentCoreRLApp()
_INT = re.compile(r"-?\d+")


def score(reply: str, answer: int) -> float:
    """1.0 when the last integer in `reply` equals `answer`, else 0.0."""
    numbers = _INT.findall(reply)
    return 1.0 if numbers and int(numbers[-1]) == int(answer) else 0.0


@app.rollout_entrypoint
def rollout(payload: dict) -> dict:
    """One episode: one model call, one reward. Raises (the toolkit then writes its error object,
    and the orchestrator counts the rollout failed) when the row lacks `prompt` or `answer`."""
    spec = payload["_rollout"]
    prompt, answer = str(payload["prompt"]), int(payload["answer"])
    client = OpenAI(base_url=spec["base_url"], api_key=spec["api_key"], max_retries=0, timeout=600)
    reply = client.chat.completions.create(
        model=spec["model_id"], messages=[{"role": "user", "content": prompt}],
        max_tokens=spec.get("max_tokens"), temperature=spec.get("temperature", 1.0), top_p=spec.get("top_p", 1.0))
    return {"rewards": score(reply.choices[0].message.content or "", answer)}


if __name__ == "__main__":
    app.run(port=int(os.environ.get("PORT", "8080")))
