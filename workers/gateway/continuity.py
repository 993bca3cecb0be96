"""Multi-turn token continuity: continue from the recorded tokens when the client's history matches.

The problem. A model writes a tool call one way (`{"name":"calc","arguments":{"x":1}}`), the
agent's SDK sends it back parsed, and the chat template re-renders it another way (`{"name":
"calc", "arguments": {"x": 1}}`). The re-rendered prompt then no longer starts with the tokens
recorded for the previous turn, and capture.py starts a new row (FORK): with real models nearly
every tool turn forks and the trajectory trains as disconnected pieces.

The rule (token-in-token-out continuity, as slime's message tree and rLLM's cumulative token
mode). After each turn the gateway remembers a `TurnMemo`: the conversation as messages (the
request's plus the assistant message it answered), compared by meaning (`message_key`: role,
content, tool names, arguments as parsed JSON; call ids ignored), the tools and template
arguments, and where the turn's tokens end in its row. A later request whose messages start with
a memo's messages, with the same tools and arguments, is rendered as
``recorded tokens + encode(trailer + new text)`` instead of ``encode(render(messages))``, where,
with P = render(memo messages, no generation prompt) and F = render(all messages):
- F must start with P (the template does not rewrite the history when the new messages are
  added: Qwen3 dropping earlier `<think>` blocks after a new user query fails here and FORKs);
- P must start with the memo's own prompt text (the history before the answer renders as it did);
- the answer as P renders it must parse to the same message as the generated answer (same
  content, same calls): a template that only re-formats a call (JSON spacing) continues, one that
  rewrites the answer (drops its `<think>` block) does not, and the turn FORKs;
- the trailer is what P writes after the answer's end token (`<|im_end|>` -> `"\\n"`): the
  assistant -> tool separator is kept.
Anything else (an edited or dropped message, other tools, an answer cut by max_tokens, an end
token that is not an added token) falls back to the plain render, which FORKs as before.

Invariant: a continued prompt differs from the plain render only in the tokens of earlier
answers, which are exactly the tokens the engine generated; the text between them is the
template's. Pure (no tokenizer, no HTTP): the renderer and the capture store are handed in.
Callers: workers/gateway/turns.py.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

MAX_MEMOS = 8  # memos kept per session (a conversation needs 1; sub-agents and retries a few more)

MessageKey = bytes  # sha256 of the message's canonical form (memos hold no conversation text)


def _canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)


def message_key(msg: dict[str, Any]) -> MessageKey:
    """What makes two messages the same turn: role, content ("" for None), tool names and
    arguments as parsed JSON (key order and spacing ignored), reasoning_content and name; as a
    sha256 digest."""
    calls = [[c["function"]["name"], c["function"].get("arguments")] for c in msg.get("tool_calls") or ()]
    canon = _canon([msg["role"], msg.get("content") or "", calls, msg.get("reasoning_content"), msg.get("name")])
    return digest(canon)


def context_key(tools: Sequence[dict[str, Any]] | None, template_kwargs: dict[str, Any] | None) -> str:
    """The tools and template arguments, canonical: a memo only applies under the same ones."""
    return _canon([list(tools or ()), template_kwargs or {}])


def digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8")).digest()


@dataclass(frozen=True)
class TurnMemo:
    """One recorded turn, as a later request can continue it.

    messages: keys of the request's messages plus the answer's; context: context_key.
    prompt_chars / prompt_digest: length and sha256 of the turn's rendered prompt text.
    row_index / row_len: the answer's last token is token row_len - 1 of that capture row.
    end_text: text of the token that ended the answer (an added token, e.g. `<|im_end|>`); None
        for an answer that did not end on one (kept for linear.py only; tree mode skips it).
    """

    messages: tuple[MessageKey, ...]
    context: str
    prompt_chars: int
    prompt_digest: bytes
    row_index: int
    row_len: int
    end_text: str | None


@dataclass(frozen=True)
class Continuation:
    """How to build a continued prompt: the row prefix to reuse, then the text to encode."""

    row_index: int
    row_len: int
    text: str


def find_continuation(
    memos: Sequence[TurnMemo],
    keys: Sequence[MessageKey],
    context: str,
    full_text: str,
    render_prefix: Callable[[int], str],
    answer_key: Callable[[str], MessageKey],
) -> Continuation | None:
    """The continuation of the longest memo the request extends, or None (see the module rule).

    keys: message_key of each request message; full_text: F; render_prefix(n): P for the first n
    messages without the generation prompt (may raise ValueError: no continuation then);
    answer_key(text): message_key of an assistant answer written as `text` (parsed for calls).
    """
    candidates = [
        m for m in memos
        if m.end_text and m.context == context and len(m.messages) < len(keys) and tuple(keys[: len(m.messages)]) == m.messages
    ]
    for memo in sorted(candidates, key=lambda m: len(m.messages), reverse=True):
        try:
            prefix = render_prefix(len(memo.messages))
        except ValueError:
            continue
        if not full_text.startswith(prefix) or len(prefix) < memo.prompt_chars:
            continue
        if digest(prefix[: memo.prompt_chars]) != memo.prompt_digest:
            continue
        end = prefix.rfind(memo.end_text)
        if end < memo.prompt_chars or answer_key(prefix[memo.prompt_chars:end]) != memo.messages[-1]:
            continue
        trailer = prefix[end + len(memo.end_text):]
        return Continuation(memo.row_index, memo.row_len, trailer + full_text[len(prefix):])
    return None


def remember(memos: list[TurnMemo], memo: TurnMemo) -> None:
    """Add `memo`, keeping the MAX_MEMOS most recent."""
    memos.append(memo)
    del memos[:-MAX_MEMOS]
