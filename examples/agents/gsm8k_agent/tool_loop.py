"""The GSM8K agent's episode: a multi-turn tool loop on the OpenAI Chat Completions API.

Turn k sends the conversation so far with `tools=[calculator]`. An answer with `tool_calls` is
appended as an assistant message, each call is run by the calculator and answered with a
`role="tool"` message (same `tool_call_id`), and the loop asks again; an answer without tool calls
is the final answer. The episode ends after at most `max_turns` model calls.

Ends (`Episode.end`):
- "answer": the model answered without a tool call;
- "max_turns": the turn cap was reached while the model still called tools;
- "context_exceeded": the server refused a later turn with 400 `context_length_exceeded`
  (the session's token budget is spent; what was generated so far is scored, as a truncated
  episode). On the first turn the same error is raised: nothing was generated to score.

Invariant: every request of an episode offers the calculator tool, and every tool call gets
exactly one tool message before the next request. Other API errors propagate unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import openai
from calculator import TOOL_NAME, TOOL_SPEC, run_tool

SYSTEM_PROMPT = (
    "Solve the math problem step by step. Use the calculator tool for arithmetic. "
    "End your answer with a line '#### <number>'."
)
CONTEXT_EXCEEDED = "context_length_exceeded"  # OpenAI's error code for a prompt over the budget

EpisodeEnd = Literal["answer", "max_turns", "context_exceeded"]


@dataclass
class Episode:
    """What one episode did. `final_text`: the last assistant text (scored by reward.score);
    `prompt_tokens`: the server's `usage.prompt_tokens` of each answered turn (None if not sent)."""

    final_text: str
    end: EpisodeEnd
    num_turns: int
    num_tool_calls: int
    messages: list[dict[str, Any]] = field(default_factory=list)
    prompt_tokens: list[int | None] = field(default_factory=list)


def _assistant_message(msg: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "assistant", "content": msg.content or ""}
    if msg.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in msg.tool_calls
        ]
    return out


def _tool_result(call: Any) -> str:
    if call.function.name != TOOL_NAME:
        return f"error: unknown tool {call.function.name!r}; the only tool is {TOOL_NAME!r}"
    return run_tool(call.function.arguments)


async def run_episode(client: openai.AsyncOpenAI, *, model: str, question: str, max_turns: int,
                      sampling: dict[str, Any] | None = None) -> Episode:
    """Run the tool loop for `question` with at most `max_turns` (>= 1) model calls.

    `sampling`: extra `chat.completions.create` keyword arguments (temperature, top_p, max_tokens).
    Raises ValueError for max_turns < 1; openai.APIError from the server (except a later turn's
    `context_length_exceeded`, which ends the episode).
    """
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": question},
    ]
    final_text, num_tool_calls, prompt_tokens = "", 0, []
    for turn in range(max_turns):
        try:
            out = await client.chat.completions.create(model=model, messages=messages, tools=[TOOL_SPEC],
                                                       **(sampling or {}))
        except openai.BadRequestError as exc:
            if turn > 0 and exc.code == CONTEXT_EXCEEDED:
                return Episode(final_text, "context_exceeded", turn, num_tool_calls, messages, prompt_tokens)
            raise
        prompt_tokens.append(out.usage.prompt_tokens if out.usage else None)
        msg = out.choices[0].message
        messages.append(_assistant_message(msg))
        final_text = msg.content or ""
        if not msg.tool_calls:
            return Episode(final_text, "answer", turn + 1, num_tool_calls, messages, prompt_tokens)
        for call in msg.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": _tool_result(call)})
            num_tool_calls += 1
    return Episode(final_text, "max_turns", max_turns, num_tool_calls, messages, prompt_tokens)
