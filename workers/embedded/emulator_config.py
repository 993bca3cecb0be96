"""How the ACR emulator runs: `EmulatorConfig` and the constants of its API surface.

Pure (no I/O): read by the emulator's routes (workers.embedded.emulator_routes), its entry point
(workers.embedded.emulator) and `workers.embedded.local_stack.LocalStack`, which imports only this
module and the stats shape, not the server.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from workers.embedded.emulator_commands import DEFAULT_MAX_OUTPUT_BYTES
from workers.embedded.emulator_sessions import DEFAULT_SESSION_IDLE_TIMEOUT_S, DEFAULT_SESSION_MAX_LIFETIME_S
from workers.embedded.faults import FaultRates

DEFAULT_RUNTIME_ARN = "arn:aws:bedrock-agentcore:us-west-2:000000000000:runtime/local_agent-emulator0"
RUNTIME_ARN_RE = re.compile(r"arn:aws[a-z-]*:bedrock-agentcore:[a-z0-9-]+:\d{12}:runtime/[A-Za-z][A-Za-z0-9_-]{0,99}")
STATS_PATH = "/_emulator/stats"
READY_LINE_PREFIX = "ACR emulator ready"
MAX_TICK_S = 1.0  # reaper/ping period upper bound; shrunk to a quarter of small timeouts
MIN_TICK_S = 0.02
PROTOCOLS = ("HTTP", "A2A")  # ACR's serverProtocol: where an invocation goes in the container
A2A_HEADERS = ("a2a-version", "a2a-extensions")  # forwarded to an A2A agent with the JSON-RPC body


@dataclass
class EmulatorConfig:
    """How to run the emulator. `agent_cmd` is an argv list; `{port}` in it is substituted.

    qualifiers: endpoint names that exist (others: ResourceNotFoundException).
    request_rate_per_s: optional cap on all data-plane calls (ThrottlingException past it).
    max_output_bytes: per-stream cap of InvokeAgentRuntimeCommand output.
    protocol: the runtime's serverProtocol. HTTP: the body goes to the agent's `POST /invocations`;
        A2A: the JSON-RPC body goes to the agent's `POST /` (ACR's A2A contract, port 9000 there;
        here each agent's port is also in env A2A_PORT) with the A2A-Version header.
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
    protocol: str = "HTTP"

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {list(PROTOCOLS)}, got {self.protocol!r}")
        if not self.agent_cmd:
            raise ValueError("agent_cmd must not be empty")
        if self.num_agents < 1:
            raise ValueError(f"num_agents must be >= 1, got {self.num_agents}")
        if not RUNTIME_ARN_RE.fullmatch(self.agent_runtime_arn):
            raise ValueError(f"agent_runtime_arn {self.agent_runtime_arn!r} is not a runtime ARN")

    def tick_s(self) -> float:
        return max(MIN_TICK_S, min(MAX_TICK_S, self.idle_timeout_s / 4, self.max_lifetime_s / 4))
