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
runtime ARN or qualifier, unknown session on stop, a command on a session that was stopped:
its container is gone on ACR, so nothing it ran may open it again), ServiceQuotaExceededException 402 (open-session
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
- an agent process that exits is started again on the next call or tick (at most MAX_AGENT_RESTARTS
  times per agent; emulator_routes): a crash costs the rollouts it held, as one microVM's crash does
  on ACR, not every later one;
- on shutdown (SIGTERM/SIGINT) every agent process is stopped by PID.

What it does not emulate: one microVM per session (sessions share K processes, so stopping a
session does not kill work the agent started for it), auth/SigV4 checking, MCP headers.

Modules: emulator_config (EmulatorConfig), emulator_routes (the routes above), emulator_sessions
(pure session logic), emulator_commands (the command API), emulator_agents (agent processes).

Port: `--port 0` (the default) binds a port the kernel picks at bind time, so no other process can
take it first; the bound endpoint is printed on the ready line and, with `--ready-file PATH`,
written there as JSON (workers.embedded.ready_file) once every agent answers /ping. Agents get
this endpoint in AWS_ENDPOINT_URL_BEDROCK_AGENTCORE, and each a port picked for it
(emulator_agents.free_port: the ACR contract hands an agent its port, so that pick keeps a
documented pick-then-bind race).

Callers: `workers.embedded.local_stack.LocalStack` starts it as a subprocess; tests start it the same way.
CLI: `python -m workers.embedded.emulator [--port P] [--ready-file F] --agent-cmd "..." --num-agents K
--session-rate 25 [--faults '{"throttle": 0.1, "seed": 1}'] [--idle-timeout-s S] [--max-lifetime-s S] ...`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shlex
import signal
import socket
import sys
import tempfile
from pathlib import Path

import aiohttp
from aiohttp import web

from workers.embedded.emulator_agents import start_agents, stop_agents
from workers.embedded.emulator_commands import DEFAULT_MAX_OUTPUT_BYTES
from workers.embedded.emulator_config import DEFAULT_RUNTIME_ARN, READY_LINE_PREFIX, EmulatorConfig
from workers.embedded.emulator_routes import Emulator
from workers.embedded.emulator_sessions import DEFAULT_SESSION_IDLE_TIMEOUT_S, DEFAULT_SESSION_MAX_LIFETIME_S
from workers.embedded.faults import FaultRates
from workers.embedded.ready_file import write_ready_file

__all__ = ["serve", "main"]

LISTEN_BACKLOG = 128  # connections queued before accept (aiohttp's TCPSite default)


async def serve(cfg: EmulatorConfig, port: int, stop: asyncio.Event, ready_file: str | Path | None = None,
                host: str = "127.0.0.1") -> None:
    """Bind host:port (0: a port the kernel picks; `host` 0.0.0.0 serves agents on other machines,
    as ACR reaches them), start agents, serve until `stop` is set, then stop agents.

    The socket is bound and listening before the agents start, so they get the emulator's own
    endpoint in AWS_ENDPOINT_URL_BEDROCK_AGENTCORE (and the runtime's ARN in AGENT_RUNTIME_ARN,
    as a runtime's environment variables would carry it); calls arriving before the routes run wait in
    the listen backlog. Once serving: prints the ready line and writes `{"endpoint", "agent_pids"}`
    to `ready_file`. Raises OSError when `port` is taken.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart on its old port (TIME_WAIT left)
    sock.bind((host, port))
    sock.listen(LISTEN_BACKLOG)
    bound_host, bound_port = sock.getsockname()[:2]
    # agents on this machine reach a wildcard bind through loopback
    endpoint = f"http://{'127.0.0.1' if bound_host in ('0.0.0.0', '') else bound_host}:{bound_port}"
    agent_env = {**cfg.agent_env, "AWS_ENDPOINT_URL_BEDROCK_AGENTCORE": endpoint,
                 "AGENT_RUNTIME_ARN": cfg.agent_runtime_arn}  # for agents that call ACR's command API
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=cfg.invoke_read_timeout_s)
    with sock:
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:
            agents = await start_agents(cfg.agent_cmd, cfg.num_agents, agent_env, http, cfg.agent_start_timeout_s)
            runner = ticker = None
            with tempfile.TemporaryDirectory(prefix="acr-emulator-sessions-") as workdir:
                emu = Emulator(cfg, agents, http, Path(workdir))
                emu.agent_env = agent_env  # a restarted agent gets the same environment
                try:
                    runner = web.AppRunner(emu.app(), access_log=None)
                    await runner.setup()
                    await web.SockSite(runner, sock, backlog=LISTEN_BACKLOG).start()
                    ticker = asyncio.create_task(emu.tick_forever())
                    pids = [a.proc.pid for a in agents]
                    print(f"{READY_LINE_PREFIX} on {endpoint} arn={cfg.agent_runtime_arn} "
                          f"agent_pids={','.join(map(str, pids))}", flush=True)
                    if ready_file is not None:
                        write_ready_file(ready_file, {"endpoint": endpoint, "agent_pids": pids})
                    await stop.wait()
                finally:
                    if ticker is not None:
                        ticker.cancel()
                    if runner is not None:
                        await runner.cleanup()
                    emu.workspaces.close_all()
                    await emu.stop_restarts()
                    await stop_agents(agents)  # emu.agents: restarted processes replaced the exited ones in it


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Local AgentCore Runtime data-plane emulator")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0: every interface, like moto_s3's --host)")
    p.add_argument("--port", type=int, default=0, help="0 (default): a free port, bound by the emulator itself")
    p.add_argument("--ready-file", default=None, help="where to write the bound endpoint as JSON once ready")
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
    p.add_argument("--protocol", default="HTTP", choices=("HTTP", "A2A"), help="the runtime's serverProtocol")
    return p.parse_args(argv)


def _config_from_args(a: argparse.Namespace) -> EmulatorConfig:
    return EmulatorConfig(
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
        protocol=a.protocol,
    )


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = _parse_args(argv)
    cfg = _config_from_args(args)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(cfg, args.port, stop, args.ready_file, host=args.host)

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
