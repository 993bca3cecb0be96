"""The embedded default's AWS side: a moto S3 server and the ACR emulator on loopback.

`LocalStack` starts two real servers as subprocesses on 127.0.0.1, one after the other:

1. `python -m workers.embedded.moto_s3` (moto's S3 server); once it is ready, the results bucket
   is created;
2. `python -m workers.embedded.emulator`, which launches the agent processes with this stack's AWS
   env (so agents write their S3 results to moto) and is ready when they answer /ping.

Each server binds port 0 itself and reports the endpoint it bound in a ready file
(workers.embedded.ready_file), so no port is picked here and none can be taken before it is bound.
The emulator needs moto's endpoint for its agents' env, hence the order; it sets its own endpoint
(AWS_ENDPOINT_URL_BEDROCK_AGENTCORE) in their env itself.

Its `env` dict (`AWS_ENDPOINT_URL_BEDROCK_AGENTCORE`, `AWS_ENDPOINT_URL_S3`, dummy credentials,
`AWS_DEFAULT_REGION`) is all a boto3 client needs to talk to it as it would to AWS.

Invariant: every process this class started is gone after `stop()`, which runs on `__exit__`, at
interpreter exit (atexit), and on any failure during `start()`; it is idempotent. Processes are
stopped by PID: SIGTERM, then SIGKILL after `STOP_GRACE_S`. The emulator stops its own agents
on SIGTERM, and its agents die with it if it is SIGKILLed (PR_SET_PDEATHSIG).

Process lifetime: each server runs in its own session (a terminal's Ctrl-C reaches the driver
only, which then stops rollouts and their ACR sessions while the servers still answer, and stops
the servers last), and gets SIGTERM from the kernel when the process that started it dies, even
by SIGKILL (PR_SET_PDEATHSIG, workers/embedded/pdeathsig.py); the emulator then stops its agents.
"""

from __future__ import annotations

import atexit
import json
import os
import shlex
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Sequence

import boto3

from workers.embedded.emulator_config import DEFAULT_RUNTIME_ARN, STATS_PATH
from workers.embedded.emulator_sessions import EmulatorStats
from workers.embedded.faults import FaultRates
from workers.embedded.pdeathsig import die_with_parent
from workers.embedded.ready_file import ServerNotReady, wait_ready_file

STOP_GRACE_S = 10.0  # SIGTERM -> SIGKILL wait per process; the emulator needs it to stop agents
_REPO_ROOT = Path(__file__).resolve().parents[2]
DUMMY_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}


class LocalStackError(RuntimeError):
    """A local server did not start; the message carries the tail of its log."""


class LocalStack:
    """Moto S3 + ACR emulator (+ its agents) as subprocesses. Use as a context manager, or call
    start() and stop().

    agent_cmd: the agent's argv (or one shell-quoted string); `{port}` is substituted and env
        PORT is set for each agent process.
    startup_timeout_s: bound on each server (and all agents) becoming healthy; LocalStackError after.
    log_dir: where `moto.log` and `emulator.log` (with agent output) go; a temp dir if None.
    faults: fault injection rates (workers.embedded.faults), passed to the emulator as --faults JSON.
    idle_timeout_s / max_lifetime_s: session idle timeout and maximum lifetime (ACR: 900 s / 8 h).
    request_rate_per_s: optional cap on all ACR data-plane calls (ThrottlingException past it).
    protocol: the runtime's serverProtocol, HTTP or A2A (workers.embedded.emulator_config).
    """

    def __init__(
        self,
        agent_cmd: Sequence[str] | str,
        *,
        num_agents: int = 2,
        session_rate_per_s: float = 25.0,
        session_burst: int | None = None,
        max_open_sessions: int | None = None,
        bucket: str = "acr-rollouts",
        region: str = "us-west-2",
        agent_runtime_arn: str = DEFAULT_RUNTIME_ARN,
        startup_timeout_s: float = 60.0,
        log_dir: str | Path | None = None,
        agent_env: dict[str, str] | None = None,
        faults: FaultRates | None = None,
        idle_timeout_s: float | None = None,
        max_lifetime_s: float | None = None,
        request_rate_per_s: float | None = None,
        protocol: str = "HTTP",
    ) -> None:
        self.agent_cmd = shlex.split(agent_cmd) if isinstance(agent_cmd, str) else list(agent_cmd)
        if not self.agent_cmd:
            raise ValueError("agent_cmd must not be empty")
        self.num_agents = num_agents
        self.session_rate_per_s = session_rate_per_s
        self.session_burst = session_burst
        self.max_open_sessions = max_open_sessions
        self.bucket = bucket
        self.region = region
        self.agent_runtime_arn = agent_runtime_arn
        self.startup_timeout_s = startup_timeout_s
        self.log_dir = Path(log_dir) if log_dir else None
        self.agent_env = dict(agent_env or {})
        self.faults = faults
        self.idle_timeout_s = idle_timeout_s
        self.max_lifetime_s = max_lifetime_s
        self.request_rate_per_s = request_rate_per_s
        self.protocol = protocol
        self.s3_endpoint: str | None = None
        self.acr_endpoint: str | None = None
        self._procs: list[tuple[str, subprocess.Popen, Path]] = []
        self._history: dict[str, int] = {}
        self._commands: dict[str, tuple[list[str], dict[str, str] | None]] = {}  # for restart_server
        self._started = False

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "LocalStack":
        """Start moto and the emulator, create the bucket; raises LocalStackError (after
        stopping whatever did start) when a server is not healthy within startup_timeout_s."""
        if self._started:
            raise RuntimeError("LocalStack already started")
        self._started = True
        atexit.register(self.stop)
        try:
            if self.log_dir is None:
                self.log_dir = Path(tempfile.mkdtemp(prefix="acr-local-stack-"))
            self.log_dir.mkdir(parents=True, exist_ok=True)
            moto_ready = self._ready_path("moto")
            self._spawn("moto", [sys.executable, "-m", "workers.embedded.moto_s3", "--ready-file", str(moto_ready)])
            self.s3_endpoint = self._wait_ready("moto", moto_ready)["endpoint"]
            emulator_ready = self._ready_path("emulator")
            cmd = [
                sys.executable, "-m", "workers.embedded.emulator",
                "--ready-file", str(emulator_ready),
                "--agent-cmd", shlex.join(self.agent_cmd),
                "--num-agents", str(self.num_agents),
                "--session-rate", str(self.session_rate_per_s),
                "--agent-runtime-arn", self.agent_runtime_arn,
                "--agent-start-timeout-s", str(self.startup_timeout_s),
                "--protocol", self.protocol,
            ]  # fmt: skip
            if self.session_burst is not None:
                cmd += ["--session-burst", str(self.session_burst)]
            if self.max_open_sessions is not None:
                cmd += ["--max-open-sessions", str(self.max_open_sessions)]
            if self.faults is not None:
                cmd += ["--faults", self.faults.to_json()]
            for flag, value in (
                ("--idle-timeout-s", self.idle_timeout_s),
                ("--max-lifetime-s", self.max_lifetime_s),
                ("--request-rate", self.request_rate_per_s),
            ):
                if value is not None:
                    cmd += [flag, str(value)]
            self._spawn("emulator", cmd, extra_env={**self.env, **self.agent_env})
            # While the emulator starts its agents (they write to S3 only once invoked, after start()).
            boto3.client("s3", endpoint_url=self.s3_endpoint, region_name=self.region, **_creds()).create_bucket(
                Bucket=self.bucket, CreateBucketConfiguration={"LocationConstraint": self.region}
            )
            self.acr_endpoint = self._wait_ready("emulator", emulator_ready)["endpoint"]
            return self
        except BaseException:
            self.stop()
            raise

    def terminate(self) -> None:
        """Send SIGTERM to every started process, emulator first, without waiting: they stop
        meanwhile (the driver shuts Ray down); `stop` then waits for them."""
        for _name, proc, _log in reversed(self._procs):
            if proc.poll() is None:
                proc.terminate()

    def stop(self) -> None:
        """Stop every started process by PID (SIGTERM to all, then each waited for, SIGKILL after
        STOP_GRACE_S). Idempotent."""
        self.terminate()
        while self._procs:
            name, proc, _log = self._procs.pop()  # reverse start order: emulator before moto
            try:
                proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        atexit.unregister(self.stop)

    def __enter__(self) -> "LocalStack":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop_server(self, name: str) -> None:
        """Stop server `name` ("emulator": its agents and sessions go with it; "moto": its objects
        and bucket go) by PID, as an outage would; `start_server` brings it back on the same port.
        For fault tests and scripts/chaos.py (issue 14)."""
        i = next((i for i, p in enumerate(self._procs) if p[0] == name), None)
        if i is None:
            raise ValueError(f"no running server {name!r} (running: {[p[0] for p in self._procs]})")
        _, proc, _ = self._procs.pop(i)
        proc.terminate()
        try:
            proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def start_server(self, name: str) -> None:
        """Start a server stopped by `stop_server` again, on the port it had (the clients' endpoint
        stays valid); moto gets its bucket back (empty). Raises LocalStackError if it is not healthy."""
        if any(p[0] == name for p in self._procs):
            raise ValueError(f"server {name!r} is running")
        cmd, extra_env = self._commands[name]
        endpoint = self.acr_endpoint if name == "emulator" else self.s3_endpoint
        ready = self._ready_path(name)
        self._spawn(name, [*cmd, "--port", str(endpoint).rsplit(":", 1)[1]], extra_env)
        self._wait_ready(name, ready)
        if name == "moto":
            boto3.client("s3", endpoint_url=self.s3_endpoint, region_name=self.region, **_creds()).create_bucket(
                Bucket=self.bucket, CreateBucketConfiguration={"LocationConstraint": self.region})

    def restart_exited(self) -> list[str]:
        """Start again, each on its port, the servers whose process has exited (crashed, killed);
        returns their names. The driver calls it periodically (orchestrator/control/supervise.py ServerWatch)."""
        exited = [name for name, proc, _ in self._procs if proc.poll() is not None]
        for name in exited:
            self._procs = [p for p in self._procs if p[0] != name]
            self.start_server(name)
        return exited

    # ------------------------------------------------------------------ queries

    @property
    def env(self) -> dict[str, str]:
        """Standard AWS env vars that point boto3 at this stack."""
        if self.s3_endpoint is None:
            raise RuntimeError("LocalStack not started")
        env = {
            **DUMMY_CREDENTIALS,
            "AWS_ENDPOINT_URL_S3": self.s3_endpoint,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_REGION": self.region,
        }
        if self.acr_endpoint is not None:
            env["AWS_ENDPOINT_URL_BEDROCK_AGENTCORE"] = self.acr_endpoint
        return env

    def pids(self) -> dict[str, int]:
        """PID of each server process this stack started and still holds."""
        return {name: proc.pid for name, proc, _ in self._procs}

    def started_pids(self) -> dict[str, int]:
        """PID of every server process this stack ever started, stopped ones included."""
        return dict(self._history)

    def stats(self) -> EmulatorStats:
        """The emulator's counters (sessions, peak open, peak request rate, faults, agent PIDs)."""
        if self.acr_endpoint is None:
            raise RuntimeError("LocalStack not started")
        with urllib.request.urlopen(f"{self.acr_endpoint}{STATS_PATH}", timeout=10) as r:
            return EmulatorStats.from_json(json.loads(r.read()))

    # ------------------------------------------------------------------ helpers

    def _spawn(self, name: str, cmd: list[str], extra_env: dict[str, str] | None = None) -> None:
        assert self.log_dir is not None
        log_path = self.log_dir / f"{name}.log"
        env = {**os.environ, **(extra_env or {})}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        self._commands.setdefault(name, (list(cmd), extra_env))
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    start_new_session=True, preexec_fn=die_with_parent)
        self._procs.append((name, proc, log_path))
        self._history[name] = proc.pid

    def _ready_path(self, name: str) -> Path:
        """Where `name` reports its endpoint; removed first, so only this start's file counts."""
        assert self.log_dir is not None
        path = self.log_dir / f"{name}.ready.json"
        path.unlink(missing_ok=True)
        return path

    def _wait_ready(self, name: str, path: Path) -> dict:
        _, proc, log_path = next(p for p in self._procs if p[0] == name)
        try:
            return wait_ready_file(name, path, proc, self.startup_timeout_s, log_path)
        except ServerNotReady as e:
            raise LocalStackError(str(e)) from None


def _creds() -> dict[str, str]:
    return {
        "aws_access_key_id": DUMMY_CREDENTIALS["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": DUMMY_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
    }
