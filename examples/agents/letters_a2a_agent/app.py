"""The letters task as an A2A agent: agentcore-rl-toolkit's `RolloutAgentExecutor`, unchanged.

It is what a user's SWE agent looks like to the orchestrator (`rollout.contract=a2a`): one
rollout is one A2A task. The first `message/send` carries `{"task_input": {...}}` (the dataset
row plus `llm`, `sampling_params`, `group_id`); `run_setup` prepares the environment (here: a
seeded, heavy-tailed sleep standing in for a container image pull, median
`LETTERS_SETUP_MEDIAN_S`, default 0) and the toolkit parks the task at `input-required`. The
second message runs `run_rollout`: one model call through the rollout gateway with the official
`openai` SDK (`llm.base_url`, `llm.api_key` = the gateway session token), scored by the letters
reward (examples/agents/letters_agent/reward.py); the toolkit returns the dump `{reward,
task_output, metrics, exception}` as the task's `rollout` artifact.

Invariant: a reward is reported only for a rollout whose model call and scoring succeeded; any
failure there goes into the dump's `exception` (data the orchestrator counts as a failed
rollout, never a reward).

Run: `python examples/agents/letters_a2a_agent/app.py` (port: env A2A_PORT, else 9000 as ACR's
A2A contract fixes; `--port N`). Needs `agentcore-rl-toolkit[a2a-server]` and `openai`.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import random
import sys
import time
import zlib
from pathlib import Path

from agentcore_rl_toolkit.rollout_session.a2a_executor import RolloutAgentExecutor, make_ping_handler
from agentcore_rl_toolkit.rollout_session.exception_utils import exception_to_string
from agentcore_rl_toolkit.rollout_session.wire import RolloutDumpResponse
from bedrock_agentcore.runtime.a2a import serve_a2a

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "letters_agent"))
from reward import score  # noqa: E402  (the letters task's one reward)

logger = logging.getLogger("letters_a2a_agent")

A2A_CONTRACT_PORT = 9000


def setup_time_s(task_input: dict) -> float:
    """Seconds of simulated setup: log-normal with median `LETTERS_SETUP_MEDIAN_S` (0: none) and
    shape `LETTERS_SETUP_SIGMA` (default 1), seeded by the rollout's group and row, so every run
    draws the same delays for the same rollouts."""
    median_s = float(os.environ.get("LETTERS_SETUP_MEDIAN_S", "0"))
    if median_s <= 0:
        return 0.0
    sigma = float(os.environ.get("LETTERS_SETUP_SIGMA", "1.0"))
    key = f"{task_input.get('group_id')}:{task_input.get('prompt')}"
    return median_s * math.exp(sigma * random.Random(zlib.crc32(key.encode())).gauss(0.0, 1.0))


def with_ints(task_input: dict) -> dict:
    """A2A data parts are protobuf Structs, whose numbers are all doubles (`count` 4 arrives as
    4.0): integral numbers of the row become ints again."""
    return {k: int(v) if isinstance(v, float) and v.is_integer() else v for k, v in task_input.items()}


class LettersExecutor(RolloutAgentExecutor):
    """Setup: the simulated environment; rollout: one model call, scored."""

    def run_setup(self, task_input: dict) -> None:
        if "prompt" not in task_input or "llm" not in task_input:
            raise ValueError(f"task_input needs 'prompt' and 'llm', got keys {sorted(task_input)}")
        time.sleep(setup_time_s(task_input))

    def run_rollout(self, task_input: dict) -> RolloutDumpResponse:
        from openai import OpenAI

        llm = task_input["llm"]
        t0 = time.monotonic()
        try:
            client = OpenAI(base_url=llm["base_url"], api_key=llm["api_key"], max_retries=0,
                            timeout=float(llm.get("timeout", 600)))
            out = client.chat.completions.create(
                model=str(llm["model"]).removeprefix("openai/"),  # LiteLLM's provider prefix
                messages=[{"role": "user", "content": str(task_input["prompt"])}],
                temperature=llm.get("temperature"), top_p=llm.get("top_p"),
                max_tokens=int(llm["max_tokens"]) if llm.get("max_tokens") else None)
            text = out.choices[0].message.content or ""
            reward = float(score(with_ints(task_input), text))
        except Exception as exc:  # the rollout was attempted: its failure is data, not a task failure
            logger.exception("rollout failed")
            return RolloutDumpResponse(task_output=None, reward=None, exception=exception_to_string(exc))
        return RolloutDumpResponse(task_output={"completion": text}, reward=reward, exception=None,
                                   metrics={"model_s": time.monotonic() - t0})


def main() -> None:
    p = argparse.ArgumentParser(description="letters task, A2A rollout agent")
    p.add_argument("--port", type=int, default=int(os.environ.get("A2A_PORT", A2A_CONTRACT_PORT)))
    p.add_argument("--host", default=os.environ.get("HOST", "127.0.0.1"))
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    executor = LettersExecutor()
    serve_a2a(executor, port=args.port, host=args.host, ping_handler=make_ping_handler(executor),
              log_level="warning")


if __name__ == "__main__":
    main()
