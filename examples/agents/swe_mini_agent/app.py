"""The swe_mini coding task as an A2A agent: agentcore-rl-toolkit's `RolloutAgentExecutor`, unchanged,
shaped like the toolkit's SWE example (setup a container, then a tool loop, reward = the tests).

One rollout is one A2A task on one ACR session. `run_setup` writes the row's repository into the
session's sandbox through ACR's command API (`InvokeAgentRuntimeCommand` on the session the
request came in on; workspace.py) and then waits a seeded, heavy-tailed time standing in for a
container image pull (a `sleep` in the sandbox: log-normal, median `SWE_MINI_SETUP_MEDIAN_S`
seconds, default 2, shape `SWE_MINI_SETUP_SIGMA`, default 1: the slowest 1 % take ten times the
median). `run_rollout` acts by `SWE_MINI_AGENT_MODE`:
- `model` (default): the tool loop of episode.py through the rollout gateway with the official
  `openai` SDK (`llm.base_url`, `llm.api_key` = the gateway session token);
- `oracle`: writes the row's gold `patch` (reward 1 on every row);
- `noop`: changes nothing (reward 0 on every row);
then runs the row's tests once more in its sandbox (what the model saw: `episode_tests_passed`,
never the reward) and **grades in a clean second sandbox** (agent_common/grading.py): the episode's
changes as a diff, applied only to the row's `editable` source (tests and test config dropped and
flagged) in a fresh session of the same runtime, the row's tests plus its out-of-process `checks`
run there: reward 1.0 when all pass, 0.0 otherwise. The dump's metrics say what the episode did
(turns, tool calls), `grading_s` (the grading span) and the reward-hacking flags
(`hacking/protected_paths`, `hacking/outside_scope`, `hacking/episode_vs_graded`); one log line per
rollout (`input_id=...: swe_mini episode ...`) too.

The runtime's ARN (for the command API) comes from `AGENT_RUNTIME_ARN`, which the local emulator
sets; on ACR set it in the runtime's environment variables, and give the runtime's role
`bedrock-agentcore:InvokeAgentRuntimeCommand` on itself.

Invariant: a reward is reported only after the clean grading gave a verdict; a failure of the model
call, of the command API, or of the grading (`GradingFailed`: grading_unstartable, grading_timeout,
grading_no_verdict) goes into the dump's `exception` (a failed rollout, never a reward),
and a setup that cannot write the repository fails the task (`setup_failed`).

Run: `python examples/agents/swe_mini_agent/app.py` (port: env A2A_PORT, else 9000; `--port N`).
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
from bedrock_agentcore.runtime.context import BedrockAgentCoreContext

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # this agent's modules and examples/agents/agent_common
from agent_common.grading import Check, GradeSpec, diff_files, grade, snapshot  # noqa: E402
from agent_common.sandbox import SandboxClient  # noqa: E402
from episode import Episode, Tools, run_episode  # noqa: E402
from workspace import REPO_DIR, Workspace  # noqa: E402

logger = logging.getLogger("swe_mini_agent")

A2A_CONTRACT_PORT = 9000
MODES = ("model", "oracle", "noop")


def setup_time_s(task_input: dict) -> float:
    """Seconds of simulated image pull, seeded by the rollout's group and row (see the module docstring)."""
    median_s = float(os.environ.get("SWE_MINI_SETUP_MEDIAN_S", "2"))
    if median_s <= 0:
        return 0.0
    sigma = float(os.environ.get("SWE_MINI_SETUP_SIGMA", "1.0"))
    key = f"{task_input.get('group_id')}:{task_input.get('input_id')}"
    return median_s * math.exp(sigma * random.Random(zlib.crc32(key.encode())).gauss(0.0, 1.0))


def grade_spec(task_input: dict) -> GradeSpec:
    """The clean grading of a swe_mini row: its repository, test command, editable source (`editable`)
    and out-of-process checks (`checks`, hidden inputs included); this agent's interpreter runs them."""
    return GradeSpec(files=task_input["repo"], test_cmd=str(task_input["test_cmd"]),
                     editable=tuple(task_input["editable"]), checks=tuple(Check.parse(c) for c in task_input["checks"]),
                     python=sys.executable)


def agent_mode() -> str:
    mode = os.environ.get("SWE_MINI_AGENT_MODE", "model")
    if mode not in MODES:
        raise ValueError(f"SWE_MINI_AGENT_MODE must be one of {list(MODES)}, got {mode!r}")
    return mode


class SweMiniExecutor(RolloutAgentExecutor):
    """Setup: the repository in the sandbox plus the image-pull delay; rollout: the mode's edits, then the tests."""

    def __init__(self) -> None:
        super().__init__()
        self.mode = agent_mode()
        arn = os.environ.get("AGENT_RUNTIME_ARN")
        if not arn:
            raise RuntimeError("AGENT_RUNTIME_ARN is not set: the agent needs its runtime's ARN for ACR's command API")
        self.sandboxes = SandboxClient(arn)

    def _workspace(self) -> Workspace:
        sid = BedrockAgentCoreContext.get_session_id()
        if not sid:
            raise RuntimeError("no runtime session id on this request (X-Amzn-Bedrock-AgentCore-Runtime-Session-Id)")
        return Workspace(self.sandboxes.attach(sid))

    def run_setup(self, task_input: dict) -> None:
        missing = [k for k in ("repo", "test_cmd", "prompt", "llm") if k not in task_input]
        if missing:
            raise ValueError(f"task_input lacks {missing} (a task=swe_mini row plus the orchestrator's llm)")
        ws = self._workspace()
        ws.unpack(task_input["repo"])
        delay = setup_time_s(task_input)
        if delay > 0:
            ws.busy(delay)

    def run_rollout(self, task_input: dict) -> RolloutDumpResponse:
        t0 = time.monotonic()
        try:
            ws = self._workspace()
            tools = Tools(ws, str(task_input["test_cmd"]))
            ep = self._act(task_input, ws, tools)
            episode = ws.run_tests(tools.test_cmd)  # the model's view; never the reward
            diff = diff_files(task_input["repo"], snapshot(ws.sandbox, REPO_DIR, python=sys.executable))
            graded = grade(self.sandboxes, grade_spec(task_input), diff)
        except Exception as exc:  # attempted: its failure is data (GradingFailed: its reason), never a reward
            logger.exception("rollout failed")
            return RolloutDumpResponse(task_output=None, reward=None, exception=exception_to_string(exc))
        s = graded.scope
        logger.warning("input_id=%s: swe_mini episode mode=%s turns=%d tool_calls=%d bad_tool_calls=%d "
                       "prompt_tokens=%s end=%s reward=%s episode_tests=%s protected=%s outside=%s grading_s=%.2f",
                       task_input.get("input_id"), self.mode, ep.num_turns, ep.num_tool_calls, ep.num_bad_tool_calls,
                       ",".join(str(t) for t in ep.prompt_tokens), ep.end, graded.reward, episode.passed,
                       ",".join(s.protected) or "-", ",".join((*s.outside, *s.reaches_outside)) or "-",
                       graded.grading_s)
        return RolloutDumpResponse(
            task_output={"tests_passed": graded.passed, "episode_tests_passed": episode.passed, "end": ep.end,
                         "mode": self.mode, "applied": sorted(s.applied), "protected": list(s.protected),
                         "outside": list(s.outside), "reaches_outside": list(s.reaches_outside),
                         "check_notes": list(graded.check_notes)},
            reward=graded.reward, exception=None,
            metrics={"turns": ep.num_turns, "tool_calls": ep.num_tool_calls, "bad_tool_calls": ep.num_bad_tool_calls,
                     "rollout_s": time.monotonic() - t0, **graded.metrics(episode_passed=episode.passed)})

    def _act(self, task_input: dict, ws: Workspace, tools: Tools) -> Episode:
        if self.mode == "oracle":
            for path, text in task_input["patch"].items():
                ws.write_file(path, text)
            return Episode(end="solved")
        if self.mode == "noop":
            return Episode(end="max_turns")
        from openai import OpenAI

        llm = task_input["llm"]
        client = OpenAI(base_url=llm["base_url"], api_key=llm["api_key"], max_retries=0,
                        timeout=float(llm.get("timeout", 600)))
        sampling = {"temperature": llm.get("temperature"), "top_p": llm.get("top_p"),
                    "max_tokens": int(llm["max_tokens"]) if llm.get("max_tokens") else None}
        return run_episode(client, tools, model=str(llm["model"]).removeprefix("openai/"), issue=str(task_input["prompt"]),
                           max_turns=int(task_input.get("max_turns", 8)), sampling=sampling)


def main() -> None:
    p = argparse.ArgumentParser(description="swe_mini coding task, A2A rollout agent")
    p.add_argument("--port", type=int, default=int(os.environ.get("A2A_PORT", A2A_CONTRACT_PORT)))
    p.add_argument("--host", default=os.environ.get("HOST", "127.0.0.1"))
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    executor = SweMiniExecutor()
    serve_a2a(executor, port=args.port, host=args.host, ping_handler=make_ping_handler(executor),
              log_level="warning")


if __name__ == "__main__":
    main()
