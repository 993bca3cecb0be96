"""The rollout gateway's HTTP app: OpenAI-compatible routes over token-in/token-out replicas.

Routes: POST /v1/chat/completions (non-streaming, n=1), GET /v1/models (bearer token required, as
OpenAI does), GET /health (open).
A chat request is authenticated by its bearer token (the session's secret), parsed, rendered with
the chat template, clamped to the session's context budget, sent to the replica the router picks,
recorded in the capture store, and answered in OpenAI's shape. Every error, whoever raises it,
leaves through one middleware as `{"error": {"message", "type", "param", "code"}}`.

Invariant: a 200 answer means its turn is recorded in the capture store; a turn that is not
recorded (aborted by the engine, session closed while it ran) is answered with an error and counted
in the metrics, never silently dropped.

Callers: workers/gateway/server.py builds the app; tests drive it with the official `openai` SDK.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

from aiohttp import web

from orchestrator.types import GenerateRequest
from workers.gateway.capture import CaptureStore, Session, SessionNotFound, TurnKind, Unauthorized
from workers.gateway.chat_template import ChatRenderer, TemplateError
from workers.gateway.config import GatewayConfig
from workers.gateway.openai_api import (
    ApiError,
    ChatRequest,
    bad_request,
    chat_completion_body,
    error_body,
    models_body,
)
from workers.gateway.router import NoReplicas, ReplicaRouter

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GatewayMetrics:
    """Counters since the app started (a snapshot; counts, tokens)."""

    turns_served: int = 0
    turns_first: int = 0
    turns_clean: int = 0
    turns_fork: int = 0
    turns_aborted: int = 0
    turns_unrecorded_closed: int = 0
    unauthorized: int = 0
    bad_requests: int = 0
    server_errors: int = 0
    prompt_tokens: int = 0
    tokens_generated: int = 0
    engine_busy_s: float = 0.0  # sum over turns of engine time (s); / wall time = mean concurrency


class _Counters:
    """Mutable counters behind GatewayMetrics (one event loop mutates them)."""

    def __init__(self) -> None:
        self.values = {name: 0 for name in GatewayMetrics.__dataclass_fields__}

    def add(self, name: str, n: int = 1) -> None:
        self.values[name] += n

    def snapshot(self) -> GatewayMetrics:
        return GatewayMetrics(**self.values)


COUNTERS_KEY = web.AppKey("gateway_counters", _Counters)
_KIND_COUNTER = {TurnKind.FIRST: "turns_first", TurnKind.CLEAN: "turns_clean", TurnKind.FORK: "turns_fork"}


def metrics_of(app: web.Application) -> GatewayMetrics:
    """Snapshot of an app's counters."""
    return app[COUNTERS_KEY].snapshot()


def bearer_token(request: web.Request) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, or None."""
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def _error_response(err: ApiError) -> web.Response:
    return web.json_response(error_body(err), status=err.status)


def _classify(exc: Exception) -> ApiError:
    """Map any exception raised under a route to the OpenAI error it is answered with."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, Unauthorized):
        return ApiError(401, f"Incorrect API key provided: {exc}", code="invalid_api_key")
    if isinstance(exc, SessionNotFound):
        return ApiError(401, f"session closed while the request ran: {exc}", code="invalid_api_key")
    if isinstance(exc, TemplateError):
        return bad_request(str(exc), param="messages")
    if isinstance(exc, NoReplicas):
        return ApiError(503, str(exc), type="server_error", code="no_replicas")
    if isinstance(exc, web.HTTPException):
        code = "not_found" if exc.status == 404 else None
        return ApiError(exc.status, exc.reason or "HTTP error", code=code)
    log.exception("gateway: unhandled error", exc_info=exc)
    return ApiError(500, f"internal gateway error: {type(exc).__name__}: {exc}", type="server_error")


@web.middleware
async def openai_errors(request: web.Request, handler) -> web.StreamResponse:
    """Answer every error in OpenAI's `{"error": {...}}` shape and count it."""
    try:
        return await handler(request)
    except Exception as exc:  # noqa: BLE001 - this is the one place errors become answers
        err = _classify(exc)
        counters = request.app[COUNTERS_KEY]
        if err.status == 401:
            counters.add("unauthorized")
        elif err.status >= 500:
            counters.add("server_errors")
        else:
            counters.add("bad_requests")
        return _error_response(err)


def _generate_request(
    req: ChatRequest, session: Session, prompt_ids: tuple[int, ...], stop_ids: tuple[int, ...], request_id: str
) -> GenerateRequest:
    """Engine request with sampling defaults applied and max_tokens clamped to the context budget."""
    remaining = session.max_context_tokens - len(prompt_ids)
    if remaining < 1:
        raise bad_request(
            f"prompt is {len(prompt_ids)} tokens; the session's context budget is {session.max_context_tokens} "
            "tokens, leaving no room to generate",
            param="messages",
            code="context_length_exceeded",
        )
    defaults = session.sampling
    wanted = req.max_tokens or defaults.max_tokens or remaining
    temperature = defaults.temperature if defaults.enforce or req.temperature is None else req.temperature
    top_p = defaults.top_p if defaults.enforce or req.top_p is None else req.top_p
    return GenerateRequest(
        request_id=request_id,
        prompt_ids=prompt_ids,
        max_tokens=min(wanted, remaining),
        temperature=temperature,
        top_p=top_p,
        stop_token_ids=stop_ids,
        seed=req.seed,
    )


def create_app(
    cfg: GatewayConfig,
    capture: CaptureStore,
    router: ReplicaRouter,
    *,
    renderer: ChatRenderer | None = None,
) -> web.Application:
    """Build the gateway app. `renderer` defaults to the tokenizer at `cfg.model_path`."""
    renderer = renderer or ChatRenderer.from_pretrained(cfg.model_path, extra_stop_token_ids=cfg.extra_stop_token_ids)
    app = web.Application(middlewares=[openai_errors], client_max_size=cfg.max_body_bytes)
    counters = _Counters()
    app[COUNTERS_KEY] = counters
    started_s = int(time.time())

    async def chat(request: web.Request) -> web.Response:
        session = capture.authenticate(bearer_token(request))
        try:
            body = await request.json()
        except ValueError as e:
            raise bad_request(f"request body is not valid JSON: {e}") from e
        req = ChatRequest.parse(body)
        prompt_ids = renderer.render(req.messages, req.tools, req.chat_template_kwargs)
        stop_ids = renderer.stop_ids_for(req.stop)
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        gen = _generate_request(req, session, prompt_ids, stop_ids, completion_id)
        t0 = time.perf_counter()
        with router.lease(session.session_id) as engine:
            result = await engine.generate(gen)
        counters.add("engine_busy_s", time.perf_counter() - t0)
        if result.finish_reason == "abort":
            counters.add("turns_aborted")
            raise ApiError(503, "the inference replica aborted the request (weights update?); retry", type="server_error")
        try:
            record = capture.record_turn(session.session_id, prompt_ids, result)
        except SessionNotFound:
            counters.add("turns_unrecorded_closed")
            raise
        counters.add("turns_served")
        counters.add(_KIND_COUNTER[record.kind])
        counters.add("prompt_tokens", len(prompt_ids))
        counters.add("tokens_generated", len(result.output_ids))
        text = renderer.decode(result.output_ids, finish_reason=result.finish_reason, stop_ids=stop_ids)
        return web.json_response(
            chat_completion_body(
                completion_id=completion_id,
                created_s=int(time.time()),
                model=cfg.model_id,
                text=text,
                finish_reason=result.finish_reason,
                prompt_tokens=len(prompt_ids),
                completion_tokens=len(result.output_ids),
            )
        )

    async def models(request: web.Request) -> web.Response:
        capture.authenticate(bearer_token(request))  # OpenAI requires the key here too
        return web.json_response(models_body(cfg.model_id, started_s))

    async def health(request: web.Request) -> web.Response:
        return web.json_response(
            {"status": "ok", "replicas": router.num_replicas(), "open_sessions": capture.num_open()}
        )

    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    return app
