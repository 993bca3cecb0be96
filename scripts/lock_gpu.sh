#!/usr/bin/env bash
# Regenerate requirements/gpu.lock, the pinned GPU environment `make install-gpu` installs: pyproject.toml's
# base dependencies with the `gpu` and `verl` extras, resolved for Linux x86_64 (manylinux_2_28, CPython 3.11)
# from PyPI, whose Linux torch wheels are the CUDA builds (the nvidia-* runtime wheels come with them).
#
#   scripts/lock_gpu.sh            # rewrite the lock (needs the package registry; about a minute)
#   scripts/lock_gpu.sh --check    # exit 1 if a fresh resolution differs from the committed lock
#
# uv does the resolving: $UV when set, else `uv` on PATH, else one installed with pip into /tmp/uv-lock-venv.
# scripts/gpu_lock/overrides.txt lifts verl 0.9.1's transformers cap (why is written there). Afterwards run
# `python -m pytest tests/test_gpu_lock.py` (offline): it fails when the lock and the extras disagree.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

LOCK=requirements/gpu.lock
UV="${UV:-$(command -v uv || true)}"
if [[ -z "$UV" ]]; then
  if [[ ! -x /tmp/uv-lock-venv/bin/uv ]]; then
    python3 -m venv /tmp/uv-lock-venv
    /tmp/uv-lock-venv/bin/python -m pip install -q uv
  fi
  UV=/tmp/uv-lock-venv/bin/uv
fi

out="$LOCK"
if [[ "${1:-}" == "--check" ]]; then out="$(mktemp)"; trap 'rm -f "$out"' EXIT; fi

"$UV" pip compile pyproject.toml --extra gpu --extra verl \
  --python-platform x86_64-manylinux_2_28 --python-version 3.11 \
  --override scripts/gpu_lock/overrides.txt \
  --custom-compile-command "scripts/lock_gpu.sh" \
  --quiet --output-file "$out"

if [[ "${1:-}" == "--check" ]]; then
  if diff -u "$LOCK" "$out"; then echo "lock_gpu.sh: $LOCK is current"; else
    echo "lock_gpu.sh: $LOCK differs from a fresh resolution (above); run scripts/lock_gpu.sh" >&2; exit 1; fi
fi
