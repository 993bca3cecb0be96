"""ACR data-plane client: invoke an agent runtime, stop its session, poll S3 for the agent's result.

`AsyncAcrClient` (aiobotocore, coroutines): one instance serves the many rollouts in flight of an
async rollout actor, where a blocked thread per polling rollout would exhaust a thread pool.

Endpoints, region and credentials come from the standard AWS configuration only
(`AWS_ENDPOINT_URL_BEDROCK_AGENTCORE`, `AWS_ENDPOINT_URL_S3`, `AWS_DEFAULT_REGION`, ...): the
local emulator and moto are reached exactly like AWS, there is no local-only code path.

Retries (bounded, exponential backoff with jitter, no home-made loops):
- throttling (429) and 5xx: botocore's own retry modes (`standard` by default, `adaptive` adds
  client-side rate limiting), `max_attempts` in all;
- RuntimeClientError (424: the agent's container failed the request): `tenacity`, at most
  `runtime_error_attempts` invocations of the same session;
- `wait_for_result` polls S3 with `tenacity` (HEAD until the key exists, backoff
  `poll_initial_s` doubling up to `poll_max_s`, with jitter) and stops at its deadline.

Cluster-wide rate limit: `AsyncAcrClient(..., request_gate=g)` awaits `g.acquire()` in botocore's
`before-send` hook of the `bedrock-agentcore` client, i.e. before EVERY HTTP attempt of every
ACR call (invoke, get, stop, command), botocore's retry attempts included.

Caller sequence (the rollout worker): open gateway session -> `invoke` -> `wait_for_result` ->
`stop_session`.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any, Literal, get_args

from typing import Protocol

import tenacity
from botocore.config import Config
from botocore.exceptions import ClientError

POLL_INITIAL_S = 0.02  # first wait between two HEADs of the result key (rollout.poll_initial_s)
POLL_MAX_S = 0.5  # cap of the wait: bounds the latency added to a finished rollout (rollout.poll_max_s)
RUNTIME_ERROR_CODE = "RuntimeClientError"  # ACR's 424: retried by tenacity, not by botocore


class RequestGate(Protocol):
    """The cluster-wide request-rate limiter as the client sees it (workers.acr.limits.Coalescer)."""

    async def acquire(self) -> None: ...


RetryMode = Literal["standard", "adaptive", "legacy"]  # botocore retry modes
RETRY_MODES: tuple[str, ...] = get_args(RetryMode)

@dataclass(frozen=True)
class AcrClientConfig:
    """botocore and retry settings shared by both clients (times in seconds).

    max_attempts: total attempts per call including the first (botocore `total_max_attempts`);
        1 turns retries off.
    runtime_error_attempts: invocations of one session when ACR answers RuntimeClientError (424),
        waiting `retry_initial_s` * 2^k + jitter (capped at `retry_max_s`) in between.
    poll_initial_s, poll_max_s: S3 result polling backoff (first wait, cap).
    retry_mode: botocore retry mode; "adaptive" also rate-limits the client after throttles.
    read_timeout_s: socket read timeout of one call (an agent may stream slowly).
    invoke_headers: extra HTTP headers of every InvokeAgentRuntime call, signed with it (an A2A
        runtime needs `A2A-Version`; boto3's operation has no parameter for it).
    """

    region_name: str | None = None
    retry_mode: RetryMode = "standard"
    max_attempts: int = 8
    max_pool_connections: int = 64
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 900.0
    runtime_error_attempts: int = 3
    retry_initial_s: float = 0.05
    retry_max_s: float = 2.0
    poll_initial_s: float = POLL_INITIAL_S
    poll_max_s: float = POLL_MAX_S
    invoke_headers: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        """The one check of these values; each message starts with the config key that sets it
        (orchestrator/config/rollout.py turns the ValueError into a ConfigError)."""
        if self.retry_mode not in RETRY_MODES:
            raise ValueError(f"rollout.acr.retry_mode must be one of {list(RETRY_MODES)}, got {self.retry_mode!r}")
        if self.max_attempts < 1:
            raise ValueError(f"rollout.acr.max_attempts must be >= 1, got {self.max_attempts}")
        if self.runtime_error_attempts < 1:
            raise ValueError(f"rollout.acr.runtime_error_attempts must be >= 1, got {self.runtime_error_attempts}")
        if self.poll_initial_s <= 0:
            raise ValueError(f"rollout.poll_initial_s must be > 0, got {self.poll_initial_s}")
        if self.poll_max_s < self.poll_initial_s:
            raise ValueError(f"rollout.poll_max_s must be >= rollout.poll_initial_s, got {self.poll_max_s}")
        if self.max_pool_connections < 1:
            raise ValueError(f"max_pool_connections must be >= 1, got {self.max_pool_connections}")

    def botocore_kwargs(self) -> dict[str, Any]:
        return dict(
            retries={"mode": self.retry_mode, "total_max_attempts": self.max_attempts},
            max_pool_connections=self.max_pool_connections,
            connect_timeout=self.connect_timeout_s,
            read_timeout=self.read_timeout_s,
        )


@dataclass(frozen=True)
class AcrCallStats:
    """Counters since the client was made: successful invokes and stops, retries (botocore's and
    tenacity's), ThrottlingExceptions that reached the caller, HTTP requests sent to ACR (every
    attempt; each took one token of the request gate when there is one)."""

    invocations: int
    stops: int
    retries: int
    throttled: int
    requests: int = 0


class _Counters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.invocations = self.stops = self.retries = self.throttled = self.requests = 0

    def add(self, *, invocations: int = 0, stops: int = 0, retries: int = 0, throttled: int = 0,
            requests: int = 0) -> None:
        with self._lock:
            self.invocations += invocations
            self.stops += stops
            self.retries += retries
            self.throttled += throttled
            self.requests += requests

    def snapshot(self) -> AcrCallStats:
        with self._lock:
            return AcrCallStats(self.invocations, self.stops, self.retries, self.throttled, self.requests)

    def count_error(self, e: ClientError) -> None:
        meta = e.response.get("ResponseMetadata", {})
        self.add(
            retries=int(meta.get("RetryAttempts", 0)),
            throttled=int(e.response.get("Error", {}).get("Code") == "ThrottlingException"),
        )

    def count_request(self, **_: Any) -> None:
        self.add(requests=1)


class AgentBodyError(ValueError):
    """The agent's answer (or a stored result) is not a JSON object."""


def _parse_body(raw: bytes, session_id: str, content_type: str) -> dict:
    try:
        out = json.loads(raw) if raw else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AgentBodyError(f"session {session_id}: agent answered non-JSON {content_type!r}: {raw[:200]!r}") from e
    if not isinstance(out, dict):
        raise AgentBodyError(f"session {session_id}: agent answered JSON {type(out).__name__}, expected an object")
    return out


def _is_not_found(e: ClientError) -> bool:
    return e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound", "ResourceNotFoundException")


def is_runtime_client_error(exc: BaseException) -> bool:
    """ACR's RuntimeClientError (HTTP 424): the agent failed the request; worth a bounded retry."""
    return isinstance(exc, ClientError) and exc.response.get("Error", {}).get("Code") == RUNTIME_ERROR_CODE


def _retry_424(cfg: AcrClientConfig, counters: "_Counters") -> dict[str, Any]:
    """tenacity arguments for the RuntimeClientError retry (sync and async alike)."""
    return dict(
        retry=tenacity.retry_if_exception(is_runtime_client_error),
        stop=tenacity.stop_after_attempt(cfg.runtime_error_attempts),
        wait=tenacity.wait_exponential_jitter(initial=cfg.retry_initial_s, max=cfg.retry_max_s,
                                              jitter=cfg.retry_initial_s),
        before_sleep=lambda _state: counters.add(retries=1),
        reraise=True,
    )


def _poll(cfg: AcrClientConfig, timeout_s: float) -> dict[str, Any]:
    """tenacity arguments for polling until a call returns something other than None."""
    return dict(
        retry=tenacity.retry_if_result(lambda r: r is None),
        stop=tenacity.stop_before_delay(max(0.0, timeout_s)),
        wait=tenacity.wait_exponential_jitter(initial=cfg.poll_initial_s, max=cfg.poll_max_s,
                                              jitter=cfg.poll_initial_s),
        retry_error_callback=lambda _state: None,  # deadline passed: None, not an exception
    )


def _invoke_kwargs(arn: str, session_id: str, payload: dict, qualifier: str | None) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        agentRuntimeArn=arn,
        runtimeSessionId=session_id,
        payload=json.dumps(payload).encode(),
        contentType="application/json",
        accept="application/json",
    )
    if qualifier is not None:
        kwargs["qualifier"] = qualifier
    return kwargs


def _stop_kwargs(arn: str, session_id: str, qualifier: str | None) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(agentRuntimeArn=arn, runtimeSessionId=session_id)
    if qualifier is not None:
        kwargs["qualifier"] = qualifier
    return kwargs


class AsyncAcrClient:
    """The same calls on aiobotocore, as coroutines. Use as `async with AsyncAcrClient(cfg) as c:`
    (or `await c.start()` / `await c.close()`); one instance serves many concurrent rollouts.

    request_gate: the cluster-wide request-rate limiter; awaited before every HTTP attempt to ACR.
    """

    def __init__(self, cfg: AcrClientConfig | None = None, request_gate: RequestGate | None = None) -> None:
        self.cfg = cfg or AcrClientConfig()
        self._gate = request_gate
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
        self.acr.meta.events.register("before-send.bedrock-agentcore", self._before_send)
        if self.cfg.invoke_headers:
            self.acr.meta.events.register("before-sign.bedrock-agentcore.InvokeAgentRuntime", self._add_headers)
        self._stack = stack
        return self

    async def _before_send(self, **_: Any) -> None:
        """botocore hook before every HTTP attempt to ACR: one token of the request gate."""
        if self._gate is not None:
            await self._gate.acquire()
        self._counters.add(requests=1)

    def _add_headers(self, request: Any, **_: Any) -> None:
        """botocore hook before an InvokeAgentRuntime is signed: `invoke_headers` join it."""
        for name, value in self.cfg.invoke_headers:
            request.headers[name] = value

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
        """InvokeAgentRuntime; read the whole (possibly streamed) body and parse it as a JSON object.

        RuntimeClientError (424) is retried (see module docstring); throttling and 5xx by botocore.
        Raises ValueError when the body is not a JSON object, ClientError when retries are spent.
        """
        self._require_started()
        kwargs = _invoke_kwargs(arn, session_id, payload, qualifier)
        async for attempt in tenacity.AsyncRetrying(**_retry_424(self.cfg, self._counters)):
            with attempt:
                return await self._invoke_once(kwargs, session_id)
        raise AssertionError("unreachable: tenacity reraises")

    async def _invoke_once(self, kwargs: dict[str, Any], session_id: str) -> dict:
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
        """StopRuntimeSession. True when stopped now; False when ACR did not know the session
        (already stopped or expired), so a retried stop is harmless."""
        self._require_started()
        try:
            resp = await self.acr.stop_runtime_session(**_stop_kwargs(arn, session_id, qualifier))
        except ClientError as e:
            self._counters.count_error(e)
            if _is_not_found(e):
                return False
            raise
        self._counters.add(stops=1, retries=resp["ResponseMetadata"].get("RetryAttempts", 0))
        return True

    async def wait_for_result(self, bucket: str, key: str, timeout_s: float) -> dict | None:
        """Poll `s3://bucket/key` with HEAD (bounded exponential backoff with jitter, see
        AcrClientConfig) until it exists, then GET and parse it as JSON. None when `timeout_s`
        passes first. Raises ClientError for S3 errors other than not-found, ValueError on bad JSON."""
        self._require_started()
        return await tenacity.AsyncRetrying(**_poll(self.cfg, timeout_s))(self._get_if_exists, bucket, key)

    async def delete_result(self, bucket: str, key: str) -> None:
        """DeleteObject `s3://bucket/key` (idempotent: a missing key is not an error). Raises
        ClientError on other S3 errors."""
        self._require_started()
        await self.s3.delete_object(Bucket=bucket, Key=key)

    async def _get_if_exists(self, bucket: str, key: str) -> dict | None:
        try:
            await self.s3.head_object(Bucket=bucket, Key=key)
        except ClientError as e:
            if _is_not_found(e):
                return None
            raise
        obj = await self.s3.get_object(Bucket=bucket, Key=key)
        async with obj["Body"] as body:
            raw = await body.read()
        return _parse_body(raw, key, obj.get("ContentType", ""))
