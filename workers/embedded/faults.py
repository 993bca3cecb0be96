"""Fault injection for the local ACR emulator: which rollout gets which fault, decided up front.

`FaultRates` holds one probability per fault kind (per rollout session) and a seed; `FaultPlan`
maps a `runtimeSessionId` to at most one fault kind with a seeded hash, so the same rates, seed
and session ids always give the same faults: a test can compute the expected count of every kind
from the session ids it dispatched (`FaultPlan.count`) before it runs anything.

Two families of faults:

- emulator-side (`EMULATOR_FAULTS`): the emulator itself answers the session's first
  `repeats` invocations with the error, as ACR would, without reaching the agent or creating the
  session: `throttle` -> 429 ThrottlingException, `server_error` -> 500
  InternalServerException, `runtime_client_error` -> 424 RuntimeClientError. Later invocations
  of the same session go through, so a client that retries (botocore) recovers;
- agent-side (`AGENT_FAULTS`): the emulator forwards every invocation of the session to the
  agent with the header `FAULT_HEADER: <kind>`; an agent that honours it (workers.embedded.stub_agent)
  misbehaves that way: `crash` (dies mid-rollout: toolkit error object without a reward, or
  `interrupted` on the HTTP contract), `no_result` (never writes a result), `malformed_result`
  (result body is not JSON), `nan_reward` (reward NaN or +-inf), `slow` (finishes long after any
  sane rollout timeout). An agent that ignores the header behaves normally.

The header name uses ACR's custom-header prefix, which the `bedrock-agentcore` SDK forwards to
agent code: read it as `context.request_headers` (keys lower-cased by Starlette), see
`fault_from_headers`.

Invariant: `FaultPlan.fault_for(sid)` is a pure function of (rates, sid); the probability that
it returns kind k is rates.k (exactly, up to 2**-64), and at most one kind per session.
Callers: workers.embedded.emulator_routes (decides), workers.embedded.stub_agent (obeys), rollout tests and
scripts/bench_rollout.py (predict counts).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import asdict, dataclass, fields
from typing import Iterable, Literal, Mapping

FaultKind = Literal[
    "throttle",
    "server_error",
    "runtime_client_error",
    "crash",
    "no_result",
    "malformed_result",
    "nan_reward",
    "slow",
]
EMULATOR_FAULTS: tuple[FaultKind, ...] = ("throttle", "server_error", "runtime_client_error")
AGENT_FAULTS: tuple[FaultKind, ...] = ("crash", "no_result", "malformed_result", "nan_reward", "slow")
FAULT_KINDS: tuple[FaultKind, ...] = EMULATOR_FAULTS + AGENT_FAULTS  # fixed order: the hash walks it

# ACR forwards X-Amzn-Bedrock-AgentCore-Runtime-Custom-* headers to the agent; the SDK exposes them.
FAULT_HEADER = "X-Amzn-Bedrock-AgentCore-Runtime-Custom-Emulator-Fault"

# ACR error each emulator-side fault is answered with: (exception name, HTTP status).
EMULATOR_FAULT_ERRORS: dict[str, tuple[str, int]] = {
    "throttle": ("ThrottlingException", 429),
    "server_error": ("InternalServerException", 500),
    "runtime_client_error": ("RuntimeClientError", 424),
}

_HASH_SCALE = float(2**64)  # blake2b-64 digest -> uniform in [0, 1)


@dataclass(frozen=True)
class FaultRates:
    """Probability of each fault kind per rollout session (each in [0, 1], sum <= 1), and a seed.

    repeats: how many consecutive invocations of a session an emulator-side fault answers
        (1: only the first, so one botocore retry recovers; large: the error persists).
    Raises ValueError naming the field on a rate outside [0, 1], a sum above 1, or repeats < 1.
    """

    throttle: float = 0.0
    server_error: float = 0.0
    runtime_client_error: float = 0.0
    crash: float = 0.0
    no_result: float = 0.0
    malformed_result: float = 0.0
    nan_reward: float = 0.0
    slow: float = 0.0
    seed: int = 0
    repeats: int = 1

    def __post_init__(self) -> None:
        for kind in FAULT_KINDS:
            r = getattr(self, kind)
            if not 0.0 <= r <= 1.0:
                raise ValueError(f"faults.{kind} must be in [0, 1], got {r}")
        if self.total() > 1.0 + 1e-9:
            raise ValueError(f"fault rates sum to {self.total()} > 1")
        if self.repeats < 1:
            raise ValueError(f"faults.repeats must be >= 1, got {self.repeats}")

    @classmethod
    def uniform(cls, total: float, seed: int = 0, repeats: int = 1) -> "FaultRates":
        """`total` spread evenly over all FAULT_KINDS (total / 8 each)."""
        if not 0.0 <= total <= 1.0:
            raise ValueError(f"total fault rate must be in [0, 1], got {total}")
        each = total / len(FAULT_KINDS)
        return cls(**{k: each for k in FAULT_KINDS}, seed=seed, repeats=repeats)

    def total(self) -> float:
        return sum(getattr(self, k) for k in FAULT_KINDS)

    def rates(self) -> dict[FaultKind, float]:
        return {k: getattr(self, k) for k in FAULT_KINDS}

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "FaultRates":
        """Inverse of to_json; unknown keys raise ValueError naming them."""
        d = json.loads(text)
        if not isinstance(d, dict):
            raise ValueError(f"faults JSON must be an object, got {type(d).__name__}")
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown fault keys {sorted(unknown)}; known: {list(FAULT_KINDS) + ['seed', 'repeats']}")
        return cls(**d)


class FaultPlan:
    """Deterministic fault per session id under `rates` (see module docstring). Pure."""

    def __init__(self, rates: FaultRates) -> None:
        self.rates = rates
        self._cumulative: list[tuple[float, FaultKind]] = []
        acc = 0.0
        for kind in FAULT_KINDS:
            acc += getattr(rates, kind)
            self._cumulative.append((acc, kind))

    def draw(self, session_id: str) -> float:
        """The session's uniform number in [0, 1): blake2b-64 of (seed, session id)."""
        h = hashlib.blake2b(f"{self.rates.seed}\x00{session_id}".encode(), digest_size=8).digest()
        return int.from_bytes(h, "big") / _HASH_SCALE

    def fault_for(self, session_id: str) -> FaultKind | None:
        """The one fault kind of this session, or None (probability 1 - rates.total())."""
        if not self._cumulative or self._cumulative[-1][0] <= 0.0:
            return None
        u = self.draw(session_id)
        for bound, kind in self._cumulative:
            if u < bound:
                return kind
        return None

    def is_emulator_fault(self, session_id: str) -> bool:
        return self.fault_for(session_id) in EMULATOR_FAULTS

    def count(self, session_ids: Iterable[str]) -> Counter:
        """Expected number of sessions per fault kind (key None: no fault) among session_ids."""
        return Counter(self.fault_for(sid) for sid in session_ids)


def fault_from_headers(headers: Mapping[str, str] | None) -> FaultKind | None:
    """The agent-side fault the emulator asked for in these request headers, if any.

    Case-insensitive (Starlette lower-cases names). Raises ValueError on an unknown kind.
    """
    if not headers:
        return None
    want = FAULT_HEADER.lower()
    for name, value in headers.items():
        if name.lower() == want:
            if value not in AGENT_FAULTS:
                raise ValueError(f"{FAULT_HEADER}: unknown agent fault {value!r}; known: {AGENT_FAULTS}")
            return value  # type: ignore[return-value]
    return None
