"""The default task's agent: an ACR container app that asks the model once and reports a reward.

It serves the AgentCore Runtime contract with `bedrock_agentcore.runtime.BedrockAgentCoreApp`
(`POST /invocations`, `GET /ping`) and the S3-result contract of agentcore-rl-toolkit:

- the payload is a dataset row plus a reserved `_rollout` dict
  (`exp_id`, `input_id`, `s3_bucket`, `base_url`, `model_id`, `api_key`, optional `temperature`,
  `max_tokens`; these two may also sit in the row);
- the invocation answers at once with `{"status": "processing", "s3_bucket", "result_key"}` and
  the rollout runs in the background; while any rollout runs, `/ping` reports `HealthyBusy`;
- the rollout calls the model with the official `openai` SDK at `base_url` with `api_key`
  (the rollout gateway's session token), scores the completion with `reward.score(row, text)`
  and writes `{"rewards": r}` to `s3://{s3_bucket}/{exp_id}/{input_id}/{session_id}.json`,
  where session_id is ACR's `X-Amzn-Bedrock-AgentCore-Runtime-Session-Id` header.

Invariant: a result object is written only for a rollout whose model call and scoring succeeded.
On any failure (model error, bad row, S3 error) the agent logs the error and writes nothing: the
orchestrator's S3 poll times out and marks the rollout failed, so a failure can never be
mistaken for a reward. (agentcore-rl-toolkit instead writes an error object with
`status_code: 500` and no `rewards`; the orchestrator must treat that as failed too.)
The OpenAI client runs with `max_retries=0` so that each turn reaches the gateway exactly once.

Run: `python examples/agents/letters_agent/app.py --port 8080` (or env PORT). S3 and the
region come from the standard AWS env vars (`AWS_ENDPOINT_URL_S3` locally).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import random
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
from bedrock_agentcore.runtime import BedrockAgentCoreApp
from bedrock_agentcore.runtime.context import RequestContext
from openai import AsyncOpenAI

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the container's working dir
from reward import score  # noqa: E402

logger = logging.getLogger("letters_agent")

ROLLOUT_KEY = "_rollout"
DEFAULT_PORT = 8080
MODEL_TIMEOUT_S = 600.0  # one model call; the orchestrator's own rollout timeout is the real bound

app = BedrockAgentCoreApp()
_s3 = None  # boto3 clients are thread-safe; created on first use so env vars set before start apply
_background: set[asyncio.Task] = set()  # strong refs: asyncio keeps only weak refs to tasks


@dataclass(frozen=True)
class RolloutSpec:
    """The `_rollout` dict of one invocation, validated."""

    exp_id: str
    input_id: str
    s3_bucket: str
    base_url: str
    model_id: str
    api_key: str
    temperature: float | None
    max_tokens: int | None

    @classmethod
    def parse(cls, payload: dict[str, Any]) -> "RolloutSpec":
        """Raises ValueError naming the first missing `_rollout` field."""
        r = payload.get(ROLLOUT_KEY)
        if not isinstance(r, dict):
            raise ValueError(f"payload needs a '{ROLLOUT_KEY}' dict")
        missing = [k for k in ("exp_id", "input_id", "s3_bucket", "base_url", "model_id", "api_key") if not r.get(k)]
        if missing:
            raise ValueError(f"'{ROLLOUT_KEY}' lacks {missing}")
        temperature = r.get("temperature", payload.get("temperature"))
        max_tokens = r.get("max_tokens", payload.get("max_tokens"))
        return cls(
            exp_id=str(r["exp_id"]),
            input_id=str(r["input_id"]),
            s3_bucket=str(r["s3_bucket"]),
            base_url=str(r["base_url"]),
            model_id=str(r["model_id"]),
            api_key=str(r["api_key"]),
            temperature=None if temperature is None else float(temperature),
            max_tokens=None if max_tokens is None else int(max_tokens),
        )

    def result_key(self, session_id: str) -> str:
        return f"{self.exp_id}/{self.input_id}/{session_id}.json"


def _s3_client():
    global _s3
    if _s3 is None:
        _s3 = boto3.client("s3")
    return _s3


async def _ask_model(spec: RolloutSpec, prompt: str) -> str:
    kwargs: dict[str, Any] = {}
    if spec.temperature is not None:
        kwargs["temperature"] = spec.temperature
    if spec.max_tokens is not None:
        kwargs["max_tokens"] = spec.max_tokens
    async with AsyncOpenAI(
        base_url=spec.base_url, api_key=spec.api_key, max_retries=0, timeout=MODEL_TIMEOUT_S
    ) as client:
        out = await client.chat.completions.create(
            model=spec.model_id, messages=[{"role": "user", "content": prompt}], **kwargs
        )
    return out.choices[0].message.content or ""


def env_time_s(session_id: str) -> float:
    """Simulated environment time (seconds) before the model call: log-normal with median
    `LETTERS_ENV_TIME_MEDIAN_S` (default 0: none) and shape `LETTERS_ENV_TIME_SIGMA` (default 1),
    seeded by the session id so a benchmark replays the same delays. Heavy-tailed like tool and
    sandbox time of real agents; used by scripts/bench_modes.py."""
    median_s = float(os.environ.get("LETTERS_ENV_TIME_MEDIAN_S", "0"))
    if median_s <= 0:
        return 0.0
    sigma = float(os.environ.get("LETTERS_ENV_TIME_SIGMA", "1.0"))
    rng = random.Random(zlib.crc32(session_id.encode()))
    return median_s * math.exp(sigma * rng.gauss(0.0, 1.0))


async def _rollout(spec: RolloutSpec, row: dict[str, Any], session_id: str, task_id: int) -> None:
    key = spec.result_key(session_id)
    try:
        await asyncio.sleep(env_time_s(session_id))
        text = await _ask_model(spec, str(row["prompt"]))
        reward = float(score(row, text))
        body = json.dumps({"rewards": reward})
        await asyncio.to_thread(
            _s3_client().put_object, Bucket=spec.s3_bucket, Key=key, Body=body, ContentType="application/json"
        )
        logger.info("session %s: reward %.3f written to s3://%s/%s", session_id, reward, spec.s3_bucket, key)
    except Exception:
        logger.exception("session %s: rollout failed, no result written for %s", session_id, key)
    finally:
        app.complete_async_task(task_id)


@app.entrypoint
async def invoke(payload: dict[str, Any], context: RequestContext) -> dict[str, Any]:
    """Validate, start the rollout in the background, answer at once with where the result goes.

    Raises ValueError (HTTP 500 from the SDK) on a payload without a valid `_rollout`, a row
    without `prompt`, or a request without ACR's session header.
    """
    spec = RolloutSpec.parse(payload)
    if not context.session_id:
        raise ValueError("no X-Amzn-Bedrock-AgentCore-Runtime-Session-Id header on the request")
    row = {k: v for k, v in payload.items() if k != ROLLOUT_KEY}
    if "prompt" not in row:
        raise ValueError("dataset row needs a 'prompt'")
    # Registered before the invocation returns, so /ping says HealthyBusy from the first moment.
    task_id = app.add_async_task("letters_rollout", {"session_id": context.session_id})
    task = asyncio.create_task(_rollout(spec, row, context.session_id, task_id))
    _background.add(task)
    task.add_done_callback(_background.discard)
    return {"status": "processing", "s3_bucket": spec.s3_bucket, "result_key": spec.result_key(context.session_id)}


def main() -> None:
    p = argparse.ArgumentParser(description="letters agent (ACR container app)")
    p.add_argument("--port", type=int, default=int(os.environ.get("PORT", DEFAULT_PORT)))
    p.add_argument("--host", default=None)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    app.run(port=args.port, host=args.host)


if __name__ == "__main__":
    main()
