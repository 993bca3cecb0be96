"""Token continuity's pure rule (workers/gateway/continuity.py), with a toy template as strings.

End to end on real templates: tests/test_gateway_templates.py.
"""

from __future__ import annotations

from workers.gateway.continuity import (
    MAX_MEMOS,
    TurnMemo,
    context_key,
    digest,
    find_continuation,
    message_key,
    remember,
)

USER = {"role": "user", "content": "2+3?"}
CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": {"x": 1, "y": [2]}}}]}
TOOL = {"role": "tool", "tool_call_id": "call_1", "content": "5"}


def render(messages: list[dict], gen: bool = True) -> str:
    """A ChatML-like toy template that writes calls as spaced JSON."""
    out = ""
    for m in messages:
        body = m["content"] or ""
        for c in m.get("tool_calls") or ():
            body += '{"name": "%s"}' % c["function"]["name"]
        out += f"<s>{m['role']}\n{body}<e>\n"
    return out + ("<s>assistant\n" if gen else "")


def memo_after_first_turn(answer_key: bytes, row_len: int = 10) -> TurnMemo:
    prompt = render([USER])
    return TurnMemo(messages=(message_key(USER), answer_key), context=context_key(None, None),
                    prompt_chars=len(prompt), prompt_digest=digest(prompt), row_index=0, row_len=row_len,
                    end_text="<e>")


def call_key(_text: str) -> bytes:  # the rendered answer parses to the generated call
    return message_key(CALL)


def test_message_key_compares_meaning_not_spelling():
    reordered = {**CALL, "content": None, "tool_calls": [
        {"id": "call_other", "function": {"name": "calc", "arguments": {"y": [2], "x": 1}}}]}
    assert message_key(reordered) == message_key(CALL)  # key order, call id, None vs "" ignored
    changed = {**CALL, "tool_calls": [{"function": {"name": "calc", "arguments": {"x": 2, "y": [2]}}}]}
    assert message_key(changed) != message_key(CALL)
    assert message_key({**TOOL, "content": "6"}) != message_key(TOOL)


def test_matching_history_continues_with_the_separator_and_the_new_text():
    messages = [USER, CALL, TOOL]
    cont = find_continuation([memo_after_first_turn(message_key(CALL))], [message_key(m) for m in messages],
                             context_key(None, None), render(messages), lambda n: render(messages[:n], gen=False),
                             call_key)
    assert cont is not None and (cont.row_index, cont.row_len) == (0, 10)
    assert cont.text == "\n<s>tool\n5<e>\n<s>assistant\n"  # "\n" after <e>: the separator is kept


def test_no_continuation_for_other_tools_an_edit_or_a_rewritten_answer():
    messages = [USER, CALL, TOOL]
    keys = [message_key(m) for m in messages]
    memo = memo_after_first_turn(message_key(CALL))
    prefix = lambda n: render(messages[:n], gen=False)  # noqa: E731
    assert find_continuation([memo], keys, context_key([{"type": "function"}], None), render(messages), prefix,
                             call_key) is None
    edited = [USER, {**CALL, "tool_calls": [{"function": {"name": "other", "arguments": {}}}]}, TOOL]
    assert find_continuation([memo], [message_key(m) for m in edited], context_key(None, None), render(edited),
                             lambda n: render(edited[:n], gen=False), call_key) is None
    rewritten = lambda _text: message_key({"role": "assistant", "content": "dropped"})  # noqa: E731
    assert find_continuation([memo], keys, context_key(None, None), render(messages), prefix, rewritten) is None


def test_memos_are_bounded():
    memos: list[TurnMemo] = []
    for i in range(MAX_MEMOS + 3):
        remember(memos, memo_after_first_turn(message_key(CALL), row_len=i + 1))
    assert len(memos) == MAX_MEMOS and memos[-1].row_len == MAX_MEMOS + 3


# -- linear history (workers/gateway/linear.py) ----------------------------------------------

def render_dropping_old_thoughts(messages: list[dict], gen: bool = True) -> str:
    """The toy template, but like Qwen3 thinking-off: only the last answer keeps its `<t></t>`."""
    out = ""
    for i, m in enumerate(messages):
        think = "<t></t>" if m["role"] == "assistant" and i == len(messages) - 1 else ""
        out += f"<s>{m['role']}\n{think}{m['content'] or ''}<e>\n"
    return out + ("<s>assistant\n<t></t>" if gen else "")


def test_linear_tail_starts_after_the_previous_messages_even_where_history_is_re_rendered():
    from workers.gateway.linear import closer, healed_text

    answer = {"role": "assistant", "content": "call calc"}
    prev, new = [USER, answer], [TOOL]
    full, prefix = render_dropping_old_thoughts(prev + new), render_dropping_old_thoughts(prev, gen=False)
    assert not full.startswith(prefix)  # tree mode's rule cannot continue here
    close = closer(lambda body: render_dropping_old_thoughts([USER, {"role": "assistant", "content": body}], False))
    assert close == "<e>\n"
    # the answer ended on `<e>`: the rest of the closer, then the tool turn and the generation prompt
    assert healed_text(full, prefix, close, "<e>", new) == "\n<s>tool\n5<e>\n<s>assistant\n<t></t>"
    assert healed_text(full, prefix, close, None, new) == "<e>\n<s>tool\n5<e>\n<s>assistant\n<t></t>"  # cut answer


def test_linear_splice_is_refused_when_it_cannot_be_proven():
    from workers.gateway.linear import healed_text, tail_start

    prev = [USER, {"role": "assistant", "content": "x"}]
    full, prefix = render(prev + [TOOL]), render(prev, gen=False)
    assert tail_start(full, prefix, "") is None  # no closer found
    assert tail_start(full, prefix, "<z>") is None  # the prefix does not end with it
    assert tail_start("<s>user\n2+3?<e>\n", prefix, "<e>\n") is None  # fewer closers than messages
    assert healed_text(full, prefix, "<e>\n", "<eom>", [TOOL]) is None  # ended on a token the template does not close with
    assert healed_text(full, prefix, "<e>\n", "<e>", [{**TOOL, "content": "not rendered"}]) is None  # new text missing
    assert healed_text(full, prefix, "<e>\n", "<e>", [TOOL]) == "\n<s>tool\n5<e>\n<s>assistant\n"
