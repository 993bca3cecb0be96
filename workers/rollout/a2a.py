"""The A2A rollout protocol, client half: one rollout is one A2A Task driven over ACR invocations.

The wire is agentcore-rl-toolkit 0.2.0's (`rollout_session/a2a_protocol.py`, `a2a_client.py`,
served by its `RolloutAgentExecutor`), carried as JSON-RPC 2.0 in the body of InvokeAgentRuntime
with the session header (the session id is also the task's `contextId`):

1. `SendMessage` with one data part `{"task_input": {...}}` and no task id: the agent mints the
   task and runs its setup (minutes for a SWE container), then parks the task at
   `TASK_STATE_INPUT_REQUIRED`; `GetTask` polls until then (bounded exponential backoff).
2. `SendMessage` with the same `task_input` on that task id: the agent runs the rollout; `GetTask`
   polls until a terminal state. `COMPLETED` carries an artifact named `rollout` whose data part is
   the dump `{reward, task_output, metrics, exception}`; `FAILED` carries the reason as text.
3. `CancelTask` (best effort, bounded) whenever the task is left before it ended.

JSON-RPC errors -32054 (session operation in progress, or HTTP 409) are retried every
CONFLICT_INTERVAL_S up to CONFLICT_TRIES calls and -32053 (throttled) with exponential backoff and
full jitter up to THROTTLE_TRIES, as the toolkit does; every other JSON-RPC error fails the rollout.

Invariant: `A2ASession.run` returns only the dump of a terminal task, and a task this session
created and left before its end gets one CancelTask before the caller stops the ACR session.
Protocol types are the official a2a-sdk's (`a2a.types`, proto-JSON); pure apart from the injected
`call` (one InvokeAgentRuntime: a JSON-RPC request dict in, the agent's JSON answer out).
"""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import tenacity
from a2a.types import (
    CancelTaskRequest,
    GetTaskRequest,
    Message,
    Part,
    Role,
    SendMessageConfiguration,
    SendMessageRequest,
    Task,
    TaskState,
)
from google.protobuf import json_format
from google.protobuf.struct_pb2 import Value

from workers.rollout.contract import AgentFailed, BadResult, ContractError

log = logging.getLogger(__name__)

A2A_VERSION = "1.0"  # the `A2A-Version` header a v1 agent requires (a2a-sdk >= 1.0)
TASK_INPUT_KEY = "task_input"
ROLLOUT_ARTIFACT = "rollout"
SESSION_IN_PROGRESS_CODE = -32054  # ACR: RetryableConflictException
THROTTLE_CODE = -32053  # ACR: throttling
CONFLICT_TRIES, CONFLICT_INTERVAL_S = 8, 2.0
THROTTLE_TRIES, THROTTLE_INITIAL_S, THROTTLE_MAX_S = 6, 0.5, 30.0
CANCEL_WAIT_S = 5.0  # bound on the CancelTask of a task left mid-flight
TERMINAL = frozenset({TaskState.TASK_STATE_COMPLETED, TaskState.TASK_STATE_FAILED,
                      TaskState.TASK_STATE_CANCELED, TaskState.TASK_STATE_REJECTED})
A2A_RESERVED_KEYS = ("llm", "sampling_params", "group_id")  # task_input keys the orchestrator sets

Call = Callable[[dict], Awaitable[dict]]


class A2AConflict(RuntimeError):
    """-32054 / HTTP 409: a previous operation on this session still runs; retry the same call."""


class A2AThrottled(RuntimeError):
    """-32053 / HTTP 429: back off and retry the same call."""


@dataclass(frozen=True)
class RolloutDump:
    """The agent's `rollout` artifact (toolkit `RolloutDumpResponse`): `reward` None or
    `exception` set means the rollout cannot be trained."""

    reward: float | None
    task_output: dict | None
    exception: str | None
    metrics: dict[str, float] = field(default_factory=dict)


def task_input(row: dict, *, input_id: str, group_id: int, endpoint: dict, sampling: dict,
               timeout_s: float) -> dict:
    """The toolkit's task dict for one rollout (its verl agent loop's `make_task`): the dataset row
    plus `group_id`, `sampling_params` {temperature, top_p, max_tokens} and `llm` {model
    ("openai/<served name>", LiteLLM's form), base_url, api_key (the gateway session token),
    num_retries 0, timeout (seconds), and the sampling}. Raises ContractError for a row that carries
    one of A2A_RESERVED_KEYS."""
    clash = [k for k in A2A_RESERVED_KEYS if k in row]
    if clash:
        raise ContractError(f"dataset row input_id={input_id!r} carries {clash[0]!r}, which rollout.contract=a2a "
                            f"sets in the agent's task_input (reserved: {', '.join(A2A_RESERVED_KEYS)})")
    llm = {"model": f"openai/{endpoint['model_id']}", "base_url": endpoint["base_url"],
           "api_key": endpoint["api_key"], "num_retries": 0, "timeout": timeout_s, **sampling}
    return {**row, "group_id": str(group_id), "sampling_params": dict(sampling), "llm": llm}


def rpc(method: str, params: Any) -> dict:
    """A JSON-RPC 2.0 request of `method` ("SendMessage", "GetTask", "CancelTask") whose params are
    the proto-JSON of the a2a-sdk request `params`."""
    return {"jsonrpc": "2.0", "id": uuid.uuid4().hex, "method": method,
            "params": json_format.MessageToDict(params)}


def send_message(task_input: dict, *, session_id: str, task_id: str | None) -> dict:
    """`SendMessage` of one user message with the data part `{"task_input": task_input}`; no
    `task_id`: a new task (setup); with it: resume the parked task (rollout). Answers at once
    (`return_immediately`): the agent works in the background and the client polls."""
    data = Value()
    data.struct_value.update({TASK_INPUT_KEY: task_input})
    message = Message(message_id=uuid.uuid4().hex, role=Role.ROLE_USER, parts=[Part(data=data)],
                      context_id=session_id, **({"task_id": task_id} if task_id else {}))
    config = SendMessageConfiguration(return_immediately=True, accepted_output_modes=["text"])
    return rpc("SendMessage", SendMessageRequest(message=message, configuration=config))


def get_task(task_id: str) -> dict:
    return rpc("GetTask", GetTaskRequest(id=task_id))


def cancel_task(task_id: str) -> dict:
    return rpc("CancelTask", CancelTaskRequest(id=task_id))


def parse_task(answer: dict, where: str) -> Task:
    """The Task in a JSON-RPC answer (`result` of GetTask, `result.task` of SendMessage).

    Raises A2AConflict / A2AThrottled for ACR's retryable codes, AgentFailed for any other JSON-RPC
    error, BadResult when the answer is not a JSON-RPC response holding a task."""
    error = answer.get("error")
    if isinstance(error, dict):
        code, message = error.get("code"), str(error.get("message", ""))[:300]
        if code == SESSION_IN_PROGRESS_CODE:
            raise A2AConflict(f"{where}: {message}")
        if code == THROTTLE_CODE:
            raise A2AThrottled(f"{where}: {message}")
        raise AgentFailed(f"{where}: JSON-RPC error {code}: {message}")
    result = answer.get("result")
    if isinstance(result, dict) and isinstance(result.get("task"), dict):
        result = result["task"]
    if not isinstance(result, dict) or "id" not in result:
        raise BadResult(f"{where}: not a JSON-RPC answer with a task (keys: {sorted(answer)[:8]})")
    try:
        return json_format.ParseDict(result, Task(), ignore_unknown_fields=True)
    except json_format.ParseError as e:
        raise BadResult(f"{where}: the task does not parse: {e}") from e


def status_text(task: Task) -> str:
    """The text of the task's status message (a `failed` reason), else its state's name."""
    texts = [p.text for p in task.status.message.parts if p.WhichOneof("content") == "text"]
    return "\n".join(texts) if texts else TaskState.Name(task.status.state)


def dump_of(task: Task, where: str) -> RolloutDump:
    """The dump of a terminal task: its `rollout` artifact when COMPLETED. Raises AgentFailed for a
    task that ended otherwise (the agent could not attempt it), BadResult for a COMPLETED task with
    no readable dump."""
    if task.status.state != TaskState.TASK_STATE_COMPLETED:
        raise AgentFailed(f"{where}: task {TaskState.Name(task.status.state)}: {status_text(task)[-300:]}")
    for artifact in task.artifacts:
        if artifact.name != ROLLOUT_ARTIFACT:
            continue
        for part in artifact.parts:
            if part.WhichOneof("content") == "data":
                return _dump(json_format.MessageToDict(part.data), where)
    raise BadResult(f"{where}: task completed with no {ROLLOUT_ARTIFACT!r} artifact")


def _dump(data: Any, where: str) -> RolloutDump:
    if not isinstance(data, dict):
        raise BadResult(f"{where}: the rollout artifact is {type(data).__name__}, expected an object")
    reward, exception = data.get("reward"), data.get("exception")
    metrics = data.get("metrics") or {}
    return RolloutDump(reward=reward, task_output=data.get("task_output"),
                       exception=None if exception is None else str(exception),
                       metrics={k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))})


def reward_of(dump: RolloutDump, where: str) -> float:
    """The trainable reward of a dump. Raises AgentFailed when the agent reported an exception
    (its last line named), BadResult when the reward is missing, not a number or not finite."""
    if dump.exception is not None:
        last = dump.exception.strip().splitlines()
        raise AgentFailed(f"{where}: the rollout raised: {(last[-1] if last else 'an empty exception')[:300]}")
    r = dump.reward
    if isinstance(r, bool) or not isinstance(r, (int, float)):
        raise BadResult(f"{where}: 'reward' is {'missing' if r is None else repr(r)[:50]}")
    if not math.isfinite(r):
        raise BadResult(f"{where}: 'reward' is not finite: {r}")
    return float(r)


def _retrying(call: Call) -> Call:
    """`call` with ACR's two transient answers retried: conflicts at a constant interval,
    throttles with exponential backoff and full jitter (the toolkit's `_retry_transient`)."""
    conflicts = tenacity.retry(retry=tenacity.retry_if_exception_type(A2AConflict), reraise=True,
                               wait=tenacity.wait_fixed(CONFLICT_INTERVAL_S),
                               stop=tenacity.stop_after_attempt(CONFLICT_TRIES))
    throttles = tenacity.retry(retry=tenacity.retry_if_exception_type(A2AThrottled), reraise=True,
                               wait=tenacity.wait_random_exponential(multiplier=THROTTLE_INITIAL_S,
                                                                     max=THROTTLE_MAX_S),
                               stop=tenacity.stop_after_attempt(THROTTLE_TRIES))
    return throttles(conflicts(call))


class A2ASession:
    """One rollout's task on one ACR session. `call` sends one JSON-RPC request (one
    InvokeAgentRuntime of `session_id`); `poll_initial_s` doubling up to `poll_max_s` paces GetTask.
    Time bounds are the caller's (an `asyncio.timeout` around `setup` and `run`)."""

    def __init__(self, call: Call, session_id: str, *, poll_initial_s: float, poll_max_s: float) -> None:
        self._session_id = session_id
        self._poll = (poll_initial_s, poll_max_s)
        self.task_id: str | None = None
        self.finished = False
        self._where = f"the A2A task of session {session_id}"

        async def checked(body: dict) -> Task:
            return parse_task(await call(body), self._where)

        self._call = _retrying(checked)

    async def setup(self, task_input: dict) -> None:
        """Start the task and wait until the agent parked it at INPUT_REQUIRED. Raises
        AgentFailed when setup ended the task instead (its reason named)."""
        task = await self._call(send_message(task_input, session_id=self._session_id, task_id=None))
        self.task_id = task.id
        parked = await self._wait(lambda t: t.status.state in TERMINAL
                                  or t.status.state == TaskState.TASK_STATE_INPUT_REQUIRED, task)
        if parked.status.state != TaskState.TASK_STATE_INPUT_REQUIRED:
            self.finished = True
            raise AgentFailed(f"{self._where}: setup ended the task: {status_text(parked)[-300:]}")

    async def run(self, task_input: dict) -> RolloutDump:
        """Resume the parked task with the rollout and wait for its end; its dump (see dump_of)."""
        if self.task_id is None:
            raise RuntimeError("A2ASession.run before setup")
        task = await self._call(send_message(task_input, session_id=self._session_id, task_id=self.task_id))
        done = await self._wait(lambda t: t.status.state in TERMINAL, task)
        self.finished = True
        return dump_of(done, self._where)

    async def cancel_if_unfinished(self) -> None:
        """Best-effort CancelTask of a task left before its end, within CANCEL_WAIT_S; never raises."""
        if self.task_id is None or self.finished:
            return
        self.finished = True
        try:
            async with asyncio.timeout(CANCEL_WAIT_S):
                await self._call(cancel_task(self.task_id))
        except Exception as exc:  # the session stop that follows ends the task anyway
            log.debug("%s: cancel failed: %s: %s", self._where, type(exc).__name__, exc)

    async def _wait(self, done: Callable[[Task], bool], task: Task) -> Task:
        if done(task):
            return task
        initial, cap = self._poll
        poll = tenacity.AsyncRetrying(retry=tenacity.retry_if_result(lambda t: not done(t)),
                                      wait=tenacity.wait_exponential(multiplier=initial, max=cap),
                                      stop=tenacity.stop_never)  # the caller's timeout bounds it
        return await poll(self._call, get_task(task.id))
