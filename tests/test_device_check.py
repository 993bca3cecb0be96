"""scripts/device_check.sh --dry-run: the GPU device check runs end to end on CPU (tiny config)
without vLLM or Ray importable, and writes its JSON under $OUT."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from stand_ins import REPO

T_TIMEOUT_S = 300  # the script aims at < 60 s; a loaded 2-core CI box is slower


def test_device_check_dry_run_writes_figures_without_vllm_or_ray(tmp_path):
    blockers = tmp_path / "blockers"  # `import vllm` / `import ray` fail as if not installed
    blockers.mkdir()
    for name in ("vllm", "ray"):
        (blockers / f"{name}.py").write_text(f"raise ImportError('{name} must not be imported by the device check')\n")
    out_dir = tmp_path / "out"
    env = {**os.environ, "OUT": str(out_dir), "PYTHON": sys.executable,
           "PYTHONPATH": os.pathsep.join([str(blockers), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(["bash", str(REPO / "scripts" / "device_check.sh"), "--dry-run"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=T_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out_dir / "device_check.json").read_text())
    assert report["failed"] == []
    assert report["imported"] == {"vllm": False, "ray": False}
    trainer = report["trainer"]
    assert trainer["ok"] and trainer["tokens_per_s"] > 0 and trainer["step_skipped"] == 0.0
    assert trainer["num_micro_batches"] == 2  # 4 rows x 32 tokens under a 64-token budget
    transfer = report["transfer_shm"]
    assert transfer["ok"] and transfer["gb_per_s"] > 0 and transfer["bytes"] > 0
