"""The agent side of agentcore-rl-toolkit's S3-result contract, shared by the example agents.

An invocation payload is a dataset row plus a reserved `_rollout` dict (`exp_id`, `input_id`,
`s3_bucket`, `base_url`, `model_id`, `api_key`, optional `temperature`, `top_p`, `max_tokens`,
`result_url`; built by workers/rollout/worker.py `build_payload`). The agent answers the invocation at
once, runs the rollout in the background (`/ping` says HealthyBusy meanwhile) and writes
`{"rewards": r}` to `s3://{s3_bucket}/{exp_id}/{input_id}/{session_id}.json`, session_id being
ACR's `X-Amzn-Bedrock-AgentCore-Runtime-Session-Id` header. A rollout that fails writes the
toolkit's error object `{"status_code": 500, "stop_reason": "<why>"}` (no `rewards`) to the same
key, so the orchestrator marks it failed at once instead of waiting for its timeout. When
`result_url` is given the agent also POSTs the same body there (bearer `api_key`;
workers/rollout/results.py), which wakes the waiting rollout worker at once; S3 stays the durable
record, so a failed POST is only logged.

Invariant: `run_in_background` completes the app's async task on every exit path, so `/ping`
never stays HealthyBusy after a rollout ends; a `rewards` field is written only by `write_reward`
(a finished, scored rollout), never by `write_error`.
This module imports only boto3, aiohttp, openai and the standard library, so agent containers stay standalone.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import aiohttp
import boto3

ROLLOUT_KEY = "_rollout"
RESULT_POST_TIMEOUT_S = 30.0  # bound on the fast-completion POST; S3 already holds the result
MAX_STOP_REASON_CHARS = 2000  # an error object carries at most this much of the failure text
REQUIRED_FIELDS = ("exp_id", "input_id", "s3_bucket")
# The model endpoint: sent in `_rollout` when the orchestrator serves the policy; absent when it
# evaluates the agent with its own model (eval.serve_model=false), which these env vars name.
MODEL_FIELDS_ENV = {"base_url": "AGENT_MODEL_BASE_URL", "model_id": "AGENT_MODEL_ID", "api_key": "AGENT_MODEL_API_KEY"}

logger = logging.getLogger("agent_common")
_s3 = None  # boto3 clients are thread-safe; created at start (serve) or first use, after env vars are set
_s3_lock = threading.Lock()
_background: set[asyncio.Task] = set()  # strong refs: asyncio keeps only weak refs to tasks
_openai_clients: dict[str, Any] = {}  # base_url -> shared AsyncOpenAI (see openai_client)


@dataclass(frozen=True)
class RolloutSpec:
    """The `_rollout` dict of one invocation, validated. Sampling fields are None when not sent."""

    exp_id: str
    input_id: str
    s3_bucket: str
    base_url: str
    model_id: str
    api_key: str
    temperature: float | None
    top_p: float | None
    max_tokens: int | None
    result_url: str | None = None

    @classmethod
    def parse(cls, payload: dict[str, Any]) -> "RolloutSpec":
        """Raises ValueError naming the missing `_rollout` fields. Sampling fields may also sit in the row.
        Without `base_url` in `_rollout` (no served policy) the model endpoint is the agent's own:
        env AGENT_MODEL_BASE_URL, AGENT_MODEL_ID, AGENT_MODEL_API_KEY."""
        r = payload.get(ROLLOUT_KEY)
        if not isinstance(r, dict):
            raise ValueError(f"payload needs a '{ROLLOUT_KEY}' dict")
        if not r.get("base_url"):  # the agent's own model
            r = {**r, **{k: os.environ.get(env, "") for k, env in MODEL_FIELDS_ENV.items()}}
        missing = [k for k in (*REQUIRED_FIELDS, *MODEL_FIELDS_ENV) if not r.get(k)]
        if missing:
            raise ValueError(f"'{ROLLOUT_KEY}' lacks {missing} (without base_url: set env "
                             f"{sorted(MODEL_FIELDS_ENV.values())} to the agent's own model)")

        def opt(key: str, typ: type) -> Any:
            value = r.get(key, payload.get(key))
            return None if value is None else typ(value)

        return cls(exp_id=str(r["exp_id"]), input_id=str(r["input_id"]), s3_bucket=str(r["s3_bucket"]),
                   base_url=str(r["base_url"]), model_id=str(r["model_id"]), api_key=str(r["api_key"]),
                   temperature=opt("temperature", float), top_p=opt("top_p", float),
                   max_tokens=opt("max_tokens", int), result_url=r.get("result_url") or None)

    def result_key(self, session_id: str) -> str:
        """`{exp_id}/{input_id}/{session_id}.json`."""
        return f"{self.exp_id}/{self.input_id}/{session_id}.json"

    def sampling_kwargs(self) -> dict[str, Any]:
        """The sampling fields that were sent, as `chat.completions.create` keyword arguments."""
        out = {"temperature": self.temperature, "top_p": self.top_p, "max_tokens": self.max_tokens}
        return {k: v for k, v in out.items() if v is not None}


def dataset_row(payload: dict[str, Any]) -> dict[str, Any]:
    """The payload without the reserved `_rollout` dict."""
    return {k: v for k, v in payload.items() if k != ROLLOUT_KEY}


def _s3_client():
    global _s3
    with _s3_lock:  # boto3's default session is not thread-safe to build clients from
        if _s3 is None:
            _s3 = boto3.client("s3")
    return _s3


async def write_reward(spec: RolloutSpec, session_id: str, reward: float, **extra: Any) -> str:
    """Write `{"rewards": reward, **extra}` to the result key, then POST it to `spec.result_url`
    if set; return the key. Raises on S3 errors; a failed POST is logged (S3 is the record)."""
    return await _publish(spec, session_id, json.dumps({"rewards": float(reward), **extra}))


async def write_error(spec: RolloutSpec, session_id: str, stop_reason: str) -> str:
    """Write agentcore-rl-toolkit's error object `{"status_code": 500, "stop_reason": ...}` (no
    `rewards`: the rollout ends failed) like `write_reward`; return the key. Raises on S3 errors."""
    body = json.dumps({"status_code": 500, "stop_reason": stop_reason[:MAX_STOP_REASON_CHARS]})
    return await _publish(spec, session_id, body)


async def _publish(spec: RolloutSpec, session_id: str, body: str) -> str:
    key = spec.result_key(session_id)
    await asyncio.to_thread(_s3_client().put_object, Bucket=spec.s3_bucket, Key=key, Body=body,
                            ContentType="application/json")
    if spec.result_url:
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {spec.api_key}"}
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=RESULT_POST_TIMEOUT_S)) as http:
                async with http.post(spec.result_url, data=body, headers=headers) as resp:
                    if resp.status >= 400:
                        logger.warning("session %s: result_url answered %d", session_id, resp.status)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            logger.warning("session %s: result_url POST failed (%s); S3 holds the result", session_id, exc)
    return key


def openai_client(spec: RolloutSpec, timeout_s: float) -> Any:
    """An `openai.AsyncOpenAI` for this rollout's gateway session (`base_url`, `api_key` = the
    session token, `max_retries=0` so each turn reaches the gateway exactly once). Clients of one
    `base_url` share one HTTP connection pool for the process's life: building an AsyncOpenAI
    costs ~28 ms of CPU (httpx client + TLS context), `with_options` ~0.04 ms."""
    from openai import AsyncOpenAI

    base = _openai_clients.get(spec.base_url)
    if base is None:
        base = _openai_clients[spec.base_url] = AsyncOpenAI(base_url=spec.base_url, api_key="per-rollout",
                                                            max_retries=0, timeout=timeout_s)
    return base.with_options(api_key=spec.api_key, timeout=timeout_s)


def start_rollout(app: Any, name: str, payload: dict[str, Any], session_id: str | None, required: tuple[str, ...],
                  rollout: Callable[[RolloutSpec, dict[str, Any], str], Awaitable[None]]) -> dict[str, Any]:
    """The body of an agent's `/invocations` entrypoint for the S3-result contract: validate the
    `_rollout` dict, the session header and the row's `required` fields, start `rollout(spec, row,
    session_id)` in the background, and answer at once with where the result goes.

    Raises ValueError (HTTP 500 from the SDK) naming what is missing."""
    spec = RolloutSpec.parse(payload)
    if not session_id:
        raise ValueError("no X-Amzn-Bedrock-AgentCore-Runtime-Session-Id header on the request")
    row = dataset_row(payload)
    missing = [k for k in required if k not in row]
    if missing:
        raise ValueError(f"dataset row lacks {missing}")
    run_in_background(app, name, session_id, rollout(spec, row, session_id))
    return {"status": "processing", "s3_bucket": spec.s3_bucket, "result_key": spec.result_key(session_id)}


def serve(app: Any, description: str, default_port: int = 8080) -> None:
    """Run the agent app on `--port` (default: env PORT, else `default_port`), logging at INFO."""
    import argparse
    import os

    p = argparse.ArgumentParser(description=description)
    p.add_argument("--port", type=int, default=int(os.environ.get("PORT", default_port)))
    p.add_argument("--host", default=None)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    threading.Thread(target=_warm_up, name="warm-up", daemon=True).start()
    app.run(port=args.port, host=args.host)


def _warm_up() -> None:
    """Import openai and build the S3 client beside the server: done on the event loop by the first
    rollout, they stall every rollout of this process for seconds on a busy machine."""
    try:
        importlib.import_module("openai")
        _s3_client()
    except Exception:  # noqa: BLE001  the first rollout then pays (and reports) it
        logger.warning("warm-up failed; the first rollout will import and connect", exc_info=True)


def run_in_background(app: Any, name: str, session_id: str, work: Awaitable[None]) -> None:
    """Register an async task on the BedrockAgentCoreApp `app` (so `/ping` says HealthyBusy from
    this moment), run `work` in the background, and complete the task however `work` ends.
    An exception escaping `work` is logged, never raised into the server."""
    task_id = app.add_async_task(name, {"session_id": session_id})

    async def _run() -> None:
        try:
            await work
        except Exception:
            logger.exception("session %s: background rollout raised", session_id)
        finally:
            app.complete_async_task(task_id)

    task = asyncio.create_task(_run())
    _background.add(task)
    task.add_done_callback(_background.discard)
