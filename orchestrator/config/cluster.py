"""`cluster` group: where actors go. Its typed request is workers/core/placement.py's
PlacementSpec (the same module owns the placement modes); the driver places actors with it."""

from __future__ import annotations

from dataclasses import dataclass, field

from orchestrator.config.errors import ConfigError, check, one_of
from workers.core.placement import PLACEMENT_MODES, PlacementSpec


@dataclass
class TrainerPlacementConfig:
    """Trainer GPUs (`cluster.trainer`): `nodes` x `gpus_per_node` ranks, one GPU each (0: CPU, cluster=local)."""

    nodes: int = 1
    gpus_per_node: int = 0


@dataclass
class InferencePlacementConfig:
    """Inference GPUs (`cluster.inference`): `replicas` engines of `tensor_parallel_size` GPUs each.
    `replicas` must equal `inference.replicas` (the cluster yamls interpolate it from there)."""

    replicas: int = 1
    tensor_parallel_size: int = 1


@dataclass
class ClusterConfig:
    """Where actors go (workers/core/placement.py). `name`: local (no GPUs), disaggregated (trainer
    and inference on separate GPUs) or colocated (they share GPUs; inference sleeps during updates).
    `num_cpus` / `num_gpus`: logical CPUs / GPUs of a Ray cluster the driver starts itself (None:
    the machine's; ignored when joining a cluster). `placement_timeout_s`: wait for placement groups.
    `nodes` x `gpus_per_node` GPUs of `gpu_memory_gib` GiB: the hardware a plan is made for
    (`dry_run=true`, orchestrator/planning/dry_run.py; SkyPilot's num_nodes and accelerators); gpus_per_node
    null: the GPUs the placement asks for, on one node. `task_events_max`: task events the GCS of a
    cluster the driver starts keeps (Ray's `task_events_max_num_task_in_gcs`, default 100,000, about
    3 KB each: a long async run makes millions of actor calls and the GCS would grow to ~300 MB
    before Ray starts dropping the oldest; scripts/soak.py measures it). A cluster that is joined
    keeps its own setting (`RAY_task_events_max_num_task_in_gcs` on `ray start`)."""

    name: str = "local"
    address: str | None = None
    num_cpus: int | None = None
    num_gpus: int | None = None
    trainer_replicas: int = 1
    torch_threads: int = 1
    trainer: TrainerPlacementConfig = field(default_factory=TrainerPlacementConfig)
    inference: InferencePlacementConfig = field(default_factory=InferencePlacementConfig)
    placement_timeout_s: float = 60.0
    nodes: int = 1
    gpus_per_node: int | None = None
    gpu_memory_gib: float = 80.0
    task_events_max: int = 10_000

    def __post_init__(self) -> None:
        check(self.nodes >= 1, "cluster.nodes", "must be >= 1", self.nodes)
        check(self.gpus_per_node is None or self.gpus_per_node >= 0, "cluster.gpus_per_node", "must be null or >= 0",
              self.gpus_per_node)
        check(self.task_events_max >= 0, "cluster.task_events_max", "must be >= 0", self.task_events_max)
        check(self.gpu_memory_gib > 0, "cluster.gpu_memory_gib", "must be > 0", self.gpu_memory_gib)
        one_of(self.name, "cluster.name", PLACEMENT_MODES)
        check(self.trainer_replicas == 1, "cluster.trainer_replicas", "must be 1 on a CPU cluster", self.trainer_replicas)
        check(self.torch_threads >= 1, "cluster.torch_threads", "must be >= 1", self.torch_threads)
        check(self.num_gpus is None or self.num_gpus >= 0, "cluster.num_gpus", "must be >= 0", self.num_gpus)
        check(self.placement_timeout_s > 0, "cluster.placement_timeout_s", "must be > 0", self.placement_timeout_s)
        try:
            self.placement_spec()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def placement_spec(self) -> PlacementSpec:
        """The typed request of workers/core/placement.py (raises ValueError naming the key)."""
        return PlacementSpec(mode=self.name, trainer_nodes=self.trainer.nodes,  # type: ignore[arg-type]
                             trainer_gpus_per_node=self.trainer.gpus_per_node,
                             inference_replicas=self.inference.replicas,
                             tensor_parallel_size=self.inference.tensor_parallel_size)
