"""GatewayServer: the rollout gateway as one object the rollout workers talk to.

A plain class (no Ray import): the driver wraps it as an async Ray actor
(`ray.remote(GatewayServer)`), tests use it directly. `start()` serves the aiohttp app on the event
loop that calls it (in an async Ray actor: the actor's own loop); every other method must be called
on that same loop, so the capture store and router are only ever touched by one loop.

Engines: `set_engines` accepts objects with `async generate(GenerateRequest) -> GenerateResult`
(the InferenceEngine protocol: a simulated engine, an in-process InferenceWorker) or Ray actor
handles whose `generate` is an actor method (`workers.core.calls.is_actor_method`), wrapped by
`RayActorEngine`, which awaits the ObjectRef and cancels it on cancellation (no Ray import needed).

Invariant: a session id is open in the gateway from `open_session` until `close_session`, which
returns everything recorded for it exactly once; after that its token answers 409 (closed).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from workers.core.calls import is_actor_method
from workers.core.types import GenerateRequest, GenerateResult, InferenceEngine, SessionCapture
from workers.gateway.app import GatewayMetrics, create_app, metrics_of
from workers.gateway.capture import CaptureStore, SamplingDefaults
from workers.gateway.chat_template import ChatRenderer
from workers.gateway.config import GatewayConfig
from workers.gateway.router import ReplicaRouter

log = logging.getLogger(__name__)
STOP_GRACE_S = 1.0  # `stop` waits this long for turns in flight, then cancels them (seconds)


class RayActorEngine:
    """InferenceEngine over a Ray actor handle: `await handle.generate.remote(req)`.

    Cancelling the call cancels the actor task (`ray.cancel`), which raises CancelledError inside
    the replica's async `generate` and so aborts the request in the engine.
    """

    def __init__(self, handle: Any) -> None:
        self._handle = handle

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        ref = self._handle.generate.remote(req)
        try:
            return await ref
        except asyncio.CancelledError:
            import ray  # only reachable with a Ray handle, so Ray is installed and initialised

            ray.cancel(ref)
            raise


def as_engine(obj: Any) -> InferenceEngine:
    """Adapt `obj` to the InferenceEngine protocol.

    Raises TypeError when `obj` has no `generate`, or a synchronous one (it would block the loop).
    """
    gen = getattr(obj, "generate", None)
    if gen is None:
        raise TypeError(f"{type(obj).__name__} has no generate method; cannot serve as an inference engine")
    if is_actor_method(gen):
        return RayActorEngine(obj)
    if not inspect.iscoroutinefunction(gen):
        raise TypeError(f"{type(obj).__name__}.generate must be `async def` (got a synchronous callable)")
    return obj


class GatewayServer:
    """Owns the capture store, the replica router and the HTTP listener of one gateway."""

    def __init__(
        self,
        cfg: GatewayConfig,
        engines: Sequence[Any] = (),
        *,
        renderer: ChatRenderer | None = None,
    ) -> None:
        self._cfg = cfg
        self._sampling = SamplingDefaults(
            temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_tokens, enforce=cfg.enforce_sampling
        )
        self._capture = CaptureStore(default_max_context_tokens=cfg.max_context_tokens, default_sampling=self._sampling)
        self._router = ReplicaRouter([as_engine(e) for e in engines])
        self._renderer = renderer
        self._app: web.Application | None = None
        self._runner: web.AppRunner | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._base_url: str | None = None

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> str:
        """Listen on cfg.host:cfg.port (0 = a free port); return the base URL agents are given:
        `http://HOST:PORT/v1`, or as `cfg.advertise_url` says (see `advertised_url`).

        Idempotent: a second call returns the same URL. Raises OSError if the port is taken.
        """
        if self._base_url is not None:
            return self._base_url
        self._loop = asyncio.get_running_loop()
        renderer = self._renderer or await asyncio.to_thread(
            ChatRenderer.from_pretrained,
            self._cfg.model_path,
            extra_stop_token_ids=self._cfg.extra_stop_token_ids,
            chat_template_path=self._cfg.chat_template,
            tool_call_parser=self._cfg.tool_call_parser,
        )
        self._renderer = renderer
        if renderer.tool_format is None:
            log.warning(
                "gateway: the chat template of %s renders no known tool-call format; requests offering "
                "tools will be refused (set gateway.chat_template / tool_call_parser to serve tool agents)",
                self._cfg.model_path,
            )
        self._app = create_app(self._cfg, self._capture, self._router, renderer=renderer)
        # access_log=None: no request lines (and so no headers or tokens) in the logs;
        # handler_cancellation: a client that disconnects cancels its handler, hence its engine call;
        # shutdown_timeout: `stop` cancels turns still in flight after this (aiohttp's default: 60 s)
        self._runner = web.AppRunner(self._app, access_log=None, handler_cancellation=True,
                                     shutdown_timeout=STOP_GRACE_S)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._cfg.host, self._cfg.port)
        try:
            await site.start()
        except BaseException:
            await self._runner.cleanup()
            self._runner = None
            raise
        host, port = self._runner.addresses[0][:2]
        self._base_url = advertised_url(self._cfg.advertise_url, host, port)
        return self._base_url

    async def stop(self) -> None:
        """Stop listening and drop open connections. Open sessions stay readable via close_session."""
        if self._runner is not None:
            await self._runner.cleanup()
        self._runner = None
        self._base_url = None

    @property
    def base_url(self) -> str | None:
        """The URL `start` returned, or None while stopped."""
        return self._base_url

    # -- what the rollout workers call -----------------------------------------------------

    async def open_session(
        self,
        session_id: str,
        max_context_tokens: int | None = None,
        sampling: SamplingDefaults | dict | None = None,
        max_turns: int | None = None,
    ) -> str:
        """Open a capture session; return its secret token (the agent's OpenAI / Anthropic `api_key`).

        sampling: the session's SamplingDefaults (or their fields as a dict, for callers that do
            not import the gateway); None: the gateway's defaults.
        max_turns: the session's turn cap (None: gateway.max_turns).
        Raises SessionExists if the id is already open, ValueError on a bad budget.
        """
        self._check_loop()
        if isinstance(sampling, dict):
            sampling = SamplingDefaults(**sampling)
        return self._capture.open(
            session_id,
            max_context_tokens=max_context_tokens,
            sampling=sampling,
            max_turns=self._cfg.max_turns if max_turns is None else max_turns,
        )

    async def close_session(self, session_id: str) -> SessionCapture:
        """Close the session (its token answers 409 from now on) and return its recorded rows.

        Raises SessionNotFound if the session is not open.
        """
        self._check_loop()
        capture = self._capture.close(session_id)
        self._router.forget(session_id)
        return capture

    def set_engines(self, engines: Sequence[Any]) -> None:
        """Replace the inference replicas (engine objects or Ray actor handles)."""
        self._check_loop()
        self._router.set_engines([as_engine(e) for e in engines])

    def metrics(self) -> GatewayMetrics:
        """Counters since start (turns served, 401s, tokens generated, ...)."""
        return metrics_of(self._app) if self._app is not None else GatewayMetrics()

    def num_open_sessions(self) -> int:
        return self._capture.num_open()

    def _check_loop(self) -> None:
        if self._loop is None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not None and running is not self._loop:
            raise RuntimeError("GatewayServer methods must be called on the event loop that ran start()")


def advertised_url(advertise_url: str | None, host: str, port: int) -> str:
    """The base URL agents are given for a gateway bound to `host:port`: `http://HOST:PORT/v1`
    when `advertise_url` is None, this node's routable address for "auto", else `advertise_url`."""
    from workers.core.netaddr import AUTO, routable_address

    if advertise_url is None:
        return f"http://{host}:{port}/v1"
    if advertise_url == AUTO:
        return f"http://{routable_address()}:{port}/v1"
    return advertise_url.rstrip("/")
