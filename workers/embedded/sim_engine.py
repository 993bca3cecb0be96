"""Zero-cost inference engines behind the real InferenceEngine seam (tests and benchmarks only).

`ScriptedEngine` answers each request with the next scripted reply's token ids (the last reply
repeats), cut after the first of the request's stop ids it holds (as an engine stops), then
truncated to max_tokens; a reply that reaches its end finishes "stop" (its final id is treated as
the stop token). Each token gets a distinct log-prob (-0.01 * (position + 1)) so tests
can check alignment. It records requests, can hold them on a gate, fail them, or note their
cancellation. It never sleeps: it costs what an `await` costs, so a benchmark that drives the
gateway with it measures the gateway.

Invariant: `requests` lists every request received, in arrival order; `cancelled` the request ids
whose call was cancelled while it waited on the gate.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from workers.core.types import GenerateRequest, GenerateResult

GATE_TIMEOUT_S = 60.0  # a gated request waits at most this long (tests never hang)


class ReplicaDown(RuntimeError):
    """The simulated replica is down (fail=True)."""


class ScriptedEngine:
    """Answers scripted token ids; see the module docstring."""

    def __init__(self, replies: Sequence[Sequence[int]], *, version: int = 0, record: bool = True) -> None:
        if not replies or any(not r for r in replies):
            raise ValueError("ScriptedEngine needs at least one non-empty reply")
        self.replies = [tuple(r) for r in replies]
        self.version = version
        self.record = record
        self.requests: list[GenerateRequest] = []
        self.cancelled: list[str] = []
        self.served = 0
        self.fail = False
        self.abort = False
        self.gate: asyncio.Event | None = None
        self.started = asyncio.Event()  # set when a request arrives
        self.cancel_seen = asyncio.Event()  # set when a gated request is cancelled

    def script(self, *replies: Sequence[int]) -> None:
        """Replace the replies (served in order from the next request on; the last repeats)."""
        self.replies = [tuple(r) for r in replies]
        self.served = 0

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        if self.record:
            self.requests.append(req)
        self.started.set()
        if self.fail:
            raise ReplicaDown("simulated replica failure")
        if self.gate is not None:
            try:
                await asyncio.wait_for(self.gate.wait(), GATE_TIMEOUT_S)
            except asyncio.CancelledError:
                self.cancelled.append(req.request_id)
                self.cancel_seen.set()
                raise
        full = self.replies[min(self.served, len(self.replies) - 1)]
        self.served += 1
        stop_at = next((i + 1 for i, t in enumerate(full) if t in req.stop_token_ids), len(full))
        full = full[:stop_at]  # as an engine does: the first stop id ends the output (and is kept)
        out = full[: req.max_tokens]
        finish = "stop" if len(out) == len(full) else "length"
        if self.abort:
            out, finish = out[:1], "abort"
        return GenerateResult(
            output_ids=out,
            logprobs=tuple(-0.01 * (i + 1) for i in range(len(out))),
            finish_reason=finish,
            policy_version=self.version,
        )
