"""The documentation: README.md (a landing page) and the MkDocs site of docs/ (mkdocs.yml).

The site builds with `mkdocs build --strict` (broken links, anchors and pages left out of the nav
fail: mkdocs.yml's `validation:`), every page under docs/ is in the nav, every run command the
pages show (`python -m orchestrator.main ...`, `make run ARGS='...'`, `scripts/submit.sh ...`,
SkyPilot's `OVERRIDES="..."`) composes into a valid typed config with the entry point's own Hydra
composition, every config key the pages name exists in the schema, and the README stays short.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml

from stand_ins import REPO, compose_config

DOCS = REPO / "docs"
README = REPO / "README.md"
README_MAX_LINES = 200
PAGES = [README, *sorted(DOCS.rglob("*.md"))]

FENCE = re.compile(r"^(?P<indent>[ \t]*)```[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)
OVERRIDE = re.compile(r"^[+~]{0,2}[A-Za-z_][\w.]*=")
FILE_SUFFIXES = {"json", "jsonl", "py", "yaml", "yml", "md", "html", "png", "txt", "parquet", "log", "pt"}


def _nav_files(nav) -> list[str]:
    """Every page named in mkdocs.yml's `nav` (a list of str / {title: str | list})."""
    out: list[str] = []
    for item in nav:
        values = item.values() if isinstance(item, dict) else [item]
        for value in values:
            out += _nav_files(value) if isinstance(value, list) else [value]
    return out


def _mkdocs_config() -> dict:
    return yaml.safe_load((REPO / "mkdocs.yml").read_text())


# --- (a) the site builds strictly ------------------------------------------------------------------

def test_the_site_builds_strictly(tmp_path):
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(REPO / "mkdocs.yml"),
         "--site-dir", str(site)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1", "NO_COLOR": "1"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "WARNING" not in proc.stderr, proc.stderr[-4000:]
    for page in _nav_files(_mkdocs_config()["nav"]):
        html = site / ("index.html" if page == "index.md" else page.removesuffix(".md") + "/index.html")
        assert html.is_file(), page
    assert (site / "img" / "bench_modes" / "reward.png").is_file()  # images travel with the pages


def test_mkdocs_yml_turns_every_link_problem_into_a_warning():
    """--strict fails only on warnings: the validation settings must say `warn`, not `info`/`ignore`."""
    validation = _mkdocs_config()["validation"]
    assert validation["nav"]["omitted_files"] == "warn" and validation["nav"]["not_found"] == "warn"
    for key in ("not_found", "anchors", "unrecognized_links", "absolute_links"):
        assert validation["links"][key] == "warn", key
    assert _mkdocs_config()["docs_dir"] == "docs"


# --- (b) no orphan page ----------------------------------------------------------------------------

def test_every_page_under_docs_is_in_the_nav_and_every_nav_entry_exists():
    nav = _nav_files(_mkdocs_config()["nav"])
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert sorted(set(pages) - set(nav)) == [], "pages missing from mkdocs.yml's nav"
    assert sorted(set(nav) - set(pages)) == [], "nav entries with no page"
    assert len(nav) == len(set(nav)), "a page listed twice"


def test_the_readme_indexes_every_page_and_its_links_resolve():
    """README.md is outside the site (GitHub renders it): its links are checked here."""
    text = README.read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        path, _, anchor = link.partition("#")
        target = (REPO / path) if path else README
        assert target.exists(), link
        if anchor and target.suffix == ".md":
            assert anchor in _anchors(target), link
    indexed = {link.partition("#")[0] for link in links}
    for page in _nav_files(_mkdocs_config()["nav"]):
        if page != "index.md":
            assert f"docs/{page}" in indexed, f"README's index misses docs/{page}"


def _anchors(page: Path) -> set[str]:
    """The ids of the page's headings as MkDocs' toc extension makes them (Python-Markdown's slugify)."""
    ids = set()
    in_fence = False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        m = None if in_fence else re.match(r"#{1,6}\s+(.*?)\s*#*$", line)
        if m:
            title = re.sub(r"[`*]", "", m.group(1))
            slug = re.sub(r"[^\w\s-]", "", title).strip().lower()
            ids.add(re.sub(r"[-\s]+", "-", slug))
    return ids


# --- (c) the documented commands compose -----------------------------------------------------------

def _code_blocks(text: str) -> list[str]:
    blocks = []
    for m in FENCE.finditer(text):
        indent = len(m.group("indent"))
        blocks.append("\n".join(line[indent:] for line in m.group("body").splitlines()))
    return blocks


def _overrides_of(line: str) -> list[list[str]] | None:
    """The Hydra overrides of each run command on one (joined) shell line; None: not a run command."""
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError as exc:  # an unbalanced quote is a doc bug too
        raise AssertionError(f"cannot parse {line!r}: {exc}") from None
    found = []
    for i, tok in enumerate(tokens):
        if tok == "orchestrator.main" and i > 0 and tokens[i - 1] == "-m":
            found.append(tokens[i + 1:])
        elif tok == "run" and i > 0 and tokens[i - 1] == "make":
            args = [t for t in tokens[i + 1:] if t.startswith("ARGS=")]
            found.append(shlex.split(args[0].removeprefix("ARGS=")) if args else [])
        elif tok.endswith("scripts/submit.sh"):
            found.append(tokens[i + 1:])
        elif tok.startswith("OVERRIDES="):
            found.append(shlex.split(tok.removeprefix("OVERRIDES=")))
    return found or None


def _documented_commands() -> list[tuple[str, str, list[str]]]:
    """(page, command line, overrides) of every run command in a code block of the README and docs/."""
    out = []
    for page in PAGES:
        for block in _code_blocks(page.read_text()):
            for line in block.replace("\\\n", " ").splitlines():
                for overrides in _overrides_of(line) or []:
                    out.append((page.relative_to(REPO).as_posix(), " ".join(line.split()), overrides))
    return out


COMMANDS = _documented_commands()


def test_the_pages_show_the_commands_a_newcomer_copies():
    pages = {page for page, _, _ in COMMANDS}
    assert {"README.md", "docs/quickstart.md", "docs/agents.md", "docs/training.md", "docs/configuration.md",
            "docs/operations.md"} <= pages, pages
    assert len(COMMANDS) >= 20, COMMANDS


@pytest.mark.parametrize("page,command,overrides", COMMANDS, ids=[f"{p}:{c[:60]}" for p, c, _ in COMMANDS])
def test_a_documented_command_composes_into_a_valid_config(page, command, overrides):
    """What a user gets from copying the command: Hydra's composition as `python -m orchestrator.main`
    runs it (`check_overrides`: unknown keys, bad group choices, a needless `+`), then the typed
    config and its validation (`to_run_config`, through the suite's `compose_config`)."""
    from orchestrator.config import ConfigError, register
    from orchestrator.config.hydra_errors import check_overrides

    register()  # the schemas in Hydra's ConfigStore, as orchestrator/main.py does at import
    flags = [o for o in overrides if o.startswith("-")]
    assert flags == [], f"{page}: {command}: flags are not overrides"
    bad = [o for o in overrides if not OVERRIDE.match(o)]
    assert bad == [], f"{page}: {command}: not key=value overrides: {bad}"
    problem = check_overrides(overrides)
    assert problem is None, f"{page}: {command}: config error: {problem}"
    try:
        compose_config(overrides)
    except ConfigError as exc:
        pytest.fail(f"{page}: {command}: config error: {exc}")


# --- the config keys the pages name exist ----------------------------------------------------------

def _schema_has(schema: type, path: list[str]) -> bool:
    """Whether the dotted `path` names a field of the dataclass `schema` (any key under a dict field)."""
    if not path:
        return True
    fields = {f.name: f for f in dataclasses.fields(schema)}
    if path[0] not in fields:
        return False
    hints = typing.get_type_hints(schema)
    kind = hints[path[0]]
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    target = args[0] if typing.get_origin(kind) is typing.Union and len(args) == 1 else kind
    if dataclasses.is_dataclass(target):
        return _schema_has(target, path[1:])
    if typing.get_origin(target) is dict or target is dict:
        return True  # a mapping: any key below it
    return len(path) == 1


def _named_keys() -> list[tuple[str, str]]:
    """(page, dotted key) of every inline code span that names a config key (`group.key` or
    `group.key=value`), with `{a, b}` lists expanded."""
    from orchestrator.config import GROUP_SCHEMAS

    groups = "|".join(GROUP_SCHEMAS)
    key = re.compile(rf"^\+{{0,2}}((?:{groups})(?:\.\w+)+(?:\.\{{[\w,]+\}})?)(?:=\S*)?$")
    out = []
    for page in PAGES:
        text = FENCE.sub("", page.read_text())
        for span in re.findall(r"`([^`]+)`", text):  # an inline span may wrap onto the next line
            span = re.sub(r"\{([\w, ]+)\}", lambda m: "{" + m.group(1).replace(" ", "") + "}", span)
            for part in span.split():
                m = key.match(part)
                if not m:
                    continue
                dotted = m.group(1)
                if dotted.rsplit(".", 1)[-1] in FILE_SUFFIXES:  # `eval.jsonl`, `eval.py`: a file, not a key
                    continue
                if "{" in dotted:
                    head, names = dotted.split(".{")
                    out += [(page.name, f"{head}.{n.strip()}") for n in names.rstrip("}").split(",")]
                else:
                    out.append((page.name, dotted))
    return out


def test_every_config_key_the_pages_name_exists():
    """A key named in prose (`rollout.adaptive.kv_target`, `gateway.port=0`) must be one a user can set."""
    from orchestrator.config import GROUP_SCHEMAS

    named = _named_keys()
    assert len(named) > 100, len(named)
    unknown = sorted({(page, k) for page, k in named
                      if not _schema_has(GROUP_SCHEMAS[k.split(".")[0]], k.split(".")[1:])})
    assert unknown == [], unknown


# --- (d) the README is a landing page --------------------------------------------------------------

def test_the_readme_is_a_landing_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"
    text = "\n".join(lines)
    for section in ("make run", "make test", "## Next steps", "## Documentation", "## Layout"):
        assert section in text, section


def test_the_config_groups_table_lists_every_group_and_choice():
    """docs/configuration.md's table has a row per config group of configs/, and that row names each
    of the group's choices (a new task or preset the table misses is what a new user found)."""
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \| [^|]* \| (.*) \|$",
                                                           (DOCS / "configuration.md").read_text(), re.M)}
    groups = {p.name: sorted(f.stem for f in p.glob("*.yaml")) for p in (REPO / "configs").iterdir() if p.is_dir()}
    assert set(groups) <= set(rows), sorted(set(groups) - set(rows))
    missing = {g: [c for c in choices if f"`{c}`" not in rows[g]] for g, choices in groups.items()
               if g not in ("async", "eval", "gateway", "algorithm")}  # one `default` each, described, not listed
    assert not any(missing.values()), missing
