"""Counters of one gateway app (turns, errors, tokens, engine time), read as a frozen snapshot.

Invariant: turns_served = turns_first + turns_clean + turns_fork (every served turn is recorded in
exactly one way); turns_ill_formed <= turns_served; turns_length <= turns_served. One event loop mutates the counters.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GatewayMetrics:
    """Counters since the app started (a snapshot; counts, tokens, seconds)."""

    turns_served: int = 0
    turns_first: int = 0
    turns_clean: int = 0
    turns_fork: int = 0
    turns_continued: int = 0  # prompts built on recorded tokens (continuity.py), a subset of served
    turns_healed: int = 0  # history_mode=linear: prompts spliced onto the served ids (linear.py)
    healed_prefix_tokens: int = 0  # tokens of those prompts taken from the served ids, not re-rendered
    turns_nonlinear: int = 0  # history_mode=linear: requests that did not extend the previous turn
    turns_aborted: int = 0
    turns_unrecorded_closed: int = 0
    turns_cancelled: int = 0  # the client went away; its engine request was cancelled
    turns_ill_formed: int = 0  # outputs that opened a tool call the parser could not read
    turns_length: int = 0  # served turns whose generation was cut at max_tokens (finish_reason "length")
    turns_context_exceeded: int = 0  # 400 context_length_exceeded, plus generations cut at the context's end
    tool_calls: int = 0
    replica_failures: int = 0  # generate calls that raised; the replica was taken out
    turns_engine_lost: int = 0  # 503: no replica could serve the turn; its session is marked engine_lost
    unauthorized: int = 0
    closed_session_requests: int = 0  # 409: token of a closed session
    turn_limit_refused: int = 0  # 429: session past its turn cap
    bad_requests: int = 0
    server_errors: int = 0
    prompt_tokens: int = 0
    tokens_generated: int = 0
    engine_busy_s: float = 0.0  # sum over turns of engine time (s); / wall time = mean concurrency


class Counters:
    """Mutable counters behind GatewayMetrics."""

    def __init__(self) -> None:
        self.values = {name: 0 for name in GatewayMetrics.__dataclass_fields__}

    def add(self, name: str, n: float = 1) -> None:
        self.values[name] += n

    def snapshot(self) -> GatewayMetrics:
        return GatewayMetrics(**self.values)
