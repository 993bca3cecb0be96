"""gpt-oss's harmony format at the gateway's seams: parse generated ids, prepare messages and
template for rendering.

Parse (`HarmonyCodec.parse`). The generated ids go through openai-harmony's `StreamableParser`
(role assistant), token by token, never through text patterns. Each message it completes is
mapped by its channel and recipient:
  recipient `functions.NAME` (any channel: commentary, analysis, ...)  -> a tool call NAME, its
      content the arguments JSON object (empty content: no arguments);
  channel `analysis`, no recipient                                   -> reasoning;
  channel `final` or `commentary` (a preamble), no recipient          -> content.
A generation cut mid-message (max_tokens, a stop string) is still parsed: the parser's partial
message counts as text on its channel; a call whose arguments were cut is not returned (it is a
truncation, not a malformed call: `ill_formed` stays False). Ill-formed: a sequence the parser
rejects (what it completed before is still read), arguments that are not a JSON object, or a
recipient other than `functions.*` (a built-in tool the gateway does not offer). Parse what can be
parsed, as tool_parsers.py does: the well-formed calls are returned beside an ill-formed part (the
turn counts ill-formed); with no well-formed call, or tools not offered, the whole decoded text is
the content and no call is returned.
The ids the model ends an action with are openai-harmony's `stop_tokens_for_assistant_actions`
(`<|call|>`, `<|return|>`); `<|end|>` ends one message of several and is not a stop.

Render (`template_messages`, `repair_template`). The format, and what keeps a served prefix
append-only:
- an assistant message's `reasoning_content` (how the gateway returns the analysis channel, as
  vLLM does) is the template's `thinking` field: rendered as the analysis message before a tool
  call inside a tool-call chain, dropped (by the template) once a final answer follows, as the
  format requires; a final answer in history ends with `<|end|>`, not the `<|return|>` the model
  sampled (the template writes it). Both rewrite the history after a final answer, so the turn
  after one starts a new row (TemplateInfo.final_tokens; see turns.py);
- OpenAI parallel calls (one assistant message, several `tool_calls`) become the chain the format
  writes: one call message per call, each followed by its own result (matched by tool_call_id,
  else in order), since the template renders only a message's first call and names each result
  after the last call;
- the conversation start date is pinned per session (chat_template.pin_date; turns.py);
- `repair_template`: the gpt-oss template writes a call's recipient in the role header
  (`<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>`) while the model
  samples it after the channel, as openai-harmony renders it
  (`<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>`); the
  repair writes the second form, so a re-rendered call is the sampled tokens (the
  agentcore-rl-toolkit 0.2.0 documents the same defect in rollout_gateway/response_schemas.py).

Invariant: parsing never loses a complete call and never invents one; `template_messages` keeps
every message's text, only moving fields and splitting parallel calls. Callers:
workers/gateway/chat_template.py (render) and turns.py (parse).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from workers.gateway.harmony_vocab import load_encoding
from workers.gateway.tool_parsers import ParsedOutput, ToolCall, new_call_id

FUNCTIONS = "functions."  # the namespace of the tools the agent offers
HARMONY_SPECIALS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|call|>", "<|return|>")
_HEADER_ORIGINAL = (
    '            {{- "<|start|>assistant to=" }}\n'
    '            {{- "functions." + tool_call.name + "<|channel|>commentary " }}\n'
    '            {{- (tool_call.content_type if tool_call.content_type is defined else "json") + "<|message|>" }}'
)
_HEADER_REPAIRED = (
    '            {{- "<|start|>assistant<|channel|>commentary to=" }}\n'
    '            {{- "functions." + tool_call.name + " " }}\n'
    '            {{- (tool_call.content_type if tool_call.content_type is defined else "<|constrain|>json") }}\n'
    '            {{- "<|message|>" }}'
)


def repair_template(template: str) -> str:
    """`template` with the tool-call header in the order the model samples (see the module
    docstring); unchanged when the original block is not there exactly once (another revision)."""
    if template.count(_HEADER_ORIGINAL) != 1:
        return template
    return template.replace(_HEADER_ORIGINAL, _HEADER_REPAIRED)


class HarmonyCodec:
    """openai-harmony's encoding for the served gpt-oss tokenizer (vocabulary: harmony_vocab.py).

    Raises HarmonyVocabError (not a gpt-oss vocabulary) or ValueError (the tokenizer's ids of the
    harmony special tokens differ from openai-harmony's).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.encoding = load_encoding(tokenizer)
        vocab = {t.content: int(i) for i, t in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items()}
        for text in HARMONY_SPECIALS:
            (harmony_id,) = self.encoding.encode(text, allowed_special="all")
            if vocab.get(text) != harmony_id:
                raise ValueError(f"tokenizer id of {text} is {vocab.get(text)}, openai-harmony's is {harmony_id}")
        self.action_stop_ids: tuple[int, ...] = tuple(self.encoding.stop_tokens_for_assistant_actions())

    def parse(self, output_ids: Sequence[int], *, tools_offered: bool = True, whole: bool = False) -> ParsedOutput:
        """Content, reasoning and tool calls of generated ids (see the module docstring).

        tools_offered: False makes any call ill-formed (the request offered no tools).
        whole: the ids are a whole answer less its end token (an answer's text re-encoded, as
            continuity compares them): the last, unended message counts as complete.
        """
        from openai_harmony import HarmonyError, Role, StreamableParser, StreamState

        parser = StreamableParser(self.encoding, Role.ASSISTANT)
        rejected = False
        try:
            for token in output_ids:
                parser.process(int(token))
        except HarmonyError:
            rejected = True  # the messages completed before the rejected token still count
        items = [(m.channel, m.recipient, "".join(c.text for c in m.content if hasattr(c, "text")), True)
                 for m in parser.messages]
        if not rejected and parser.state == StreamState.CONTENT:  # cut mid-message: what it wrote so far
            items.append((parser.current_channel, parser.current_recipient, parser.current_content, whole))
        content, reasoning, calls, ill_formed = [], [], [], rejected
        for channel, recipient, text, complete in items:
            if recipient and recipient != "all":
                if not tools_offered:
                    return self._ill_formed(output_ids)
                if not complete:
                    continue  # arguments cut off: a truncation, not a call
                call = _call(recipient[len(FUNCTIONS):], text) if recipient.startswith(FUNCTIONS) else None
                if call is None:  # a built-in recipient or arguments that are no JSON object
                    ill_formed = True
                    continue
                calls.append(call)
            elif channel == "analysis":
                reasoning.append(text)
            else:
                content.append(text)
        if ill_formed and not calls:
            return self._ill_formed(output_ids)
        return ParsedOutput(content="".join(content), tool_calls=tuple(calls), ill_formed=ill_formed,
                            reasoning="\n".join(reasoning) if reasoning else None)

    def _ill_formed(self, output_ids: Sequence[int]) -> ParsedOutput:
        ids = [int(t) for t in output_ids]
        if ids and ids[-1] in self.action_stop_ids:
            ids = ids[:-1]
        return ParsedOutput(content=self.encoding.decode(ids), ill_formed=True)


def _call(name: str, arguments: str) -> ToolCall | None:
    """A call to `name` with `arguments` (a JSON object, or empty), None when malformed."""
    if not name:
        return None
    try:
        args = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return None
    if not isinstance(args, dict):
        return None
    return ToolCall(id=new_call_id(), name=name, arguments_json=json.dumps(args, ensure_ascii=False))


def template_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as the gpt-oss template reads them (see the module docstring): assistant
    `reasoning_content` -> `thinking`; parallel calls -> one call per message, each followed by
    its result. The input is not modified."""
    out: list[dict[str, Any]] = []
    i = 0
    while i < len(messages):
        msg = _with_thinking(messages[i])
        calls = msg.get("tool_calls") or []
        if msg.get("role") != "assistant" or len(calls) < 2:
            out.append(msg)
            i += 1
            continue
        j = i + 1
        while j < len(messages) and messages[j].get("role") == "tool":
            j += 1
        out.extend(_chain(msg, calls, list(messages[i + 1:j])))
        i = j
    return out


def _with_thinking(msg: dict[str, Any]) -> dict[str, Any]:
    reasoning = msg.get("reasoning_content") if msg.get("role") == "assistant" else None
    if not reasoning:
        return msg
    out = {k: v for k, v in msg.items() if k != "reasoning_content"}
    out["thinking"] = reasoning
    if out.get("tool_calls") and out.get("content"):
        out["content"] = ""  # the template takes one analysis text for a call: the reasoning
    return out


def _chain(msg: dict[str, Any], calls: list[dict[str, Any]], results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """[call 1, its result, call 2, its result, ...] of one assistant message with several calls."""
    left = list(results)
    out = []
    for k, call in enumerate(calls):
        head = {**msg, "tool_calls": [call]} if k == 0 else {"role": "assistant", "content": "", "tool_calls": [call]}
        out.append(head)
        match = next((r for r in left if call.get("id") is not None and r.get("tool_call_id") == call.get("id")), None)
        if match is None and left:
            match = next((r for r in left if r.get("tool_call_id") not in {c.get("id") for c in calls}), left[0])
        if match is not None:
            left.remove(match)
            out.append(match)
    return out + left
