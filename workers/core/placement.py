"""GPU placement plan: which placement groups to create and which bundle each actor takes.

Pure logic (no Ray import): `plan_placement` turns what the cluster config asks for into a
`PlacementPlan` (placement-group specs plus one `Slot` per trainer rank and per inference
replica); `check_capacity` compares the plan with the GPUs the Ray cluster reports and raises
`InsufficientGpusError` with the numbers, so a config that asks for too many GPUs fails before
any placement group or actor exists. orchestrator/wiring/placement_groups.py creates the groups and turns a
`Slot` into Ray actor options; orchestrator/main.py asks it for the options of every actor.

Modes:
- "local": no placement groups, no GPUs (actors as on a laptop); the plan is empty.
- "disaggregated": trainer ranks and inference replicas on disjoint GPUs. The trainer gets one
  STRICT_PACK group per trainer node (`gpus_per_node` bundles of 1 GPU, one per rank, so a node's
  ranks share a host); inference gets one group with one bundle of `tensor_parallel_size` GPUs
  per replica (PACK: a bundle never spans hosts; replicas go where Ray finds room).
- "colocated": trainer ranks and inference replicas share GPUs. One STRICT_PACK group per
  trainer node, one 1-GPU bundle per rank; rank r and inference replica r take the same bundle,
  each with `COLOCATED_GPU_SHARE` of it, so both see the same `CUDA_VISIBLE_DEVICES`. The engine
  sleeps while the trainer updates (orchestrator/adapters/colocate.py).

Invariants: every GPU of every bundle is claimed by the slots that point at it (no GPU reserved
and idle, none claimed twice beyond 1.0); disaggregated slots never share a bundle; colocated
slot i of the trainer and of inference point at the same bundle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

PlacementMode = Literal["local", "disaggregated", "colocated"]
PLACEMENT_MODES: tuple[PlacementMode, ...] = ("local", "disaggregated", "colocated")
GroupStrategy = Literal["STRICT_PACK", "PACK"]
COLOCATED_GPU_SHARE = 0.5  # fraction of a GPU each of the two co-located actors asks Ray for (sum = 1)


class InsufficientGpusError(ValueError):
    """The config asks for more GPUs (or bigger per-node groups) than the Ray cluster has."""


@dataclass(frozen=True)
class PlacementSpec:
    """What the config asks for (cluster.trainer.*, cluster.inference.*).

    trainer_nodes × trainer_gpus_per_node trainer ranks (one GPU each); inference_replicas
    engines of tensor_parallel_size GPUs each.
    """

    mode: PlacementMode
    trainer_nodes: int = 1
    trainer_gpus_per_node: int = 1
    inference_replicas: int = 1
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.mode not in PLACEMENT_MODES:
            raise ValueError(f"cluster.name must be one of {list(PLACEMENT_MODES)}, got {self.mode!r}")
        for key, value in (("cluster.trainer.nodes", self.trainer_nodes),
                           ("cluster.inference.replicas", self.inference_replicas),
                           ("cluster.inference.tensor_parallel_size", self.tensor_parallel_size)):
            if value < 1:
                raise ValueError(f"{key} must be >= 1, got {value}")
        if self.mode != "local" and self.trainer_gpus_per_node < 1:
            raise ValueError(f"cluster.trainer.gpus_per_node must be >= 1 with cluster={self.mode}, "
                             f"got {self.trainer_gpus_per_node}")
        if self.mode == "colocated":
            if self.tensor_parallel_size != 1:
                raise ValueError("cluster.inference.tensor_parallel_size must be 1 with cluster=colocated "
                                 f"(a replica shares one GPU with one trainer rank), got {self.tensor_parallel_size}")
            if self.inference_replicas > self.trainer_world_size:
                raise ValueError(f"inference.replicas={self.inference_replicas} must be <= the trainer's "
                                 f"{self.trainer_world_size} GPUs with cluster=colocated (one replica per shared GPU): "
                                 f"set inference.replicas<={self.trainer_world_size}, or give the trainer more GPUs "
                                 f"(cluster.trainer.gpus_per_node x cluster.trainer.nodes = {self.inference_replicas})")

    @property
    def trainer_world_size(self) -> int:
        """Trainer ranks (one GPU each)."""
        return self.trainer_nodes * self.trainer_gpus_per_node

    def describe(self) -> str:
        """The request in words, for error messages."""
        trainer = f"trainer {self.trainer_nodes} node(s) x {self.trainer_gpus_per_node} GPU(s)"
        inference = f"inference {self.inference_replicas} replica(s) x tensor_parallel_size {self.tensor_parallel_size}"
        return f"{trainer}; {inference}"


@dataclass(frozen=True)
class GroupSpec:
    """One placement group to create. bundles: Ray resource dicts, e.g. ({"GPU": 1.0},)."""

    name: str
    bundles: tuple[dict[str, float], ...]
    strategy: GroupStrategy

    @property
    def num_gpus(self) -> float:
        return sum(b.get("GPU", 0.0) for b in self.bundles)


@dataclass(frozen=True)
class Slot:
    """Where one actor goes: bundle `bundle` of group `group` (index into `PlacementPlan.groups`),
    asking Ray for `num_gpus` GPUs of it (Ray then sets the actor's CUDA_VISIBLE_DEVICES)."""

    group: int
    bundle: int
    num_gpus: float


@dataclass(frozen=True)
class PlacementPlan:
    """Groups to create and one slot per trainer rank / inference replica (empty for "local")."""

    spec: PlacementSpec
    groups: tuple[GroupSpec, ...]
    trainer: tuple[Slot, ...]
    inference: tuple[Slot, ...]

    @property
    def num_gpus(self) -> float:
        """GPUs the plan reserves (sum over all bundles)."""
        return sum(g.num_gpus for g in self.groups)


def plan_placement(spec: PlacementSpec) -> PlacementPlan:
    """The placement plan of `spec` (see the module docstring for each mode's layout)."""
    if spec.mode == "local":
        return PlacementPlan(spec, (), (), ())
    gpn = spec.trainer_gpus_per_node
    groups = [GroupSpec(f"trainer-node-{n}", tuple({"GPU": 1.0} for _ in range(gpn)), "STRICT_PACK")
              for n in range(spec.trainer_nodes)]
    rank_bundle = [(r // gpn, r % gpn) for r in range(spec.trainer_world_size)]
    if spec.mode == "disaggregated":
        trainer = tuple(Slot(g, b, 1.0) for g, b in rank_bundle)
        tp = float(spec.tensor_parallel_size)
        groups.append(GroupSpec("inference", tuple({"GPU": tp} for _ in range(spec.inference_replicas)), "PACK"))
        inference = tuple(Slot(len(groups) - 1, i, tp) for i in range(spec.inference_replicas))
    else:  # colocated: replica i shares rank i's GPU
        trainer = tuple(Slot(g, b, COLOCATED_GPU_SHARE) for g, b in rank_bundle)
        inference = tuple(Slot(g, b, COLOCATED_GPU_SHARE) for g, b in rank_bundle[: spec.inference_replicas])
    return PlacementPlan(spec, tuple(groups), trainer, inference)


def check_capacity(plan: PlacementPlan, node_gpus: Sequence[float]) -> None:
    """Raise InsufficientGpusError unless the plan's groups fit on nodes with `node_gpus` GPUs.

    node_gpus: GPUs of each alive node (Ray's "GPU" resource, logical GPUs included). A
    STRICT_PACK group must fit on one node; a PACK group's bundles may go to different nodes.
    Fit is checked first-fit-decreasing (Ray's own placement may still wait for GPUs that other
    jobs hold; orchestrator/wiring/placement_groups.py then times out with the same numbers).
    """
    need = plan.num_gpus
    have = float(sum(node_gpus))
    per_node = [float(g) for g in node_gpus]
    where = f"cluster={plan.spec.mode} needs {need:g} GPUs ({plan.spec.describe()})"
    if need > have:
        raise InsufficientGpusError(
            f"{where}, but the Ray cluster has {have:g} GPUs (per node: {per_node}); lower cluster.trainer.* / "
            "cluster.inference.* or add GPUs (cluster.num_gpus sets logical GPUs of a local cluster)")
    assign_bundles(plan, node_gpus)


@dataclass(frozen=True)
class BundleSite:
    """Where a bundle is expected to land: node index and the GPU indices it takes there."""

    group: int
    bundle: int
    node: int
    gpus: tuple[int, ...]


def assign_bundles(plan: PlacementPlan, node_gpus: Sequence[float]) -> list[BundleSite]:
    """Expected node and GPU indices of every bundle, first-fit-decreasing (a STRICT_PACK group on
    one node, a PACK group's bundles each on one node), as `check_capacity` checks fit. Ray makes
    its own choice among equally good nodes; the counts per node are what this guarantees.
    Raises InsufficientGpusError naming the group that fits on no node."""
    per_node = [float(g) for g in node_gpus]
    where = f"cluster={plan.spec.mode} needs {plan.num_gpus:g} GPUs ({plan.spec.describe()})"
    items: list[tuple[float, str, list[tuple[int, int, float]]]] = []  # (gpus, what, [(group, bundle, gpus)])
    for gi, g in enumerate(plan.groups):
        if g.strategy == "STRICT_PACK":
            items.append((g.num_gpus, f"group {g.name} ({len(g.bundles)} bundles on one node)",
                          [(gi, bi, b.get("GPU", 0.0)) for bi, b in enumerate(g.bundles)]))
        else:
            items.extend((b.get("GPU", 0.0), f"a bundle of group {g.name}", [(gi, bi, b.get("GPU", 0.0))])
                         for bi, b in enumerate(g.bundles))
    free = sorted(per_node, reverse=True)
    order = sorted(range(len(per_node)), key=lambda i: -per_node[i])  # free[j] is node order[j]
    next_gpu = [0] * len(per_node)
    sites: list[BundleSite] = []
    for gpus, what, bundles in sorted(items, key=lambda x: -x[0]):
        fit = next((i for i, f in enumerate(free) if f >= gpus), None)
        if fit is None:
            raise InsufficientGpusError(
                f"{where}: {what} needs {gpus:g} GPUs on one node, but no node has that many free "
                f"(per node: {per_node}, free after packing larger groups: {free})")
        free[fit] -= gpus
        node = order[fit]
        for gi, bi, n in bundles:
            whole = max(1, int(n))
            sites.append(BundleSite(gi, bi, node, tuple(range(next_gpu[node], next_gpu[node] + whole))))
            next_gpu[node] += whole
    return sorted(sites, key=lambda s: (s.group, s.bundle))
