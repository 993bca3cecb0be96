"""The Ray side of the rollout pool: RolloutActor (an async actor per worker) and RolloutPool.

Each RolloutActor builds, inside its own process and event loop: the per-process clients of the
cluster-wide limits (one request-rate limiter and one open-session cap, named Ray actors shared
by every rollout actor, see workers.acr.limits), an AsyncAcrClient whose every HTTP attempt
takes a rate token, a ResultServer for fast completion, and the gateway / buffer adapters.

Invariant: `RolloutPool.run_all` returns one outcome per request, or raises (a ContractError from
any actor stops the run; Ray re-raises it as an instance of ContractError). `shutdown` cancels
rollouts still running; each stops its ACR session on the way out.

Callers: orchestrator/build.py builds the pool (`start_rollout_pool`); the loops call `run_all`.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

from workers.core.calls import call, is_actor_method
from workers.core.netaddr import listen_and_advertise
from workers.core.types import RolloutRequest, Sample, SessionCapture
from workers.rollout.worker import NoGateway, RolloutOutcome, RolloutSettings, RolloutWorker
from workers.rollout.results import ResultBoard, ResultServer


@dataclass(frozen=True)
class PoolOptions:
    """What a rollout actor needs beyond RolloutSettings.

    limits: workers.acr.limits.LimitHandles (the named limit actors), or None for no limits.
    acr: workers.acr.client.AcrClientConfig, or None for defaults.
    result_host: interface the fast-completion result server listens on ("" = no server; "auto":
        every interface, advertised as this node's routable address);
        `result_advertise_host` is the host agents are told to post to (default: result_host,
        or this node's IP when result_host is 0.0.0.0).
    """

    limits: Any = None
    acr: Any = None
    result_host: str = "127.0.0.1"
    result_advertise_host: str | None = None


class RolloutActor:
    """The Ray-facing shell around one RolloutWorker (see module docstring)."""

    def __init__(self, settings: RolloutSettings, gateway_handle: Any, buffer_handle: Any,
                 options: PoolOptions | None = None) -> None:  # gateway_handle None: no served model
        self._settings = settings
        self._gateway_handle = gateway_handle
        self._buffer_handle = buffer_handle
        self._options = options or PoolOptions()
        self._worker: RolloutWorker | None = None
        self._acr = None
        self._server: ResultServer | None = None
        self._tasks: set[asyncio.Future] = set()
        self._lock: asyncio.Lock | None = None

    async def _ensure(self) -> RolloutWorker:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._worker is None:
                self._worker = await self._build()
        return self._worker

    async def _build(self) -> RolloutWorker:
        from workers.acr.client import AcrClientConfig, AsyncAcrClient
        from workers.acr.limits import limit_clients

        opts = self._options
        clients = limit_clients(opts.limits) if opts.limits is not None else None
        self._acr = await AsyncAcrClient(opts.acr or AcrClientConfig(),
                                         request_gate=clients.requests if clients else None).start()
        board, url = None, None
        if opts.result_host:
            board = ResultBoard()
            listen, advertise = listen_and_advertise(opts.result_host)  # auto: every interface, this node's address
            self._server = ResultServer(board, host=listen)
            url = await self._server.start()
            advertise = opts.result_advertise_host or advertise or listen
            url = url.replace(f"//{listen}:", f"//{advertise}:", 1)
        gateway = NoGateway() if self._gateway_handle is None else GatewayActorClient(self._gateway_handle)
        return RolloutWorker(self._settings, gateway, self._acr,
                             _sink_for(self._buffer_handle), slots=clients.sessions if clients else None,
                             results=board, result_url=url)

    async def run_many(self, reqs: list[RolloutRequest], partition: str) -> list[RolloutOutcome]:
        """Run `reqs` concurrently; outcomes in request order. A ContractError cancels the rest
        (each stops its session) and propagates."""
        worker = await self._ensure()
        tasks = [asyncio.ensure_future(worker.run(r, partition)) for r in reqs]
        self._tasks.update(tasks)
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        finally:
            self._tasks.difference_update(tasks)

    def acr_stats(self) -> dict[str, int]:
        """ACR call counters of this actor (invocations, stops, retries, throttled, requests,
        sessions_open)."""
        if self._acr is None or self._worker is None:
            return {}
        st = self._acr.stats()
        return {**{k: int(v) for k, v in vars(st).items()}, "sessions_open": self._worker.sessions_open}

    def rollout_counts(self) -> dict[str, int]:
        """`rollout/{completed,failed}`, `rollout/failed/{reason}`, `acr/stop_failed` of this actor."""
        return self._worker.rollout_counts() if self._worker is not None else {}

    async def shutdown(self) -> None:
        """Cancel rollouts still running (each stops its ACR session on the way out), then close."""
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.stop()
        if self._acr is not None:
            await self._acr.close()


class GatewayActorClient:
    """GatewaySessions over the gateway: its Ray actor handle or a local GatewayServer."""

    def __init__(self, handle: Any) -> None:
        self._h = handle

    async def open_session(self, session_id: str, max_context_tokens: int | None = None,
                           sampling: dict | None = None) -> str:
        return await call(self._h, "open_session", session_id, max_context_tokens, sampling)

    async def close_session(self, session_id: str) -> SessionCapture:
        return await call(self._h, "close_session", session_id)


class _ActorSink:
    """SampleSink over any actor handle with a `put(samples, partition)` method."""

    def __init__(self, handle: Any) -> None:
        self._h = handle

    async def put(self, samples: list[Sample], partition: str) -> None:
        await call(self._h, "put", samples, partition)


def _sink_for(handle: Any):
    """The trajectory buffer for a BufferHandle; an actor with a `put` actor method is used as is."""
    if is_actor_method(getattr(handle, "put", None)):
        return _ActorSink(handle)
    from workers.buffer.store import TrajectoryBuffer

    return TrajectoryBuffer.connect(handle)


class RolloutPool:
    """Driver-side handle on the rollout actors (Ray handles, or RolloutActor objects in one
    process): spreads requests over them round-robin."""

    def __init__(self, actors: list[Any]) -> None:
        if not actors:
            raise ValueError("RolloutPool needs at least one rollout actor")
        self._actors = actors
        self._next = 0

    async def run_all(self, reqs: list[RolloutRequest], partition: str) -> list[RolloutOutcome]:
        """Run every request; outcomes in request order. Raises what an actor raised."""
        shards: list[list[int]] = [[] for _ in self._actors]
        for i in range(len(reqs)):
            shards[(self._next + i) % len(shards)].append(i)
        self._next = (self._next + len(reqs)) % len(self._actors)
        used = [(a, idx) for a, idx in zip(self._actors, shards) if idx]
        results = await asyncio.gather(*(call(a, "run_many", [reqs[i] for i in idx], partition) for a, idx in used))
        out: list[RolloutOutcome | None] = [None] * len(reqs)
        for (_, idx), outcomes in zip(used, results):
            for i, o in zip(idx, outcomes):
                out[i] = o
        return out  # type: ignore[return-value]

    async def acr_stats(self) -> dict[str, int]:
        return _sum(await asyncio.gather(*(call(a, "acr_stats") for a in self._actors)))

    async def rollout_counts(self) -> dict[str, int]:
        """Summed `rollout/...` counts of every actor (terminal states and failure reasons)."""
        return _sum(await asyncio.gather(*(call(a, "rollout_counts") for a in self._actors)))

    async def shutdown(self) -> None:
        await asyncio.gather(*(call(a, "shutdown") for a in self._actors), return_exceptions=True)


def _sum(dicts: list[dict[str, int]]) -> dict[str, int]:
    total: Counter[str] = Counter()
    for d in dicts:
        total.update(d)
    return dict(total)


def start_rollout_actors(num: int, settings: RolloutSettings, gateway_handle: Any, buffer_handle: Any,
                         max_concurrency: int = 1000, options: PoolOptions | None = None,
                         runtime_env: dict | None = None) -> list[Any]:
    """Create `num` async Ray actors running RolloutActor (`runtime_env`: e.g. the AWS env vars)."""
    import ray

    cls = ray.remote(num_cpus=0, max_concurrency=max_concurrency)(RolloutActor)
    extra = {"runtime_env": runtime_env} if runtime_env else {}
    return [cls.options(name=f"rollout-{i}-{uuid.uuid4().hex[:6]}", **extra).remote(
                settings, gateway_handle, buffer_handle, options)
            for i in range(num)]


def start_rollout_pool(settings: RolloutSettings, *, num_workers: int, limits: Any, acr: Any, result_host: str,
                       gateway: Any, buffer_handle: Any) -> RolloutPool:
    """Start the named cluster-wide limit actors (`limits`: workers.acr.limits.AcrLimitsConfig)
    and `num_workers` rollout actors whose ACR clients use `acr` (workers.acr.client.AcrClientConfig);
    return the pool. The driver maps its `rollout` config group to these typed settings."""
    from workers.acr.limits import start_limit_actors

    options = PoolOptions(limits=start_limit_actors(limits), result_host=result_host, acr=acr)
    return RolloutPool(start_rollout_actors(num_workers, settings, gateway, buffer_handle, options=options))
