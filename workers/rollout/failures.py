"""Why a rollout failed: the closed set of reasons and the rule from an exception to its reason.

Reasons (`rollout/failed/{reason}` counters, `RolloutResult.reason`): `timeout`, `bad_result`,
`agent_error`, `throttled`, `acr_error`, `transport`, the A2A contract's setup phase
(`setup_timeout`: past `rollout.setup_timeout_s`; `setup_failed`: the agent ended the task in
setup; workers/rollout/lifecycle.py), and the faults of our own parts and servers:
`engine_lost` (a turn found no inference replica: the gateway marked the session),
`nonlinear_history` (gateway.on_nonlinear=error refused a request that edited the history),
`actor_lost` (the rollout actor died: workers/rollout/recovery.py), `acr_unavailable` /
`s3_unavailable` (the ACR endpoint or the result store refused or dropped the connection after
botocore's retries, e.g. the local emulator or moto restarting: later rollouts succeed once it is
back, and a StopRuntimeSession that failed meanwhile is retried by the worker for
STOP_RETRY_FOR_S). The result store's outage is `s3_unavailable` also when the agent is the one
that met it: an agent whose write of its result failed because S3 could not be reached, or refused
it for a fault of the store (its bucket gone: moto restarted empty and not yet given its bucket
back), reports the toolkit's error object once the store answers again (`agent_could_not_store`),
which is S3's failure, not the agent's (`agent_error` would point the user at their agent). Callers: workers/rollout/worker.py,
pool.py.
"""

from __future__ import annotations

import contextlib
import re
from typing import Iterator, Literal
from urllib.parse import unquote

from botocore.exceptions import (ClientError, ConnectionClosedError, ConnectionError as BotoConnectionError,
                                 ConnectTimeoutError, EndpointConnectionError, HTTPClientError, ReadTimeoutError)

from workers.acr.client import AgentBodyError
from workers.rollout.contract import AgentFailed, BadResult

FailReason = Literal["timeout", "bad_result", "agent_error", "throttled", "acr_error", "transport", "engine_lost",
                     "actor_lost", "acr_unavailable", "s3_unavailable", "setup_timeout", "setup_failed",
                     "nonlinear_history"]
UNREACHABLE = (BotoConnectionError, HTTPClientError)  # the endpoint is down or restarting (botocore's retries spent)
STOP_RETRY_EVERY_S = 2.0  # a StopRuntimeSession that failed is tried again this often (seconds) ...
STOP_RETRY_FOR_S = 300.0  # ... for this long: the emulator / ACR may come back; then its slot is freed


# botocore's messages for an endpoint it could not reach, as `f"{type(exc).__name__}: {exc}"` writes them
# into an agent's error object: the text of each class's `fmt` before its quoted endpoint URL
_UNREACHABLE_TEXT = re.compile(
    "(?:" + "|".join(re.escape(cls.fmt.split('"{endpoint_url}"')[0]) for cls in
                     (EndpointConnectionError, ConnectTimeoutError, ReadTimeoutError, ConnectionClosedError))
    + r')\s*"?(?P<url>[^"\s]+)"?')
# S3's answer to an agent's PutObject that is the store's fault, as botocore's ClientError writes it
STORE_FAULT_CODES = ("NoSuchBucket", "InternalError", "ServiceUnavailable", "SlowDown")
_PUT_REFUSED_TEXT = re.compile(
    re.escape(ClientError.MSG_TEMPLATE).replace(r"\{error_code\}", r"(?P<code>\w+)")
    .replace(r"\{operation_name\}", "PutObject").replace(r"\{retry_info\}", r"(?: \([^)]*\))?")
    .replace(r"\{error_message\}", r"(?P<message>[^\n]*)"))


class EndpointDown(Exception):
    """The ACR endpoint (`acr_unavailable`) or the result store (`s3_unavailable`) could not be
    reached: refused, reset or timed out after botocore's retries (a server restarting).
    `message`: the text when the cause's own would not name the part (default: the cause's)."""

    def __init__(self, reason: FailReason, cause: BaseException, message: str | None = None) -> None:
        super().__init__(message or f"{type(cause).__name__}: {cause}")
        self.reason = reason


class SetupFailed(Exception):
    """The agent's setup (A2A contract) did not park its task: `reason` is `setup_timeout` or
    `setup_failed`; the message says which bound or what the agent reported."""

    def __init__(self, reason: FailReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@contextlib.contextmanager
def reaching(reason: FailReason) -> Iterator[None]:
    """Turn an unreachable endpoint inside the block into EndpointDown(reason)."""
    try:
        yield
    except UNREACHABLE as e:
        raise EndpointDown(reason, e) from e


def agent_could_not_store(stop_reason: str | None, bucket: str, key: str) -> str | None:
    """When an agent's error object says it failed because of the result store while it wrote this
    rollout's result, the line that names S3 as the broken part; else None (the agent's own
    failure). The store's failures: botocore's could-not-connect, connect- or read-timeout or
    connection-closed message for a URL of `key`; or S3 answering a PutObject with one of
    STORE_FAULT_CODES (its message names no object: an agent of the contract writes only its result).
    `bucket`/`key`: where the result was due (rollout.acr.s3_bucket, `result_key`). Pure."""
    text = stop_reason or ""
    for match in _UNREACHABLE_TEXT.finditer(text):
        if key in unquote(match.group("url")):
            return (f"S3 (the result store) could not be reached: the agent could not write its result to "
                    f"s3://{bucket}/{key} ({match.group(0)}); the object store was down or restarting, "
                    "not the agent at fault")
    for match in _PUT_REFUSED_TEXT.finditer(text):
        if match.group("code") in STORE_FAULT_CODES:
            return (f"S3 (the result store) refused the agent's write of its result to s3://{bucket}/{key} "
                    f"({match.group('code')}: {match.group('message')[:200]}); the object store failed or lost "
                    "its bucket (rollout=local: moto restarted), not the agent at fault")
    return None


def fail_reason(exc: BaseException) -> FailReason:
    """The reason a rollout failed with `exc` (see FailReason)."""
    if isinstance(exc, (EndpointDown, SetupFailed)):
        return exc.reason
    if isinstance(exc, (BadResult, AgentBodyError)):
        return "bad_result"
    if isinstance(exc, AgentFailed):
        return "agent_error"
    if isinstance(exc, ClientError):
        code = exc.response.get("Error", {}).get("Code")
        if code == "ThrottlingException":
            return "throttled"
        return "agent_error" if code == "RuntimeClientError" else "acr_error"
    return "transport"
