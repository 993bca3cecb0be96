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
