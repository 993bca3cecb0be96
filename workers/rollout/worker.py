"""RolloutWorker: one ACR invocation per sample, joined with the gateway's token capture.

Invariant: every `RolloutWorker.run` call either returns exactly one `RolloutResult` (the stored
sample's metadata plus the outcome-only fields, workers/core/types.py) with a terminal status ("completed", "truncated" or "failed", with a `reason` from `FailReason`) after storing
exactly one sample, or raises (ContractError: the run must stop; CancelledError) after storing
nothing. On every exit path (success, agent error, bad result, timeout, cancellation, shutdown)
the ACR session is stopped (a task of its own that a cancellation, even a repeated one, cannot
lose; `close` waits for it: workers/rollout/stops.py), the gateway session closed and the
session slot of the cluster-wide cap released (a stop that fails, e.g. while the endpoint
restarts, is tried again in the background and frees the slot once it succeeds; reasons and the
unreachable-endpoint rule: workers/rollout/failures.py). A sample with captured tokens but no
usable reward is stored with status "failed" and reward None, so it can never be trained as if it had one; so is
a session whose turn found no inference replica (`engine_lost`, marked by the gateway), whatever
reward its agent then reported. A session that ran out of context (the gateway answered a turn
400 `context_length_exceeded`, or cut a generation at the context's end) ends "truncated", with the
reward `rollout.overflow` gives it (workers/rollout/overflow.py); the run goes on.

Which bad data stops the run and which fails one rollout: see `workers.rollout.contract`.

Completion: with a `ResultBoard` the agent's POST to `result_url` wakes the worker at once (S3
contract); the HTTP contract's foreground invocation answers with the result itself. S3 polling
(bounded backoff) stays the fallback; it starts `push_grace_s` after the invoke when a result
board is present. The sample is stored before the ACR session is stopped, so the stop's latency
is not on the completion -> sample-in-buffer path.
The A2A contract (workers/rollout/a2a.py) drives one A2A task per rollout over the same session:
setup, then the rollout, polling GetTask; a task left before its end is cancelled before the stop.

Callers: `workers.rollout.actor.RolloutActor` (Ray), tests and scripts/bench_rollout.py (direct).
No Ray import here.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, replace
from typing import Literal, Protocol

import tenacity

from workers.core.seeds import session_seed
from workers.core.types import RolloutRequest, RolloutResult, Sample, SessionCapture
from workers.rollout.contract import (
    RESERVED_KEYS,
    AgentFailed,
    BadResult,
    BadResultStreak,
    ContractError,
    check_row,
    http_payload,
    http_reward,
    new_invocation_id,
    new_session_id,
    parse_record,
    parse_result_body,
    parse_reward,
    result_key,
    s3_payload,
)
from workers.rollout import a2a
from workers.rollout.failures import (EndpointDown, FailReason, agent_could_not_store, fail_reason,
                                      reaching as _reaching)
from workers.rollout.lifecycle import Bounds, Spans, run_bounded
from workers.rollout.overflow import truncation
from workers.rollout.results import ResultBoard
from workers.rollout.settings import RolloutSettings
from workers.rollout.stops import LostStop, SessionStops

__all__ = ["RESERVED_KEYS", "ContractError", "BadResult", "NoGateway", "RolloutSettings", "RolloutResult", "RolloutWorker",
           "build_payload", "new_session_id", "parse_reward", "result_key", "FailReason"]

log = logging.getLogger(__name__)


class GatewaySessions(Protocol):
    """sampling: the session's sampling settings as a dict of the gateway's SamplingDefaults fields."""

    async def open_session(self, session_id: str, max_context_tokens: int | None = None,
                           sampling: dict | None = None) -> str: ...
    async def close_session(self, session_id: str) -> SessionCapture: ...


class NoGateway:
    """GatewaySessions when no model is served (`eval.serve_model=false`): the agent uses its own
    model, so a session has no token and records nothing."""

    async def open_session(self, session_id: str, max_context_tokens: int | None = None,
                           sampling: dict | None = None) -> str:
        return ""

    async def close_session(self, session_id: str) -> SessionCapture:
        return SessionCapture(session_id=session_id, rows=(), num_turns=0)


class AcrCalls(Protocol):
    async def invoke(self, arn: str, session_id: str, payload: dict, qualifier: str | None = None) -> dict: ...
    async def stop_session(self, arn: str, session_id: str, qualifier: str | None = None) -> bool: ...
    async def wait_for_result(self, bucket: str, key: str, timeout_s: float) -> dict | None: ...
    async def delete_result(self, bucket: str, key: str) -> None: ...


class SampleSink(Protocol):
    async def put(self, samples: list[Sample], partition: str) -> None: ...


class RateGate(Protocol):
    """A cluster-wide rate (workers.acr.limits.Coalescer over a RateLimiterService)."""

    async def acquire(self) -> None: ...


class SessionGate(Protocol):
    """The cluster-wide open-session cap (workers.acr.limits.SessionSlots); `priority`: lower first."""

    async def acquire(self, priority: float = 0.0) -> None: ...
    def release_held(self) -> None: ...


def build_payload(req: RolloutRequest, s: RolloutSettings, session_id: str, api_key: str,
                  result_url: str | None = None) -> dict:
    """S3 contract: dataset row + `_rollout`. Raises ContractError if the row has reserved keys.
    Without a gateway (`s.gateway_base_url` empty: evaluation of an agent with its own model) the
    payload names no model endpoint: no base_url, model_id or api_key."""
    rollout = {
        "exp_id": s.exp_id, "input_id": req.input_id, "session_id": session_id,
        "s3_bucket": s.s3_bucket, **model_endpoint(s, api_key),
        "max_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p,
    }  # fmt: skip
    if result_url is not None:
        rollout["result_url"] = result_url
    return s3_payload(req.row, req.input_id, rollout)


def model_endpoint(s: RolloutSettings, api_key: str) -> dict:
    """{base_url, model_id, api_key} of the served policy; {} when no model is served (no gateway)."""
    if not s.gateway_base_url:
        return {}
    return {"base_url": s.gateway_base_url, "model_id": s.model_id, "api_key": api_key}


def _consume(task: asyncio.Future) -> None:
    """Done callback of a task nobody awaits: retrieve its outcome so asyncio does not log it."""
    if not task.cancelled():
        task.exception()


@dataclass(frozen=True)
class _Verdict:
    reward: float | None
    reason: FailReason | None
    error: str | None
    result_s: float | None  # clock time the result reached this worker


class RolloutWorker:
    """Runs rollouts concurrently in one asyncio loop (an async Ray actor in production).

    Collaborators are injected: `gateway` (session open/close), `acr` (ACR + S3 calls; it holds
    the request-rate gate), `sink` (the trajectory buffer), `slots` (open-session cap: container
    slots, optional), `rollout_slots` (rollout-slot cap, a2a only, optional), `new_sessions` (the
    session-creation rate: one unit per session, taken after its container slot, optional),
    `results` + `result_url` (fast completion, optional). `clock` returns seconds (monotonic).
    """

    def __init__(self, settings: RolloutSettings, gateway: GatewaySessions, acr: AcrCalls, sink: SampleSink,
                 clock=time.monotonic, *, slots: SessionGate | None = None, rollout_slots: SessionGate | None = None,
                 new_sessions: RateGate | None = None, results: ResultBoard | None = None,
                 result_url: str | None = None) -> None:
        self._s = settings
        self._gateway = gateway
        self._acr = acr
        self._sink = sink
        self._clock = clock
        self._slots = slots
        self._new_sessions = new_sessions
        self._bounds = Bounds(settings.setup_timeout_s or settings.timeout_s,
                              settings.run_timeout_s or settings.timeout_s, rollout_slots)
        self._results = results
        self._push_seen = False  # an agent posted a result: S3 polling waits push_grace_s from now on
        self._deletes: set[asyncio.Task] = set()  # delete_results: DeleteObject calls in flight
        self._result_url = result_url if results is not None else None
        self._streak = BadResultStreak(settings.max_consecutive_bad_results)
        self.counts: Counter[str] = Counter()
        self._stops = SessionStops(acr, settings.agent_runtime_arn, settings.qualifier, counts=self.counts,
                                   on_stopped=slots.release_held if slots is not None else lambda: None, clock=clock)

    @property
    def sessions_open(self) -> int:
        """ACR sessions this worker invoked and has not stopped yet (0 between rollouts)."""
        return self._stops.open

    def open_session_ids(self) -> set[str]:
        """The ACR sessions this worker invoked and has not stopped yet (a failed stop is retried)."""
        return self._stops.open_ids()

    def rollout_counts(self) -> dict[str, int]:
        """`rollout/{completed,truncated,failed}` and `rollout/failed/{reason}` so far, plus stop failures and
        `rollout/results_pushed` (S3-contract results that arrived by the agent's POST, not by polling)."""
        return dict(self.counts)

    async def run(self, req: RolloutRequest, partition: str) -> RolloutResult:
        """Run one rollout to a terminal state, store its sample in `partition`, stop its ACR
        session, return its result (`session_open`: that stop has not succeeded yet).

        Raises ContractError (reserved key in the row, or a streak of bad results): stop the run.
        """
        out = await self._run(req, partition)
        return replace(out, session_open=True) if self._stops.is_open(out.session_id) else out

    async def _run(self, req: RolloutRequest, partition: str) -> RolloutResult:
        check_row(req.row, req.input_id)
        sid = req.session_id or new_session_id(self._s.exp_id, req.group_id, req.sample_index)
        if self._slots is not None:  # container slots go to groups in arrival order (their ids)
            await self._slots.acquire(req.group_id)
        t0 = self._clock()  # latency_s: the session's life, not the wait for a slot
        invoked = False
        spans = Spans()
        try:
            if self._new_sessions is not None:
                await self._new_sessions.acquire()  # container slot, then the session-creation rate
            # the gateway enforces the sampling the agent is told: the trainer scores exactly this
            # distribution (TrainerSettings.sampling_temperature / sampling_top_p)
            sampling = {"temperature": self._s.temperature, "top_p": self._s.top_p,
                        "max_tokens": self._s.max_tokens, "enforce": True}
            if self._s.seed is not None:
                sampling["seed"] = session_seed(self._s.seed, req.input_id, req.group_id, req.sample_index)
            api_key = await self._gateway.open_session(sid, self._s.max_context_tokens, sampling)
            try:
                if self._results is not None:
                    self._results.expect(sid, api_key)
                invoked = True  # counted before the call: a timed-out invoke may still open it
                self._stops.opened(sid)
                v = await self._attempt(req, sid, api_key, spans)
            finally:
                if self._results is not None:
                    self._results.forget(sid)
                capture = await self._gateway.close_session(sid)  # no task: not on the completion path
            if capture.engine_lost:  # a turn got a 503: whatever the agent did next, the root cause is the engine
                v = _Verdict(None, "engine_lost", "engine_lost: an inference replica died under a turn of this "
                             "session and no other could serve it", v.result_s)
            elif capture.nonlinear:  # gateway.on_nonlinear=error refused a turn: the row is not the agent's history
                v = _Verdict(None, "nonlinear_history", "nonlinear_history: the agent edited its message history "
                             "(gateway.history_mode=linear, on_nonlinear=error)", v.result_s)
            truncated = capture.context_exceeded and v.reason not in ("engine_lost", "nonlinear_history")
            if v.reason is None or truncated:  # a truncated agent spoke the contract, whatever it then reported
                self._streak.on_good()
            elif v.reason == "bad_result":
                self._streak.on_bad(f"dataset row input_id={req.input_id!r}: {v.error}")  # may stop the run
            status = "completed" if v.reward is not None else "failed"
            if truncated:
                cut = truncation(self._s.overflow, v.reward, v.error)
                v, status = _Verdict(cut.reward, None, cut.error, v.result_s), "truncated"
            sample = Sample(session_id=sid, group_id=req.group_id, input_id=req.input_id,
                            sample_index=req.sample_index, rows=capture.rows, reward=v.reward, status=status,
                            latency_s=self._clock() - t0, error=v.error, setup_s=spans.setup_s,
                            rollout_slot_wait_s=spans.rollout_slot_wait_s, num_turns=capture.num_turns,
                            agent_metrics=tuple(sorted(spans.agent_metrics.items())) if v.reward is not None else ())
            await self._sink.put([sample], partition)
            stored_s = self._clock()
            self.counts[f"rollout/{status}"] += 1
            if v.reason is not None:
                self.counts[f"rollout/failed/{v.reason}"] += 1
            return RolloutResult(sample.info(), v.reason, None if v.result_s is None else stored_s - v.result_s,
                                 num_input_tokens=sum(len(r.token_ids) - r.num_generated for r in capture.rows))
        finally:
            if invoked:  # its own task: a second cancellation does not lose it (workers/rollout/stops.py)
                await self._stops.stop(sid)  # gives the slot back once stopped (a failed stop is retried)
            elif self._slots is not None:
                self._slots.release_held()

    async def _attempt(self, req: RolloutRequest, sid: str, api_key: str, spans: Spans) -> _Verdict:
        """Invoke and wait for the result under the rollout timeout (a2a: each phase under its
        own, workers/rollout/lifecycle.py); failures become data."""
        a2a_contract = self._s.contract == "a2a"
        limit_s = self._bounds.run_timeout_s if a2a_contract else self._s.timeout_s
        try:
            if a2a_contract:
                reward, result_s = await self._a2a_rollout(req, sid, api_key, spans)
            else:
                async with asyncio.timeout(self._s.timeout_s):  # unlike wait_for, no extra task (latency)
                    reward, result_s = await self._invoke_and_wait(req, sid, api_key)
            return _Verdict(reward, None, None, result_s)
        except TimeoutError:  # asyncio.TimeoutError is TimeoutError since 3.11
            return _Verdict(None, "timeout", f"timeout after {limit_s}s waiting for {self._where(req, sid)}", None)
        except ContractError:
            raise
        except Exception as exc:  # agent/transport failure: the rollout fails, the run goes on
            log.debug("rollout %s failed", sid, exc_info=True)
            reason = fail_reason(exc)
            return _Verdict(None, reason, f"{reason}: {type(exc).__name__}: {exc}", None)

    def _where(self, req: RolloutRequest, sid: str) -> str:
        if self._s.contract == "a2a":
            return f"the A2A task of session {sid}"
        if self._s.contract == "http":
            return f"the HTTP result of session {sid}"
        return f"s3://{self._s.s3_bucket}/{result_key(self._s.exp_id, req.input_id, sid)}"

    def _result_url_of(self, sid: str) -> str | None:
        return f"{self._result_url}/{sid}" if self._result_url else None

    async def _invoke_and_wait(self, req: RolloutRequest, sid: str, api_key: str) -> tuple[float, float]:
        if self._s.contract == "http":
            return await self._http_rollout(req, sid, api_key)
        return await self._s3_rollout(req, sid, api_key)

    # -- A2A contract (workers/rollout/a2a.py) ----------------------------------------------

    async def _a2a_rollout(self, req: RolloutRequest, sid: str, api_key: str, spans: Spans) -> tuple[float, float]:
        s = self._s
        if not s.gateway_base_url:
            raise ContractError("rollout.contract=a2a needs the gateway: the agent's task_input names its model")
        sampling = {"temperature": s.temperature, "top_p": s.top_p, "max_tokens": s.max_tokens}
        task = a2a.task_input(req.row, input_id=req.input_id, group_id=req.group_id,
                              endpoint=model_endpoint(s, api_key), sampling=sampling, timeout_s=s.timeout_s)

        async def call(body: dict) -> dict:
            with _reaching("acr_unavailable"):
                return await self._acr.invoke(s.agent_runtime_arn, sid, body, s.qualifier)

        session = a2a.A2ASession(call, sid, poll_initial_s=s.poll_initial_s, poll_max_s=s.poll_max_s)
        try:
            dump = await run_bounded(session, task, self._bounds, spans, self._clock, priority=req.group_id)
        finally:
            await session.cancel_if_unfinished()  # after the rollout slot went back, before the session stop in `_run`
        reward = a2a.reward_of(dump, self._where(req, sid))
        spans.agent_metrics = dict(dump.metrics)  # a rewarded dump's only: a failed rollout reports none
        return reward, self._clock()

    # -- S3 contract ------------------------------------------------------------------------

    async def _s3_rollout(self, req: RolloutRequest, sid: str, api_key: str) -> tuple[float, float]:
        s = self._s
        payload = build_payload(req, s, sid, api_key, self._result_url_of(sid))
        with _reaching("acr_unavailable"):
            await self._acr.invoke(s.agent_runtime_arn, sid, payload, s.qualifier)
        key = result_key(s.exp_id, req.input_id, sid)
        where = f"s3://{s.s3_bucket}/{key}"
        poll = asyncio.ensure_future(self._poll_s3(key))
        posted = self._results.future(sid) if self._results is not None else None
        try:
            if posted is None:
                got = await poll
            else:  # the board's own future: a post wakes this coroutine directly (no wrapper task)
                await asyncio.wait((poll, posted), return_when=asyncio.FIRST_COMPLETED)
                got = posted.result() if posted.done() else poll.result()  # poll.result re-raises S3 errors
        finally:
            if not poll.done():
                poll.cancel()  # not awaited: finishing its cancellation is not on the completion path
                poll.add_done_callback(_consume)
        if posted is None or not posted.done():
            if got is None:
                raise TimeoutError(f"no result at {where} within {s.timeout_s}s")
            self._delete_result(key)
            return self._s3_reward(got, where, key), self._clock()
        self._push_seen = True
        self.counts["rollout/results_pushed"] += 1
        self._delete_result(key)  # the agent writes S3 before it posts (agent_common/rollout_contract.py)
        posted_at = f"{where} (posted)"
        return self._s3_reward(parse_result_body(got.body, posted_at), posted_at, key), got.arrived_s

    def _s3_reward(self, result: dict, where: str, key: str) -> float:
        """`parse_reward`, but an error object whose agent could not reach S3 to write this result is
        the store's failure (EndpointDown `s3_unavailable`, workers/rollout/failures.py), not the agent's."""
        try:
            return parse_reward(result, where)
        except AgentFailed as exc:
            if (line := agent_could_not_store(exc.stop_reason, self._s.s3_bucket, key)) is not None:
                raise EndpointDown("s3_unavailable", exc, line) from exc
            raise

    def _delete_result(self, key: str) -> None:
        """With `delete_results`, DeleteObject the result just read, off the completion path; a
        failed delete only leaves the object (counted as `result_delete_failed`)."""
        if not self._s.delete_results:
            return

        async def delete() -> None:
            try:
                await self._acr.delete_result(self._s.s3_bucket, key)
            except Exception:  # best effort: the result is already in hand
                log.debug("delete of s3://%s/%s failed", self._s.s3_bucket, key, exc_info=True)
                self.counts["result_delete_failed"] += 1

        task = asyncio.ensure_future(delete())
        self._deletes.add(task)
        task.add_done_callback(self._deletes.discard)

    async def _poll_s3(self, key: str) -> dict | None:
        if self._results is not None and self._push_seen and self._s.push_grace_s > 0:
            await asyncio.sleep(self._s.push_grace_s)
        with _reaching("s3_unavailable"):
            return await self._acr.wait_for_result(self._s.s3_bucket, key, math.inf)  # the rollout timeout decides

    # -- HTTP contract ----------------------------------------------------------------------

    async def _http_rollout(self, req: RolloutRequest, sid: str, api_key: str) -> tuple[float, float]:
        s = self._s
        inv = new_invocation_id()
        where = f"session {sid}"
        config = {**model_endpoint(s, api_key), "session_id": sid,
                  "exp_id": s.exp_id, "input_id": req.input_id, "max_tokens": s.max_tokens,
                  "temperature": s.temperature, "top_p": s.top_p}
        if (url := self._result_url_of(sid)) is not None:
            config["result_url"] = url

        async def call(operation: Literal["start", "get"]):
            payload = http_payload(req.row, req.input_id, config, operation, inv, s.http_background)
            with _reaching("acr_unavailable"):
                answer = await self._acr.invoke(s.agent_runtime_arn, sid, payload, s.qualifier)
            return parse_record(answer, inv, where)

        record = await call("start")
        if record.status == "in_progress":  # background start: poll `get` with bounded backoff
            poll = tenacity.AsyncRetrying(
                retry=tenacity.retry_if_result(lambda r: r.status == "in_progress"),
                wait=tenacity.wait_exponential_jitter(initial=s.poll_initial_s, max=s.poll_max_s,
                                                      jitter=s.poll_initial_s),
                stop=tenacity.stop_never,  # bounded by the rollout timeout around this call
            )
            record = await poll(call, "get")
        return http_reward(record, where), self._clock()

    # -- cleanup ----------------------------------------------------------------------------

    async def stop_lost_session(self, session_id: str) -> LostStop:
        """Close the gateway session and stop the ACR session of a rollout whose actor died (the
        pool asks a live actor): "stopped", "not_open" (ACR did not know it) or "failed" (counted in
        `acr/stop_failed`). Never raises for a session that is already gone."""
        try:
            await self._gateway.close_session(session_id)
        except Exception:  # noqa: BLE001 - not open at the gateway (closed before the death, or never opened)
            pass
        return await self._stops.stop_lost(session_id)

    async def close(self) -> None:
        """Wait for every ACR stop in flight and try each failed one once more: call after the
        rollouts were cancelled, before the ACR client (or endpoint) goes."""
        await self._stops.close()
