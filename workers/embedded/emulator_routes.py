"""The ACR emulator's HTTP routes: the three data-plane calls and the stats endpoint.

`Emulator` owns the session table (workers.embedded.emulator_sessions), the command workspaces
(workers.embedded.emulator_commands) and the fault plan (workers.embedded.faults) over agent
processes already started (workers.embedded.emulator_agents); `acr_error` answers in ACR's
rest-json error shape. The contract these routes keep, and its invariants, are in the docstring of
workers.embedded.emulator, which builds an `Emulator` and serves `Emulator.app()`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import Counter
from dataclasses import asdict, replace
from pathlib import Path

import aiohttp
from aiohttp import web

from workers.embedded.emulator_agents import AgentProcess, ping_status, restart_agent
from workers.embedded.emulator_commands import (
    DEFAULT_COMMAND_TIMEOUT_S, EVENTSTREAM_CONTENT_TYPE, MAX_COMMAND_CHARS, MAX_COMMAND_TIMEOUT_S,
    MIN_COMMAND_TIMEOUT_S, Workspaces, exception_event, run_command,
)  # fmt: skip
from workers.embedded.emulator_config import A2A_HEADERS, RUNTIME_ARN_RE, STATS_PATH, EmulatorConfig
from workers.embedded.emulator_sessions import EmulatorStats, RateWindow, SessionRefused, SessionTable, TokenBucket
from workers.embedded.faults import AGENT_FAULTS, EMULATOR_FAULT_ERRORS, EMULATOR_FAULTS, FAULT_HEADER, FaultPlan

logger = logging.getLogger(__name__)

SESSION_HEADER = "X-Amzn-Bedrock-AgentCore-Runtime-Session-Id"
REQUEST_ID_HEADER = "X-Amzn-Bedrock-AgentCore-Runtime-Request-Id"
USER_ID_HEADER = "X-Amzn-Bedrock-AgentCore-Runtime-User-Id"
CUSTOM_HEADER_PREFIX = "x-amzn-bedrock-agentcore-runtime-custom-"  # forwarded to the agent, like ACR
SESSION_ID_MIN_LEN = 33  # botocore shape SessionType: min 33
SESSION_ID_MAX_LEN = 256  # botocore shape SessionType: max 256
MAX_PAYLOAD_BYTES = 100_000_000  # botocore shape Body: max 100 MB
AGENT_ERROR_SNIPPET_CHARS = 2000  # of an agent's error body quoted in RuntimeClientError
# an agent process that exits is started again (ACR gives each session a fresh microVM, so a crash
# costs that session's rollout only), at most this many times per agent index over the emulator's life:
# an agent that crashes on every start is then left dead and calls fail "no agent process is alive"
MAX_AGENT_RESTARTS = 100

_ERROR_STATUS = {
    "ValidationException": 400,
    "ServiceQuotaExceededException": 402,
    "ResourceNotFoundException": 404,
    "RuntimeClientError": 424,
    "ThrottlingException": 429,
    "InternalServerException": 500,
}


def acr_error(error: str, message: str, status: int | None = None, **extra) -> web.Response:
    """An error in ACR's rest-json shape: botocore reads the code from x-amzn-ErrorType."""
    status = status if status is not None else _ERROR_STATUS[error]
    return web.json_response({"message": message, **extra}, status=status, headers={"x-amzn-ErrorType": error})


def validation_error(name: str, message: str) -> web.Response:
    return acr_error(
        "ValidationException", message, reason="FieldValidationFailed", fieldList=[{"name": name, "message": message}]
    )


class Emulator:
    """The data-plane routes over already-started agents; owns the session table and workspaces."""

    def __init__(
        self, cfg: EmulatorConfig, agents: list[AgentProcess], http: aiohttp.ClientSession, workdir: Path
    ) -> None:
        now = time.monotonic()
        burst = cfg.session_burst or max(1, round(cfg.session_rate_per_s))
        self.cfg = cfg
        self.agents = agents
        self.http = http
        self.table = SessionTable(
            cfg.num_agents, TokenBucket(cfg.session_rate_per_s, burst, now), idle_timeout_s=cfg.idle_timeout_s,
            max_lifetime_s=cfg.max_lifetime_s, max_open=cfg.max_open_sessions,
        )  # fmt: skip
        self.request_limiter = (
            TokenBucket(cfg.request_rate_per_s, max(1, round(cfg.request_rate_per_s)), now)
            if cfg.request_rate_per_s
            else None
        )
        self.rate = RateWindow(1.0)
        self.calls: Counter = Counter()
        self.request_throttled = 0
        self.plan = FaultPlan(cfg.faults) if cfg.faults is not None and cfg.faults.total() > 0 else None
        self.fault_hits: Counter = Counter()  # session id -> emulator-side fault answers sent
        self.faults_injected: Counter = Counter()
        self.workspaces = Workspaces(workdir)
        self.agent_env: dict[str, str] = dict(cfg.agent_env)  # what a restarted agent gets (serve adds the endpoint)
        self.agent_restarts: Counter = Counter()  # agent index -> restarts started
        self._restarting: dict[int, asyncio.Task] = {}

    # ------------------------------------------------------------------ app

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_PAYLOAD_BYTES, middlewares=[self._count_calls])
        # The ARN arrives percent-encoded ('/' as %2F); aiohttp matches on the encoded path.
        app.router.add_post("/runtimes/{arn:[^/]+}/invocations", self.invoke)
        app.router.add_post("/runtimes/{arn:[^/]+}/invocations/", self.invoke)  # A2A clients' JSON-RPC URL
        app.router.add_post("/runtimes/{arn:[^/]+}/stopruntimesession", self.stop_session)
        app.router.add_post("/runtimes/{arn:[^/]+}/commands", self.command)
        app.router.add_get(STATS_PATH, self.stats_handler)
        return app

    @web.middleware
    async def _count_calls(self, request: web.Request, handler) -> web.StreamResponse:
        if not request.path.startswith("/runtimes/"):
            return await handler(request)
        self.rate.record(time.monotonic())
        self.calls[request.path.rsplit("/", 1)[-1]] += 1
        if self.request_limiter is not None and not self.request_limiter.try_acquire(time.monotonic()):
            self.request_throttled += 1
            return acr_error("ThrottlingException", "Rate exceeded")
        return await handler(request)

    def stats(self) -> EmulatorStats:
        self._expire(time.monotonic())
        snap = self.table.snapshot(tuple(a.proc.pid for a in self.agents), tuple(a.port for a in self.agents))
        return replace(
            snap,
            invocations=self.calls["invocations"],
            commands=self.calls["commands"],
            stops=self.calls["stopruntimesession"],
            requests=self.rate.total,
            peak_request_rate=self.rate.peak,
            throttled=snap.throttled + self.request_throttled,
            faults_injected=dict(self.faults_injected),
        )

    async def stats_handler(self, request: web.Request) -> web.Response:
        return web.json_response(asdict(self.stats()))

    # ------------------------------------------------------------------ checks

    def _check_target(self, request: web.Request) -> web.Response | None:
        arn = request.match_info["arn"]
        if not RUNTIME_ARN_RE.fullmatch(arn):
            return validation_error("agentRuntimeArn", f"{arn!r} is not an agent runtime ARN")
        if arn != self.cfg.agent_runtime_arn:
            return acr_error("ResourceNotFoundException", f"agent runtime {arn} not found")
        qualifier = request.query.get("qualifier", "DEFAULT")
        if qualifier not in self.cfg.qualifiers:
            return acr_error("ResourceNotFoundException", f"endpoint {qualifier} of {arn} not found")
        return None

    def _session_id(self, request: web.Request, required: bool = False) -> str | web.Response:
        sid = request.headers.get(SESSION_HEADER)
        if sid is None:
            if required:
                return validation_error("runtimeSessionId", "runtimeSessionId is required")
            sid = str(uuid.uuid4())  # botocore fills this idempotency token itself
        if not SESSION_ID_MIN_LEN <= len(sid) <= SESSION_ID_MAX_LEN:
            return validation_error(
                "runtimeSessionId",
                f"runtimeSessionId length {len(sid)} outside [{SESSION_ID_MIN_LEN}, {SESSION_ID_MAX_LEN}]",
            )
        return sid

    async def _refresh_agents(self) -> None:
        """Mark exited agents dead and start each again (bounded by MAX_AGENT_RESTARTS); when no agent
        is alive, wait for the restarts under way (each bounded by the agents' start timeout)."""
        for a in self.agents:
            if a.alive():
                continue
            if self.table.mark_dead(a.index):
                logger.warning("agent %d (pid %d) exited with %s", a.index, a.proc.pid, a.proc.returncode)
            if a.index not in self._restarting and self.agent_restarts[a.index] < MAX_AGENT_RESTARTS:
                self.agent_restarts[a.index] += 1
                self._restarting[a.index] = asyncio.ensure_future(self._restart(a.index))
        if self._restarting and not any(a.alive() for a in self.agents):
            await asyncio.wait(list(self._restarting.values()))

    async def _restart(self, index: int) -> None:
        try:
            agent = await restart_agent(self.cfg.agent_cmd, index, self.agent_env, self.http,
                                        self.cfg.agent_start_timeout_s)
        except Exception as exc:  # noqa: BLE001  left dead; the next call's refresh tries again (bounded)
            logger.warning("agent %d could not be restarted: %s", index, exc)
        else:
            self.agents[index] = agent
            self.table.mark_alive(index)
            logger.warning("agent %d restarted (pid %d)", index, agent.proc.pid)
        finally:
            self._restarting.pop(index, None)

    async def stop_restarts(self) -> None:
        """Cancel the restarts under way (shutdown); the agents they started are stopped with the rest."""
        for task in list(self._restarting.values()):
            task.cancel()
        await asyncio.gather(*self._restarting.values(), return_exceptions=True)

    def _expire(self, now: float) -> None:
        for sid in self.table.expire(now):
            self.workspaces.close(sid)

    async def _route(self, sid: str) -> tuple[int, bool] | web.Response:
        now = time.monotonic()
        self._expire(now)
        await self._refresh_agents()
        now = time.monotonic()
        try:
            return self.table.route(sid, now)
        except SessionRefused as e:
            return acr_error(e.error, str(e))

    # ------------------------------------------------------------------ routes

    async def invoke(self, request: web.Request) -> web.StreamResponse:
        """InvokeAgentRuntime: route the session, forward to its agent, stream the answer back."""
        if (err := self._check_target(request)) is not None:
            return err
        sid = self._session_id(request)
        if isinstance(sid, web.Response):
            return sid
        fault = self.plan.fault_for(sid) if self.plan is not None else None
        if fault in EMULATOR_FAULTS and self.fault_hits[sid] < self.plan.rates.repeats:
            self.fault_hits[sid] += 1
            self.faults_injected[fault] += 1
            name, status = EMULATOR_FAULT_ERRORS[fault]
            return acr_error(name, f"injected fault: {fault}", status)
        routed = await self._route(sid)
        if isinstance(routed, web.Response):
            return routed
        index, created = routed
        try:
            if created and fault in AGENT_FAULTS:
                self.faults_injected[fault] += 1
            return await self._forward(request, sid, self.agents[index], fault if fault in AGENT_FAULTS else None)
        finally:
            self.table.release(sid, time.monotonic())

    async def _forward(
        self, request: web.Request, sid: str, agent: AgentProcess, fault: str | None
    ) -> web.StreamResponse:
        body = await request.read()
        headers = {
            SESSION_HEADER: sid,
            REQUEST_ID_HEADER: str(uuid.uuid4()),
            "Content-Type": request.headers.get("Content-Type", "application/json"),
            "Accept": request.headers.get("Accept", "*/*"),
        }
        a2a = self.cfg.protocol == "A2A"
        for name, value in request.headers.items():
            if name.lower().startswith(CUSTOM_HEADER_PREFIX) or name == USER_ID_HEADER or (
                    a2a and name.lower() in A2A_HEADERS):
                headers[name] = value
        if fault is not None:
            headers[FAULT_HEADER] = fault
        try:
            path = "/" if a2a else "/invocations"
            async with self.http.post(f"{agent.url}{path}", data=body, headers=headers) as up:
                if up.status >= 400:
                    text = (await up.text())[:AGENT_ERROR_SNIPPET_CHARS]
                    return acr_error("RuntimeClientError", f"agent returned HTTP {up.status}: {text}")
                resp = web.StreamResponse(
                    status=200,
                    headers={SESSION_HEADER: sid, "Content-Type": up.headers.get("Content-Type", "application/json")},
                )
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return acr_error("RuntimeClientError", f"agent {agent.index} unreachable: {e!r}")

    async def stop_session(self, request: web.Request) -> web.Response:
        """StopRuntimeSession: close the session and its command workspace."""
        if (err := self._check_target(request)) is not None:
            return err
        sid = self._session_id(request, required=True)
        if isinstance(sid, web.Response):
            return sid
        self._expire(time.monotonic())
        if not self.table.stop(sid):
            return acr_error("ResourceNotFoundException", f"session {sid} not found")
        self.workspaces.close(sid)
        return web.json_response({}, headers={SESSION_HEADER: sid})

    async def command(self, request: web.Request) -> web.StreamResponse:
        """InvokeAgentRuntimeCommand: run the command in the session's directory, stream events."""
        if (err := self._check_target(request)) is not None:
            return err
        sid = self._session_id(request)
        if isinstance(sid, web.Response):
            return sid
        try:
            body = json.loads(await request.read() or b"{}")
        except ValueError:
            return acr_error("ValidationException", "body is not JSON", reason="CannotParse")
        command, timeout_s = body.get("command"), body.get("timeout", DEFAULT_COMMAND_TIMEOUT_S)
        if not isinstance(command, str) or not 1 <= len(command) <= MAX_COMMAND_CHARS:
            return validation_error("body.command", f"command must be a string of 1-{MAX_COMMAND_CHARS} characters")
        if type(timeout_s) is not int or not MIN_COMMAND_TIMEOUT_S <= timeout_s <= MAX_COMMAND_TIMEOUT_S:
            bounds = f"[{MIN_COMMAND_TIMEOUT_S}, {MAX_COMMAND_TIMEOUT_S}]"
            return validation_error("body.timeout", f"timeout must be an integer in {bounds}")
        if self.table.was_stopped(sid):  # on ACR the stop ended the microVM and whatever in it sent this
            return acr_error("ResourceNotFoundException", f"session {sid} was stopped: its container is gone")
        routed = await self._route(sid)
        if isinstance(routed, web.Response):
            return routed
        proc_box: list = []
        try:
            cwd = self.workspaces.path(sid)
            headers = {SESSION_HEADER: sid, "Content-Type": EVENTSTREAM_CONTENT_TYPE}
            resp = web.StreamResponse(status=200, headers=headers)
            await resp.prepare(request)

            def on_start(proc) -> None:
                proc_box.append(proc)
                self.workspaces.attach(sid, proc)

            try:
                await run_command(command, cwd, timeout_s, self.cfg.max_output_bytes, resp.write, on_start)
            except (ConnectionError, asyncio.CancelledError):
                raise
            except Exception as e:  # after the 200 went out, errors travel as a stream event
                logger.exception("command in session %s failed", sid)
                await resp.write(exception_event("internalServerException", f"command failed: {e!r}"))
            await resp.write_eof()
            return resp
        finally:
            for proc in proc_box:
                self.workspaces.detach(sid, proc)
            self.table.release(sid, time.monotonic())

    # ------------------------------------------------------------------ background

    async def tick_forever(self) -> None:
        """Each tick: expire sessions, probe every agent's /ping, keep busy agents' sessions alive."""
        while True:
            await asyncio.sleep(self.cfg.tick_s())
            try:
                await self._refresh_agents()
                alive = [a for a in self.agents if a.alive()]
                statuses = await asyncio.gather(*(ping_status(a, self.http) for a in alive))
                now = time.monotonic()
                for a, status in zip(alive, statuses):
                    if status == "HealthyBusy":
                        self.table.keep_alive(a.index, now)
                self._expire(now)
            except Exception:
                logger.exception("emulator tick failed")
