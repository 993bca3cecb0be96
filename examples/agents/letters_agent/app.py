"""The default task's agent: an ACR container app that asks the model once and reports a reward.

It serves the AgentCore Runtime contract with `bedrock_agentcore.runtime.BedrockAgentCoreApp`
(`POST /invocations`, `GET /ping`) and agentcore-rl-toolkit's S3-result contract through the
shared `examples/agents/agent_common/rollout_contract.py`: the payload is a dataset row plus a
reserved `_rollout` dict; the invocation answers at once with `{"status": "processing",
"s3_bucket", "result_key"}` and the rollout runs in the background (`/ping` says HealthyBusy);
the rollout calls the model with the official `openai` SDK at `base_url` with `api_key` (the
rollout gateway's session token), scores the completion with `reward.score(row, text)` and
writes `{"rewards": r}` to `s3://{s3_bucket}/{exp_id}/{input_id}/{session_id}.json` (and POSTs it
to `result_url` when given, which wakes the orchestrator at once).

Invariant: `rewards` is written only for a rollout whose model call and scoring succeeded; any
failure (model error, bad row) writes the toolkit's error object `{"status_code": 500,
"stop_reason": ...}` instead, so the orchestrator marks the rollout failed at once and a failure
can never be mistaken for a reward.

Run: `python examples/agents/letters_agent/app.py --port 8080` (or env PORT). S3 and the
region come from the standard AWS env vars (`AWS_ENDPOINT_URL_S3` locally).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import re
import sys
import zlib
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

logger = logging.getLogger("letters_agent")

DEFAULT_PORT = 8080
MODEL_TIMEOUT_S = 600.0  # one model call; the orchestrator's own rollout timeout is the real bound

app = BedrockAgentCoreApp()


_PLACE = re.compile(r"-(g\d+-s\d+)-[0-9a-f]{32}$")  # the orchestrator's runtimeSessionId: <exp>-g<group>-s<sample>-<uuid>


def env_time_s(session_id: str) -> float:
    """Simulated environment time (seconds) before the model call: log-normal with median
    `LETTERS_ENV_TIME_MEDIAN_S` (default 0: none) and shape `LETTERS_ENV_TIME_SIGMA` (default 1).
    Seeded by the rollout's place in its run (group and sample index, read from the session id;
    the whole id when it has no such part), so every run of a benchmark, and every configuration
    of scripts/bench_modes.py, draws the same delays for the same rollouts (common random numbers:
    the configurations differ by what the system does, not by which tail they drew). Heavy-tailed
    like tool and sandbox time of real agents."""
    median_s = float(os.environ.get("LETTERS_ENV_TIME_MEDIAN_S", "0"))
    if median_s <= 0:
        return 0.0
    sigma = float(os.environ.get("LETTERS_ENV_TIME_SIGMA", "1.0"))
    place = _PLACE.search(session_id)
    rng = random.Random(zlib.crc32((place.group(1) if place else session_id).encode()))
    return median_s * math.exp(sigma * rng.gauss(0.0, 1.0))


async def _rollout(spec: RolloutSpec, row: dict[str, Any], session_id: str) -> None:
    try:
        await asyncio.sleep(env_time_s(session_id))
        out = await openai_client(spec, MODEL_TIMEOUT_S).chat.completions.create(
            model=spec.model_id, messages=[{"role": "user", "content": str(row["prompt"])}],
            **spec.sampling_kwargs())
        reward = float(score(row, out.choices[0].message.content or ""))
        key = await write_reward(spec, session_id, reward)
        logger.info("session %s: reward %.3f written to s3://%s/%s", session_id, reward, spec.s3_bucket, key)
    except Exception as exc:
        logger.exception("session %s: rollout failed; writing an error object", session_id)
        await write_error(spec, session_id, f"{type(exc).__name__}: {exc}")


@app.entrypoint
async def invoke(payload: dict[str, Any], context: RequestContext) -> dict[str, Any]:
    """Validate, start the rollout in the background, answer at once with where the result goes.

    Raises ValueError (HTTP 500 from the SDK) on a payload without a valid `_rollout`, a row
    without `prompt`, or a request without ACR's session header.
    """
    return start_rollout(app, "letters_rollout", payload, context.session_id, ("prompt",), _rollout)


def main() -> None:
    serve(app, "letters agent (ACR container app)", DEFAULT_PORT)


if __name__ == "__main__":
    main()
