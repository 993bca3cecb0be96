"""Local emulator of the AgentCore Runtime (ACR) data plane, for runs without AWS.

It answers the three data-plane calls exactly as boto3's `bedrock-agentcore` client sends them
(rest-json, botocore service model 2024-02-28):

    POST /runtimes/{agentRuntimeArn}/invocations?qualifier=Q       InvokeAgentRuntime
         header X-Amzn-Bedrock-AgentCore-Runtime-Session-Id, body = payload blob
         -> 200, the agent's body streamed through, its Content-Type, the session id echoed
    POST /runtimes/{agentRuntimeArn}/stopruntimesession             StopRuntimeSession
         -> 200, session id echoed; 404 ResourceNotFoundException when the session is not open
    POST /runtimes/{agentRuntimeArn}/commands                       InvokeAgentRuntimeCommand
         body {"command": str, "timeout": int} -> an event stream (workers.embedded.emulator_commands)

and errors in the service's own shape (HTTP status, `x-amzn-ErrorType` header, `{"message"}`
body) so that botocore raises `client.exceptions.<Name>`: ValidationException 400 (malformed
ARN, session id outside 33-256 chars, bad command body), ResourceNotFoundException 404 (unknown
runtime ARN or qualifier, unknown session on stop), ServiceQuotaExceededException 402 (open-session
cap), RuntimeClientError 424 (the agent answered >= 400 or could not be reached),
ThrottlingException 429 (session-creation rate, optional all-call rate), InternalServerException
500 (no agent alive). `GET /_emulator/stats` answers `EmulatorStats` as JSON.

Behind it run K agent processes (workers.embedded.emulator_agents). Invariants:
- sessions follow workers.embedded.emulator_sessions.SessionTable: sticky routing, creation limits,
  open == created - stopped - expired, idle timeout (a HealthyBusy /ping of the session's agent
  counts as activity; the emulator pings every agent each tick) and maximum lifetime;
- every data-plane call is counted in a sliding 1 s window (`peak_request_rate`) before any
  check, refused calls included;
- a session that ends (stop or expiry) loses its command working directory and processes;
- faults (workers.embedded.faults) are decided by FaultPlan per session: emulator-side kinds answer
  the session's first `repeats` InvokeAgentRuntime calls with their error before anything else
  happens (no session is created); agent-side kinds reach the agent as the FAULT_HEADER header;
- on shutdown (SIGTERM/SIGINT) every agent process is stopped by PID.

What it does not emulate: one microVM per session (sessions share K processes, so stopping a
session does not kill work the agent started for it), auth/SigV4 checking, MCP headers.

Callers: `workers.embedded.local_stack.LocalStack` starts it as a subprocess; tests start it the same way.
CLI: `python -m workers.embedded.emulator --port P --agent-cmd "..." --num-agents K --session-rate 25
[--faults '{"throttle": 0.1, "seed": 1}'] [--idle-timeout-s S] [--max-lifetime-s S] ...`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import shlex
import signal
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import aiohttp
from aiohttp import web

from workers.embedded.emulator_agents import AgentProcess, free_port, ping_status, start_agents, stop_agents
from workers.embedded.emulator_commands import (
    DEFAULT_COMMAND_TIMEOUT_S, DEFAULT_MAX_OUTPUT_BYTES, EVENTSTREAM_CONTENT_TYPE, MAX_COMMAND_CHARS,
    MAX_COMMAND_TIMEOUT_S, MIN_COMMAND_TIMEOUT_S, Workspaces, exception_event, run_command,
)  # fmt: skip
from workers.embedded.emulator_sessions import (
    DEFAULT_SESSION_IDLE_TIMEOUT_S, DEFAULT_SESSION_MAX_LIFETIME_S, EmulatorStats, RateWindow,
    SessionRefused, SessionTable, TokenBucket,
)  # fmt: skip
from workers.embedded.faults import AGENT_FAULTS, EMULATOR_FAULT_ERRORS, EMULATOR_FAULTS, FAULT_HEADER, FaultPlan, FaultRates

__all__ = [
    "DEFAULT_RUNTIME_ARN", "STATS_PATH", "EmulatorConfig", "EmulatorStats", "SessionRefused", "SessionTable",
    "TokenBucket", "RateWindow", "free_port", "serve", "main",
]  # fmt: skip

logger = logging.getLogger(__name__)

SESSION_HEADER = "X-Amzn-Bedrock-AgentCore-Runtime-Session-Id"
REQUEST_ID_HEADER = "X-Amzn-Bedrock-AgentCore-Runtime-Request-Id"
USER_ID_HEADER = "X-Amzn-Bedrock-AgentCore-Runtime-User-Id"
CUSTOM_HEADER_PREFIX = "x-amzn-bedrock-agentcore-runtime-custom-"  # forwarded to the agent, like ACR
SESSION_ID_MIN_LEN = 33  # botocore shape SessionType: min 33
SESSION_ID_MAX_LEN = 256  # botocore shape SessionType: max 256
MAX_PAYLOAD_BYTES = 100_000_000  # botocore shape Body: max 100 MB
DEFAULT_RUNTIME_ARN = "arn:aws:bedrock-agentcore:us-west-2:000000000000:runtime/local_agent-emulator0"
RUNTIME_ARN_RE = re.compile(r"arn:aws[a-z-]*:bedrock-agentcore:[a-z0-9-]+:\d{12}:runtime/[A-Za-z][A-Za-z0-9_-]{0,99}")
STATS_PATH = "/_emulator/stats"
READY_LINE_PREFIX = "ACR emulator ready"
MAX_TICK_S = 1.0  # reaper/ping period upper bound; shrunk to a quarter of small timeouts
MIN_TICK_S = 0.02
AGENT_ERROR_SNIPPET_CHARS = 2000  # of an agent's error body quoted in RuntimeClientError

_ERROR_STATUS = {
    "ValidationException": 400,
    "ServiceQuotaExceededException": 402,
    "ResourceNotFoundException": 404,
    "RuntimeClientError": 424,
    "ThrottlingException": 429,
    "InternalServerException": 500,
}


@dataclass
class EmulatorConfig:
    """How to run the emulator. `agent_cmd` is an argv list; `{port}` in it is substituted.

    qualifiers: endpoint names that exist (others: ResourceNotFoundException).
    request_rate_per_s: optional cap on all data-plane calls (ThrottlingException past it).
    max_output_bytes: per-stream cap of InvokeAgentRuntimeCommand output.
    """

    agent_cmd: list[str]
    num_agents: int = 2
    session_rate_per_s: float = 25.0
    session_burst: int | None = None  # default: max(1, round(session_rate_per_s))
    agent_runtime_arn: str = DEFAULT_RUNTIME_ARN
    qualifiers: tuple[str, ...] = ("DEFAULT",)
    idle_timeout_s: float = DEFAULT_SESSION_IDLE_TIMEOUT_S
    max_lifetime_s: float = DEFAULT_SESSION_MAX_LIFETIME_S
    max_open_sessions: int | None = None
    request_rate_per_s: float | None = None
    agent_start_timeout_s: float = 60.0
    invoke_read_timeout_s: float = 900.0
    max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES
    faults: FaultRates | None = None
    agent_env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.agent_cmd:
            raise ValueError("agent_cmd must not be empty")
        if self.num_agents < 1:
            raise ValueError(f"num_agents must be >= 1, got {self.num_agents}")
        if not RUNTIME_ARN_RE.fullmatch(self.agent_runtime_arn):
            raise ValueError(f"agent_runtime_arn {self.agent_runtime_arn!r} is not a runtime ARN")

    def tick_s(self) -> float:
        return max(MIN_TICK_S, min(MAX_TICK_S, self.idle_timeout_s / 4, self.max_lifetime_s / 4))


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

    # ------------------------------------------------------------------ app

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_PAYLOAD_BYTES, middlewares=[self._count_calls])
        # The ARN arrives percent-encoded ('/' as %2F); aiohttp matches on the encoded path.
        app.router.add_post("/runtimes/{arn:[^/]+}/invocations", self.invoke)
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

    def _refresh_agents(self) -> None:
        for a in self.agents:
            if not a.alive() and self.table.mark_dead(a.index):
                logger.warning("agent %d (pid %d) exited with %s", a.index, a.proc.pid, a.proc.returncode)

    def _expire(self, now: float) -> None:
        for sid in self.table.expire(now):
            self.workspaces.close(sid)

    def _route(self, sid: str) -> tuple[int, bool] | web.Response:
        now = time.monotonic()
        self._expire(now)
        self._refresh_agents()
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
        routed = self._route(sid)
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
        for name, value in request.headers.items():
            if name.lower().startswith(CUSTOM_HEADER_PREFIX) or name == USER_ID_HEADER:
                headers[name] = value
        if fault is not None:
            headers[FAULT_HEADER] = fault
        try:
            async with self.http.post(f"{agent.url}/invocations", data=body, headers=headers) as up:
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
        routed = self._route(sid)
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
                self._refresh_agents()
                alive = [a for a in self.agents if a.alive()]
                statuses = await asyncio.gather(*(ping_status(a, self.http) for a in alive))
                now = time.monotonic()
                for a, status in zip(alive, statuses):
                    if status == "HealthyBusy":
                        self.table.keep_alive(a.index, now)
                self._expire(now)
            except Exception:
                logger.exception("emulator tick failed")


async def serve(cfg: EmulatorConfig, port: int, stop: asyncio.Event) -> None:
    """Start agents, serve on 127.0.0.1:port until `stop` is set, then stop agents."""
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=cfg.invoke_read_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:
        agents = await start_agents(cfg.agent_cmd, cfg.num_agents, cfg.agent_env, http, cfg.agent_start_timeout_s)
        runner = ticker = None
        with tempfile.TemporaryDirectory(prefix="acr-emulator-sessions-") as workdir:
            emu = Emulator(cfg, agents, http, Path(workdir))
            try:
                runner = web.AppRunner(emu.app(), access_log=None)
                await runner.setup()
                await web.TCPSite(runner, "127.0.0.1", port).start()
                ticker = asyncio.create_task(emu.tick_forever())
                pids = ",".join(str(a.proc.pid) for a in agents)
                ready = f"{READY_LINE_PREFIX} on http://127.0.0.1:{port} arn={cfg.agent_runtime_arn} agent_pids={pids}"
                print(ready, flush=True)
                await stop.wait()
            finally:
                if ticker is not None:
                    ticker.cancel()
                if runner is not None:
                    await runner.cleanup()
                emu.workspaces.close_all()
                await stop_agents(agents)


def _parse_args(argv: list[str] | None) -> tuple[EmulatorConfig, int]:
    p = argparse.ArgumentParser(description="Local AgentCore Runtime data-plane emulator")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--agent-cmd", required=True, help="agent command line; {port} is substituted, PORT env set")
    p.add_argument("--num-agents", type=int, default=2)
    p.add_argument("--session-rate", type=float, default=25.0, help="session creations per second")
    p.add_argument("--session-burst", type=int, default=None)
    p.add_argument("--agent-runtime-arn", default=DEFAULT_RUNTIME_ARN)
    p.add_argument("--qualifiers", default="DEFAULT", help="comma-separated endpoint names")
    p.add_argument("--idle-timeout-s", type=float, default=DEFAULT_SESSION_IDLE_TIMEOUT_S)
    p.add_argument("--max-lifetime-s", type=float, default=DEFAULT_SESSION_MAX_LIFETIME_S)
    p.add_argument("--max-open-sessions", type=int, default=None)
    p.add_argument("--request-rate", type=float, default=None, help="cap on all data-plane calls per second")
    p.add_argument("--max-output-bytes", type=int, default=DEFAULT_MAX_OUTPUT_BYTES)
    p.add_argument("--faults", default=None, help="FaultRates as JSON, e.g. '{\"throttle\": 0.1, \"seed\": 3}'")
    p.add_argument("--agent-start-timeout-s", type=float, default=60.0)
    a = p.parse_args(argv)
    cfg = EmulatorConfig(
        agent_cmd=shlex.split(a.agent_cmd),
        num_agents=a.num_agents,
        session_rate_per_s=a.session_rate,
        session_burst=a.session_burst,
        agent_runtime_arn=a.agent_runtime_arn,
        qualifiers=tuple(q for q in a.qualifiers.split(",") if q),
        idle_timeout_s=a.idle_timeout_s,
        max_lifetime_s=a.max_lifetime_s,
        max_open_sessions=a.max_open_sessions,
        request_rate_per_s=a.request_rate,
        max_output_bytes=a.max_output_bytes,
        faults=FaultRates.from_json(a.faults) if a.faults else None,
        agent_start_timeout_s=a.agent_start_timeout_s,
    )
    return cfg, a.port


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg, port = _parse_args(argv)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(cfg, port, stop)

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
