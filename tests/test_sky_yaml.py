"""scripts/sky/train.yaml validated offline by SkyPilot itself (`sky.Task.from_yaml_config`).

SkyPilot pins click and uvicorn differently from Ray, so it lives in its own venv (.venv-sky,
made by `make test`'s install step, target `.venv-sky/.installed`); the check runs through that
venv's python in a subprocess. Also: both shell blocks parse (`bash -n`), the run block starts
the head on rank 0 and workers elsewhere from SkyPilot's node variables, and OVERRIDES given at
launch reach the job.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml

from stand_ins import REPO

SKY_PY = REPO / ".venv-sky" / "bin" / "python"
TASK_YAML = REPO / "scripts" / "sky" / "train.yaml"

VALIDATE = r"""
import json, sys
import sky
from sky.utils import yaml_utils
sky.Task.from_yaml(sys.argv[1])  # as written (the secret is given at launch)
config = yaml_utils.safe_load(open(sys.argv[1]).read())
task = sky.Task.from_yaml_config(config, env_overrides=[("OVERRIDES", sys.argv[2])],  # as `sky launch --env/--secret`
                                 secrets_overrides=[("RAY_AUTH_TOKEN", "0" * 64)])
(res,) = list(task.resources)
print(json.dumps({"num_nodes": task.num_nodes, "accelerators": res.accelerators, "envs": task.envs,
                  "secrets": sorted(task.secrets), "setup": task.setup, "run": task.run,
                  "workdir": task.workdir}))
"""


@pytest.fixture(scope="module")
def task() -> dict:
    if not SKY_PY.exists():
        pytest.skip(f"{SKY_PY} is missing: SkyPilot lives in its own venv; create it with `make .venv-sky/.installed` "
                    "(`make test` does)")
    out = subprocess.run([str(SKY_PY), "-c", VALIDATE, str(TASK_YAML), "cluster=colocated trainer.total_steps=7"],
                         capture_output=True, text=True, timeout=180, cwd=REPO)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_sky_accepts_the_task_with_2_nodes_of_8_h100(task):
    assert task["num_nodes"] == 2
    assert task["accelerators"] == {"H100": 8}
    assert task["secrets"] == ["RAY_AUTH_TOKEN"]


def test_overrides_pass_through_envs_to_the_submitted_job(task):
    assert task["envs"]["OVERRIDES"] == "cluster=colocated trainer.total_steps=7"
    assert "scripts/submit.sh $OVERRIDES" in task["run"]


def test_setup_installs_the_gpu_lock_and_run_starts_ray_by_node_rank(task):
    assert "make install-gpu" in task["setup"]  # the lock (requirements/gpu.lock) through scripts/install_gpu.sh
    run = task["run"]
    for var in ("SKYPILOT_NODE_RANK", "SKYPILOT_NODE_IPS", "SKYPILOT_NUM_GPUS_PER_NODE"):
        assert var in run
    assert "ray start --head" in run and 'ray start --address="$HEAD_IP:$RAY_PORT"' in run
    for block in ("setup", "run"):  # both parse as bash
        check = subprocess.run(["bash", "-n"], input=task[block], capture_output=True, text=True, timeout=30)
        assert check.returncode == 0, f"{block}: {check.stderr}"


def test_submit_gets_the_head_dashboard_address():
    cfg = yaml.safe_load(TASK_YAML.read_text())
    assert f"RAY_ADDRESS=\"http://127.0.0.1:$DASHBOARD_PORT\"" in cfg["run"]
    assert cfg["envs"]["DASHBOARD_PORT"] == 8265


def test_the_default_job_is_the_2_node_experiment_and_matches_the_hardware():
    """OVERRIDES defaults to +experiment=swe_agent_2node, which names the nodes and GPUs the yaml asks for."""
    from stand_ins import compose_config

    cfg = yaml.safe_load(TASK_YAML.read_text())
    assert cfg["envs"]["OVERRIDES"] == "+experiment=swe_agent_2node"
    run = compose_config(cfg["envs"]["OVERRIDES"].split())
    gpu, count = cfg["resources"]["accelerators"].split(":")
    assert (run.cluster.nodes, run.cluster.gpus_per_node) == (cfg["num_nodes"], int(count)) == (2, 8)
    assert gpu == "H100" and run.cluster.gpu_memory_gib == 80
