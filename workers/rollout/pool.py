"""The Ray side of the rollout pool: RolloutActor (an async actor per worker) and RolloutPool.

Each RolloutActor builds, inside its own process and event loop: the per-process clients of the
cluster-wide limits (one request-rate limiter and one open-session cap, named Ray actors shared
by every rollout actor, see workers.acr.limits), an AsyncAcrClient whose every HTTP attempt
takes a rate token, a ResultServer for fast completion, and the gateway / buffer adapters.

Invariant: `RolloutPool.run_all` returns one outcome per request, or raises (a ContractError from
any actor stops the run; Ray re-raises it as an instance of ContractError). `shutdown` cancels
rollouts still running; each stops its ACR session on the way out.

Callers: orchestrator/main.py builds the pool; the loops call `run_all`.
"""

from __future__ import annotations

import asyncio
import socket
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

from workers.core.types import RolloutRequest, Sample, SessionCapture
from workers.rollout.worker import RolloutOutcome, RolloutSettings, RolloutWorker
from workers.rollout.results import ResultBoard, ResultServer


@dataclass(frozen=True)
class PoolOptions:
    """What a rollout actor needs beyond RolloutSettings.

    limits: workers.acr.limits.LimitHandles (the named limit actors), or None for no limits.
    acr: workers.acr.client.AcrClientConfig, or None for defaults.
    result_host: interface the fast-completion result server listens on ("" = no server);
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
                 options: PoolOptions | None = None) -> None:
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
            self._server = ResultServer(board, host=opts.result_host)
            url = await self._server.start()
            advertise = opts.result_advertise_host or (opts.result_host if opts.result_host != "0.0.0.0"
                                                       else socket.gethostbyname(socket.gethostname()))
            url = url.replace(f"//{opts.result_host}:", f"//{advertise}:", 1)
        return RolloutWorker(self._settings, GatewayActorClient(self._gateway_handle), self._acr,
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
    """GatewaySessions over the gateway's Ray actor handle."""

    def __init__(self, handle: Any) -> None:
        self._h = handle

    async def open_session(self, session_id: str, max_context_tokens: int | None = None) -> str:
        return await self._h.open_session.remote(session_id, max_context_tokens)

    async def close_session(self, session_id: str) -> SessionCapture:
        return await self._h.close_session.remote(session_id)


class _ActorSink:
    """SampleSink over any actor handle with a `put(samples, partition)` method."""

    def __init__(self, handle: Any) -> None:
        self._h = handle

    async def put(self, samples: list[Sample], partition: str) -> None:
        await self._h.put.remote(samples, partition)


def _sink_for(handle: Any):
    """The trajectory buffer for a BufferHandle; an actor with `put.remote` is used as is."""
    put = getattr(handle, "put", None)
    if put is not None and hasattr(put, "remote"):
        return _ActorSink(handle)
    from workers.buffer.store import TrajectoryBuffer

    return TrajectoryBuffer.connect(handle)


class RolloutPool:
    """Driver-side handle on the rollout actors: spreads requests over them round-robin."""

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
        results = await asyncio.gather(*(a.run_many.remote([reqs[i] for i in idx], partition) for a, idx in used))
        out: list[RolloutOutcome | None] = [None] * len(reqs)
        for (_, idx), outcomes in zip(used, results):
            for i, o in zip(idx, outcomes):
                out[i] = o
        return out  # type: ignore[return-value]

    async def acr_stats(self) -> dict[str, int]:
        return _sum(await asyncio.gather(*(a.acr_stats.remote() for a in self._actors)))

    async def rollout_counts(self) -> dict[str, int]:
        """Summed `rollout/...` counts of every actor (terminal states and failure reasons)."""
        return _sum(await asyncio.gather(*(a.rollout_counts.remote() for a in self._actors)))

    async def shutdown(self) -> None:
        await asyncio.gather(*(a.shutdown.remote() for a in self._actors), return_exceptions=True)


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


def pool_from_config(rollout_cfg: Any, *, exp_id: str, agent_runtime_arn: str, gateway_base_url: str,
                     model_id: str, gateway: Any, buffer_handle: Any) -> RolloutPool:
    """Start the limit actors and `rollout_cfg.num_workers` rollout actors from the `rollout`
    config group (orchestrator.config.RolloutConfig); return the pool."""
    from workers.acr.client import AcrClientConfig
    from workers.acr.limits import AcrLimitsConfig, start_limit_actors

    c, acr = rollout_cfg, rollout_cfg.acr
    settings = RolloutSettings(
        exp_id=exp_id, agent_runtime_arn=agent_runtime_arn, qualifier=acr.qualifier, s3_bucket=acr.s3_bucket,
        gateway_base_url=gateway_base_url, model_id=model_id, max_tokens=c.max_tokens, temperature=c.temperature,
        top_p=c.top_p, timeout_s=c.timeout_s, max_context_tokens=c.max_context_tokens, contract=c.contract,
        http_background=c.http_background, push_grace_s=c.push_grace_s,
        max_consecutive_bad_results=c.max_consecutive_bad_results)
    limits = start_limit_actors(AcrLimitsConfig(requests_per_s=acr.limits.requests_per_s,
                                                headroom=acr.limits.headroom,
                                                max_open_sessions=acr.limits.max_open_sessions))
    options = PoolOptions(limits=limits, result_host=c.result_host, acr=AcrClientConfig(
        region_name=acr.region, retry_mode=acr.retry_mode, max_attempts=acr.max_attempts,
        runtime_error_attempts=acr.runtime_error_attempts, poll_initial_s=c.poll_initial_s, poll_max_s=c.poll_max_s))
    return RolloutPool(start_rollout_actors(c.num_workers, settings, gateway, buffer_handle, options=options))
