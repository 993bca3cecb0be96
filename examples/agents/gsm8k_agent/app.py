"""The GSM8K agent: an ACR container app that solves a math word problem with a calculator tool.

It serves the AgentCore Runtime contract with `bedrock_agentcore.runtime.BedrockAgentCoreApp`
(`POST /invocations`, `GET /ping`) and agentcore-rl-toolkit's S3-result contract
(examples/agents/agent_common/rollout_contract.py):

- the payload is a GSM8K row (`question`, numeric `answer`, optional `max_turns`; see
  workers/core/tasks/gsm8k.py) plus the reserved `_rollout` dict;
- the invocation answers at once with `{"status": "processing", "s3_bucket", "result_key"}`;
- the rollout runs the tool loop (tool_loop.py) with the official `openai` SDK at `base_url`
  with `api_key` (the rollout gateway's session token), scores the last answer with
  `reward.score(row, text)` and writes `{"rewards": r, "turns": k, "tool_calls": m, "end": ...}`
  to `s3://{s3_bucket}/{exp_id}/{input_id}/{session_id}.json`.

Invariant: a `rewards` field is written only for an episode whose model calls and scoring
succeeded. On any failure (model error, first turn over the context budget, bad row) the agent
logs and writes agentcore-rl-toolkit's error object `{"status_code": 500, "stop_reason": ...}`,
so the rollout ends `failed` at once (not at its timeout) and a failure is never mistaken for a
reward; if S3 itself fails, nothing is written and the rollout times out. The OpenAI client runs with
`max_retries=0` so each turn reaches the gateway exactly once. Each finished episode logs one
line `session S input_id=I: gsm8k episode turns=K tool_calls=M prompt_tokens=P1,P2,.. end=E
reward=R` (P: the gateway's `usage.prompt_tokens` per turn; with the tools block rendered).

Run: `python examples/agents/gsm8k_agent/app.py --port 8080` (or env PORT). S3 and the region
come from the standard AWS env vars (`AWS_ENDPOINT_URL_S3` locally).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from bedrock_agentcore.runtime import BedrockAgentCoreApp
from bedrock_agentcore.runtime.context import RequestContext

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]  # this agent's modules and examples/agents/agent_common
from agent_common.rollout_contract import (  # noqa: E402
    RolloutSpec,
    openai_client,
    serve,
    start_rollout,
    write_error,
    write_reward,
)
from reward import score  # noqa: E402
from tool_loop import run_episode  # noqa: E402

logger = logging.getLogger("gsm8k_agent")

DEFAULT_PORT = 8080
DEFAULT_MAX_TURNS = 4  # when the row does not say (task.max_turns sets it per row)
MODEL_TIMEOUT_S = 600.0  # one model call; the orchestrator's own rollout timeout is the real bound

app = BedrockAgentCoreApp()


async def _rollout(spec: RolloutSpec, row: dict[str, Any], session_id: str) -> None:
    key = spec.result_key(session_id)
    try:
        ep = await run_episode(openai_client(spec, MODEL_TIMEOUT_S), model=spec.model_id,
                               question=str(row["question"]), max_turns=int(row.get("max_turns", DEFAULT_MAX_TURNS)),
                               sampling=spec.sampling_kwargs())
        reward = score(row, ep.final_text)
        await write_reward(spec, session_id, reward, turns=ep.num_turns, tool_calls=ep.num_tool_calls, end=ep.end)
        logger.info("session %s input_id=%s: gsm8k episode turns=%d tool_calls=%d prompt_tokens=%s end=%s "
                    "reward=%.1f", session_id, spec.input_id, ep.num_turns, ep.num_tool_calls,
                    ",".join(str(n) for n in ep.prompt_tokens), ep.end, reward)
    except Exception as exc:
        logger.exception("session %s: rollout failed; writing an error object to %s", session_id, key)
        try:
            await write_error(spec, session_id, f"{type(exc).__name__}: {exc}")
        except Exception:
            logger.exception("session %s: could not write the error object either", session_id)


@app.entrypoint
async def invoke(payload: dict[str, Any], context: RequestContext) -> dict[str, Any]:
    """Validate, start the episode in the background, answer at once with where the result goes.

    Raises ValueError (HTTP 500 from the SDK) on a payload without a valid `_rollout`, a row
    without `question` / `answer`, or a request without ACR's session header.
    """
    return start_rollout(app, "gsm8k_rollout", payload, context.session_id, ("question", "answer"), _rollout)


def main() -> None:
    serve(app, "GSM8K calculator agent (ACR container app)", DEFAULT_PORT)


if __name__ == "__main__":
    main()
