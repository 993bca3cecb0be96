"""The rollout gateway's HTTP app: OpenAI- and Anthropic-compatible routes over token-in/token-out
replicas.

Routes (each also served without the `/v1` prefix and with a doubled `/v1/v1`, so an SDK given
`http://host:port` or `http://host:port/v1` as its base URL finds them either way):
  POST /v1/chat/completions        OpenAI Chat Completions (n=1; stream=true as SSE)
  POST /v1/messages                Anthropic Messages (stream=true as SSE events)
  POST /v1/messages/count_tokens   Anthropic token count of a Messages request
  GET  /v1/models                  the served model (token required, as OpenAI does)
  GET  /health                     liveness, open to anyone; the open-session count only to a caller
                                   whose session token authenticates (the driver reads it from
                                   GatewayServer.num_open_sessions)
A request is authenticated by its session token (`Authorization: Bearer` or `x-api-key`) before
its body is read; the turn itself runs in turns.TurnRunner. Every error, whoever raises it, leaves
through one middleware, in OpenAI's `{"error": {...}}` shape or, under `/messages`, Anthropic's
`{"type": "error", "error": {...}}`: 401 unknown token, 409 closed session, 413 body past
`max_body_bytes` (named in the message), prompts rendered and tokenized off the event loop (turns.py),
429 turn cap, 400 bad request / context_length_exceeded / tools_unsupported, 503 engine trouble.

Invariant: a 200 answer means its turn is recorded in the capture store; a turn that is not
recorded (aborted by the engine, session closed while it ran, client gone) is answered with an
error (or nobody) and counted in the metrics, never silently dropped. No route serves a request
whose token does not authenticate.

Callers: workers/gateway/server.py builds the app; tests drive it with the official SDKs.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson
from aiohttp import web

from workers.gateway import anthropic_api
from workers.gateway.auth import session_token
from workers.gateway.capture import (
    CaptureError,
    CaptureStore,
    SessionClosed,
    SessionNotFound,
    TurnLimitExceeded,
    Unauthorized,
)
from workers.gateway.chat_template import ChatRenderer, TemplateError
from workers.gateway.config import GatewayConfig
from workers.gateway.metrics import Counters, GatewayMetrics
from workers.gateway.openai_api import (
    ApiError,
    ChatRequest,
    bad_request,
    chat_completion_body,
    chat_completion_chunks,
    error_body,
    logprobs_body,
    models_body,
)
from workers.gateway.router import NoReplicas, ReplicaRouter
from workers.gateway.streaming import anthropic_sse, openai_sse, send_sse
from workers.gateway.turns import TurnOutcome, TurnRunner

log = logging.getLogger(__name__)

COUNTERS_KEY = web.AppKey("gateway_counters", Counters)
MAX_BODY_KEY = web.AppKey("gateway_max_body_bytes", int)
ROUTE_PREFIXES = ("/v1", "", "/v1/v1")  # see the module docstring


def metrics_of(app: web.Application) -> GatewayMetrics:
    """Snapshot of an app's counters."""
    return app[COUNTERS_KEY].snapshot()


def _classify(exc: Exception) -> ApiError:
    """Map any exception raised under a route to the error it is answered with."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, Unauthorized):
        return ApiError(401, f"Incorrect API key provided: {exc}", code="invalid_api_key", retry=False)
    if isinstance(exc, (SessionClosed, SessionNotFound)):
        return ApiError(409, f"the rollout session is closed: {exc}", code="session_closed", retry=False)
    if isinstance(exc, TurnLimitExceeded):
        return ApiError(429, str(exc), type="rate_limit_error", code="turn_limit_exceeded", retry=False)
    if isinstance(exc, TemplateError):
        return bad_request(str(exc), param="messages")
    if isinstance(exc, NoReplicas):
        return ApiError(503, str(exc), type="server_error", code="no_replicas")
    if isinstance(exc, web.HTTPException):
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status)
        return ApiError(exc.status, exc.text or exc.reason or "HTTP error", code=code)
    log.exception("gateway: unhandled error", exc_info=exc)
    return ApiError(500, f"internal gateway error: {type(exc).__name__}: {exc}", type="server_error")


_STATUS_COUNTER = {401: "unauthorized", 409: "closed_session_requests", 429: "turn_limit_refused"}


@web.middleware
async def api_errors(request: web.Request, handler) -> web.StreamResponse:
    """Answer every error in the API's own shape and count it."""
    try:
        return await handler(request)
    except Exception as exc:  # noqa: BLE001 - this is the one place errors become answers
        err = _classify(exc)
        counter = _STATUS_COUNTER.get(err.status) or ("server_errors" if err.status >= 500 else "bad_requests")
        request.app[COUNTERS_KEY].add(counter)
        body = anthropic_api.error_body(err) if "/messages" in request.path else error_body(err)
        headers = {} if err.retry is None else {"x-should-retry": "true" if err.retry else "false"}
        return web.Response(status=err.status, body=orjson.dumps(body), content_type="application/json", headers=headers)


def _json(data: Any) -> web.Response:
    return web.Response(body=orjson.dumps(data), content_type="application/json")


async def _body(request: web.Request) -> Any:
    """The parsed JSON body. Raises ApiError(400) for invalid JSON, ApiError(413) naming the limit
    (`gateway.max_body_bytes`) past it: aiohttp stops reading there, before anything is rendered."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[MAX_BODY_KEY]
        raise ApiError(413, f"request body larger than the gateway's limit of {limit} bytes "
                            f"(gateway.max_body_bytes={limit}); send a shorter conversation",
                       code="request_too_large", retry=False) from None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"request body is not valid JSON: {e}") from e


class _Routes:
    """The gateway's route handlers over one TurnRunner: each authenticates, parses, runs the turn
    through pure code and shapes the answer in its API's format (errors: `api_errors`)."""

    def __init__(self, cfg: GatewayConfig, capture: CaptureStore, router: ReplicaRouter, renderer: ChatRenderer,
                 runner: TurnRunner) -> None:
        self._cfg, self._capture, self._router, self._renderer, self._runner = cfg, capture, router, renderer, runner
        self._started_s = int(time.time())

    def _logprobs(self, req: ChatRequest, out: TurnOutcome) -> dict[str, Any] | None:
        if not req.logprobs:
            return None
        return logprobs_body(self._renderer.token_texts(out.result.output_ids), out.result.logprobs)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        """OpenAI Chat Completions."""
        session = self._capture.authenticate(session_token(request.headers))
        req = ChatRequest.parse(await _body(request))
        out = await self._runner.run(session, req)
        shape = dict(
            completion_id=out.completion_id,
            created_s=out.created_s,
            model=self._cfg.model_id,
            content=out.parsed.content,
            tool_calls=out.parsed.tool_calls,
            finish_reason=out.result.finish_reason,
            prompt_tokens=len(out.prompt_ids),
            completion_tokens=len(out.result.output_ids),
            logprobs=self._logprobs(req, out),
            reasoning=out.parsed.reasoning,
        )
        if req.stream:
            return await send_sse(request, openai_sse(chat_completion_chunks(**shape, include_usage=req.include_usage)))
        return _json(chat_completion_body(**shape))

    async def messages(self, request: web.Request) -> web.StreamResponse:
        """Anthropic Messages."""
        session = self._capture.authenticate(session_token(request.headers))
        req = anthropic_api.parse_messages_request(await _body(request))
        out = await self._runner.run(session, req, id_prefix="msg_")
        shape = dict(
            message_id=out.completion_id,
            model=self._cfg.model_id,
            content=out.parsed.content,
            tool_calls=out.parsed.tool_calls,
            finish_reason=out.result.finish_reason,
            input_tokens=len(out.prompt_ids),
            output_tokens=len(out.result.output_ids),
            stop_sequence=out.stop_sequence,
            reasoning=out.parsed.reasoning,
        )
        if req.stream:
            return await send_sse(request, anthropic_sse(anthropic_api.message_events(**shape)))
        return _json(anthropic_api.message_body(**shape))

    async def count_tokens(self, request: web.Request) -> web.Response:
        """Anthropic token count."""
        self._capture.authenticate(session_token(request.headers))
        req = anthropic_api.parse_messages_request(await _body(request), require_max_tokens=False)
        return _json({"input_tokens": len(await self._runner.count_prompt_ids(req))})

    async def models(self, request: web.Request) -> web.Response:
        self._capture.authenticate(session_token(request.headers))  # OpenAI requires the key here too
        return _json(models_body(self._cfg.model_id, self._started_s))

    async def health(self, request: web.Request) -> web.Response:
        """Liveness for anyone (no token): status, replicas, tool format. `open_sessions` (how many
        rollouts are running) only for a caller whose session token authenticates: an agent of an open
        rollout; an unknown, closed or malformed token gets the same answer as none."""
        body: dict[str, Any] = {
            "status": "ok",
            "replicas": self._router.num_replicas(),
            "healthy_replicas": self._router.num_healthy(),
            "tool_format": self._renderer.tool_format,
        }
        try:
            self._capture.authenticate(session_token(request.headers))
        except CaptureError:
            return _json(body)
        return _json({**body, "open_sessions": self._capture.num_open()})


def create_app(
    cfg: GatewayConfig,
    capture: CaptureStore,
    router: ReplicaRouter,
    *,
    renderer: ChatRenderer | None = None,
) -> web.Application:
    """Build the gateway app. `renderer` defaults to the tokenizer at `cfg.model_path` (with
    `cfg.chat_template` and `cfg.tool_call_parser`)."""
    renderer = renderer or ChatRenderer.from_pretrained(
        cfg.model_path,
        extra_stop_token_ids=cfg.extra_stop_token_ids,
        chat_template_path=cfg.chat_template,
        tool_call_parser=cfg.tool_call_parser,
    )
    app = web.Application(middlewares=[api_errors], client_max_size=cfg.max_body_bytes)
    counters = Counters()
    app[COUNTERS_KEY] = counters
    app[MAX_BODY_KEY] = cfg.max_body_bytes
    runner = TurnRunner(capture, router, renderer, counters, continuity=cfg.token_continuity,
                        history_mode=cfg.history_mode, on_nonlinear=cfg.on_nonlinear, replica_wait_s=cfg.replica_wait_s)
    routes = _Routes(cfg, capture, router, renderer, runner)
    for prefix in ROUTE_PREFIXES:
        app.router.add_post(f"{prefix}/chat/completions", routes.chat)
        app.router.add_post(f"{prefix}/messages", routes.messages)
        app.router.add_post(f"{prefix}/messages/count_tokens", routes.count_tokens)
        app.router.add_get(f"{prefix}/models", routes.models)
    app.router.add_get("/health", routes.health)
    return app
