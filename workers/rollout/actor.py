"""RolloutActor: the async Ray actor around one RolloutWorker, and how the pool starts more of them.

Each RolloutActor builds, inside its own process and event loop: the per-process clients of the
cluster-wide limits (one request-rate limiter and one open-session cap, named Ray actors shared
by every rollout actor, see workers/acr/limits/), an AsyncAcrClient whose every HTTP attempt
takes a rate token, a ResultServer for fast completion, and the gateway / buffer adapters; its
rollouts' samples go to the buffer in batches (workers/rollout/put_batcher.py).

Invariant: `RolloutActor.shutdown` returns only once every rollout it ran has stopped its ACR
session (or the stop failed twice: those session ids are returned), so the driver can stop the
local emulator right after, and every sample handed to its put batcher has been written. The
class holds no Ray import: `ray.remote` is applied in `rollout_actor_spawner`, and tests run it in
one process.

Callers: workers/rollout/pool.py (`start_rollout_pool`, recovery's `spawn`), tests.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from workers.core.calls import is_actor_method
from workers.core.netaddr import listen_and_advertise
from workers.core.types import RolloutRequest, RolloutResult
from workers.rollout.clients import GatewaySessionsClient, SampleStoreClient
from workers.rollout.put_batcher import PutBatcher
from workers.rollout.results import ResultBoard, ResultServer
from workers.rollout.stops import LostStop
from workers.rollout.worker import NoGateway, RolloutSettings, RolloutWorker


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
        self._puts: PutBatcher | None = None
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
        clients = limit_clients(opts.limits, owner=_own_actor_name()) if opts.limits is not None else None
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
        gateway = NoGateway() if self._gateway_handle is None else GatewaySessionsClient(self._gateway_handle)
        self._puts = PutBatcher(sink_for(self._buffer_handle))  # one store write per batch of rollouts
        return RolloutWorker(self._settings, gateway, self._acr,
                             self._puts, slots=clients.sessions if clients else None,
                             rollout_slots=clients.rollouts if clients else None,
                             new_sessions=clients.new_sessions if clients else None, results=board, result_url=url)

    async def prepare(self) -> None:
        """Build the worker now (ACR clients, result endpoint, buffer connection) rather than at the
        first rollout, so that this cost overlaps the engines' start."""
        await self._ensure()

    async def run_many(self, reqs: list[RolloutRequest], partition: str) -> list[RolloutResult]:
        """Run `reqs` concurrently; their results in request order. A ContractError cancels the rest
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

    async def stop_lost_sessions(self, session_ids: list[str]) -> list[LostStop]:
        """Stop the ACR sessions and close the gateway sessions of rollouts whose actor died; how
        each stop ended ("stopped", "not_open", "failed"), in order."""
        worker = await self._ensure()
        return list(await asyncio.gather(*(worker.stop_lost_session(s) for s in session_ids)))

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

    async def shutdown(self) -> list[str]:
        """Cancel rollouts still running (each stops its ACR session on the way out), wait for
        every ACR stop in flight, then close. Returns the ACR sessions still open (stops that failed
        even when tried once more)."""
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        still_open: list[str] = []
        if self._puts is not None:  # what a finished rollout handed over is written, not dropped
            await self._puts.close()
        if self._worker is not None:  # every ACR stop ends before the client (and the emulator) goes
            await self._worker.close()
            still_open = sorted(self._worker.open_session_ids())
        if self._server is not None:
            await self._server.stop()
        if self._acr is not None:
            await self._acr.close()
        return still_open


def sink_for(handle: Any):
    """The trajectory buffer for a BufferHandle; an actor with a `put` actor method is used as is."""
    if is_actor_method(getattr(handle, "put", None)):
        return SampleStoreClient(handle)
    from workers.buffer.store import TrajectoryBuffer

    return TrajectoryBuffer.connect(handle)


def _own_actor_name() -> str:
    """This actor's Ray name (the session cap counts its slots under it), "" outside an actor."""
    try:
        import ray

        return ray.get_runtime_context().get_actor_name() or ""
    except Exception:  # noqa: BLE001 - not in a Ray actor (tests run RolloutActor in one process)
        return ""



def rollout_actor_spawner(settings: RolloutSettings, gateway_handle: Any, buffer_handle: Any,
                          max_concurrency: int = 1000, options: PoolOptions | None = None,
                          runtime_env: dict | None = None) -> Callable[[], tuple[Any, str]]:
    """A function that starts one more async Ray actor running RolloutActor, named
    `rollout-{i}-{6 hex}` (i counts the actors it started), and returns (handle, name)."""
    import itertools

    import ray

    cls = ray.remote(num_cpus=0, max_concurrency=max_concurrency)(RolloutActor)
    extra = {"runtime_env": runtime_env} if runtime_env else {}
    counter = itertools.count()

    def spawn() -> tuple[Any, str]:
        name = f"rollout-{next(counter)}-{uuid.uuid4().hex[:6]}"
        return cls.options(name=name, **extra).remote(settings, gateway_handle, buffer_handle, options), name

    return spawn


def start_rollout_actors(num: int, settings: RolloutSettings, gateway_handle: Any, buffer_handle: Any,
                         max_concurrency: int = 1000, options: PoolOptions | None = None,
                         runtime_env: dict | None = None) -> list[Any]:
    """Create `num` async Ray actors running RolloutActor (`runtime_env`: e.g. the AWS env vars)."""
    spawn = rollout_actor_spawner(settings, gateway_handle, buffer_handle, max_concurrency, options, runtime_env)
    return [spawn()[0] for _ in range(num)]
