"""The flat reference of every config key, for the docs site (docs/config_reference.md), as verl's
generated config reference does.

`python -m orchestrator.config.reference > docs/config_reference.md` writes it. Each key of each
group's schema (nested dataclasses flattened to dotted keys: `rollout.acr.limits.requests_per_s`)
with its type, its default (the schema's: a value a worker's settings own comes through
`default_of`, so the page cannot disagree with the code) and its help, the first of: the comment
on its line in the dataclass that declares it; the comment block right above it; what the class
docstring says from its label (`field:`) to the next field's; a comment block above an earlier
field of the same run that names it; the docstring's first sentence naming it as `` `field` ``;
that earlier block even if it does not name it; the same, in order, in the worker settings its
default comes from (`default_of`); else "".

Invariant: one row per leaf key of `GROUP_SCHEMAS`, in declaration order; the page is a pure
function of the schema (tests/test_config_files.py compares the committed page with `render()`).
Reads source with `inspect` and `tokenize`; imports no Ray, torch or vLLM.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import re
import sys
import tokenize
import typing
from dataclasses import MISSING, dataclass
from functools import cache
from typing import Any

from orchestrator.config.run import GROUP_SCHEMAS, TOP_LEVEL_KEYS


@dataclass(frozen=True)
class KeyDoc:
    """One leaf key: dotted name, type as written, default rendered as YAML would show it, help text."""

    key: str
    type: str
    default: str
    help: str


@cache
def _comments(cls: type) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """For the fields a dataclass declares in its own body: (field -> comment on its line, field ->
    comment block right above it, field -> the block above an earlier field of its run of
    consecutive fields, which may describe it too)."""
    try:
        lines, _ = inspect.getsourcelines(cls)
    except (OSError, TypeError):
        return {}, {}, {}
    source = "".join(lines)
    comment_at: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comment_at[tok.start[0]] = tok.string.lstrip("#").strip()
    own: dict[str, str] = {}
    above: dict[str, str] = {}
    inherited: dict[str, str] = {}
    block: list[str] = []  # comment lines since the last field
    run: str = ""  # the latest comment block of this run of consecutive fields
    field_line = re.compile(r"^\s+([A-Za-z_]\w*)\s*:[^=]*(=|$)")
    for n, line in enumerate(source.splitlines(), start=1):
        stripped = line.strip()
        if stripped.startswith("#"):
            block.append(comment_at.get(n, ""))
            continue
        m = field_line.match(line)
        if m and not stripped.startswith(("def ", "class ", "@", "return ")):
            direct = bool(block)
            if block:
                run, block = " ".join(b for b in block if b), []
            if n in comment_at:
                own[m.group(1)] = comment_at[n]
            if run:
                (above if direct else inherited)[m.group(1)] = run
            continue
        block, run = [], ""  # a blank line, a docstring or a method ends the run
    return own, above, inherited


def _labels(doc: str, names: list[str]) -> dict[str, tuple[int, int]]:
    """Where the docstring labels each field: `name:` or `` `name`: ``, also as one of several
    (`temperature / top_p:`); name -> (start, end) of its first label."""
    spans = {}
    for name in names:
        m = re.search(rf"(?:^|(?<=[\s.;(]))`?{re.escape(name)}`?(?:\s*/\s*`?[\w.]+`?)*\s*:(?=\s)", doc)
        if m:
            spans[name] = (m.start(), m.end())
    return spans


def _from_docstring(cls: type, name: str) -> tuple[str, str]:
    """What the class docstring says of `name`: (from its label, `name:`, to the next field's label;
    the first sentence naming it as `` `name` ``), each "" when there is none."""
    doc = " ".join((inspect.getdoc(cls) or "").split())
    names = [f.name for f in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls) else [name]
    spans = _labels(doc, names)
    labelled = ""
    if name in spans:
        start, end = spans[name]
        following = [s for s, _ in spans.values() if s >= end]
        labelled = doc[start:min(following, default=len(doc))].strip().rstrip(";,").strip()
    sentence = next((s for s in re.split(r"(?<=\.)\s+(?=[A-Z`])", doc) if f"`{name}`" in s), "")
    return labelled, sentence


def field_help(cls: type, name: str) -> str:
    """The help of field `name` of dataclass `cls` (see the module docstring)."""
    for klass in cls.__mro__:
        if not dataclasses.is_dataclass(klass) or name not in getattr(klass, "__annotations__", {}):
            continue
        own, above, inherited = _comments(klass)
        labelled, sentence = _from_docstring(klass, name)
        earlier = inherited.get(name, "")
        named = re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", earlier) is not None
        for text in (own.get(name), above.get(name), labelled, earlier if named else "", sentence, earlier):
            if text:
                return text
        owner = _default_owner(klass, name)
        if owner is not None:
            return field_help(*owner)
    return ""


def _default_owner(cls: type, name: str) -> tuple[type, str] | None:
    """(settings class, field) when `cls.name` takes its default with `default_of(Settings, "field")`."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return None
    m = re.search(rf"^\s+{re.escape(name)}\s*:[^=\n]*=\s*default_of\((\w+),\s*\"(\w+)\"\)", source, re.M)
    owner = vars(sys.modules[cls.__module__]).get(m.group(1)) if m else None
    return (owner, m.group(2)) if m and dataclasses.is_dataclass(owner) else None


def _type_name(tp: Any) -> str:
    if isinstance(tp, str):
        return tp
    if tp is type(None):
        return "None"
    if getattr(tp, "__module__", "") == "builtins":
        return tp.__name__
    text = str(tp).replace("typing.", "")
    return re.sub(r"\b[\w.]+\.(\w+)", r"\1", text)


def _render_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if value else '""'
    return repr(value) if not isinstance(value, (list, dict)) else (str(value) if value else ("[]" if isinstance(value, list) else "{}"))


def _default(f: dataclasses.Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return MISSING


def keys_of(cls: type, prefix: str) -> list[KeyDoc]:
    """Every leaf key of dataclass `cls` under `prefix`, nested dataclasses flattened."""
    hints = typing.get_type_hints(cls, globalns=vars(sys.modules[cls.__module__]))
    out: list[KeyDoc] = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}"
        value = _default(f)
        if dataclasses.is_dataclass(value):
            out += keys_of(type(value), key)
            continue
        out.append(KeyDoc(key, _type_name(hints.get(f.name, f.type)),
                          "(required)" if value is MISSING else _render_value(value), field_help(cls, f.name)))
    return out


def all_keys() -> list[KeyDoc]:
    """Every leaf key of every config group, group by group in `GROUP_SCHEMAS` order."""
    return [k for group, schema in GROUP_SCHEMAS.items() for k in keys_of(schema, group)]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
    """The reference page (Markdown): one table per group."""
    out = ["# Config reference", "",
           "Every key of the typed config, with its default and what it does. Generated from the schema",
           "(`orchestrator/config/`) by `python -m orchestrator.config.reference > docs/config_reference.md`;",
           "do not edit by hand (tests/test_config_files.py checks it is current). The group files under",
           "`configs/` set only what differs from these defaults; [Configuration](configuration.md) explains",
           "how to compose and override them.", "",
           f"Top-level keys: {', '.join(f'`{k}`' for k in TOP_LEVEL_KEYS)} (configs/config.yaml).", ""]
    by_group: dict[str, list[KeyDoc]] = {}
    for k in all_keys():
        by_group.setdefault(k.key.split(".", 1)[0], []).append(k)
    for group, keys in by_group.items():
        out += [f"## {group}", "", "| key | type | default | help |", "|---|---|---|---|"]
        out += [f"| `{k.key}` | {_cell(k.type)} | `{_cell(k.default)}` | {_cell(k.help)} |" for k in keys]
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(render())
