"""ACR data-plane client: invoke an agent runtime, stop its session, poll S3 for the agent's result.

Two flavours with the same methods and semantics:

- `AcrClient`: plain boto3, blocking; safe to share between threads (boto3 clients are
  thread-safe), so callers may run it with `asyncio.to_thread`;
- `AsyncAcrClient`: aiobotocore, coroutines; use it from async actors with many rollouts in
  flight, where a blocked thread per polling rollout would exhaust the default thread pool.

Endpoints, region and credentials come from the standard AWS configuration only
(`AWS_ENDPOINT_URL_BEDROCK_AGENTCORE`, `AWS_ENDPOINT_URL_S3`, `AWS_DEFAULT_REGION`, ...): the
local emulator and moto are reached exactly like AWS, there is no local-only code path.

Throttling and transient errors are retried by botocore's own retry modes (`standard` by
default, `adaptive` adds client-side rate limiting); nothing here loops on errors. The one loop is
`wait_for_result`: HEAD the result key with bounded exponential backoff until it exists or the
deadline passes, then GET it.

Caller sequence (the rollout worker): open gateway session -> `invoke` -> `wait_for_result` ->
`stop_session`.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Literal

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

POLL_INITIAL_S = 0.05  # first wait between two HEADs of the result key
POLL_MAX_S = 1.0  # cap of the wait: bounds the latency added to a finished rollout
POLL_FACTOR = 2.0  # backoff growth per miss


@dataclass(frozen=True)
class AcrClientConfig:
    """botocore settings shared by both clients.

    max_attempts: total attempts per call including the first (botocore `total_max_attempts`);
        1 turns retries off.
    retry_mode: botocore retry mode; "adaptive" also rate-limits the client after throttles.
    read_timeout_s: socket read timeout of one call (an agent may stream slowly).
    """

    region_name: str | None = None
    retry_mode: Literal["standard", "adaptive", "legacy"] = "standard"
    max_attempts: int = 8
    max_pool_connections: int = 64
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 900.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"acr.max_attempts must be >= 1, got {self.max_attempts}")
        if self.max_pool_connections < 1:
            raise ValueError(f"acr.max_pool_connections must be >= 1, got {self.max_pool_connections}")

    def botocore_kwargs(self) -> dict[str, Any]:
        return dict(
            retries={"mode": self.retry_mode, "total_max_attempts": self.max_attempts},
            max_pool_connections=self.max_pool_connections,
            connect_timeout=self.connect_timeout_s,
            read_timeout=self.read_timeout_s,
        )


@dataclass(frozen=True)
class AcrCallStats:
    """Counters since the client was made: calls, botocore retries, ThrottlingExceptions raised."""

    invocations: int
    stops: int
    retries: int
    throttled: int


class _Counters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.invocations = self.stops = self.retries = self.throttled = 0

    def add(self, *, invocations: int = 0, stops: int = 0, retries: int = 0, throttled: int = 0) -> None:
        with self._lock:
            self.invocations += invocations
            self.stops += stops
            self.retries += retries
            self.throttled += throttled

    def snapshot(self) -> AcrCallStats:
        with self._lock:
            return AcrCallStats(self.invocations, self.stops, self.retries, self.throttled)

    def count_error(self, e: ClientError) -> None:
        meta = e.response.get("ResponseMetadata", {})
        self.add(
            retries=int(meta.get("RetryAttempts", 0)),
            throttled=int(e.response.get("Error", {}).get("Code") == "ThrottlingException"),
        )


def _parse_body(raw: bytes, session_id: str, content_type: str) -> dict:
    try:
        out = json.loads(raw) if raw else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"session {session_id}: agent answered non-JSON {content_type!r}: {raw[:200]!r}") from e
    if not isinstance(out, dict):
        raise ValueError(f"session {session_id}: agent answered JSON {type(out).__name__}, expected an object")
    return out


def _is_not_found(e: ClientError) -> bool:
    return e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound", "ResourceNotFoundException")


def _next_delay(delay_s: float) -> float:
    return min(delay_s * POLL_FACTOR, POLL_MAX_S)


class AcrClient:
    """Blocking ACR + S3 client on boto3. Thread-safe.

    Raises botocore `ClientError` subclasses from the service as-is (e.g.
    `client.acr.exceptions.ThrottlingException` once retries are spent).
    """

    def __init__(self, cfg: AcrClientConfig | None = None) -> None:
        self.cfg = cfg or AcrClientConfig()
        config = Config(**self.cfg.botocore_kwargs())
        self.acr = boto3.client("bedrock-agentcore", region_name=self.cfg.region_name, config=config)
        self.s3 = boto3.client("s3", region_name=self.cfg.region_name, config=config)
        self._counters = _Counters()

    def stats(self) -> AcrCallStats:
        return self._counters.snapshot()

    def invoke(self, arn: str, session_id: str, payload: dict, qualifier: str | None = None) -> dict:
        """InvokeAgentRuntime; read the whole (possibly streamed) body and parse it as a JSON object.

        Raises ValueError when the body is not a JSON object.
        """
        kwargs: dict[str, Any] = dict(
            agentRuntimeArn=arn,
            runtimeSessionId=session_id,
            payload=json.dumps(payload).encode(),
            contentType="application/json",
            accept="application/json",
        )
        if qualifier is not None:
            kwargs["qualifier"] = qualifier
        try:
            resp = self.acr.invoke_agent_runtime(**kwargs)
        except ClientError as e:
            self._counters.count_error(e)
            raise
        self._counters.add(invocations=1, retries=resp["ResponseMetadata"].get("RetryAttempts", 0))
        with resp["response"] as body:
            raw = body.read()
        return _parse_body(raw, session_id, resp.get("contentType", ""))

    def stop_session(self, arn: str, session_id: str, qualifier: str | None = None) -> bool:
        """StopRuntimeSession. True when stopped now; False when ACR did not know the session
        (already stopped or expired), so a retried stop is harmless."""
        kwargs: dict[str, Any] = dict(agentRuntimeArn=arn, runtimeSessionId=session_id)
        if qualifier is not None:
            kwargs["qualifier"] = qualifier
        try:
            resp = self.acr.stop_runtime_session(**kwargs)
        except ClientError as e:
            self._counters.count_error(e)
            if _is_not_found(e):
                return False
            raise
        self._counters.add(stops=1, retries=resp["ResponseMetadata"].get("RetryAttempts", 0))
        return True

    def wait_for_result(self, bucket: str, key: str, timeout_s: float) -> dict | None:
        """Poll `s3://bucket/key` with HEAD (backoff POLL_INITIAL_S x POLL_FACTOR, capped at
        POLL_MAX_S) until it exists, then GET and parse it as JSON. None when `timeout_s` passes
        first. Raises ClientError for S3 errors other than not-found, ValueError on bad JSON."""
        deadline = time.monotonic() + timeout_s
        delay_s = POLL_INITIAL_S
        while True:
            try:
                self.s3.head_object(Bucket=bucket, Key=key)
                break
            except ClientError as e:
                if not _is_not_found(e):
                    raise
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(delay_s, left))
            delay_s = _next_delay(delay_s)
        obj = self.s3.get_object(Bucket=bucket, Key=key)
        with obj["Body"] as body:
            return _parse_body(body.read(), key, obj.get("ContentType", ""))


class AsyncAcrClient:
    """The same calls on aiobotocore, as coroutines. Use as `async with AsyncAcrClient(cfg) as c:`
    (or `await c.start()` / `await c.close()`); one instance serves many concurrent rollouts."""

    def __init__(self, cfg: AcrClientConfig | None = None) -> None:
        self.cfg = cfg or AcrClientConfig()
        self._counters = _Counters()
        self._stack = None
        self.acr = None
        self.s3 = None

    async def start(self) -> "AsyncAcrClient":
        from contextlib import AsyncExitStack

        from aiobotocore.config import AioConfig
        from aiobotocore.session import get_session

        session = get_session()
        config = AioConfig(**self.cfg.botocore_kwargs())
        stack = AsyncExitStack()
        try:
            self.acr = await stack.enter_async_context(
                session.create_client("bedrock-agentcore", region_name=self.cfg.region_name, config=config)
            )
            self.s3 = await stack.enter_async_context(
                session.create_client("s3", region_name=self.cfg.region_name, config=config)
            )
        except BaseException:
            await stack.aclose()
            raise
        self._stack = stack
        return self

    async def close(self) -> None:
        if self._stack is not None:
            stack, self._stack = self._stack, None
            await stack.aclose()

    async def __aenter__(self) -> "AsyncAcrClient":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def stats(self) -> AcrCallStats:
        return self._counters.snapshot()

    def _require_started(self) -> None:
        if self.acr is None or self._stack is None:
            raise RuntimeError("AsyncAcrClient used before start() or after close()")

    async def invoke(self, arn: str, session_id: str, payload: dict, qualifier: str | None = None) -> dict:
        """See AcrClient.invoke."""
        self._require_started()
        kwargs: dict[str, Any] = dict(
            agentRuntimeArn=arn,
            runtimeSessionId=session_id,
            payload=json.dumps(payload).encode(),
            contentType="application/json",
            accept="application/json",
        )
        if qualifier is not None:
            kwargs["qualifier"] = qualifier
        try:
            resp = await self.acr.invoke_agent_runtime(**kwargs)
        except ClientError as e:
            self._counters.count_error(e)
            raise
        self._counters.add(invocations=1, retries=resp["ResponseMetadata"].get("RetryAttempts", 0))
        async with resp["response"] as body:
            raw = await body.read()
        return _parse_body(raw, session_id, resp.get("contentType", ""))

    async def stop_session(self, arn: str, session_id: str, qualifier: str | None = None) -> bool:
        """See AcrClient.stop_session."""
        self._require_started()
        kwargs: dict[str, Any] = dict(agentRuntimeArn=arn, runtimeSessionId=session_id)
        if qualifier is not None:
            kwargs["qualifier"] = qualifier
        try:
            resp = await self.acr.stop_runtime_session(**kwargs)
        except ClientError as e:
            self._counters.count_error(e)
            if _is_not_found(e):
                return False
            raise
        self._counters.add(stops=1, retries=resp["ResponseMetadata"].get("RetryAttempts", 0))
        return True

    async def wait_for_result(self, bucket: str, key: str, timeout_s: float) -> dict | None:
        """See AcrClient.wait_for_result."""
        self._require_started()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        delay_s = POLL_INITIAL_S
        while True:
            try:
                await self.s3.head_object(Bucket=bucket, Key=key)
                break
            except ClientError as e:
                if not _is_not_found(e):
                    raise
            left = deadline - loop.time()
            if left <= 0:
                return None
            await asyncio.sleep(min(delay_s, left))
            delay_s = _next_delay(delay_s)
        obj = await self.s3.get_object(Bucket=bucket, Key=key)
        async with obj["Body"] as body:
            raw = await body.read()
        return _parse_body(raw, key, obj.get("ContentType", ""))
