"""The ACR emulator's agent processes: launch K copies of one agent command, probe, stop by PID.

Each agent runs on its own loopback port (env `PORT`, and `{port}` substituted into the command;
picked by `free_port`, the one helper with a pick-then-bind race, documented there) and serves
the ACR container contract: `POST /invocations` (an A2A agent: `POST /`, port also in env
`A2A_PORT`), `GET /ping` -> `{"status": "Healthy" |
"HealthyBusy"}`. Invariant: every process `start_agents` launched is
reaped by `stop_agents` (SIGTERM, SIGKILL after AGENT_STOP_GRACE_S); an agent that exits is
replaced by `restart_agent` (the emulator bounds how often); and, should the emulator
itself die without cleaning up, gets SIGTERM from the kernel (PR_SET_PDEATHSIG, Linux).
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

import aiohttp

from workers.embedded.pdeathsig import die_with_parent

AGENT_STOP_GRACE_S = 5.0  # SIGTERM -> SIGKILL grace per agent process
PING_TIMEOUT_S = 2.0  # one /ping probe


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, for a process that cannot report its own.

    Race (known, kept on purpose): the port is bound to 0, read and released here, then bound
    again by the child; another process can take it in between, and the child then fails to
    start (start_agents raises naming it). Used only for agent processes, because the ACR container
    contract gives an agent its port (env PORT) and has no way for it to report one it bound
    itself. Servers of our own bind port 0 and report the port instead (workers.embedded.ready_file).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


async def ping_status(agent: AgentProcess, http: aiohttp.ClientSession) -> str | None:
    """The agent's /ping status ("Healthy", "HealthyBusy", ...), or None if it did not answer 200."""
    try:
        async with http.get(f"{agent.url}/ping", timeout=aiohttp.ClientTimeout(total=PING_TIMEOUT_S)) as r:
            if r.status != 200:
                return None
            body = await r.json(content_type=None)
            return str(body.get("status", "Healthy")) if isinstance(body, dict) else "Healthy"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None


async def start_agents(
    agent_cmd: Sequence[str],
    num_agents: int,
    agent_env: Mapping[str, str],
    http: aiohttp.ClientSession,
    start_timeout_s: float,
) -> list[AgentProcess]:
    """Launch num_agents agents and wait until each answers GET /ping with 200.

    Raises RuntimeError naming the agent when its program cannot be run (not found, not
    executable), when one exits early or is not healthy within start_timeout_s; agents already
    started are stopped before raising.
    """
    agents: list[AgentProcess] = []
    try:
        for i in range(num_agents):
            port = free_port()
            argv = [a.replace("{port}", str(port)) for a in agent_cmd]
            env = {**os.environ, **agent_env, "PORT": str(port), "A2A_PORT": str(port)}
            try:
                proc = await asyncio.create_subprocess_exec(*argv, env=env, preexec_fn=die_with_parent)
            except OSError as exc:  # no such program, not executable: the command, not the agent, is wrong
                raise RuntimeError(f"agent {i} could not be started: {argv[0]!r}: {exc.strerror}") from exc
            agents.append(AgentProcess(index=i, port=port, proc=proc))
        deadline = time.monotonic() + start_timeout_s
        for a in agents:
            await _wait_healthy(a, http, deadline)
        return agents
    except BaseException:
        await stop_agents(agents)
        raise


async def restart_agent(
    agent_cmd: Sequence[str],
    index: int,
    agent_env: Mapping[str, str],
    http: aiohttp.ClientSession,
    start_timeout_s: float,
) -> AgentProcess:
    """A fresh process for agent `index` (one that exited), on a new port, once it answers /ping:
    ACR starts a fresh microVM per session, so an agent's crash costs the sessions it held, never
    every later rollout. Raises RuntimeError as `start_agents` does (the process is stopped first)."""
    port = free_port()
    argv = [a.replace("{port}", str(port)) for a in agent_cmd]
    env = {**os.environ, **agent_env, "PORT": str(port), "A2A_PORT": str(port)}
    try:
        proc = await asyncio.create_subprocess_exec(*argv, env=env, preexec_fn=die_with_parent)
    except OSError as exc:
        raise RuntimeError(f"agent {index} could not be restarted: {argv[0]!r}: {exc.strerror}") from exc
    agent = AgentProcess(index=index, port=port, proc=proc)
    try:
        await _wait_healthy(agent, http, time.monotonic() + start_timeout_s)
    except BaseException:
        await stop_agents([agent])
        raise
    return agent


async def _wait_healthy(agent: AgentProcess, http: aiohttp.ClientSession, deadline: float) -> None:
    delay_s = 0.05
    while True:
        if not agent.alive():
            raise RuntimeError(f"agent {agent.index} (pid {agent.proc.pid}) exited with {agent.proc.returncode}")
        if await ping_status(agent, http) is not None:
            return
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
