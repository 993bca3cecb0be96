"""The swe_mini agent's repository in its sandbox: every file operation and test run is an
`InvokeAgentRuntimeCommand` on the rollout's own ACR session (the shared sandbox client,
examples/agents/agent_common/sandbox.py), so the repository lives where ACR runs the session, not in the agent's
process.

`Workspace(sandbox)` works in the directory `repo/` of the session's working directory:
`unpack(files)` writes the repository, `list_files()`, `read_file(path)`, `write_file(path, text)`
and `run_tests(test_cmd)` are the agent's tools. Paths are relative to the repository; an
absolute path or one that leaves it (`..`) is refused with `ToolError` before any command runs.

Invariants: a tool never raises for what the model asked (a missing file, a failing test run, a
bad path: `ToolError`, whose text the agent returns to the model); a transport failure of the
command API raises (botocore's errors) and ends the rollout as the agent's exception.
"""

from __future__ import annotations

import base64
import json
import math
import posixpath
import shlex
import sys
from dataclasses import dataclass
from typing import Any

REPO_DIR = "repo"
MAX_FILE_CHARS = 8_000  # a read_file answer keeps this many characters
MAX_LOG_CHARS = 6_000  # a run_tests answer keeps the last this many characters of the log
TEST_TIMEOUT_S = 120
IO_TIMEOUT_S = 60
MAX_WRITE_CHARS = 40_000  # the command API takes at most 65,536 characters per command (base64 grows 4/3)
# writes {path: text} (JSON, base64 in argv[1]) under the current directory, creating folders
_WRITE = ("import base64, json, pathlib, sys\n"
          "for p, t in json.loads(base64.b64decode(sys.argv[1])).items():\n"
          "    f = pathlib.Path(p); f.parent.mkdir(parents=True, exist_ok=True); f.write_text(t)\n")


class ToolError(ValueError):
    """What the model asked cannot be done (its text goes back to the model as the tool's answer)."""


@dataclass(frozen=True)
class TestRun:
    """One run of the test command: `passed` when it exited 0 within its timeout; `log`: stdout
    and stderr (the tail, at most MAX_LOG_CHARS characters)."""

    passed: bool
    exit_code: int
    log: str


def safe_path(path: Any) -> str:
    """`path` normalised inside the repository. Raises ToolError for a non-string, empty,
    absolute or escaping path."""
    if not isinstance(path, str) or not path.strip():
        raise ToolError(f"path must be a non-empty string, got {path!r}")
    norm = posixpath.normpath(path.strip())
    if norm.startswith("/") or norm == ".." or norm.startswith("../"):
        raise ToolError(f"path {path!r} is outside the repository; use a path relative to its root")
    return norm


class Workspace:
    """The repository of one rollout inside `sandbox` (an agent_common.sandbox.Sandbox)."""

    def __init__(self, sandbox: Any, python: str = sys.executable) -> None:
        self.sandbox = sandbox
        self._python = python

    def _exec(self, argv: list[str], timeout_s: float, cwd: str = REPO_DIR):
        return self.sandbox.exec(argv, timeout_s=timeout_s, cwd=cwd)

    def unpack(self, files: dict[str, str]) -> None:
        """Write the repository (`files`: path -> text). Raises RuntimeError when the command fails."""
        for p in files:
            safe_path(p)
        r = self.sandbox.exec(["mkdir", "-p", REPO_DIR], timeout_s=IO_TIMEOUT_S)
        if r.exit_code == 0:
            r = self._exec([self._python, "-c", _WRITE, _b64(files)], IO_TIMEOUT_S)
        if r.exit_code != 0:
            raise RuntimeError(f"could not write the repository into the sandbox: exit {r.exit_code}: {r.stderr[-500:]}")

    def busy(self, seconds: float) -> None:
        """Keep the sandbox busy for `seconds` (a `sleep` there: the stand-in for an image pull)."""
        self.sandbox.exec(["sleep", f"{seconds:.3f}"], timeout_s=max(1, math.ceil(seconds) + 30))

    def list_files(self) -> str:
        r = self._exec(["find", ".", "-type", "f", "-not", "-path", "*/__pycache__/*"], IO_TIMEOUT_S)
        if r.exit_code != 0:
            raise ToolError(f"listing failed: {r.stderr[-300:]}")
        return "\n".join(sorted(line.removeprefix("./") for line in r.stdout.splitlines() if line))

    def read_file(self, path: Any) -> str:
        p = safe_path(path)
        r = self._exec(["cat", "--", p], IO_TIMEOUT_S)
        if r.exit_code != 0:
            raise ToolError(f"cannot read {p}: {r.stderr.strip()[-300:]}")
        text = r.stdout
        return text if len(text) <= MAX_FILE_CHARS else text[:MAX_FILE_CHARS] + f"\n[... {len(text) - MAX_FILE_CHARS} more characters]"

    def write_file(self, path: Any, content: Any) -> str:
        p = safe_path(path)
        if not isinstance(content, str):
            raise ToolError(f"content must be a string, got {type(content).__name__}")
        if len(content) > MAX_WRITE_CHARS:
            raise ToolError(f"content of {len(content)} characters is over the {MAX_WRITE_CHARS}-character limit")
        r = self._exec([self._python, "-c", _WRITE, _b64({p: content})], IO_TIMEOUT_S)
        if r.exit_code != 0:
            raise ToolError(f"cannot write {p}: {r.stderr.strip()[-300:]}")
        return f"wrote {len(content)} characters to {p}"

    def run_tests(self, test_cmd: str) -> TestRun:
        """Run `test_cmd` (its leading `python` is this agent's interpreter) in the repository."""
        argv = shlex.split(test_cmd)
        if argv and argv[0] in ("python", "python3"):
            argv[0] = self._python
        r = self._exec(argv, TEST_TIMEOUT_S)
        log = (r.stdout + r.stderr)[-MAX_LOG_CHARS:]
        if r.timed_out:
            log += f"\n[the tests ran past {TEST_TIMEOUT_S} s and were killed]"
        return TestRun(passed=r.exit_code == 0 and not r.timed_out, exit_code=r.exit_code, log=log)


def _b64(files: dict[str, str]) -> str:
    return base64.b64encode(json.dumps(files).encode()).decode()
