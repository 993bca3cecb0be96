"""GPU placement (workers/core/placement.py, orchestrator/wiring/placement_groups.py) on a CPU box.

Pure plan and capacity checks first; then a local Ray instance of this module's own with 8
logical GPUs (Ray builds real placement groups and sets CUDA_VISIBLE_DEVICES for logical GPUs)
where light actors, created with the options main.py uses, report the bundle they landed in and
the CUDA_VISIBLE_DEVICES they see, for cluster=disaggregated and cluster=colocated.
"""

from __future__ import annotations

import pytest

from stand_ins import compose_config, own_ray
from workers.core.placement import (
    COLOCATED_GPU_SHARE,
    InsufficientGpusError,
    PlacementSpec,
    Slot,
    check_capacity,
    plan_placement,
)

NUM_GPUS = 8  # logical GPUs of the module's Ray instance


# --- pure plan ---------------------------------------------------------------------------------

def test_disaggregated_plan_gives_trainer_and_inference_separate_groups():
    plan = plan_placement(PlacementSpec("disaggregated", trainer_nodes=2, trainer_gpus_per_node=4,
                                        inference_replicas=3, tensor_parallel_size=2))
    # one STRICT_PACK group per trainer node (4 x 1 GPU), one PACK group of 3 bundles x 2 GPUs
    assert [(g.name, g.strategy, g.bundles) for g in plan.groups] == [
        ("trainer-node-0", "STRICT_PACK", ({"GPU": 1.0},) * 4),
        ("trainer-node-1", "STRICT_PACK", ({"GPU": 1.0},) * 4),
        ("inference", "PACK", ({"GPU": 2.0},) * 3),
    ]
    assert plan.trainer == tuple(Slot(r // 4, r % 4, 1.0) for r in range(8))
    assert plan.inference == tuple(Slot(2, i, 2.0) for i in range(3))
    assert plan.num_gpus == 8 + 3 * 2


def test_colocated_plan_puts_replica_i_on_trainer_rank_i_gpu():
    plan = plan_placement(PlacementSpec("colocated", trainer_nodes=1, trainer_gpus_per_node=4, inference_replicas=4))
    assert [(g.name, g.strategy, g.bundles) for g in plan.groups] == [("trainer-node-0", "STRICT_PACK", ({"GPU": 1.0},) * 4)]
    assert [(s.group, s.bundle) for s in plan.trainer] == [(s.group, s.bundle) for s in plan.inference]
    assert all(s.num_gpus == COLOCATED_GPU_SHARE for s in plan.trainer + plan.inference)
    assert plan.num_gpus == 4  # shared: 4 GPUs, not 8


def test_local_plan_is_empty():
    plan = plan_placement(PlacementSpec("local", trainer_gpus_per_node=0))
    assert plan.groups == () and plan.trainer == () and plan.inference == () and plan.num_gpus == 0


def test_bad_specs_name_the_key():
    with pytest.raises(ValueError, match="cluster.trainer.gpus_per_node must be >= 1"):
        PlacementSpec("disaggregated", trainer_gpus_per_node=0)
    with pytest.raises(ValueError, match="tensor_parallel_size must be 1 with cluster=colocated"):
        PlacementSpec("colocated", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="inference.replicas=3 must be <= the trainer.s 2 GPUs"):
        PlacementSpec("colocated", trainer_gpus_per_node=2, inference_replicas=3)


def test_capacity_error_gives_the_numbers():
    plan = plan_placement(PlacementSpec("disaggregated", trainer_gpus_per_node=8, inference_replicas=2))
    with pytest.raises(InsufficientGpusError, match=r"needs 10 GPUs \(trainer 1 node\(s\) x 8 GPU\(s\); inference "
                                                    r"2 replica\(s\) x tensor_parallel_size 1\), but the Ray cluster "
                                                    r"has 8 GPUs \(per node: \[8.0\]\)"):
        check_capacity(plan, [8.0])
    check_capacity(plan, [8.0, 2.0])  # fits: trainer group on node 0, replicas on node 1


def test_capacity_error_when_a_strict_pack_group_fits_no_node():
    plan = plan_placement(PlacementSpec("disaggregated", trainer_gpus_per_node=8, inference_replicas=1))
    # 9 GPUs needed, 12 in the cluster, but the 8-GPU trainer group must sit on one node
    with pytest.raises(InsufficientGpusError, match=r"group trainer-node-0 .* needs 8 GPUs on one node.*\[4.0, 4.0, 4.0\]"):
        check_capacity(plan, [4.0, 4.0, 4.0])


# --- real placement groups on logical GPUs ---------------------------------------------------------

@pytest.fixture(scope="module")
def ray_gpus():
    """A Ray instance of this module's own (address="local": never joins another) with 8 logical GPUs."""
    if pytest.importorskip("ray").is_initialized():
        pytest.skip("Ray is already initialized in this process by another test module")
    with own_ray(num_gpus=NUM_GPUS) as ray:
        yield ray


def _env_probe_class() -> type:
    """A light stand-in for TrainerWorker / InferenceWorker that reports where Ray put it (defined
    in a function so Ray ships it by value: workers cannot import this test module)."""

    class EnvProbe:
        def report(self) -> dict:
            import os

            import ray

            return {"cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                    "pg": ray.get_runtime_context().get_placement_group_id()}

    return EnvProbe


def _probe(ray, options: dict) -> dict:
    actor = ray.remote(num_cpus=0)(_env_probe_class()).options(**options).remote()
    try:
        return ray.get(actor.report.remote(), timeout=60)
    finally:
        ray.kill(actor)


def _devices(report: dict) -> set[str]:
    return set(report["cuda"].split(","))


def test_disaggregated_actors_see_disjoint_gpus(ray_gpus):
    from ray.util.placement_group import placement_group_table

    from orchestrator.wiring.placement_groups import PlacedGroups

    ray = ray_gpus
    spec = PlacementSpec("disaggregated", trainer_nodes=1, trainer_gpus_per_node=2, inference_replicas=3,
                         tensor_parallel_size=2)
    placed = PlacedGroups.create(plan_placement(spec), ready_timeout_s=30)
    try:
        tables = [placement_group_table(pg) for pg in placed.groups]
        print("\nbundles:", [(t["name"], t["strategy"], t["bundles"]) for t in tables])
        assert [t["bundles"] for t in tables] == [{0: {"GPU": 1.0}, 1: {"GPU": 1.0}},
                                                  {0: {"GPU": 2.0}, 1: {"GPU": 2.0}, 2: {"GPU": 2.0}}]
        trainer = [_probe(ray, placed.trainer_options(r)) for r in range(2)]
        inference = [_probe(ray, placed.inference_options(i)) for i in range(3)]
        print("trainer CUDA_VISIBLE_DEVICES:", [t["cuda"] for t in trainer])
        print("inference CUDA_VISIBLE_DEVICES:", [t["cuda"] for t in inference])
        assert [len(_devices(t)) for t in trainer] == [1, 1]
        assert [len(_devices(t)) for t in inference] == [2, 2, 2]
        all_devices = [d for t in trainer + inference for d in _devices(t)]
        assert len(all_devices) == len(set(all_devices)) == 8  # no GPU shared, all 8 used
        assert {t["pg"] for t in trainer} == {placed.groups[0].id.hex()}
        assert {t["pg"] for t in inference} == {placed.groups[1].id.hex()}
        for t in trainer + inference:  # Ray's view and the env agree
            assert _devices(t) == set(t["gpu_ids"])
    finally:
        placed.remove()


def test_colocated_rank_and_replica_share_a_gpu(ray_gpus):
    from orchestrator.wiring.placement_groups import PlacedGroups

    ray = ray_gpus
    placed = PlacedGroups.create(plan_placement(PlacementSpec("colocated", trainer_gpus_per_node=4, inference_replicas=4)),
                                 ready_timeout_s=30)
    try:
        trainer = [_probe(ray, placed.trainer_options(r)) for r in range(4)]
        inference = [_probe(ray, placed.inference_options(i)) for i in range(4)]
        print("\ncolocated trainer / inference CUDA_VISIBLE_DEVICES:",
              [(t["cuda"], i["cuda"]) for t, i in zip(trainer, inference)])
        assert [t["cuda"] for t in trainer] == [i["cuda"] for i in inference]  # rank i and replica i: one GPU
        assert len({t["cuda"] for t in trainer}) == 4 and all(len(_devices(t)) == 1 for t in trainer)
        assert ray.available_resources().get("GPU", 0.0) == NUM_GPUS - 4  # the group holds 4, not 8
    finally:
        placed.remove()


def test_too_many_gpus_fails_before_any_group_or_actor(ray_gpus):
    from ray.util.placement_group import placement_group_table

    from orchestrator.wiring.placement_groups import PlacedGroups

    ray = ray_gpus
    groups_before = placement_group_table()
    spec = PlacementSpec("disaggregated", trainer_gpus_per_node=4, inference_replicas=5)
    with pytest.raises(InsufficientGpusError, match=r"needs 9 GPUs .* has 8 GPUs"):
        PlacedGroups.create(plan_placement(spec), ready_timeout_s=30)
    # no group was created (main.py creates its actors only after `place()` returned)
    assert placement_group_table().keys() == groups_before.keys()


def test_main_config_path_places_the_disaggregated_yaml(ray_gpus):
    """The composed `cluster=disaggregated` config through `place()`, as main.py calls it."""
    from orchestrator.wiring.placement_groups import place

    cfg = _compose(["cluster=disaggregated", "inference.replicas=2"])
    placed = place(cfg.cluster)
    try:
        opts = [placed.trainer_options(0)] + [placed.inference_options(i) for i in range(2)]
        assert [o["num_gpus"] for o in opts] == [1.0, 1.0, 1.0]
        reports = [_probe(ray_gpus, o) for o in opts]
        assert len({r["cuda"] for r in reports}) == 3
    finally:
        placed.remove()


# --- every blog experiment composes with both GPU layouts ----------------------------------------------

def _compose(overrides: list[str]):
    return compose_config(overrides, run_dir="/nonexistent/run")


@pytest.mark.parametrize("cluster", ["disaggregated", "colocated"])
@pytest.mark.parametrize("experiment", ["blog_sync_1", "blog_sync_2", "blog_async_1", "blog_async_2"])
def test_blog_experiments_compose_with_gpu_layouts(experiment, cluster):
    cfg = _compose([f"+experiment={experiment}", f"cluster={cluster}", "cluster.num_gpus=2"])
    assert cfg.cluster.name == cluster and cfg.mode.name == experiment.split("_")[1]
    plan = plan_placement(cfg.cluster.placement_spec())
    assert len(plan.trainer) == 1 and len(plan.inference) == cfg.inference.replicas
    assert plan.num_gpus == (1 if cluster == "colocated" else 1 + cfg.inference.replicas)


def test_cluster_replicas_follow_inference_replicas():
    """`cluster.inference.replicas` is interpolated from `inference.replicas` (one source of truth)."""
    assert _compose(["cluster=disaggregated", "inference.replicas=3"]).cluster.inference.replicas == 3
    from orchestrator.config import ConfigError

    with pytest.raises(ConfigError, match="cluster.inference.replicas must equal inference.replicas=1"):
        _compose(["cluster=disaggregated", "cluster.inference.replicas=3"])
    # data-parallel trainer ranks (workers/trainer/group.py): 8 ranks compose, one slot each
    eight = _compose(["cluster=disaggregated", "cluster.trainer.gpus_per_node=8"]).cluster
    assert eight.placement_spec().trainer_world_size == 8
