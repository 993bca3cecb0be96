"""A run whose agent cannot work with it stops after its first rollouts, saying why.

An agent that speaks the other contract (`rollout.contract=http` with an agent built on the S3
contract, or the reverse) fails every rollout the same way: `agent_error` (it raises on the payload it
does not expect) or `bad_result` (its answer is not the result this contract reads). Without a check
an async run goes on dispatching forever, and a sync run ends on a generic "all rollouts failed".

`FirstRollouts` looks at the first `first_n` rollouts the loop receives, in order. If one of them
completed, it is disarmed for the rest of the run (later failures are faults, handled elsewhere:
workers/rollout/contract.py BadResultStreak, the failure counters). If all `first_n` failed with
one and the same contract reason (`CONTRACT_REASONS`), `observe` returns the stop message, which
names the reason, an example error and the contract the run expects. Failures of our own parts or
of ACR (`timeout`, `acr_unavailable`, `engine_lost`, ...) never stop the run here.

Invariant: pure (no Ray, no I/O); returns a message at most once, and only when the first
`first_n` rollouts the loop saw all failed for the same contract reason.
Callers: orchestrator/loop/sync_loop.py, orchestrator/loop/async_loop.py.
"""

from __future__ import annotations

from typing import Iterable

from workers.core.types import SampleInfo

CONTRACT_REASONS = ("agent_error", "bad_result")  # workers/rollout/failures.py reasons an agent's contract causes
FIRST_ROLLOUTS = 16  # how many first rollouts decide (fewer when a step has fewer)

CONTRACT_HINTS = {
    "http": ("rollout.contract=http expects the agent to answer each invocation with its result "
             "({\"reward\": r}, the toolkit's _agentcore_runtime envelope); an agent on the S3 contract "
             "(@app.rollout_entrypoint, rewards written to S3) needs rollout.contract=s3"),
    "s3": ("rollout.contract=s3 expects the agent to take `_rollout` from the payload, answer at once and "
           "write {\"rewards\": r} to S3 (the toolkit's @app.rollout_entrypoint); an agent that answers its "
           "result in the invocation's response needs rollout.contract=http"),
}


def failure_reason(sample: SampleInfo) -> str | None:
    """The failure reason of a failed sample (its error starts with `reason:`), else None."""
    if sample.status != "failed" or not sample.error:
        return None
    return sample.error.split(":", 1)[0].strip()


class FirstRollouts:
    """The contract check on the first `first_n` rollouts of a run (see the module docstring).
    `contract`: `rollout.contract` ("s3" or "http"). Raises ValueError when first_n < 1."""

    def __init__(self, first_n: int, contract: str) -> None:
        if first_n < 1:
            raise ValueError(f"first_n must be >= 1, got {first_n}")
        self._n = first_n
        self._contract = contract
        self._seen: list[SampleInfo] = []
        self._decided = False

    def observe(self, samples: Iterable[SampleInfo]) -> str | None:
        """Take the next finished rollouts; the stop message once the first `first_n` all failed for
        one contract reason, else None (and None ever after once decided)."""
        if self._decided:
            return None
        for s in samples:
            if s.status in ("completed", "truncated"):  # a truncated agent spoke the contract too
                self._decided = True
                return None
            self._seen.append(s)
            if len(self._seen) >= self._n:
                break
        if len(self._seen) < self._n:
            return None
        self._decided = True
        reasons = {failure_reason(s) for s in self._seen}
        if len(reasons) != 1 or (reason := reasons.pop()) not in CONTRACT_REASONS:
            return None
        example = next(s.error for s in self._seen if s.error)
        hint = CONTRACT_HINTS.get(self._contract, "")
        return (f"the first {self._n} rollouts all failed {reason}: does the agent speak rollout.contract="
                f"{self._contract}? {hint}; if it does, see the agent's log (e.g. {example[:200]!r})")
