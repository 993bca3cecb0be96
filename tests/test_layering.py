"""The import rules of docs/architecture.md ("Import rules"), checked on the product's import graph.

The graph is read with `ast` from every module under orchestrator/ and workers/ (every import
statement, those inside functions included: a lazy import is still a dependency). The floors are
read from the fenced block of docs/architecture.md that follows the line "Floors, top to bottom",
so the page and this test cannot disagree. Checked:

- no import cycle between modules, and no two packages that import each other;
- a package (an entry of the floors) imports only packages on floors below its own;
- workers/embedded is imported outside itself only inside a function or under TYPE_CHECKING;
- workers/core imports no Ray, vLLM or HTTP library; its `types`, `placement` and `tasks`, and
  the loops (orchestrator/loop/), import without torch or Ray (their module-level imports, followed
  through the project, reach neither);
- no module of orchestrator/ imports torch, but export.py and control/lora_targets.py inside a function;
- the agents under examples/agents/ import nothing of orchestrator/ or workers/;
- each package's `__init__.py` docstring (its face) names every module and sub-package in it.

A failure names the module, the line and the rule. Plain `ast`, no import of the product: it runs
in a second. (tests/test_markers.py holds the suite's own rules.)
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("orchestrator", "workers")
FLOORS_MARK = "Floors, top to bottom"
HTTP_LIBS = frozenset({"aiohttp", "httpx", "requests", "urllib3", "boto3", "botocore", "aiobotocore", "fastapi",
                       "starlette", "uvicorn"})
HEAVY = frozenset({"torch", "ray", "vllm"})


@dataclass(frozen=True)
class Import:
    """One imported name, resolved: `target` is a product module (dotted) or an outside top-level
    package; `lazy` when the statement is inside a function or an `if TYPE_CHECKING:` block."""

    source: str
    target: str
    line: int
    lazy: bool
    product: bool


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    """Every product module by dotted name (a package by its `__init__.py`)."""
    return {module_name(p): p for top in PRODUCT for p in sorted((ROOT / top).rglob("*.py"))}


def _statements(tree: ast.AST):
    """(node, lazy) for every import statement of a module."""
    def walk(node: ast.AST, lazy: bool):
        for child in ast.iter_child_nodes(node):
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for stmt in child.body:
                    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                        yield stmt, True
                    yield from walk(stmt, True)
                for stmt in child.orelse:
                    yield from walk(stmt, lazy)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, lazy
            yield from walk(child, inner)
    yield from walk(tree, False)


def _resolve(name: str) -> str | None:
    """The product module `name` lands in (its longest dotted prefix that is one), or None."""
    mods = modules()
    while name:
        if name in mods:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(path: Path, name: str | None = None) -> list[Import]:
    """The imports of one file (`name`: its dotted module name, for relative imports)."""
    name = name or module_name(path)
    tree = ast.parse(path.read_text(), filename=str(path))
    out: list[Import] = []
    for node, lazy in _statements(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            if node.level:
                base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules() else mod for a in node.names]
        for t in targets:
            inner = _resolve(t)
            if inner is not None and inner != name:
                out.append(Import(name, inner, node.lineno, lazy, True))
            elif inner is None:
                out.append(Import(name, t.split(".")[0], node.lineno, lazy, False))
    return out


@cache
def graph() -> dict[str, list[Import]]:
    return {m: imports_of(p, m) for m, p in modules().items()}


@cache
def floors() -> list[list[str]]:
    """The floors of docs/architecture.md, top first: each a list of entries (`orchestrator/loop/`
    a package, `orchestrator/main.py` a module)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    after = text.split(FLOORS_MARK, 1)
    assert len(after) == 2, f"docs/architecture.md lost its line '{FLOORS_MARK}' and the block after it"
    block = re.search(r"```[a-z]*\n(.*?)```", after[1], re.S)
    assert block, f"no fenced block after '{FLOORS_MARK}' in docs/architecture.md"
    return [line.split() for line in block.group(1).splitlines() if line.strip()]


def unit_of(module: str) -> str | None:
    """The floors' entry a module belongs to (the longest that contains it), or None."""
    path = modules()[module].relative_to(ROOT).as_posix()
    best = None
    for entry in (e for floor in floors() for e in floor):
        if (path == entry or (entry.endswith("/") and path.startswith(entry))) and len(entry) > len(best or ""):
            best = entry
    return best


def floor_of(entry: str) -> int:
    """Height of an entry: 0 for the lowest floor."""
    fl = floors()
    return next(len(fl) - 1 - i for i, floor in enumerate(fl) if entry in floor)


def _is_face(module: str) -> bool:
    return modules()[module].name == "__init__.py" and "." not in module  # orchestrator/, workers/: faces only


# ----------------------------------------------------------------------------- the rules


def cycles() -> list[list[str]]:
    """Strongly connected sets of more than one module (Tarjan), over every import."""
    g = {m: sorted({i.target for i in imps if i.product}) for m, imps in graph().items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in g:
        if v not in index:
            visit(v)
    return out


def unit_edges() -> dict[tuple[str, str], Import]:
    """(importing entry, imported entry) -> the first import that makes it, between floors' entries."""
    edges: dict[tuple[str, str], Import] = {}
    for m, imps in graph().items():
        if _is_face(m):
            continue
        for i in imps:
            if i.product and not _is_face(i.target):
                a, b = unit_of(m), unit_of(i.target)
                if a and b and a != b:
                    edges.setdefault((a, b), i)
    return edges


def test_every_product_module_is_on_a_floor():
    lost = [modules()[m].relative_to(ROOT).as_posix() for m in modules() if not _is_face(m) and unit_of(m) is None]
    assert not lost, (f"modules on no floor of docs/architecture.md ('{FLOORS_MARK}'): {lost}; "
                      "add the new package or module to the floor it belongs on")


def test_no_import_cycle():
    assert cycles() == [], f"import cycles (each a set of modules that reach each other): {cycles()}"


def test_no_two_packages_import_each_other():
    e = unit_edges()
    pairs = sorted({tuple(sorted(k)) for k in e if (k[1], k[0]) in e})
    assert not pairs, "packages that import each other: " + "; ".join(
        f"{a} <-> {b} ({e[(a, b)].source}:{e[(a, b)].line}, {e[(b, a)].source}:{e[(b, a)].line})" for a, b in pairs)


def test_a_package_imports_only_floors_below_its_own():
    bad = [f"{i.source}:{i.line} imports {i.target} ({a} on floor {floor_of(a)}, {b} on floor {floor_of(b)})"
           for (a, b), i in sorted(unit_edges().items()) if floor_of(b) >= floor_of(a)]
    assert not bad, "imports that do not go down a floor (docs/architecture.md, Import rules):\n" + "\n".join(bad)


def test_embedded_is_imported_only_where_it_is_needed():
    bad = [f"{i.source}:{i.line} imports {i.target} at module level" for m, imps in graph().items()
           if not m.startswith("workers.embedded") for i in imps
           if i.product and i.target.startswith("workers.embedded") and not i.lazy]
    assert not bad, "workers/embedded must be imported inside the function that needs it:\n" + "\n".join(bad)


def test_core_imports_no_ray_vllm_or_http():
    bad = [f"{i.source}:{i.line} imports {i.target}" for m, imps in graph().items() if m.startswith("workers.core")
           for i in imps if not i.product and i.target in HTTP_LIBS | {"ray", "vllm"}]
    assert not bad, "workers/core imports no Ray, vLLM or HTTP library:\n" + "\n".join(bad)


def eager_closure(module: str) -> set[str]:
    """The product modules that importing `module` runs: module-level imports, followed, with the
    packages above each (their `__init__`)."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        m = todo.pop()
        parts = m.split(".")
        for k in range(1, len(parts) + 1):
            p = ".".join(parts[:k])
            if p in modules() and p not in seen:
                seen.add(p)
                todo.extend(i.target for i in graph()[p] if i.product and not i.lazy)
    return seen


@pytest.mark.parametrize("package,heavy", [
    ("orchestrator.loop", {"torch", "ray"}),
    ("workers.core.types", {"torch", "ray"}),
    ("workers.core.placement", {"torch", "ray"}),
    ("workers.core.tasks", {"torch", "ray"}),
])
def test_light_modules_import_without_torch_or_ray(package, heavy):
    starts = [m for m in modules() if m == package or m.startswith(package + ".")]
    bad = sorted({f"{i.source}:{i.line} imports {i.target} (reached from {s})" for s in starts
                  for m in eager_closure(s) for i in graph()[m] if not i.product and not i.lazy and i.target in heavy})
    assert not bad, f"{package} must import without {sorted(heavy)}:\n" + "\n".join(bad)


TORCH_INSIDE_FUNCTIONS = frozenset({"orchestrator.export", "orchestrator.control.lora_targets"})


def test_the_driver_imports_no_torch_but_inside_two_functions():
    bad = [f"{i.source}:{i.line}" for m, imps in graph().items() if m.startswith("orchestrator.") for i in imps
           if not i.product and i.target == "torch" and not (m in TORCH_INSIDE_FUNCTIONS and i.lazy)]
    assert not bad, ("orchestrator/ imports torch (the driver handles metadata only; docs/architecture.md names "
                     "the two functions that may): " + ", ".join(bad))


def test_example_agents_import_nothing_of_the_product():
    bad = []
    for p in sorted((ROOT / "examples" / "agents").rglob("*.py")):
        for node, _ in _statements(ast.parse(p.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if not getattr(node, "level", 0) and any(n.split(".")[0] in PRODUCT for n in names):
                bad.append(f"{p.relative_to(ROOT)}:{node.lineno}")
    assert not bad, "example agents run as standalone containers and import nothing of the product: " + ", ".join(bad)


def missing_from_faces() -> dict[str, list[str]]:
    """Package (path of its folder) -> the modules and sub-packages its `__init__.py` docstring does
    not name (as `name.py` or `name/`)."""
    out: dict[str, list[str]] = {}
    for init in sorted(p for top in PRODUCT for p in (ROOT / top).rglob("__init__.py")):
        folder = init.parent
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        members = [p.name for p in folder.glob("*.py") if p.name != "__init__.py"]
        members += [f"{p.name}/" for p in folder.iterdir() if (p / "__init__.py").is_file()]
        miss = sorted(n for n in members if not re.search(rf"(?<![\w./]){re.escape(n)}(?![\w])", doc))
        if miss:
            out[folder.relative_to(ROOT).as_posix()] = miss
    return out


def test_every_package_face_names_its_modules():
    miss = missing_from_faces()
    assert not miss, "package docstrings (__init__.py) that do not name every module and sub-package:\n" + "\n".join(
        f"  {k}/__init__.py: {', '.join(v)}" for k, v in miss.items())
