"""An A2A rollout agent written with agentcore-rl-toolkit's `RolloutAgentExecutor`, unchanged, for
the A2A contract tests (run as a script, `stand_ins.TOOLKIT_A2A_AGENT`; not collected). The row's
`behaviour` picks what it does:

- ok: one model call through the gateway (`llm.base_url`, `llm.api_key`), reward 0.75;
- raise: the rollout reports an exception in its dump (attempted, failed);
- setup_fail: setup raises, so the task ends FAILED before the rollout;
- any row with `setup_s`: setup sleeps that long first (a container image being unpacked);
- no_reward: a dump with neither reward nor exception;
- slow: the rollout sleeps `sleep_s`; a CancelTask runs `cleanup`, which writes
  `$A2A_MARKS_DIR/cancelled-<contextId>` (the test reads it).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from agentcore_rl_toolkit.rollout_session.a2a_executor import RolloutAgentExecutor, make_ping_handler
from agentcore_rl_toolkit.rollout_session.wire import RolloutDumpResponse
from bedrock_agentcore.runtime.a2a import serve_a2a

class Behaviour(RolloutAgentExecutor):
    last_context_id = ""

    async def execute(self, context, event_queue):
        self.last_context_id = context.context_id  # for cleanup(), which the toolkit calls without it
        await super().execute(context, event_queue)

    async def cancel(self, context, event_queue):
        self.last_context_id = context.context_id
        await super().cancel(context, event_queue)

    def run_setup(self, task_input: dict) -> None:
        time.sleep(float(task_input.get("setup_s", 0)))
        if task_input.get("behaviour") == "setup_fail":
            raise RuntimeError("setup failed on purpose")

    def run_rollout(self, task_input: dict) -> RolloutDumpResponse:
        behaviour = task_input.get("behaviour")
        if behaviour == "raise":
            return RolloutDumpResponse(task_output=None, reward=None, exception="Traceback ...\nValueError: boom")
        if behaviour == "no_reward":
            return RolloutDumpResponse(task_output={}, reward=None, exception=None)
        if behaviour == "slow":
            time.sleep(float(task_input.get("sleep_s", 30)))
            return RolloutDumpResponse(task_output={}, reward=0.1, exception=None)
        from openai import OpenAI

        llm = task_input["llm"]
        client = OpenAI(base_url=llm["base_url"], api_key=llm["api_key"], max_retries=0, timeout=30)
        out = client.chat.completions.create(model=llm["model"].removeprefix("openai/"),
                                             messages=[{"role": "user", "content": task_input["prompt"]}],
                                             max_tokens=int(llm["max_tokens"]))
        return RolloutDumpResponse(task_output={"text": out.choices[0].message.content}, reward=0.75,
                                   exception=None, metrics={"turns": 1.0})

    def cleanup(self) -> None:
        marks = os.environ.get("A2A_MARKS_DIR")
        if marks:
            (Path(marks) / f"cancelled-{self.last_context_id}").write_text("1")


if __name__ == "__main__":
    executor = Behaviour()
    serve_a2a(executor, port=int(os.environ["A2A_PORT"]), host="127.0.0.1",
              ping_handler=make_ping_handler(executor), log_level="warning")
