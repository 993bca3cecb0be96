"""The test markers name real modules: a renamed module must not silently fall out of `e2e` or
`integration` into `make test-fast`."""

from pathlib import Path

from conftest import HEAVY_MODULES, INTEGRATION_MODULES, module_kind

TESTS = Path(__file__).resolve().parent


def test_every_marked_module_exists_and_has_one_kind():
    names = {p.name for p in TESTS.glob("test_*.py")}
    assert HEAVY_MODULES <= names and INTEGRATION_MODULES <= names, (HEAVY_MODULES | INTEGRATION_MODULES) - names
    assert not HEAVY_MODULES & INTEGRATION_MODULES
    assert module_kind("test_e2e.py") == "e2e" and module_kind("test_buffer.py") == "integration"
    assert module_kind("test_markers.py") == "unit"


def test_a_test_using_the_stack_fixture_is_integration_whatever_its_module():
    """Issue 44: four modules that start the ACR stack through `local_stack` were `unit` because no
    list named them; the fixture now marks them."""
    assert module_kind("test_sandbox.py", ["tmp_path", "local_stack", "stack"]) == "integration"
    assert module_kind("test_sandbox.py", ["tmp_path"]) == "unit"
    assert module_kind("test_e2e.py", ["local_stack"]) == "e2e"


def test_a_unit_test_that_leaves_a_process_running_fails_naming_the_rule(tmp_path):
    """The guard behind `make test-fast`: a test with no integration fixture whose body leaves a
    child process running (as an engine or the ACR stack would), or runs a command that starts one
    of the stack's parts and stops it, fails instead of passing as unit."""
    import os
    import subprocess
    import sys

    (tmp_path / "test_leaky.py").write_text(
        "import subprocess, pytest\n"
        "@pytest.fixture\n"
        "def server():\n"
        "    p = subprocess.Popen(['sleep', '30'])\n"
        "    yield p\n"
        "    p.kill(); p.wait()\n"
        "def test_leaves_a_server_running(server):\n"
        "    assert server.poll() is None\n"
        "def test_runs_a_command_to_its_end():\n"
        "    subprocess.run(['true'], check=True)\n"
        "def test_runs_a_command_that_starts_the_stack_and_stops_it():\n"  # as the main job would
        "    import sys\n"
        "    subprocess.run([sys.executable, '-m', 'heavy_part_probe'], check=True)\n"
        # a stand-in module: with a real part's, this test's own guard would catch its inner run
        "import conftest\n"
        "conftest.PART_MODULES = ('heavy_part_probe',)\n")
    (tmp_path / "heavy_part_probe.py").write_text("import time\ntime.sleep(0.5)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent)])}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
                           "-p", "no:xdist", str(tmp_path / "test_leaky.py")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert "2 failed, 1 passed" in proc.stdout, proc.stdout[-2000:]
    assert "is marked unit but started child processes" in proc.stdout
    assert any("is marked unit but started a descendant" in line and "-m heavy_part_probe" in line
               for line in proc.stdout.splitlines()), proc.stdout[-2000:]


def test_a_heavy_part_is_told_by_its_program_or_module_not_by_a_word_in_its_arguments():
    from conftest import heavy_part

    assert heavy_part(["/v/bin/python", "-m", "workers.embedded.emulator", "--port", "1"]) == "workers.embedded.emulator"
    assert heavy_part(["/usr/lib/ray/core/src/ray/raylet/raylet", "--node"]) == "raylet"
    assert heavy_part(["ray::TrainerActor.update"]) == "ray::TrainerActor.update"
    assert heavy_part(["/v/bin/vllm", "serve", "m"]) == "vllm"
    assert heavy_part(["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]) == "vllm.entrypoints.openai.api_server"
    # a command that only mentions one (a check of what a venv holds, an import test)
    assert heavy_part(["/v/bin/python", "-c", "import sys; print('vllm' in sys.modules, 'raylet')"]) is None
    assert heavy_part(["/v/bin/python", "-m", "orchestrator.main", "inference=vllm"]) is None
    assert heavy_part([]) is None


def test_every_long_check_names_a_real_test_and_make_test_skips_it():
    """A renamed long test must not silently drop out of CI's `make test-long` (nor run in the suite)."""
    import ast

    from conftest import LONG_TESTS, is_long

    for entry in LONG_TESTS:
        module, _, test = entry.partition("::")
        source = (TESTS / module).read_text()  # FileNotFoundError names a renamed module
        if test:
            names = {n.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)}
            assert test.split("[", 1)[0] in names, f"{entry}: no such test"
            if "[" in test:  # a parametrized case: its id is written in the test's ids
                assert test.split("[", 1)[1].rstrip("]") in source, f"{entry}: no such case"
        assert is_long(f"tests/{module}::{test or 'test_any'}" + ("" if "[" in test else "[param]"))
    assert not is_long("tests/test_e2e.py::test_main_job_runs_end_to_end_on_real_parts")
    assert not is_long("tests/test_e2e.py::test_first_ctrl_c_stops_the_run_fast_and_leaves_nothing_behind"
                       "[async-sigint-in-loop]")  # the suite keeps one Ctrl-C case
