"""The two agent contracts as pure functions: payloads out, rewards in, and which errors stop a run.

Contracts (agentcore-rl-toolkit's shapes):

- `s3`: payload = dataset row + `_rollout` {exp_id, input_id, session_id, s3_bucket, base_url,
  model_id, api_key, sampling, result_url}; the agent answers at once and later writes
  `{"rewards": r}` (a number, or a list whose last item counts) to
  `s3://{s3_bucket}/{exp_id}/{input_id}/{session_id}.json`, and, when `result_url` is given,
  may POST the same JSON there (fast completion; S3 stays the durable record).
- `http`: payload = dataset row + `_config` {base_url, model_id, api_key, ...} + the envelope
  `_agentcore_runtime` {version: 1, operation: start|get, invocation_id, background}; the agent
  answers an invocation record {version, invocation_id, status: in_progress|completed|
  interrupted|not_found, result | error}; a completed result is `{"reward": r}`. An app that
  ignores the envelope answers its result directly; that counts as a completed record.

The rule for bad data (it reconciles "contract errors stop the run" with "a bad result is a
failed rollout"):

- a dataset row carrying a reserved key (`_rollout`, `_config`, `_agentcore_runtime`) is the
  caller's bug: `ContractError` naming the row and the field, and the run stops;
- an agent's result that cannot be trained (not JSON, reward missing, not a number, NaN or
  infinite) fails THAT rollout: `BadResult` naming the result and the field, counted as
  `failed` with reason `bad_result`, and the sample keeps reward None so it is never trained;
- but a broken agent fails every rollout the same way: `BadResultStreak` turns
  `max_consecutive` bad results in a row (no good one between) into a `ContractError`, which
  stops the run with the last one's message. Random faults do not trip it; a systematic
  contract break does within `max_consecutive` rollouts.
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass
from typing import Any, Literal

RESERVED_KEYS = ("_rollout", "_config", "_agentcore_runtime")  # keys a dataset row must not carry
ENVELOPE_KEY = "_agentcore_runtime"
ENVELOPE_VERSION = 1  # agentcore_rl_toolkit.runtime.protocol.VERSION
Contract = Literal["s3", "http", "a2a"]  # a2a: workers/rollout/a2a.py
InvocationStatus = Literal["in_progress", "completed", "interrupted", "not_found"]
_STATUSES = ("in_progress", "completed", "interrupted", "not_found")


class ContractError(ValueError):
    """The dataset or a systematically broken agent broke the rollout contract: stops the run.
    The message names the row (or result) and the field."""


class BadResult(ValueError):
    """One agent result cannot be trained (names the result and the field): that rollout fails."""


class AgentFailed(RuntimeError):
    """The agent reported a failure for its rollout (error record, interrupted, not_found).
    `stop_reason`: the whole reason of a toolkit error object (the message keeps 200 characters)."""

    def __init__(self, message: str, stop_reason: str | None = None) -> None:
        super().__init__(message)
        self.stop_reason = stop_reason


def new_session_id(exp_id: str, group_id: int, sample_index: int) -> str:
    """A `runtimeSessionId` (33-256 chars, ACR's bound): readable prefix + 32 hex random chars."""
    return f"{exp_id[:64]}-g{group_id}-s{sample_index}-{uuid.uuid4().hex}"


def new_invocation_id() -> str:
    """An HTTP-contract invocation id (toolkit: 1-128 of [A-Za-z0-9_-], alphanumeric first)."""
    return uuid.uuid4().hex


def result_key(exp_id: str, input_id: str, session_id: str) -> str:
    """S3 key of the agent's result (agentcore-rl-toolkit S3-result contract)."""
    return f"{exp_id}/{input_id}/{session_id}.json"


def check_row(row: dict, input_id: str) -> None:
    """Raise ContractError if the dataset row carries a reserved key."""
    bad = [k for k in RESERVED_KEYS if k in row]
    if bad:
        raise ContractError(f"dataset row input_id={input_id!r} has reserved field(s) {bad}")


def s3_payload(row: dict, input_id: str, rollout: dict[str, Any]) -> dict:
    """Row + `_rollout` (the row is not mutated). Raises ContractError on reserved keys."""
    check_row(row, input_id)
    return {**row, "_rollout": rollout}


def http_payload(row: dict, input_id: str, config: dict[str, Any], operation: Literal["start", "get"],
                 invocation_id: str, background: bool = False) -> dict:
    """Row + `_config` + the `_agentcore_runtime` envelope. Raises ContractError on reserved keys."""
    check_row(row, input_id)
    envelope: dict[str, Any] = {"version": ENVELOPE_VERSION, "operation": operation, "invocation_id": invocation_id}
    if operation == "start":
        envelope["background"] = background
    return {**row, "_config": config, ENVELOPE_KEY: envelope}


MAX_ABS_REWARD = 1e6  # a reward beyond this is an agent's bug (a reward of 1e30 would swamp every advantage), not a result


def _finite_number(r: Any, where: str, field: str) -> float:
    if isinstance(r, bool) or not isinstance(r, (int, float)):
        raise BadResult(f"{where}: '{field}' is not a number: {r!r}")
    if not math.isfinite(r):
        raise BadResult(f"{where}: '{field}' is not finite: {r!r}")
    if abs(r) > MAX_ABS_REWARD:
        raise BadResult(f"{where}: '{field}' is {r!r}, beyond +-{MAX_ABS_REWARD:g}: a bug in the agent's reward, "
                        "not trained")
    return float(r)


def parse_reward(result: dict, where: str) -> float:
    """The reward of an S3-contract result `{"rewards": r}` (r a number, or a list whose last
    item counts). Raises BadResult naming `where` if missing, empty, non-numeric, not finite or
    beyond +-MAX_ABS_REWARD;
    AgentFailed for the toolkit's error object (`status_code` >= 400, no rewards)."""
    if not isinstance(result, dict):
        raise BadResult(f"{where}: result is {type(result).__name__}, expected a JSON object")
    if "rewards" not in result:
        status = result.get("status_code")
        if isinstance(status, int) and not isinstance(status, bool) and status >= 400:  # toolkit error object
            reason = str(result.get("stop_reason"))
            raise AgentFailed(f"{where}: agent reported status_code {status}: {reason[:200]}", stop_reason=reason)
        raise BadResult(f"{where}: result has no 'rewards' field (keys: {sorted(result)})")
    r = result["rewards"]
    if isinstance(r, list):
        if not r:
            raise BadResult(f"{where}: 'rewards' is an empty list")
        r = r[-1]
    return _finite_number(r, where, "rewards")


def parse_result_body(raw: bytes, where: str) -> dict:
    """JSON object of a posted/stored result (NaN/Infinity literals accepted, then refused by
    parse_reward). Raises BadResult when the body is not a JSON object."""
    try:
        out = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadResult(f"{where}: result is not JSON ({e}): {raw[:100]!r}") from e
    if not isinstance(out, dict):
        raise BadResult(f"{where}: result is JSON {type(out).__name__}, expected an object")
    return out


@dataclass(frozen=True)
class InvocationRecord:
    """An HTTP-contract invocation record (toolkit `InvocationState`)."""

    invocation_id: str
    status: InvocationStatus
    result: Any = None
    error: str | None = None


def parse_record(value: Any, invocation_id: str, where: str) -> InvocationRecord:
    """Read an invoke answer as a record. An answer that is not a record of THIS invocation
    (an app that ignores the envelope) is its completed result. Raises BadResult on a record
    with an unknown status or a completed record without exactly one of result / error."""
    if not (isinstance(value, dict) and {"version", "status", "invocation_id"} <= value.keys()
            and value["invocation_id"] == invocation_id):
        return InvocationRecord(invocation_id, "completed", result=value)
    status = value["status"]
    if value["version"] != ENVELOPE_VERSION or status not in _STATUSES:
        raise BadResult(f"{where}: invalid invocation record {value!r}")
    if status == "completed" and ("result" in value) == ("error" in value):
        raise BadResult(f"{where}: completed record needs exactly one of 'result' or 'error': {value!r}")
    return InvocationRecord(invocation_id, status, value.get("result"), value.get("error"))


def http_reward(record: InvocationRecord, where: str) -> float:
    """The reward of a terminal record. Raises AgentFailed for an error/interrupted/not_found
    record, BadResult when the result has no finite 'reward'."""
    if record.status != "completed":
        raise AgentFailed(f"{where}: invocation {record.invocation_id} is {record.status}")
    if record.error is not None:
        raise AgentFailed(f"{where}: invocation {record.invocation_id} failed: {record.error}")
    result = record.result
    if not isinstance(result, dict):
        raise BadResult(f"{where}: result is {type(result).__name__}, expected a JSON object")
    if "reward" not in result:
        raise BadResult(f"{where}: result has no 'reward' field (keys: {sorted(result)})")
    return _finite_number(result["reward"], where, "reward")


class BadResultStreak:
    """Counts bad results in a row; `on_bad` raises ContractError at `max_consecutive`.

    Invariant: the run stops iff `max_consecutive` consecutive results (no good one between)
    were bad; `on_good` resets the count.
    """

    def __init__(self, max_consecutive: int) -> None:
        if max_consecutive < 1:
            raise ValueError(f"rollout.max_consecutive_bad_results must be >= 1, got {max_consecutive}")
        self.max_consecutive = max_consecutive
        self.count = 0

    def on_good(self) -> None:
        self.count = 0

    def on_bad(self, message: str) -> None:
        self.count += 1
        if self.count >= self.max_consecutive:
            raise ContractError(f"{self.count} agent results in a row broke the reward contract; last: {message}")
