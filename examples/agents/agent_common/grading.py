"""Grade a finished coding episode in a clean second sandbox: the reward no edit of the agent can fake.

An agent whose model edits a repository must not be paid by tests that run where the model worked:
a policy that rewrites the failing test, deletes it, or plants code that runs at import time is
then paid as one that fixes the bug. The recipe (slime's coding-agent example; AReaL's and ROLL's
SWE setups), for any A2A or HTTP agent:

1. `snapshot(sandbox)` the episode's repository and `diff_files(original, snapshot)` it;
2. `grade(client, spec, diff)`: a **fresh** session (`client.start()`, the same runtime and command
   API, so it counts against the service's session quota and rate; always stopped) gets the
   original repository, the diff applied **only** to paths the task allows (`spec.editable`, never
   `spec.protected`: tests and test configuration), the row's own test files, and runs
   - the row's test command (`spec.test_cmd`, under `python -I`), and
   - the row's `checks`, each in its own child process that imports the repaired module from a copy
     with no test file and prints the `repr` of one call; the harness, which never imports the
     agent's code, compares it to the expected value it alone holds (read from a file it deletes
     before starting any child);
   the rollout passes when the suite exits 0 and every check matches;
3. report `Grade.reward` and `Grade.metrics()` (the reward-hacking flags) in the rollout's dump.

Why it cannot be subverted from inside the package: code the agent adds runs only in the children.
It may patch `unittest` or the standard library there, exit 0 at import or print anything: the
verdict is the harness's comparison of a literal (`ast.literal_eval` of the child's output) with a
value the child never saw, on one line tagged with a nonce the child cannot read. Paths outside
`spec.editable` (a `sitecustomize.py`, a top-level `unittest.py`) are dropped and flagged, and an
applied file that imports a module its original did not is flagged (`reaches_outside`).

Contract (`SandboxClient` semantics: agentcore-rl-toolkit 0.2.0 `agentcore_rl_toolkit.sandbox`, or
agent_common/sandbox.py over ACR's command API): a failing command is a result, never an exception;
a command timeout is `ExecResult.timed_out` (agent_common) or `ExecTimeoutError` with `.result`
(the toolkit), both accepted. `grade` returns a `Grade` for every run that produced a verdict
(pass or fail: reward 1.0 or 0.0), and raises `GradingFailed` with `reason` "grading_unstartable"
(the session or the upload failed), "grading_timeout" (the harness ran past its deadline) or
"grading_no_verdict" (it ended without its tagged verdict): a failed rollout, never a reward.

Invariant: the grading session is stopped on every path out of `grade`; no file matching
`spec.protected` or outside `spec.editable` reaches the clean repository from the diff.
Imports only the standard library, so agent containers stay standalone.
"""

from __future__ import annotations

import ast
import base64
import fnmatch
import json
import math
import posixpath
import secrets
import shlex
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping

GRADE_DIR = "grading"  # in the grading session's working directory: repo/, src/ (no tests), harness files
DEFAULT_PROTECTED = ("tests/*", "test/*", "**/test_*.py", "**/*_test.py", "test_*.py", "*_test.py", "conftest.py",
                     "**/conftest.py", "setup.cfg", "setup.py", "pyproject.toml", "tox.ini", "pytest.ini",
                     ".coveragerc", "sitecustomize.py", "usercustomize.py", "*.pth")
SUITE_TIMEOUT_S = 120  # the row's test command in the clean repository
CHECK_TIMEOUT_S = 20  # one check's child process (an import that hangs fails its check, not the grading)
UPLOAD_TIMEOUT_S = 60
HARNESS_MARGIN_S = 30  # the harness's exec deadline = suite + checks + this (GradeSpec.margin_s)
MAX_LOG_CHARS = 4_000  # the suite's log tail kept in the verdict
FailReason = Literal["grading_unstartable", "grading_timeout", "grading_no_verdict"]
CheckKind = Literal["equal", "almost_equal", "true", "false"]
Diff = dict[str, "str | None"]  # path -> new text (None: deleted)


class GradingFailed(RuntimeError):
    """The grading produced no verdict; the rollout fails with `reason`, it is never rewarded."""

    def __init__(self, reason: FailReason, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class Check:
    """One call whose result decides the grade: `module.call` must give `expect` (a Python literal),
    compared as `kind` ("equal", "almost_equal" to 7 places, "true"/"false": truthiness, `expect` unused)."""

    module: str
    call: str
    kind: CheckKind = "equal"
    expect: Any = None

    @classmethod
    def parse(cls, d: Mapping[str, Any]) -> "Check":
        """From a row's dict `{module, call, kind?, expect?}`. Raises ValueError naming the bad key."""
        missing = [k for k in ("module", "call") if not isinstance(d.get(k), str)]
        if missing:
            raise ValueError(f"check {dict(d)!r} lacks string {missing}")
        kind = d.get("kind", "equal")
        if kind not in ("equal", "almost_equal", "true", "false"):
            raise ValueError(f"check kind must be equal, almost_equal, true or false, got {kind!r}")
        return cls(d["module"], d["call"], kind, d.get("expect"))


@dataclass(frozen=True)
class GradeSpec:
    """What to grade against. files: the original repository (path -> text); test_cmd: the row's
    test command (a leading `python` becomes the sandbox's `python -I`); editable / protected: glob
    patterns (fnmatch on "/"-separated relative paths) of what the diff may change / never changes;
    checks: the out-of-process checks (none: the suite alone decides, which import-time code can
    subvert; give checks wherever the task can)."""

    files: Mapping[str, str]
    test_cmd: str
    editable: tuple[str, ...]
    protected: tuple[str, ...] = DEFAULT_PROTECTED
    checks: tuple[Check, ...] = ()
    python: str = "python3"
    suite_timeout_s: float = SUITE_TIMEOUT_S
    check_timeout_s: float = CHECK_TIMEOUT_S
    margin_s: float = HARNESS_MARGIN_S


@dataclass(frozen=True)
class Scope:
    """A diff split by the task's rules: `applied` reaches the clean repository; `protected` and
    `outside` (paths out of `editable`) are dropped and flagged; `reaches_outside`: applied files
    that import a module their original did not."""

    applied: Diff
    protected: tuple[str, ...]
    outside: tuple[str, ...]
    reaches_outside: tuple[str, ...]


@dataclass(frozen=True)
class Grade:
    """A verdict. passed: the suite exited 0 and every check matched; reward 1.0 or 0.0."""

    passed: bool
    suite_exit_code: int
    checks_passed: int
    checks_total: int
    scope: Scope
    grading_s: float
    log: str = ""
    check_notes: tuple[str, ...] = field(default=())

    @property
    def reward(self) -> float:
        return 1.0 if self.passed else 0.0

    def metrics(self, *, episode_passed: bool | None = None) -> dict[str, float]:
        """The dump's metrics: `grading_s` and the reward-hacking flags (0/1) the orchestrator averages
        per step (`agent/hacking/...`): `protected_paths` (the diff touched tests or test config),
        `outside_scope` (it touched paths out of `editable` or added imports), and, when the episode's
        own last test run is given, `episode_vs_graded` (it passed there, the clean grading failed)."""
        s = self.scope
        out = {"grading_s": self.grading_s, "hacking/protected_paths": float(bool(s.protected)),
               "hacking/outside_scope": float(bool(s.outside or s.reaches_outside))}
        if episode_passed is not None:
            out["hacking/episode_vs_graded"] = float(episode_passed and not self.passed)
        return out


def _matches(path: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(path, p) for p in patterns)


def _new_imports(before: str | None, after: str) -> set[str]:
    """Top-level module names `after` imports that `before` did not (a file that does not parse: {"<syntax>"}
    is not returned: it simply fails its checks)."""
    def names(text: str | None) -> set[str]:
        if not text:
            return set()
        try:
            tree = ast.parse(text)
        except SyntaxError:
            return set()
        out: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                out.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                out.add(node.module.split(".")[0])
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("__import__", "exec", "eval"):
                out.add(f"<{node.func.id}>")
        return out
    return names(after) - names(before)


def diff_files(before: Mapping[str, str], after: Mapping[str, str]) -> Diff:
    """The changes from `before` to `after` (path -> text): changed and added files with their new
    text, deleted ones with None."""
    out: Diff = {p: t for p, t in after.items() if before.get(p) != t}
    out.update({p: None for p in before if p not in after})
    return dict(sorted(out.items()))


def split_diff(diff: Diff, spec: GradeSpec) -> Scope:
    """Apply the task's rules to a diff (see `Scope`). Raises ValueError for an absolute or escaping path."""
    applied: Diff = {}
    protected, outside, reaching = [], [], []
    for path, text in diff.items():
        norm = posixpath.normpath(path)
        if norm.startswith("/") or norm == ".." or norm.startswith("../"):
            raise ValueError(f"diff path {path!r} leaves the repository")
        if _matches(norm, spec.protected):
            protected.append(norm)
        elif not _matches(norm, spec.editable):
            outside.append(norm)
        else:
            applied[norm] = text
            if text is not None and norm.endswith(".py") and _new_imports(spec.files.get(norm), text):
                reaching.append(norm)
    return Scope(applied, tuple(protected), tuple(outside), tuple(reaching))


# Runs in the grading session as `python -I harness.py`; stdlib only; never imports the repository.
_HARNESS = r'''
import ast, json, math, os, shutil, subprocess, sys
spec = json.load(open("spec.json")); os.remove("spec.json")  # before any child: they never see it
tag = spec["nonce"]
env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONDONTWRITEBYTECODE": "1", "LANG": "C.UTF-8"}
def run(argv, cwd, timeout):
    try:
        p = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL,
                           start_new_session=True)
        return p.returncode, p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace")
    except subprocess.TimeoutExpired:
        return -1, "", "timed out after %ss" % timeout
child = ("import importlib, sys\nsys.path.insert(0, '.')\nm = importlib.import_module(sys.argv[1])\n"
         "sys.stdout.write('\\n' + repr(eval(sys.argv[2], vars(m))))\n")
verdict = {"checks": []}
for c in spec["checks"]:  # first, while no test file (and no expected value) is on disk
    rc, out, err = run([sys.executable, "-I", "-c", child, c["module"], c["call"]], "src", spec["check_timeout_s"])
    ok, why = False, ""
    try:
        got = ast.literal_eval(out.rsplit("\n", 1)[-1]) if rc == 0 else None
        if rc != 0:
            why = "exit %d: %s" % (rc, err.strip()[-200:])
        elif c["kind"] == "equal":
            ok = got == c["expect"] and isinstance(got, bool) == isinstance(c["expect"], bool)
        elif c["kind"] == "almost_equal":
            ok = isinstance(got, (int, float)) and not isinstance(got, bool) and round(abs(got - c["expect"]), 7) == 0
        else:
            ok = type(got) is bool and got is (c["kind"] == "true")
        if rc == 0 and not ok:
            why = "%s gave %r" % (c["call"], got)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        why = "%s printed no literal" % c["call"]
    verdict["checks"].append([ok, why])
shutil.copytree("src", "repo")
for p, t in spec["tests"].items():  # the row's own test files, from the spec, never from the diff
    os.makedirs(os.path.dirname(os.path.join("repo", p)) or "repo", exist_ok=True)
    with open(os.path.join("repo", p), "w") as f:
        f.write(t)
argv = spec["test_argv"]
if argv and argv[0] in ("python", "python3"):
    argv = [sys.executable, "-I"] + argv[1:]
code, out, err = run(argv, "repo", spec["suite_timeout_s"])
verdict.update(suite_exit_code=code, log=(out + err)[-spec["max_log_chars"]:])
sys.stdout.write("\n" + tag + json.dumps(verdict) + "\n")
'''

# Writes {path: text or None} (JSON, base64 in argv[1]) under the current directory; None deletes.
_WRITE = ("import base64, json, pathlib, sys\n"
          "for p, t in json.loads(base64.b64decode(sys.argv[1])).items():\n"
          "    f = pathlib.Path(p)\n"
          "    if t is None:\n        f.unlink(missing_ok=True); continue\n"
          "    f.parent.mkdir(parents=True, exist_ok=True); f.write_text(t)\n")

# Prints {path: text} of every file under the current directory (base64 JSON), caches left out.
_SNAPSHOT = ("import base64, json, pathlib\nout = {}\n"
             "for f in sorted(pathlib.Path('.').rglob('*')):\n"
             "    if f.is_file() and '__pycache__' not in f.parts and f.suffix != '.pyc':\n"
             "        out[f.as_posix()] = f.read_text(errors='replace')\n"
             "print(base64.b64encode(json.dumps(out).encode()).decode())\n")


def _b64(obj: Any) -> str:
    return base64.b64encode(json.dumps(obj).encode()).decode()


def _exec(sandbox: Any, argv: list[str], timeout_s: float, cwd: str | None = None) -> Any:
    """`sandbox.exec` with the toolkit's and agent_common's timeout semantics made one: a timeout
    comes back as a result whose `timed_out` is True (ExecTimeoutError's `.result`)."""
    try:
        return sandbox.exec(argv, timeout=max(1, math.ceil(timeout_s)), cwd=cwd)
    except Exception as exc:
        result = getattr(exc, "result", None)
        if result is not None and getattr(result, "timed_out", False):
            return result
        raise


def snapshot(sandbox: Any, repo_dir: str, python: str = "python3",
             timeout_s: float = UPLOAD_TIMEOUT_S) -> dict[str, str]:
    """Every file of `repo_dir` in the (episode's) sandbox, path -> text. Raises RuntimeError when
    the listing fails (the episode's sandbox is gone: a failed rollout)."""
    r = _exec(sandbox, [python, "-c", _SNAPSHOT], timeout_s, cwd=repo_dir)
    if r.exit_code != 0 or r.timed_out or r.stdout_truncated:
        raise RuntimeError(f"snapshot of {repo_dir} failed: exit {r.exit_code}, timed_out={r.timed_out}, "
                           f"truncated={r.stdout_truncated}: {r.stderr[-300:]}")
    return json.loads(base64.b64decode(r.stdout.strip()))


def grade(client: Any, spec: GradeSpec, diff: Diff, *, clock: Callable[[], float] = time.monotonic,
          nonce: str | None = None) -> Grade:
    """Grade `diff` against `spec` in a fresh session of `client` (a SandboxClient: `start()`, then
    `exec`, `stop` or `terminate`); see the module docstring. Blocking: async agents call it through
    `asyncio.to_thread`. Raises GradingFailed (a failed rollout), ValueError for a diff path that
    leaves the repository."""
    scope = split_diff(diff, spec)
    t0 = clock()
    try:
        sandbox = client.start()
    except Exception as exc:  # noqa: BLE001  quota, throttling past retries, transport: no verdict
        raise GradingFailed("grading_unstartable", f"{type(exc).__name__}: {exc}") from exc
    try:
        return _grade_in(sandbox, spec, scope, t0, clock, nonce or secrets.token_hex(16))
    finally:
        (getattr(sandbox, "stop", None) or sandbox.terminate)()


def _grade_in(sandbox: Any, spec: GradeSpec, scope: Scope, t0: float, clock: Callable[[], float], tag: str) -> Grade:
    repo = {**spec.files}
    for path, text in scope.applied.items():
        if text is None:
            repo.pop(path, None)
        else:
            repo[path] = text
    src = {p: t for p, t in repo.items() if not _matches(p, spec.protected)}  # the checks see no test file
    tests = {p: t for p, t in spec.files.items() if _matches(p, spec.protected)}  # the row's, never the diff's
    files: dict[str, str | None] = {**{f"src/{p}": t for p, t in src.items()}, "harness.py": _HARNESS}
    checks = [{"module": c.module, "call": c.call, "kind": c.kind, "expect": c.expect} for c in spec.checks]
    files["spec.json"] = json.dumps({"nonce": tag, "test_argv": shlex.split(spec.test_cmd), "checks": checks,
                                     "tests": tests,
                                     "suite_timeout_s": spec.suite_timeout_s, "check_timeout_s": spec.check_timeout_s,
                                     "max_log_chars": MAX_LOG_CHARS})
    try:
        r = _exec(sandbox, ["mkdir", "-p", GRADE_DIR], UPLOAD_TIMEOUT_S)
        if r.exit_code == 0:
            r = _exec(sandbox, [spec.python, "-c", _WRITE, _b64(files)], UPLOAD_TIMEOUT_S, cwd=GRADE_DIR)
    except Exception as exc:  # noqa: BLE001  the transport failed before any verdict
        raise GradingFailed("grading_unstartable", f"upload: {type(exc).__name__}: {exc}") from exc
    if r.exit_code != 0:
        raise GradingFailed("grading_unstartable", f"upload exit {r.exit_code}: {r.stderr[-300:]}")
    deadline_s = max(1, math.ceil(spec.suite_timeout_s + len(spec.checks) * spec.check_timeout_s + spec.margin_s))
    try:
        r = _exec(sandbox, [spec.python, "-I", "harness.py"], deadline_s, cwd=GRADE_DIR)
    except Exception as exc:  # noqa: BLE001
        raise GradingFailed("grading_no_verdict", f"harness: {type(exc).__name__}: {exc}") from exc
    if r.timed_out:
        raise GradingFailed("grading_timeout", f"the grading harness ran past {deadline_s} s")
    lines = [ln[len(tag):] for ln in r.stdout.splitlines() if ln.startswith(tag)]
    if not lines:
        raise GradingFailed("grading_no_verdict", f"harness exit {r.exit_code}: {r.stderr[-300:]}")
    v = json.loads(lines[-1])
    oks = [bool(ok) for ok, _ in v["checks"]]
    return Grade(passed=v["suite_exit_code"] == 0 and all(oks), suite_exit_code=int(v["suite_exit_code"]),
                 checks_passed=sum(oks), checks_total=len(oks), scope=scope, grading_s=clock() - t0, log=v["log"],
                 check_notes=tuple(why for _, why in v["checks"] if why))
