"""Rollout pool: one ACR invocation per sample, joined with the gateway's token capture.

Invariant: every `RolloutWorker.run` call returns exactly one `RolloutOutcome` with a terminal
status ("completed" or "failed"), and on every exit path (success, agent error, missing result,
timeout, cancellation) the ACR session is stopped and the gateway session closed. A sample with
captured tokens but no finite reward is stored with status "failed" and reward None, so it can
never be trained as if it had one.

Callers: `orchestrator.loop_sync` through `RolloutPool.run_all`. The worker class holds no Ray
import; `start_rollout_workers` applies `ray.remote` where the actors are created.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from orchestrator.types import RolloutRequest, Sample, SessionCapture

RESERVED_KEYS = ("_rollout", "_config", "_agentcore_runtime")  # keys a dataset row must not carry
log = logging.getLogger(__name__)


class ContractError(ValueError):
    """The agent or the dataset broke the rollout contract (names the row and the field)."""


@dataclass(frozen=True)
class RolloutSettings:
    """What every rollout of a run shares. Times in seconds."""

    exp_id: str
    agent_runtime_arn: str
    qualifier: str | None
    s3_bucket: str
    gateway_base_url: str
    model_id: str
    max_tokens: int
    temperature: float
    top_p: float
    timeout_s: float
    max_context_tokens: int


@dataclass(frozen=True)
class RolloutOutcome:
    """What the driver learns of a rollout; the full sample goes to the trajectory buffer."""

    session_id: str
    group_id: int
    sample_index: int
    status: str
    reward: float | None
    num_generated_tokens: int
    latency_s: float
    error: str | None


class GatewaySessions(Protocol):
    async def open_session(self, session_id: str, max_context_tokens: int | None = None) -> str: ...
    async def close_session(self, session_id: str) -> SessionCapture: ...


class AcrCalls(Protocol):
    async def invoke(self, arn: str, session_id: str, payload: dict, qualifier: str | None = None) -> dict: ...
    async def stop_session(self, arn: str, session_id: str, qualifier: str | None = None) -> bool: ...
    async def wait_for_result(self, bucket: str, key: str, timeout_s: float) -> dict | None: ...


class SampleSink(Protocol):
    async def put(self, samples: list[Sample], partition: str) -> None: ...


def new_session_id(exp_id: str, group_id: int, sample_index: int) -> str:
    """A `runtimeSessionId` (33-256 chars, ACR's bound): readable prefix + 32 hex random chars."""
    return f"{exp_id[:64]}-g{group_id}-s{sample_index}-{uuid.uuid4().hex}"


def result_key(exp_id: str, input_id: str, session_id: str) -> str:
    """S3 key of the agent's result (agentcore-rl-toolkit S3-result contract)."""
    return f"{exp_id}/{input_id}/{session_id}.json"


def build_payload(req: RolloutRequest, s: RolloutSettings, session_id: str, api_key: str) -> dict:
    """Dataset row + the reserved `_rollout` dict. Raises ContractError if the row has reserved keys."""
    bad = [k for k in RESERVED_KEYS if k in req.row]
    if bad:
        raise ContractError(f"dataset row input_id={req.input_id!r} has reserved field(s) {bad}")
    rollout = {
        "exp_id": s.exp_id, "input_id": req.input_id, "session_id": session_id,
        "s3_bucket": s.s3_bucket, "base_url": s.gateway_base_url, "model_id": s.model_id,
        "api_key": api_key, "max_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p,
    }
    return {**req.row, "_rollout": rollout}


def parse_reward(result: dict, where: str) -> float:
    """The reward of a `{"rewards": r}` result (r a number, or a list whose last item counts).

    Raises ContractError naming `where` if the field is missing, empty, non-numeric or not finite.
    """
    if "rewards" not in result:
        raise ContractError(f"{where}: result has no 'rewards' field (keys: {sorted(result)})")
    r = result["rewards"]
    if isinstance(r, list):
        if not r:
            raise ContractError(f"{where}: 'rewards' is an empty list")
        r = r[-1]
    if isinstance(r, bool) or not isinstance(r, (int, float)):
        raise ContractError(f"{where}: 'rewards' is not a number: {r!r}")
    if not math.isfinite(r):
        raise ContractError(f"{where}: 'rewards' is not finite: {r!r}")
    return float(r)


class RolloutWorker:
    """Runs rollouts concurrently in one asyncio loop (an async Ray actor in production).

    Collaborators are injected: `gateway` (session open/close), `acr` (ACR + S3 calls),
    `sink` (the trajectory buffer). `clock` returns seconds (monotonic).
    """

    def __init__(self, settings: RolloutSettings, gateway: GatewaySessions, acr: AcrCalls,
                 sink: SampleSink, clock=time.monotonic) -> None:
        self._s = settings
        self._gateway = gateway
        self._acr = acr
        self._sink = sink
        self._clock = clock
        self._sessions_open = 0

    @property
    def sessions_open(self) -> int:
        """ACR sessions this worker invoked and has not stopped yet (0 between rollouts)."""
        return self._sessions_open

    async def run(self, req: RolloutRequest, partition: str) -> RolloutOutcome:
        """Run one rollout to a terminal state, store its sample in `partition`, return the outcome.

        ContractError from the dataset row propagates (the run must stop and name the row).
        """
        t0 = self._clock()
        session_id = new_session_id(self._s.exp_id, req.group_id, req.sample_index)
        reward: float | None = None
        error: str | None = None
        api_key = await self._gateway.open_session(session_id, self._s.max_context_tokens)
        try:
            payload = build_payload(req, self._s, session_id, api_key)  # ContractError: stop the run
            self._sessions_open += 1  # counted before the call: a timed-out invoke may still open it
            try:
                reward = await asyncio.wait_for(self._invoke_and_wait(req, session_id, payload), self._s.timeout_s)
            except TimeoutError:  # asyncio.TimeoutError is TimeoutError since 3.11
                key = result_key(self._s.exp_id, req.input_id, session_id)
                error = f"timeout after {self._s.timeout_s}s waiting for s3://{self._s.s3_bucket}/{key}"
            except ContractError as exc:
                error = f"contract: {exc}"
            except Exception as exc:  # agent/transport failure: the rollout fails, the run goes on
                error = f"{type(exc).__name__}: {exc}"
            finally:
                try:
                    await self._stop_acr_session(session_id)
                except Exception as exc:  # the session stays counted open: visible in acr/sessions_open
                    log.warning("StopRuntimeSession failed for %s: %s", session_id, exc)
                    error = error or f"stop failed: {type(exc).__name__}: {exc}"
        finally:
            capture = await self._gateway.close_session(session_id)
        status = "completed" if reward is not None else "failed"
        sample = Sample(session_id=session_id, group_id=req.group_id, input_id=req.input_id,
                        sample_index=req.sample_index, rows=capture.rows, reward=reward, status=status,
                        latency_s=self._clock() - t0, error=error)
        await self._sink.put([sample], partition)
        return RolloutOutcome(session_id, req.group_id, req.sample_index, status, reward,
                              sample.num_generated_tokens, sample.latency_s, error)

    async def _invoke_and_wait(self, req: RolloutRequest, session_id: str, payload: dict) -> float:
        s = self._s
        await self._acr.invoke(s.agent_runtime_arn, session_id, payload, s.qualifier)
        key = result_key(s.exp_id, req.input_id, session_id)
        result = await self._acr.wait_for_result(s.s3_bucket, key, s.timeout_s)
        if result is None:
            raise TimeoutError(f"no result at s3://{s.s3_bucket}/{key} within {s.timeout_s}s")
        return parse_reward(result, f"s3://{s.s3_bucket}/{key}")

    async def _stop_acr_session(self, session_id: str) -> None:
        """Stop the ACR session; shielded so a cancelled rollout still releases its session."""
        await asyncio.shield(self._acr.stop_session(self._s.agent_runtime_arn, session_id, self._s.qualifier))
        self._sessions_open -= 1


class RolloutActor:
    """The Ray-facing shell: builds the AsyncAcrClient, the gateway and buffer adapters inside the
    actor process, and exposes `run` / `run_many` / `acr_stats`."""

    def __init__(self, settings: RolloutSettings, gateway_handle: Any, buffer_handle: Any) -> None:
        self._settings = settings
        self._gateway_handle = gateway_handle
        self._buffer_handle = buffer_handle
        self._worker: RolloutWorker | None = None
        self._acr = None
        self._tasks: set[asyncio.Future] = set()

    async def _ensure(self) -> RolloutWorker:
        if self._worker is None:
            from workers.acr.client import AcrClientConfig, AsyncAcrClient
            from workers.buffer import TrajectoryBuffer

            self._acr = await AsyncAcrClient(AcrClientConfig()).start()
            sink = TrajectoryBuffer.connect(self._buffer_handle)
            self._worker = RolloutWorker(self._settings, _GatewayActorClient(self._gateway_handle), self._acr, sink)
        return self._worker

    async def run_many(self, reqs: list[RolloutRequest], partition: str) -> list[RolloutOutcome]:
        """Run `reqs` concurrently; outcomes in request order."""
        worker = await self._ensure()
        tasks = [asyncio.ensure_future(worker.run(r, partition)) for r in reqs]
        self._tasks.update(tasks)
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            self._tasks.difference_update(tasks)

    def acr_stats(self) -> dict[str, int]:
        """ACR call counters of this actor (invocations, stops, retries, throttled, sessions_open)."""
        if self._acr is None or self._worker is None:
            return {}
        st = self._acr.stats()
        return {**{k: int(v) for k, v in vars(st).items()}, "sessions_open": self._worker.sessions_open}

    async def shutdown(self) -> None:
        """Cancel rollouts still running (each stops its ACR session on the way out), then close."""
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._acr is not None:
            await self._acr.close()


class _GatewayActorClient:
    """GatewaySessions over the gateway's Ray actor handle."""

    def __init__(self, handle: Any) -> None:
        self._h = handle

    async def open_session(self, session_id: str, max_context_tokens: int | None = None) -> str:
        return await self._h.open_session.remote(session_id, max_context_tokens)

    async def close_session(self, session_id: str) -> SessionCapture:
        return await self._h.close_session.remote(session_id)


class RolloutPool:
    """Driver-side handle on the rollout actors: spreads a step's requests over them round-robin."""

    def __init__(self, actors: list[Any]) -> None:
        if not actors:
            raise ValueError("RolloutPool needs at least one rollout actor")
        self._actors = actors

    async def run_all(self, reqs: list[RolloutRequest], partition: str) -> list[RolloutOutcome]:
        shards: list[list[RolloutRequest]] = [[] for _ in self._actors]
        for i, r in enumerate(reqs):
            shards[i % len(shards)].append(r)
        results = await asyncio.gather(*(a.run_many.remote(sh, partition)
                                         for a, sh in zip(self._actors, shards) if sh))
        return [o for shard in results for o in shard]

    async def acr_stats(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for st in await asyncio.gather(*(a.acr_stats.remote() for a in self._actors)):
            for k, v in st.items():
                total[k] = total.get(k, 0) + v
        return total

    async def shutdown(self) -> None:
        await asyncio.gather(*(a.shutdown.remote() for a in self._actors), return_exceptions=True)


def start_rollout_actors(num: int, settings: RolloutSettings, gateway_handle: Any, buffer_handle: Any,
                         max_concurrency: int = 1000) -> list[Any]:
    """Create `num` async Ray actors running RolloutActor."""
    import ray

    cls = ray.remote(num_cpus=0, max_concurrency=max_concurrency)(RolloutActor)
    return [cls.options(name=f"rollout-{i}-{uuid.uuid4().hex[:6]}").remote(settings, gateway_handle, buffer_handle)
            for i in range(num)]
