"""The planner recommends only layouts the product accepts (issue 47, item 8): `--sweep` printed
`cluster.trainer.gpus_per_node=32`, which `dry_run=true` refuses on 8-GPU nodes, and colocated
layouts with 8-GPU replicas, which the config refuses. Every layout of the sweep grid that the planner
may recommend goes through the dry run here (placement and memory, with a small known model so the
layout is what is checked); the ones it may not recommend are exactly those the config refuses."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.config import ConfigError
from orchestrator.planning.dry_run import build_plan, check_plan
from orchestrator.planning.sim.run import layout
from orchestrator.planning.sim.workload import load_workload
from orchestrator.planning.simulate import not_accepted, overrides, sweep_grid, trainer_layout
from stand_ins import compose_config

REPO = Path(__file__).resolve().parent.parent
SMALL_MODEL = ["model=qwen3", "model.path=/models/Qwen3-0.6B"]  # a shape the dry run knows by name


def _overrides(w, sc) -> list[str]:
    lay = layout(w, sc)
    f = {"groups_per_update": lay.groups_per_update, "n": int(w.batch["n"]), "replicas": lay.replicas,
         "trainer_gpus": lay.trainer_gpus}
    return overrides(w, sc, f)


def test_trainer_layouts_fill_whole_nodes():
    assert trainer_layout(32, 8) == (4, 8)
    assert trainer_layout(24, 8) == (3, 8)
    assert trainer_layout(12, 8) == (2, 6)  # the same ranks on every trainer node, fewest nodes
    assert trainer_layout(3, 8) == (1, 3)


@pytest.mark.parametrize("gpus", [16, 24, 64])
def test_every_recommendable_layout_of_the_grid_passes_the_dry_run(gpus):
    w = load_workload("reference")
    checked, seen = 0, set()
    for name, sc in sweep_grid(w, gpus).items():
        cfg_overrides = [*_overrides(w, sc), *SMALL_MODEL]
        placement = tuple(o for o in cfg_overrides if o.startswith(("cluster", "inference")))
        if placement in seen:  # η, sync_every and the policy do not change where anything goes
            continue
        seen.add(placement)
        if not_accepted(w, sc) is not None:
            assert sc.colocated, name
            with pytest.raises(ConfigError, match="tensor_parallel_size"):
                compose_config(cfg_overrides)
            continue
        plan = build_plan(compose_config(cfg_overrides))
        check_plan(plan)  # raises ConfigError naming the GPU that does not fit
        checked += 1
    assert checked >= 1


def test_the_reported_recommendation_passes_dry_run_at_the_entry_point(tmp_path):
    """The issue's case: 64 GPUs on 8-GPU nodes, 32 trainer GPUs."""
    w = load_workload("reference")
    sc = sweep_grid(w, 64)["async_1"]
    ov = _overrides(w, sc)
    assert "cluster.trainer.gpus_per_node=8" in ov and "cluster.trainer.nodes=4" in ov and "cluster.gpus_per_node=8" in ov
    out = subprocess.run([sys.executable, "-m", "orchestrator.main", *ov, *SMALL_MODEL, "dry_run=true",
                          f"run_dir={tmp_path / 'r'}"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "dry run: the plan fits" in out.stdout
