"""Local emulator of the AgentCore Runtime (ACR) data plane, for runs without AWS.

It answers `InvokeAgentRuntime` and `StopRuntimeSession` exactly as boto3's `bedrock-agentcore`
client sends them (rest-json, botocore service model 2024-02-28):

    POST /runtimes/{agentRuntimeArn}/invocations?qualifier=Q
         header X-Amzn-Bedrock-AgentCore-Runtime-Session-Id, body = payload blob
         -> 200, streamed body, Content-Type and the session id echoed in the same header
    POST /runtimes/{agentRuntimeArn}/stopruntimesession
         -> 200, session id echoed

and errors in the service's own shape (HTTP status, `x-amzn-ErrorType` header, `{"message"}` body)
so that botocore raises `client.exceptions.<Name>` and its retry modes treat 429 as throttling.

Behind it run K agent processes (one command, each on its own loopback port given as env `PORT`
and as `{port}` substituted into the command). Invariants:

- a session is routed to exactly one agent process for its whole life (sticky); a new session
  goes to the alive agent with the fewest open sessions (ties: lowest index);
- a session is *created* by the first invoke that names it; creations pass a token bucket
  (`session_rate_per_s`, default 25/s like ACR's per-runtime TPS); a refused creation answers
  ThrottlingException (429) and creates nothing; invokes on an open session are not rate-limited;
- sessions_open == sessions_created - sessions_stopped - sessions_expired at every moment;
- on shutdown (SIGTERM/SIGINT) every agent process is stopped by PID; agents also get SIGTERM
  from the kernel if the emulator dies without cleaning up (PR_SET_PDEATHSIG).

What it does not emulate: one microVM per session (sessions share K processes, so stopping a
session does not kill work the agent started for it), auth/SigV4 checking, MCP headers.

Callers: `workers.acr.local_stack.LocalStack` starts it as a subprocess; tests start it the same way.
CLI: `python -m workers.acr.emulator --port P --agent-cmd "..." --num-agents K --session-rate 25`.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import logging
import os
import shlex
import signal
import socket
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field

import aiohttp
from aiohttp import web

logger = logging.getLogger(__name__)

SESSION_HEADER = "X-Amzn-Bedrock-AgentCore-Runtime-Session-Id"
REQUEST_ID_HEADER = "X-Amzn-Bedrock-AgentCore-Runtime-Request-Id"
USER_ID_HEADER = "X-Amzn-Bedrock-AgentCore-Runtime-User-Id"
SESSION_ID_MIN_LEN = 33  # botocore shape SessionType: min 33
SESSION_ID_MAX_LEN = 256  # botocore shape SessionType: max 256
MAX_PAYLOAD_BYTES = 100_000_000  # botocore shape Body: max 100 MB
DEFAULT_RUNTIME_ARN = "arn:aws:bedrock-agentcore:us-west-2:000000000000:runtime/local_agent-emulator0"
DEFAULT_SESSION_IDLE_TIMEOUT_S = 900.0  # ACR's default idle session timeout (15 min)
STATS_PATH = "/_emulator/stats"
READY_LINE_PREFIX = "ACR emulator ready"
AGENT_STOP_GRACE_S = 5.0  # SIGTERM -> SIGKILL grace per agent process
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


# ----------------------------------------------------------------------------- pure logic


class TokenBucket:
    """Token bucket: `rate_per_s` tokens per second, at most `burst` stored. Time is passed in.

    try_acquire(now_s) takes one token if one is available. Raises ValueError on a non-positive
    rate or burst, or when time goes backwards.
    """

    def __init__(self, rate_per_s: float, burst: float, now_s: float) -> None:
        if rate_per_s <= 0:
            raise ValueError(f"session_rate_per_s must be > 0, got {rate_per_s}")
        if burst < 1:
            raise ValueError(f"session_burst must be >= 1, got {burst}")
        self._rate = rate_per_s
        self._burst = float(burst)
        self._tokens = float(burst)
        self._last = now_s

    def try_acquire(self, now_s: float) -> bool:
        if now_s < self._last:
            raise ValueError(f"time went backwards: {now_s} < {self._last}")
        self._tokens = min(self._burst, self._tokens + (now_s - self._last) * self._rate)
        self._last = now_s
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False


@dataclass(frozen=True)
class EmulatorStats:
    """Counters of one emulator; JSON at GET /_emulator/stats."""

    sessions_open: int
    sessions_created: int
    sessions_stopped: int
    sessions_expired: int
    peak_open: int
    throttled: int
    invocations: int
    open_per_agent: tuple[int, ...]
    agent_pids: tuple[int, ...]
    agent_ports: tuple[int, ...]  # each agent serves /ping and /invocations on 127.0.0.1:port

    @classmethod
    def from_json(cls, d: dict) -> "EmulatorStats":
        tuples = {k: tuple(d[k]) for k in ("open_per_agent", "agent_pids", "agent_ports")}
        return cls(**{**d, **tuples})


class SessionRefused(Exception):
    """A new session could not be created; `error` is the ACR exception name to answer with."""

    def __init__(self, error: str, message: str) -> None:
        super().__init__(message)
        self.error = error


@dataclass
class _Session:
    agent: int
    last_used_s: float


class SessionTable:
    """Routes sessions to agents and counts them. Pure: no I/O, time passed in.

    Invariant: open == created - stopped - expired; each open session maps to one agent for life.
    """

    def __init__(
        self,
        num_agents: int,
        limiter: TokenBucket,
        *,
        idle_timeout_s: float = DEFAULT_SESSION_IDLE_TIMEOUT_S,
        max_open: int | None = None,
    ) -> None:
        if num_agents < 1:
            raise ValueError(f"num_agents must be >= 1, got {num_agents}")
        self._num_agents = num_agents
        self._limiter = limiter
        self._idle_timeout_s = idle_timeout_s
        self._max_open = max_open
        self._sessions: dict[str, _Session] = {}
        self._dead: set[int] = set()
        self.created = self.stopped = self.expired = self.peak_open = self.throttled = self.invocations = 0

    def mark_dead(self, agent: int) -> bool:
        """Agent `agent` exited: route no new sessions to it. True the first time it is marked."""
        if agent in self._dead:
            return False
        self._dead.add(agent)
        return True

    def route(self, session_id: str, now_s: float) -> tuple[int, bool]:
        """Agent index for `session_id` and whether the session was created by this call.

        Raises SessionRefused("ThrottlingException") when the creation rate is exceeded,
        ("ServiceQuotaExceededException") at max_open, ("InternalServerException") when no agent
        is alive.
        """
        self._expire(now_s)
        self.invocations += 1
        s = self._sessions.get(session_id)
        if s is not None:
            s.last_used_s = now_s
            return s.agent, False
        if self._max_open is not None and len(self._sessions) >= self._max_open:
            raise SessionRefused("ServiceQuotaExceededException", f"open sessions at quota {self._max_open}")
        alive = [a for a in range(self._num_agents) if a not in self._dead]
        if not alive:
            raise SessionRefused("InternalServerException", "no agent process is alive")
        if not self._limiter.try_acquire(now_s):
            self.throttled += 1
            raise SessionRefused("ThrottlingException", "Rate exceeded for session creation")
        load = self.open_per_agent()
        agent = min(alive, key=lambda a: (load[a], a))
        self._sessions[session_id] = _Session(agent=agent, last_used_s=now_s)
        self.created += 1
        self.peak_open = max(self.peak_open, len(self._sessions))
        return agent, True

    def stop(self, session_id: str, now_s: float) -> bool:
        """Close a session; False when it is not open (never created, stopped or expired)."""
        self._expire(now_s)
        if self._sessions.pop(session_id, None) is None:
            return False
        self.stopped += 1
        return True

    def open_per_agent(self) -> list[int]:
        load = [0] * self._num_agents
        for s in self._sessions.values():
            load[s.agent] += 1
        return load

    def snapshot(self, now_s: float, agent_pids: tuple[int, ...] = (), agent_ports: tuple[int, ...] = ()) -> EmulatorStats:
        self._expire(now_s)
        return EmulatorStats(
            sessions_open=len(self._sessions),
            sessions_created=self.created,
            sessions_stopped=self.stopped,
            sessions_expired=self.expired,
            peak_open=self.peak_open,
            throttled=self.throttled,
            invocations=self.invocations,
            open_per_agent=tuple(self.open_per_agent()),
            agent_pids=agent_pids,
            agent_ports=agent_ports,
        )

    def _expire(self, now_s: float) -> None:
        idle = [sid for sid, s in self._sessions.items() if now_s - s.last_used_s > self._idle_timeout_s]
        for sid in idle:
            del self._sessions[sid]
            self.expired += 1


# ----------------------------------------------------------------------------- agent processes


@dataclass
class EmulatorConfig:
    """How to run the emulator. `agent_cmd` is an argv list; `{port}` in it is substituted."""

    agent_cmd: list[str]
    num_agents: int = 2
    session_rate_per_s: float = 25.0
    session_burst: int | None = None  # default: max(1, round(session_rate_per_s))
    agent_runtime_arn: str = DEFAULT_RUNTIME_ARN
    idle_timeout_s: float = DEFAULT_SESSION_IDLE_TIMEOUT_S
    max_open_sessions: int | None = None
    agent_start_timeout_s: float = 60.0
    invoke_read_timeout_s: float = 900.0
    agent_env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.agent_cmd:
            raise ValueError("agent_cmd must not be empty")
        if self.num_agents < 1:
            raise ValueError(f"num_agents must be >= 1, got {self.num_agents}")


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (bind to port 0, read it, release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """Child-side: ask the kernel to SIGTERM us if the emulator dies (Linux only)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


@dataclass
class AgentProcess:
    index: int
    port: int
    proc: asyncio.subprocess.Process

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc.returncode is None


async def start_agents(cfg: EmulatorConfig, http: aiohttp.ClientSession) -> list[AgentProcess]:
    """Launch cfg.num_agents agents and wait until each answers GET /ping with 200.

    Raises RuntimeError naming the agent when one exits early or is not healthy within
    cfg.agent_start_timeout_s; agents already started are stopped before raising.
    """
    agents: list[AgentProcess] = []
    try:
        for i in range(cfg.num_agents):
            port = free_port()
            argv = [a.replace("{port}", str(port)) for a in cfg.agent_cmd]
            env = {**os.environ, **cfg.agent_env, "PORT": str(port)}
            proc = await asyncio.create_subprocess_exec(*argv, env=env, preexec_fn=_die_with_parent)
            agents.append(AgentProcess(index=i, port=port, proc=proc))
        deadline = time.monotonic() + cfg.agent_start_timeout_s
        for a in agents:
            await _wait_healthy(a, http, deadline)
        return agents
    except BaseException:
        await stop_agents(agents)
        raise


async def _wait_healthy(agent: AgentProcess, http: aiohttp.ClientSession, deadline: float) -> None:
    delay_s = 0.05
    while True:
        if not agent.alive():
            raise RuntimeError(f"agent {agent.index} (pid {agent.proc.pid}) exited with {agent.proc.returncode}")
        try:
            async with http.get(f"{agent.url}/ping", timeout=aiohttp.ClientTimeout(total=2)) as r:
                if r.status == 200:
                    return
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"agent {agent.index} (pid {agent.proc.pid}) not healthy on {agent.url}/ping in time")
        await asyncio.sleep(delay_s)
        delay_s = min(delay_s * 2, 0.5)


async def stop_agents(agents: list[AgentProcess]) -> None:
    """SIGTERM each agent by PID, SIGKILL after AGENT_STOP_GRACE_S, reap all. Idempotent."""
    for a in agents:
        if a.alive():
            try:
                a.proc.terminate()
            except ProcessLookupError:
                pass
    for a in agents:
        try:
            await asyncio.wait_for(a.proc.wait(), AGENT_STOP_GRACE_S)
        except asyncio.TimeoutError:
            try:
                a.proc.kill()
            except ProcessLookupError:
                pass
            await a.proc.wait()


# ----------------------------------------------------------------------------- HTTP


def acr_error(error: str, message: str, status: int, **extra) -> web.Response:
    """An error in ACR's rest-json shape: botocore reads the code from x-amzn-ErrorType."""
    return web.json_response({"message": message, **extra}, status=status, headers={"x-amzn-ErrorType": error})


_ERROR_STATUS = {
    "ValidationException": 400,
    "ServiceQuotaExceededException": 402,
    "ResourceNotFoundException": 404,
    "RuntimeClientError": 424,
    "ThrottlingException": 429,
    "InternalServerException": 500,
}


def _validation_error(name: str, message: str) -> web.Response:
    return acr_error(
        "ValidationException",
        message,
        400,
        reason="FieldValidationFailed",
        fieldList=[{"name": name, "message": message}],
    )


def create_app(cfg: EmulatorConfig, table: SessionTable, agents: list[AgentProcess], http: aiohttp.ClientSession) -> web.Application:
    """The ACR data-plane routes over already-started agents (see module docstring for shapes)."""
    app = web.Application(client_max_size=MAX_PAYLOAD_BYTES)
    pids = tuple(a.proc.pid for a in agents)
    ports = tuple(a.port for a in agents)

    def check_target(request: web.Request) -> web.Response | None:
        arn = request.match_info["arn"]
        if arn != cfg.agent_runtime_arn:
            return acr_error("ResourceNotFoundException", f"agent runtime {arn} not found", 404)
        qualifier = request.query.get("qualifier", "DEFAULT")
        if qualifier != "DEFAULT":
            return acr_error("ResourceNotFoundException", f"endpoint {qualifier} of {arn} not found", 404)
        return None

    def session_id_of(request: web.Request) -> str | web.Response:
        sid = request.headers.get(SESSION_HEADER) or str(uuid.uuid4())  # botocore's idempotency default
        if not SESSION_ID_MIN_LEN <= len(sid) <= SESSION_ID_MAX_LEN:
            return _validation_error(
                "runtimeSessionId",
                f"runtimeSessionId length {len(sid)} outside [{SESSION_ID_MIN_LEN}, {SESSION_ID_MAX_LEN}]",
            )
        return sid

    async def invoke(request: web.Request) -> web.StreamResponse:
        if (err := check_target(request)) is not None:
            return err
        sid = session_id_of(request)
        if isinstance(sid, web.Response):
            return sid
        for a in agents:
            if not a.alive() and table.mark_dead(a.index):
                logger.warning("agent %d (pid %d) exited with %s", a.index, a.proc.pid, a.proc.returncode)
        try:
            index, _created = table.route(sid, time.monotonic())
        except SessionRefused as e:
            return acr_error(e.error, str(e), _ERROR_STATUS[e.error])
        agent = agents[index]
        body = await request.read()
        headers = {
            SESSION_HEADER: sid,
            REQUEST_ID_HEADER: str(uuid.uuid4()),
            "Content-Type": request.headers.get("Content-Type", "application/json"),
            "Accept": request.headers.get("Accept", "*/*"),
        }
        if USER_ID_HEADER in request.headers:
            headers[USER_ID_HEADER] = request.headers[USER_ID_HEADER]
        try:
            async with http.post(f"{agent.url}/invocations", data=body, headers=headers) as up:
                if up.status >= 400:
                    text = (await up.text())[:2000]
                    return acr_error("RuntimeClientError", f"agent returned HTTP {up.status}: {text}", 424)
                resp = web.StreamResponse(
                    status=200,
                    headers={
                        SESSION_HEADER: sid,
                        "Content-Type": up.headers.get("Content-Type", "application/json"),
                    },
                )
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return acr_error("RuntimeClientError", f"agent {index} unreachable: {e!r}", 424)

    async def stop_session(request: web.Request) -> web.Response:
        if (err := check_target(request)) is not None:
            return err
        if SESSION_HEADER not in request.headers:
            return _validation_error("runtimeSessionId", "runtimeSessionId is required")
        sid = session_id_of(request)
        if isinstance(sid, web.Response):
            return sid
        if not table.stop(sid, time.monotonic()):
            return acr_error("ResourceNotFoundException", f"session {sid} not found", 404)
        return web.json_response({}, headers={SESSION_HEADER: sid})

    async def stats(request: web.Request) -> web.Response:
        return web.json_response(asdict(table.snapshot(time.monotonic(), pids, ports)))

    # The ARN arrives percent-encoded ('/' as %2F); aiohttp matches on the still-encoded path.
    app.router.add_post("/runtimes/{arn:[^/]+}/invocations", invoke)
    app.router.add_post("/runtimes/{arn:[^/]+}/stopruntimesession", stop_session)
    app.router.add_get(STATS_PATH, stats)
    return app


async def serve(cfg: EmulatorConfig, port: int, stop: asyncio.Event) -> None:
    """Start agents, serve on 127.0.0.1:port until `stop` is set, then stop agents."""
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=cfg.invoke_read_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:
        agents = await start_agents(cfg, http)
        runner = None
        try:
            burst = cfg.session_burst or max(1, round(cfg.session_rate_per_s))
            limiter = TokenBucket(cfg.session_rate_per_s, burst, time.monotonic())
            table = SessionTable(
                cfg.num_agents, limiter, idle_timeout_s=cfg.idle_timeout_s, max_open=cfg.max_open_sessions
            )
            runner = web.AppRunner(create_app(cfg, table, agents, http), access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            pids = ",".join(str(a.proc.pid) for a in agents)
            print(f"{READY_LINE_PREFIX} on http://127.0.0.1:{port} arn={cfg.agent_runtime_arn} agent_pids={pids}", flush=True)
            await stop.wait()
        finally:
            if runner is not None:
                await runner.cleanup()
            await stop_agents(agents)


def _parse_args(argv: list[str] | None) -> tuple[EmulatorConfig, int]:
    p = argparse.ArgumentParser(description="Local AgentCore Runtime data-plane emulator")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--agent-cmd", required=True, help="agent command line; {port} is substituted, PORT env set")
    p.add_argument("--num-agents", type=int, default=2)
    p.add_argument("--session-rate", type=float, default=25.0, help="session creations per second")
    p.add_argument("--session-burst", type=int, default=None)
    p.add_argument("--agent-runtime-arn", default=DEFAULT_RUNTIME_ARN)
    p.add_argument("--idle-timeout-s", type=float, default=DEFAULT_SESSION_IDLE_TIMEOUT_S)
    p.add_argument("--max-open-sessions", type=int, default=None)
    p.add_argument("--agent-start-timeout-s", type=float, default=60.0)
    a = p.parse_args(argv)
    cfg = EmulatorConfig(
        agent_cmd=shlex.split(a.agent_cmd),
        num_agents=a.num_agents,
        session_rate_per_s=a.session_rate,
        session_burst=a.session_burst,
        agent_runtime_arn=a.agent_runtime_arn,
        idle_timeout_s=a.idle_timeout_s,
        max_open_sessions=a.max_open_sessions,
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
