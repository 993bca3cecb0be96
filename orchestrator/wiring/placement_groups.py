"""Thin Ray wrapper over workers/core/placement.py: check capacity, create the placement groups,
and give each trainer rank / inference replica its actor options.

Invariant: no placement group is created unless `check_capacity` passed on the GPUs the live
cluster reports, and `PlacedGroups.remove()` removes every group this object created (the driver
calls it on every exit path). For "local" there are no groups and the options are empty, so
actors are created exactly as without placement.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from workers.core.placement import InsufficientGpusError, PlacementPlan, Slot, check_capacity, plan_placement

DEFAULT_READY_TIMEOUT_S = 60.0  # a group that cannot be placed in this long means GPUs are held elsewhere


def node_gpus() -> list[float]:
    """GPUs ("GPU" resource, logical ones included) of every alive node of the connected cluster."""
    return [float(n["Resources"].get("GPU", 0.0)) for n in ray.nodes() if n.get("Alive")]


@dataclass
class PlacedGroups:
    """The created placement groups of a plan, and the actor options of each slot."""

    plan: PlacementPlan
    groups: list[PlacementGroup] = field(default_factory=list)

    @classmethod
    def create(cls, plan: PlacementPlan, *, ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S) -> "PlacedGroups":
        """Check capacity against the live cluster, create the groups and wait until all are placed.

        Raises InsufficientGpusError (with the numbers) before creating anything when the cluster
        is too small, or after `ready_timeout_s` when Ray cannot place a group (the created groups
        are removed first).
        """
        check_capacity(plan, node_gpus())
        placed = cls(plan)
        try:
            for spec in plan.groups:
                placed.groups.append(placement_group([dict(b) for b in spec.bundles], strategy=spec.strategy,
                                                     name=spec.name))
            for spec, pg in zip(plan.groups, placed.groups):
                ready, _ = ray.wait([pg.ready()], timeout=ready_timeout_s)
                if not ready:
                    raise InsufficientGpusError(
                        f"placement group {spec.name} ({spec.num_gpus:g} GPUs, {spec.strategy}) was not placed "
                        f"within {ready_timeout_s:g} s; cluster GPUs per node: {node_gpus()}, available now: "
                        f"{ray.available_resources().get('GPU', 0.0):g} (other jobs may hold them)")
        except BaseException:
            placed.remove()
            raise
        return placed

    def trainer_options(self, rank: int) -> dict[str, Any]:
        """`.options(...)` kwargs of trainer rank `rank` ({} for cluster=local)."""
        return self._options(self.plan.trainer, rank, "trainer rank")

    def inference_options(self, replica: int) -> dict[str, Any]:
        """`.options(...)` kwargs of inference replica `replica` ({} for cluster=local)."""
        return self._options(self.plan.inference, replica, "inference replica")

    def remove(self) -> None:
        """Remove every group created here; safe to call twice."""
        groups, self.groups = self.groups, []
        for pg in groups:
            remove_placement_group(pg)

    def _options(self, slots: tuple[Slot, ...], index: int, what: str) -> dict[str, Any]:
        if not self.plan.groups:
            return {}
        if not 0 <= index < len(slots):
            raise IndexError(f"{what} {index} is outside the plan's {len(slots)} slots")
        slot = slots[index]
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=self.groups[slot.group], placement_group_bundle_index=slot.bundle,
            placement_group_capture_child_tasks=False)  # vLLM/torch children are processes, not Ray tasks
        return {"scheduling_strategy": strategy, "num_gpus": slot.num_gpus}


def place(cluster: Any) -> PlacedGroups:
    """What orchestrator/wiring/runtime.py calls: the placement of a `ClusterConfig` (orchestrator/config/cluster.py),
    checked against the connected cluster and created. Raises InsufficientGpusError as `create`."""
    return PlacedGroups.create(plan_placement(cluster.placement_spec()), ready_timeout_s=cluster.placement_timeout_s)
