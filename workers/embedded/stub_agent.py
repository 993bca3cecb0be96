"""A model-free ACR agent for rollout benchmarks and fault tests: it only reports a reward.

Built on `bedrock_agentcore.runtime.BedrockAgentCoreApp` like any ACR container app (`POST
/invocations`, `GET /ping`; `/ping` answers HealthyBusy while a rollout of this process runs).
It serves both agent contracts, chosen by the payload:

- S3-result contract (payload has a `_rollout` dict with `exp_id`, `input_id`, `s3_bucket`):
  answers at once `{"status": "processing", "s3_bucket", "result_key"}` (agentcore-rl-toolkit's
  acknowledgement), then after `delay_s` writes `{"rewards": r}` to
  `s3://{s3_bucket}/{exp_id}/{input_id}/{session_id}.json`. If `_rollout` also has `result_url`,
  the same JSON is POSTed there (bearer `api_key`) right after the S3 write: an optional fast
  completion path; S3 stays the durable record. Env `STUB_S3_WRITE=0` skips the S3 write when
  a `result_url` is given (benchmarks of the fast path: moto costs ~3.5 ms CPU per object).
- HTTP contract (payload has `_config`, and the toolkit's `_agentcore_runtime` envelope
  `{"version": 1, "operation": "start" | "get", "invocation_id", "background"}`): `start`
  runs the rollout (foreground: answers the terminal record; background: answers `in_progress`),
  `get` answers the record: `in_progress | completed | interrupted | not_found`, a completed
  record carrying `result: {"reward": r}`. Records live in this process's memory only. A payload
  with `_config` and no envelope is answered in the foreground with `{"reward": r}`.

The reward r is the row's `reward` field when present, else a deterministic number in [0, 1)
from the session id. `delay_s` is the row's `delay_s`, else env `STUB_DELAY_S` (default 0).

Faults (workers.embedded.faults): the emulator's header `FAULT_HEADER` selects one; S3 | HTTP effect:
  crash            -> toolkit error object `{"status_code": 500, "stop_reason"}` (no reward)
                      | record `interrupted` (the process "died" with the rollout in progress)
  no_result        -> nothing is ever written | completed record with `result: {}` (no reward)
  malformed_result -> result body `{"rewards": ` (not JSON) | the response body is not JSON
  nan_reward       -> reward NaN or +-inf (non-standard JSON, as json.dumps(allow_nan) writes it)
  slow             -> the rollout takes env `STUB_SLOW_S` seconds (default 600) before finishing

Invariant: without a fault header every invocation leads to exactly one result (S3 object or
completed record) carrying a finite reward; with one, exactly the documented misbehaviour.
Run: `python -m workers.embedded.stub_agent` (port from env PORT, default 8080).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import os
from dataclasses import dataclass
from typing import Any

import aiohttp
import boto3
from bedrock_agentcore.runtime import BedrockAgentCoreApp
from starlette.responses import JSONResponse, Response

from workers.embedded.faults import FaultKind, fault_from_headers

ROLLOUT_KEY = "_rollout"
CONFIG_KEY = "_config"
ENVELOPE_KEY = "_agentcore_runtime"
ENVELOPE_VERSION = 1  # agentcore_rl_toolkit.runtime.protocol.VERSION
DEFAULT_PORT = 8080
DEFAULT_SLOW_S = 600.0  # a "slow" rollout: far past any rollout timeout a test would set
MALFORMED_BODY = b'{"rewards": '  # truncated JSON

logger = logging.getLogger("stub_agent")
app = BedrockAgentCoreApp()
_s3 = None  # boto3 client, made on first use so env set before start applies
_http: aiohttp.ClientSession | None = None  # for result_url; lives on the worker loop
_background: set[asyncio.Task] = set()  # strong refs: asyncio keeps weak refs to tasks
_records: dict[tuple[str, str], dict] = {}  # (session id, invocation id) -> HTTP-contract record
_live: dict[tuple[str, str], asyncio.Task] = {}


@dataclass(frozen=True)
class Rollout:
    """What one invocation asks for, parsed from payload, session id and fault header."""

    session_id: str
    reward: float
    delay_s: float
    fault: FaultKind | None

    @classmethod
    def parse(cls, payload: dict[str, Any], context) -> "Rollout":
        sid = context.session_id or ""
        raw = payload.get("reward")
        if raw is None:
            h = hashlib.blake2b(sid.encode(), digest_size=8).digest()
            reward = int.from_bytes(h, "big") / float(2**64)
        else:
            reward = float(raw)
        delay_s = float(payload.get("delay_s", os.environ.get("STUB_DELAY_S", 0.0)))
        return cls(sid, reward, delay_s, fault_from_headers(getattr(context, "request_headers", None)))

    def duration_s(self) -> float:
        return float(os.environ.get("STUB_SLOW_S", DEFAULT_SLOW_S)) if self.fault == "slow" else self.delay_s

    def bad_reward(self) -> float:
        """NaN or +-inf, chosen by the session id (so both kinds occur)."""
        pick = hashlib.blake2b(self.session_id.encode(), digest_size=1).digest()[0] % 3
        return (math.nan, math.inf, -math.inf)[pick]


def _busy(name: str) -> int:
    return app.add_async_task(name)


def _spawn(coro) -> asyncio.Task:
    t = asyncio.create_task(coro)
    _background.add(t)
    t.add_done_callback(_background.discard)
    return t


# ----------------------------------------------------------------------------- S3 contract


def _s3_body(r: Rollout) -> bytes | None:
    if r.fault == "no_result":
        return None
    if r.fault == "crash":
        return json.dumps({"status_code": 500, "stop_reason": "agent crashed mid-rollout (injected)"}).encode()
    if r.fault == "malformed_result":
        return MALFORMED_BODY
    reward = r.bad_reward() if r.fault == "nan_reward" else r.reward
    return json.dumps({"rewards": reward}, allow_nan=True).encode()


async def _s3_rollout(r: Rollout, spec: dict, key: str, busy_id: int) -> None:
    global _s3, _http
    try:
        if r.duration_s() > 0:
            await asyncio.sleep(r.duration_s())
        body = _s3_body(r)
        if body is None:
            return
        if not spec.get("result_url") or os.environ.get("STUB_S3_WRITE", "1") != "0":
            if _s3 is None:
                _s3 = boto3.client("s3")
            await asyncio.to_thread(
                _s3.put_object, Bucket=spec["s3_bucket"], Key=key, Body=body, ContentType="application/json"
            )
        if spec.get("result_url"):
            if _http is None:
                _http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
            headers = {"Content-Type": "application/json", "Authorization": f"Bearer {spec.get('api_key', '')}"}
            async with _http.post(spec["result_url"], data=body, headers=headers) as resp:
                if resp.status >= 400:
                    logger.warning("result_url %s answered %d", spec["result_url"], resp.status)
    except Exception:
        url = spec.get("result_url")
        logger.exception("rollout %s failed to report (bucket %s, result_url %s)", r.session_id, spec["s3_bucket"], url)
    finally:
        app.complete_async_task(busy_id)


def _start_s3(payload: dict, r: Rollout) -> dict:
    spec = payload[ROLLOUT_KEY]
    missing = [k for k in ("exp_id", "input_id", "s3_bucket") if not spec.get(k)]
    if missing:
        raise ValueError(f"{ROLLOUT_KEY} lacks {missing}")
    key = f"{spec['exp_id']}/{spec['input_id']}/{r.session_id}.json"
    _spawn(_s3_rollout(r, spec, key, _busy("stub-s3-rollout")))
    return {"status": "processing", "s3_bucket": spec["s3_bucket"], "result_key": key}


# ----------------------------------------------------------------------------- HTTP contract


def _record(invocation_id: str, status: str, **extra) -> dict:
    return {"version": ENVELOPE_VERSION, "invocation_id": invocation_id, "status": status, **extra}


async def _http_rollout(r: Rollout, invocation_id: str, busy_id: int) -> dict:
    key = (r.session_id, invocation_id)
    try:
        if r.fault == "crash":
            await asyncio.sleep(r.delay_s / 2)
            rec = _record(invocation_id, "interrupted")
        else:
            if r.duration_s() > 0:
                await asyncio.sleep(r.duration_s())
            if r.fault == "no_result":
                rec = _record(invocation_id, "completed", result={})
            else:
                reward = r.bad_reward() if r.fault == "nan_reward" else r.reward
                rec = _record(invocation_id, "completed", result={"reward": reward})
        _records[key] = rec
        return rec
    finally:
        _live.pop(key, None)
        app.complete_async_task(busy_id)


def _answer(rec: dict, r: Rollout) -> Response:
    if r.fault == "malformed_result" and rec["status"] == "completed":
        return Response(MALFORMED_BODY, media_type="application/json")
    return Response(json.dumps(rec, allow_nan=True), media_type="application/json")


async def _serve_http(payload: dict, r: Rollout) -> Response:
    env = payload.get(ENVELOPE_KEY)
    if env is None:  # plain foreground invocation of an HTTP-contract agent
        rec = await _http_rollout(r, "foreground", _busy("stub-http-rollout"))
        if r.fault == "malformed_result":
            return Response(MALFORMED_BODY, media_type="application/json")
        if rec["status"] != "completed":
            return JSONResponse({"error": "agent crashed mid-rollout (injected)"}, status_code=500)
        return Response(json.dumps(rec["result"], allow_nan=True), media_type="application/json")
    op, inv = env.get("operation"), env.get("invocation_id")
    if env.get("version") != ENVELOPE_VERSION or op not in ("start", "get") or not isinstance(inv, str) or not inv:
        return JSONResponse({"error": f"bad {ENVELOPE_KEY} envelope: {env!r}"}, status_code=400)
    key = (r.session_id, inv)
    if key in _records:
        return _answer(_records[key], r)
    if key in _live:
        if op == "start" and not env.get("background", False):
            return _answer(await asyncio.shield(_live[key]), r)
        return _answer(_record(inv, "in_progress"), r)
    if op == "get":
        return _answer(_record(inv, "not_found"), r)
    task = _spawn(_http_rollout(r, inv, _busy("stub-http-rollout")))
    _live[key] = task
    if env.get("background", False):
        return _answer(_record(inv, "in_progress"), r)
    return _answer(await asyncio.shield(task), r)


# ----------------------------------------------------------------------------- entrypoint


@app.entrypoint
async def invoke(payload, context):
    """Dispatch on the contract the payload names (see module docstring)."""
    if not isinstance(payload, dict):
        return JSONResponse({"error": "payload must be a JSON object"}, status_code=400)
    r = Rollout.parse(payload, context)
    if ROLLOUT_KEY in payload:
        return _start_s3(payload, r)
    if CONFIG_KEY in payload or ENVELOPE_KEY in payload:
        return await _serve_http(payload, r)
    return JSONResponse({"error": f"payload needs {ROLLOUT_KEY!r} or {CONFIG_KEY!r}"}, status_code=400)


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    app.logger.setLevel(logging.WARNING)  # the SDK logs every invocation at INFO
    app.run(port=int(os.environ.get("PORT", DEFAULT_PORT)))


if __name__ == "__main__":
    main()
