"""The swe_mini agent's episode: a multi-turn tool loop on the OpenAI Chat Completions API, with
the repository's tools (`TOOLS`: list_files, read_file, write_file, run_tests) run in the sandbox.

Turn k sends the conversation so far with every tool. Each tool call of an answer gets exactly one
`role="tool"` message (same `tool_call_id`) before the next request. An answer without tool calls
is the model's claim to be done: the agent runs the tests itself; when they pass the episode ends
("solved"), else their log goes back as a user message and the loop goes on, as SWE agents nudge
a model that stops early. So the context grows over turns with tool results and test logs.

Ends (`Episode.end`): "solved" (the tests passed after an answer or a `run_tests` call),
"max_turns" (the turn cap), "context_exceeded" (the gateway refused a later turn with 400
`context_length_exceeded`: the session's token budget is spent; on the first turn it is raised,
nothing was generated). The reward is not decided here: the agent runs the tests once more.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

import openai
from workspace import ToolError, Workspace

SYSTEM_PROMPT = ("You are a software engineer fixing a bug in a Python repository. Use the tools to list and "
                 "read files, edit the source with write_file (the whole new file), and run the tests. Stop "
                 "calling tools when the tests pass.")
CONTEXT_EXCEEDED = "context_length_exceeded"
EpisodeEnd = Literal["solved", "max_turns", "context_exceeded"]


def _tool(name: str, description: str, props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": props, "required": list(props)}}}


TOOLS = [
    _tool("list_files", "List the repository's files.", {}),
    _tool("read_file", "Read one file of the repository.", {"path": {"type": "string"}}),
    _tool("write_file", "Replace a file's whole content.", {"path": {"type": "string"}, "content": {"type": "string"}}),
    _tool("run_tests", "Run the repository's unit tests and return their log.", {}),
]


@dataclass
class Episode:
    """What one episode did; `prompt_tokens`: the server's usage.prompt_tokens of each answered turn."""

    end: EpisodeEnd
    num_turns: int = 0
    num_tool_calls: int = 0
    num_bad_tool_calls: int = 0
    prompt_tokens: list[int | None] = field(default_factory=list)


def _assistant_message(msg: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "assistant", "content": msg.content or ""}
    if msg.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": c.function.arguments}}
                             for c in msg.tool_calls]
    return out


class Tools:
    """Runs one tool call against the workspace; `solved` turns True once a run_tests passes."""

    def __init__(self, ws: Workspace, test_cmd: str) -> None:
        self.ws, self.test_cmd, self.solved = ws, test_cmd, False

    def tests(self) -> str:
        run = self.ws.run_tests(self.test_cmd)
        self.solved = self.solved or run.passed
        return f"exit code {run.exit_code} ({'passed' if run.passed else 'failed'})\n{run.log}"

    def call(self, name: str, arguments: str) -> tuple[str, bool]:
        """(the tool's answer, whether the call was well-formed and ran)."""
        try:
            args = json.loads(arguments or "{}")
            if not isinstance(args, dict):
                raise ToolError(f"arguments must be a JSON object, got {arguments!r}")
            if name == "list_files":
                return self.ws.list_files(), True
            if name == "read_file":
                return self.ws.read_file(args.get("path")), True
            if name == "write_file":
                return self.ws.write_file(args.get("path"), args.get("content")), True
            if name == "run_tests":
                return self.tests(), True
            raise ToolError(f"unknown tool {name!r}; the tools are {[t['function']['name'] for t in TOOLS]}")
        except (ToolError, json.JSONDecodeError) as exc:
            return f"error: {exc}", False


def run_episode(client: openai.OpenAI, tools: Tools, *, model: str, issue: str, max_turns: int,
                sampling: dict[str, Any] | None = None) -> Episode:
    """Run the tool loop on `issue` with at most `max_turns` (>= 1) model calls. `sampling`: extra
    `chat.completions.create` arguments. Raises ValueError for max_turns < 1; openai.APIError from
    the server (except a later turn's `context_length_exceeded`, which ends the episode)."""
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT},
                                      {"role": "user", "content": issue}]
    ep = Episode(end="max_turns")
    for turn in range(max_turns):
        try:
            out = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, **(sampling or {}))
        except openai.BadRequestError as exc:
            if turn > 0 and exc.code == CONTEXT_EXCEEDED:
                ep.end = "context_exceeded"
                return ep
            raise
        ep.num_turns = turn + 1
        ep.prompt_tokens.append(out.usage.prompt_tokens if out.usage else None)
        msg = out.choices[0].message
        messages.append(_assistant_message(msg))
        if msg.tool_calls:
            for call in msg.tool_calls:
                answer, ok = tools.call(call.function.name, call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": answer})
                ep.num_tool_calls += 1
                ep.num_bad_tool_calls += not ok
        else:  # the model stopped: check its claim
            log = tools.tests()
            if not tools.solved:
                messages.append({"role": "user", "content": f"The tests still fail:\n{log}\nKeep fixing the bug."})
        if tools.solved:
            ep.end = "solved"
            return ep
    return ep
