"""Linear history (`gateway.history_mode=linear`): an append-only session stays one row.

The problem. Tree mode (continuity.py) continues the recorded tokens only where the template
renders the history the same way after new messages are appended. Some templates do not: Qwen3
with thinking off writes an empty `<think>\\n\\n</think>\\n\\n` before the answer it is asked for but
drops it from earlier answers, so every tool turn of a plain tool loop starts a new row (FORK) and
one rollout trains as several disconnected pieces with their shared prefix counted again.

The rule (the agentcore-rl-toolkit's `history_mode="linear"`, rollout_gateway/linear.py: decide
linearity on messages, then splice). When the request's messages extend the previous turn's
messages (`message_key` equal, same tools and template arguments) the prompt is

    the previous turn's row through its answer (the exact ids served and generated)
    + encode(the template's closer after that answer, less what the answer's end token wrote,
             + the template's rendering of the new messages and the generation prompt)

so earlier turns are never re-rendered and the engine always generates on the tokens it already
produced. The new messages' text is cut out of F = render(all messages): with P = render(the
previous messages, no generation prompt), every message of P ends with the template's closer
(found as the common suffix of two renders that differ only in a text answer), so the new
messages start after the n-th closer of F, n = the closers in P. This holds where F re-renders
earlier answers differently (the Qwen3 case), unlike a prefix test F.startswith(P). A closer that
cannot be found, a closer count F does not reach, or a new message whose text is not in the cut
tail refuses the splice (None): the caller treats the turn as non-linear (`gateway.on_nonlinear`).

Invariant: a healed prompt differs from the plain render only before the new messages, and there
it is exactly the session's served ids. Pure: renders are handed in; no tokenizer, no HTTP.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

PROBE_A = "linear-history probe alpha 0"
PROBE_B = "linear-history probe omega 9"  # its last character differs from PROBE_A's


def common_suffix(a: str, b: str) -> str:
    """The longest common suffix of two strings."""
    n = 0
    for x, y in zip(reversed(a), reversed(b)):
        if x != y:
            break
        n += 1
    return a[len(a) - n:] if n else ""


def closer(render_answer: Callable[[str], str]) -> str:
    """What the template writes after an assistant message (Qwen `<|im_end|>\\n`, Llama
    `<|eot_id|>`): the common suffix of the history rendered with two different text answers.

    render_answer(body): the conversation through the last answer, that answer's content
    replaced by `body`, without the generation prompt. "" when the renders share no suffix.
    """
    return common_suffix(render_answer(PROBE_A), render_answer(PROBE_B))


def tail_start(full_text: str, prefix_text: str, close: str) -> int | None:
    """Index of `full_text` where the messages after `prefix_text`'s begin: just after its n-th
    `close`, n = the number of `close` in `prefix_text` (each earlier message ends with one).

    None when `close` is empty, `prefix_text` does not end with it, or `full_text` has fewer.
    """
    if not close or not prefix_text.endswith(close):
        return None
    at = 0
    for _ in range(prefix_text.count(close)):
        found = full_text.find(close, at)
        if found < 0:
            return None
        at = found + len(close)
    return at


def healed_text(full_text: str, prefix_text: str, close: str, end_text: str | None,
                new_messages: Sequence[dict[str, Any]]) -> str | None:
    """The text to encode after the previous turn's row to build this turn's prompt, or None
    when the splice cannot be proven right (see the module rule).

    full_text: F, every message with the generation prompt; prefix_text: P, the previous
    messages through the answer, no generation prompt; close: `closer(...)`; end_text: the text
    of the token that ended the answer (an added stop token) or None (cut by max_tokens or a stop
    string: the closer is written whole); new_messages: the messages after P's, whose string
    contents must appear in the tail.
    """
    start = tail_start(full_text, prefix_text, close)
    if start is None:
        return None
    tail = full_text[start:]
    for m in new_messages:
        content = m.get("content")
        text = content.strip() if isinstance(content, str) else ""
        if text and text not in tail and json.dumps(text, ensure_ascii=False)[1:-1] not in tail:  # or `tojson`ed
            return None
    if end_text is None:
        return close + tail
    if not close.startswith(end_text):  # the answer ended on a token the template does not close with
        return None
    return close[len(end_text):] + tail
