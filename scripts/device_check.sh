#!/usr/bin/env bash
# One-command device check for a single-GPU machine (PyTorch + transformers, no vLLM / Ray, no
# network): CUDA, FSDP2 bf16 training throughput on a ~0.5B random Qwen2, CUDA weight transfer
# between two processes. Writes $OUT/device_check.json when OUT is set. Bounded to 8 minutes.
#   bash scripts/device_check.sh [--dry-run] [--try-nccl] [--out FILE]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
exec timeout --kill-after=10 "${DEVICE_CHECK_TIMEOUT_S:-480}" "$PY" scripts/device_check.py "$@"
