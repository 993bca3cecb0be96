"""The coding task "swe_mini": small generated Python repositories, each with one bug and a failing unit test.

A row is one repository in the shape of a SWE-Gym instance, generated from a seed (nothing is
downloaded): a package with the buggy module and a helper module, a README, and a `unittest`
suite that fails on the bug. The agent (examples/agents/swe_mini_agent) copies `repo` into its
sandbox during setup and edits it; its reward comes from a clean second sandbox
(examples/agents/agent_common/grading.py): the episode's changes applied only to `editable`, then
`test_cmd` and the `checks` run there: 1.0 when all pass, 0.0 otherwise.

Row: {"input_id": "swe_mini-<seed>-<i>", "prompt": the issue text, "repo": {path: text},
"patch": {path: fixed text} (the gold fix, which the agent's `oracle` mode applies and `model`
mode never shows the model), "test_cmd": "python -m unittest discover -s tests -t .",
"max_turns": model turns the agent may take, "editable": globs of the source the agent may change
(["<pkg>/*.py"]: never the tests), "checks": [{"module", "call", "kind", "expect"}]: the unit
test's assertions plus checks on inputs no file shows (`Bug.hidden`), which the grader evaluates
out of process}. Paths are relative, "/"-separated.

Bug families (`FAMILIES`): an off-by-one range, a wrong operator, a strict comparison at a
boundary, a wrong index, a wrong string method, floor instead of true division, swapped clamp
bounds; names and constants are drawn per row, so two rows rarely share a file.

Splits: a repository is held out for "test" when the hash of its files says so (`is_held_out`),
so no test repository is ever a train one, whatever the seeds.

Invariants (tests/test_swe_mini.py runs the suites): `make_rows(num, seed, split)` is a pure
function of its arguments with unique `input_id`s; for every row, `test_cmd` fails on `repo` and
passes on `repo` with `patch` applied; `patch` changes exactly one file of `repo`, which `editable`
matches; every check holds on the patched repository and one fails on `repo`.
"""

from __future__ import annotations

import itertools
import json
import random
import textwrap
import zlib
from dataclasses import dataclass
from typing import Callable

TEST_CMD = "python -m unittest discover -s tests -t ."  # run in the repository's root
PACKAGES = ("ledger", "inventory", "scores", "geometry", "billing", "metrics", "shipping", "payroll")
DEFAULT_MAX_TURNS = 8
SPLITS = ("train", "test")
HELD_OUT_MOD = 5  # one repository in five (by the hash of its files) is held out for the test split


Check = tuple[str, str, object]  # (kind, call, expected): kind "equal", "almost_equal", "true" or "false"


@dataclass(frozen=True)
class Bug:
    """One generated bug: the function's buggy and fixed bodies, the checks its unit test asserts
    (`tests`), further checks on other inputs that no file of the repository shows (`hidden`: the
    clean grading runs both, so a function special-cased to the visible inputs fails), and the issue."""

    func: str
    signature: str
    buggy: str
    fixed: str
    tests: list[Check]
    issue: str
    hidden: list[Check]


def _off_by_one(rng: random.Random) -> Bug:
    k = rng.randint(3, 9)
    h = k + rng.randint(5, 20)
    return Bug("sum_to", "n", "return sum(range(n))", "return sum(range(n + 1))",
               [("equal", f"sum_to({k})", k * (k + 1) // 2), ("equal", "sum_to(1)", 1)],
               f"`sum_to(n)` should add up 1..n inclusive, but `sum_to({k})` returns {k * (k - 1) // 2}.",
               [("equal", f"sum_to({h})", h * (h + 1) // 2)])


def _operator(rng: random.Random) -> Bug:
    factor, x = rng.randint(3, 9), rng.randint(2, 7)
    h = x + rng.randint(10, 30)
    return Bug("scale", "x", f"return x + {factor}", f"return x * {factor}",
               [("equal", f"scale({x})", x * factor), ("equal", "scale(0)", 0)],
               f"`scale(x)` should multiply by {factor}: `scale({x})` gives {x + factor}, expected {x * factor}.",
               [("equal", f"scale({h})", h * factor)])


def _boundary(rng: random.Random) -> Bug:
    limit = rng.randint(10, 99)
    return Bug("at_least", "value", f"return value > {limit}", f"return value >= {limit}",
               [("true", f"at_least({limit})", True), ("false", f"at_least({limit - 1})", False)],
               f"`at_least({limit})` returns False; a value equal to the limit {limit} must pass.",
               [("true", f"at_least({limit + 1})", True), ("false", f"at_least({limit - 7})", False)])


def _index(rng: random.Random) -> Bug:
    xs = [rng.randint(1, 50) for _ in range(rng.randint(3, 5))]
    hs = [rng.randint(51, 99) for _ in range(4)]
    return Bug("last_item", "items", "return items[0]", "return items[-1]",
               [("equal", f"last_item({xs})", xs[-1]), ("equal", "last_item([7])", 7)],
               f"`last_item({xs})` returns {xs[0]} instead of the last element {xs[-1]}.",
               [("equal", f"last_item({hs})", hs[-1])])


def _string(rng: random.Random) -> Bug:
    word = rng.choice(["alert", "ready", "stop", "hello", "done", "error"])
    other = rng.choice(["quiet", "north", "maybe"])
    return Bug("shout", "text", 'return text.lower() + "!"', 'return text.upper() + "!"',
               [("equal", f'shout("{word}")', f"{word.upper()}!")],
               f'`shout("{word}")` should return "{word.upper()}!" but returns "{word}!".',
               [("equal", f'shout("{other}")', f"{other.upper()}!")])


def _division(rng: random.Random) -> Bug:
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    while (a + b) % 2 == 0:
        b = rng.randint(1, 9)
    c = rng.randint(10, 19)
    return Bug("mean", "values", "return sum(values) // len(values)", "return sum(values) / len(values)",
               [("almost_equal", f"mean([{a}, {b}])", (a + b) / 2), ("equal", "mean([4])", 4)],
               f"`mean([{a}, {b}])` returns {(a + b) // 2}, the exact mean is {(a + b) / 2}.",
               [("almost_equal", f"mean([{c}, {c + 1}, {c + 3}])", (3 * c + 4) / 3)])


def _clamp(rng: random.Random) -> Bug:
    lo, hi = rng.randint(0, 5), rng.randint(20, 40)
    return Bug("clamp", "x", f"return min({lo}, max({hi}, x))", f"return max({lo}, min({hi}, x))",
               [("equal", f"clamp({hi + 10})", hi), ("equal", f"clamp({lo + 3})", lo + 3)],
               f"`clamp(x)` should keep x within [{lo}, {hi}], but `clamp({lo + 3})` returns {lo}.",
               [("equal", f"clamp({lo + 11})", lo + 11), ("equal", f"clamp({lo - 50})", lo)])


FAMILIES: dict[str, Callable[[random.Random], Bug]] = {
    "off_by_one": _off_by_one, "operator": _operator, "boundary": _boundary, "index": _index,
    "string": _string, "division": _division, "clamp": _clamp,
}


def _module(bug: Bug, body: str) -> str:
    return f'"""{bug.func}: see the README."""\n\n\ndef {bug.func}({bug.signature}):\n    {body}\n'


_ASSERT = {"equal": "assertEqual({call}, {expect!r})", "almost_equal": "assertAlmostEqual({call}, {expect!r})",
           "true": "assertTrue({call})", "false": "assertFalse({call})"}


def _test(pkg: str, module: str, bug: Bug) -> str:
    lines = "\n".join("        self." + _ASSERT[kind].format(call=call, expect=expect)
                       for kind, call, expect in bug.tests)
    return (f"import unittest\n\nfrom {pkg}.{module} import {bug.func}\n\n\n"
            f"class Test{bug.func.title().replace('_', '')}(unittest.TestCase):\n"
            f"    def test_{bug.func}(self):\n{lines}\n\n\nif __name__ == \"__main__\":\n    unittest.main()\n")


def _helpers(pkg: str) -> str:
    return textwrap.dedent(f'''\
        """Helpers of the {pkg} package (correct; not part of the issue)."""


        def describe(value):
            return f"{pkg}: {{value!r}}"
        ''')


def _repository(seed: int, index: int, max_turns: int) -> dict:
    rng = random.Random(f"swe_mini:{seed}:{index}")
    family = rng.choice(sorted(FAMILIES))
    bug = FAMILIES[family](rng)
    pkg = rng.choice(PACKAGES)
    module = f"{bug.func}_ops"
    path = f"{pkg}/{module}.py"
    repo = {
        "README.md": f"# {pkg}\n\nA small package. Run the tests with `{TEST_CMD}`.\n",
        f"{pkg}/__init__.py": "",
        f"{pkg}/helpers.py": _helpers(pkg),
        path: _module(bug, bug.buggy),
        "tests/__init__.py": "",
        f"tests/test_{module}.py": _test(pkg, module, bug),
    }
    prompt = (f"The repository `{pkg}` has a failing test. Issue: {bug.issue} "
              f"Fix the bug in the source (not the tests) so that `{TEST_CMD}` passes.")
    checks = [{"module": f"{pkg}.{module}", "call": call, "kind": kind, "expect": expect}
              for kind, call, expect in (*bug.tests, *bug.hidden)]
    return {"prompt": prompt, "family": family, "repo": repo, "patch": {path: _module(bug, bug.fixed)},
            "test_cmd": TEST_CMD, "max_turns": max_turns, "editable": [f"{pkg}/*.py"], "checks": checks}


def is_held_out(repo: dict[str, str]) -> bool:
    """True when the repository belongs to the test split: a hash of its files, so the same
    repository lands in the same split whatever seed or index generated it."""
    return zlib.crc32(json.dumps(repo, sort_keys=True).encode()) % HELD_OUT_MOD == 0


def make_rows(num: int, seed: int, split: str = "train", max_turns: int = DEFAULT_MAX_TURNS) -> list[dict]:
    """`num` rows of `split` drawn from the generator's stream for `seed`, in order (the stream
    skips repositories of the other split). input_ids: `swe_mini-{seed}-{i}` (train),
    `swe_mini-test-{seed}-{i}` (test). Raises ValueError when num < 0, max_turns < 1 or the split
    is unknown."""
    if num < 0:
        raise ValueError(f"swe_mini make_rows needs num >= 0, got {num}")
    if max_turns < 1:
        raise ValueError(f"swe_mini needs max_turns >= 1, got {max_turns}")
    if split not in SPLITS:
        raise ValueError(f"swe_mini split must be one of {list(SPLITS)}, got {split!r}")
    want_test, prefix = split == "test", "swe_mini" if split == "train" else "swe_mini-test"
    rows: list[dict] = []
    for index in itertools.count():
        if len(rows) == num:
            return rows
        r = _repository(seed, index, max_turns)
        if is_held_out(r["repo"]) == want_test:
            rows.append({"input_id": f"{prefix}-{seed}-{len(rows)}", **r})
    raise AssertionError("unreachable")
