"""The whole run: RunConfig (cross-group checks), the group -> schema table, Hydra registration,
and `to_run_config`, which turns a composed DictConfig into validated dataclasses.

Validation is pure: it reads values only. File-system checks (model dir, chat template, run_dir,
data files, checkpoints) run afterwards in orchestrator/control/preflight.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from orchestrator.config.algorithm import AlgorithmConfig
from orchestrator.config.async_ import AsyncConfig
from orchestrator.config.cluster import ClusterConfig
from orchestrator.config.errors import ConfigError, check, unknown_key
from orchestrator.config.eval import EvalConfig
from orchestrator.config.finite import check_finite
from orchestrator.config.gateway import GatewayGroupConfig
from orchestrator.config.inference import InferenceConfig
from orchestrator.config.logger import LoggerConfig
from orchestrator.config.mode import ModeConfig
from orchestrator.config.model import ModelConfig
from orchestrator.config.rollout import RolloutConfig
from orchestrator.config.task import TaskConfig
from orchestrator.config.trainer import CUDA_WEIGHT_SYNC_BACKENDS, FILE_BACKEND, TrainerConfig
from orchestrator.tasks import TASKS

DEFAULT_REPLICA_RESTARTS = 3  # inference.max_restarts=null where a dead replica can be replaced

if TYPE_CHECKING:
    from orchestrator.loop.async_loop import AsyncLoopSettings
    from orchestrator.loop.sync_loop import SyncLoopSettings


@dataclass
class RunConfig:
    """The whole run. `run_dir`: where metrics.jsonl, summary.json and checkpoints go. `dry_run`:
    print the plan (placement per node and GPU, memory per GPU) and start nothing."""

    mode: ModeConfig = field(default_factory=ModeConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    async_: AsyncConfig = field(default_factory=AsyncConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    gateway: GatewayGroupConfig = field(default_factory=GatewayGroupConfig)
    run_dir: str = MISSING
    seed: int = 0
    dry_run: bool = False  # print the placement and memory plan (orchestrator/planning/dry_run.py) and exit

    def __post_init__(self) -> None:
        groups = self.rollout.batch_size
        check(groups % self.mode.sync_every == 0, "mode.sync_every",
              f"must divide rollout.batch_size={groups} so each mini-batch holds whole groups",
              self.mode.sync_every)
        cap = self.async_.max_concurrent_rollouts
        mini_batch = groups // self.mode.sync_every * self.rollout.n
        check(cap is None or cap >= mini_batch, "async.max_concurrent_rollouts",
              f"must be >= one mini-batch of rollouts (rollout.batch_size / mode.sync_every x rollout.n = "
              f"{mini_batch}), or no mini-batch could ever fill", cap)
        if self.algorithm.name == "grpo" and self.mode.name != "eval":  # eval samples eval.n, trains nothing
            check(self.rollout.n >= 2, "rollout.n", "must be >= 2 for GRPO (a group of one has no baseline)",
                  self.rollout.n)
        check(self.cluster.inference.replicas == self.inference.replicas, "cluster.inference.replicas",
              f"must equal inference.replicas={self.inference.replicas} (set inference.replicas)",
              self.cluster.inference.replicas)
        check(self.rollout.max_tokens < self.inference.max_model_len, "rollout.max_tokens",
              f"must be < inference.max_model_len={self.inference.max_model_len} (rollout={self.rollout.name} sets "
              f"max_tokens, inference={self.inference.name} the context): set rollout.max_tokens below "
              f"{self.inference.max_model_len} or raise inference.max_model_len", self.rollout.max_tokens)
        check(self.trainer.weight_sync.backend not in CUDA_WEIGHT_SYNC_BACKENDS or self.cluster.name != "local",
              "trainer.weight_sync.backend", "needs CUDA GPUs: use cluster=disaggregated or cluster=colocated "
              "(cluster=local runs on CPU; use file, shm or gloo)", self.trainer.weight_sync.backend)
        check(self.inference.name != "vllm" or self.cluster.name != "local", "inference.name",
              "vllm runs on CUDA GPUs: use cluster=disaggregated or cluster=colocated (inference=vllm_cpu on CPU)",
              self.inference.name)
        task = TASKS[self.task.name]
        check(task.agent is not None or task.a2a_agent is None or self.rollout.contract == "a2a"
              or bool(self.rollout.acr.agent_cmd), "rollout.contract",
              f"must be a2a with task={self.task.name}: its agent speaks the A2A contract (or name yours in "
              "rollout.acr.agent_cmd)", self.rollout.contract)
        check(task.agent_for(self.rollout.contract) is not None or self.rollout.name != "local"
              or bool(self.rollout.acr.agent_cmd),
              "rollout.acr.agent_cmd", f"must name your agent's command with task={self.task.name}, "
              f"rollout.contract={self.rollout.contract} and rollout=local "
              "(e.g. rollout.acr.agent_cmd='python examples/agents/arith_agent/app.py')", self.rollout.acr.agent_cmd)
        validating = self.trainer.test_freq > 0 or self.trainer.val_before_train
        check(not validating or self.task.val_split != "test" or TASKS[self.task.name].check_data is None
              or bool(self.task.val_data_path), "task.val_data_path",
              f"must be set to validate task={self.task.name} on its test split (trainer.test_freq)",
              self.task.val_data_path)
        check(self.rollout.top_p == 1.0 or self.trainer.name != "verl", "rollout.top_p",
              "must be 1 with trainer=verl (verl's actor scores the tempered distribution without top-p "
              "truncation, so its log-probs could not match the engine's); use trainer=fsdp", self.rollout.top_p)
        self._check_lora()
        check(self.rollout.concurrency == "fixed" or self.mode.name == "async", "rollout.concurrency",
              f"{self.rollout.concurrency} needs mode=async (the sync loop dispatches whole batches)", self.rollout.concurrency)
        check(not self.inference.max_restarts or self.replica_replaceable, "inference.max_restarts",
              f"must be 0 (or null) with {self._why_not_replaceable()}; a dead replica stops the run there "
              "(resume it with trainer.resume_mode=auto)", self.inference.max_restarts)
        check(self.eval.serve_model or self.mode.name == "eval", "eval.serve_model",
              "can be false only with mode=eval (training needs the served policy)", self.eval.serve_model)

    def _check_lora(self) -> None:
        """`model.lora` runs with trainer=fsdp only; its adapter sync (`inference.lora_sync=adapter`)
        with the file weight sync only (the engines load the adapter as a PEFT directory)."""
        if not self.model.lora.enabled or self.mode.name == "eval":
            return
        check(self.trainer.name == "fsdp", "trainer.name",
              "must be fsdp with model.lora (the verl engine option trains every weight; LoRA through verl is "
              "not supported here)", self.trainer.name)
        check(self.inference.lora_sync == "merged" or self.trainer.weight_sync.backend == "file",
              "trainer.weight_sync.backend", "must be file with model.lora and inference.lora_sync=adapter (the "
              "engines load the adapter from a PEFT directory; the broadcast backends carry full weights only: "
              "use inference.lora_sync=merged with them)", self.trainer.weight_sync.backend)

    @property
    def replica_replaceable(self) -> bool:
        """Whether a dead inference replica can be replaced inside the run: the replacement loads the
        current weights file (file weight sync) on GPUs of its own (not cluster=colocated)."""
        return self.trainer.weight_sync.backend == FILE_BACKEND and self.cluster.name != "colocated"

    def _why_not_replaceable(self) -> str:
        if self.trainer.weight_sync.backend != FILE_BACKEND:
            return (f"trainer.weight_sync.backend={self.trainer.weight_sync.backend} (a broadcast group is formed once "
                    "and cannot take a new member: use trainer.weight_sync.backend=file to replace dead replicas)")
        return ("cluster=colocated (a replica shares its GPUs and sleep/wake cycle with a trainer rank; a "
                "replacement would start outside that cycle)")

    @property
    def replica_restarts(self) -> int:
        """Dead inference replicas replaced over the run: `inference.max_restarts`, or when null
        DEFAULT_REPLICA_RESTARTS where a replica can be replaced and 0 elsewhere."""
        if self.inference.max_restarts is not None:
            return self.inference.max_restarts
        return DEFAULT_REPLICA_RESTARTS if self.replica_replaceable else 0

    @property
    def samples_per_step(self) -> int:
        return self.rollout.batch_size * self.rollout.n


def sync_loop_settings(run: RunConfig) -> SyncLoopSettings:
    """The sync loop's settings (orchestrator/loop/sync_loop.py): mode, steps, group sizes, filtering."""
    from orchestrator.loop.sync_loop import SyncLoopSettings

    return SyncLoopSettings(total_steps=run.trainer.total_steps, batch_size=run.rollout.batch_size, n=run.rollout.n,
                            sync_every=run.mode.sync_every, filter_zero_variance=run.algorithm.filter_zero_variance)


def async_loop_settings(run: RunConfig) -> AsyncLoopSettings:
    """The async loop's settings (orchestrator/loop/async_loop.py): B groups per update, staleness
    bound, and with `rollout.concurrency=fixed` the in-flight cap (`fixed_running_groups`; adaptive /
    aimd: the policy's window instead)."""
    from orchestrator.loop.async_loop import AsyncLoopSettings

    b, eta, n = run.rollout.batch_size // run.mode.sync_every, run.async_.max_staleness, run.rollout.n
    cap = fixed_running_groups(run) if run.rollout.concurrency == "fixed" else None
    return AsyncLoopSettings(
        total_steps=run.trainer.total_steps, groups_per_update=b, n=n, sync_every=run.mode.sync_every,
        max_staleness=eta, on_stale=run.async_.on_stale, filter_zero_variance=run.algorithm.filter_zero_variance,
        max_gen_batches=run.algorithm.max_gen_batches, drain_timeout_s=run.async_.drain_timeout_s, max_running_groups=cap)


def fixed_running_groups(run: RunConfig) -> int:
    """The in-flight cap of `rollout.concurrency=fixed`, in groups: `async.max_concurrent_rollouts`
    / n when set, else (η + 1)·B (orchestrator/loop/staleness.py `fixed_max_running`, B the groups
    per optimizer update). The adaptive policy's cold start too."""
    from orchestrator.loop.staleness import fixed_max_running

    given = run.async_.max_concurrent_rollouts
    if given is not None:
        return given // run.rollout.n
    return fixed_max_running(max_staleness=run.async_.max_staleness,
                             groups_per_update=run.rollout.batch_size // run.mode.sync_every)


def staleness_window_groups(run: RunConfig) -> int:
    """Groups the async loop's staleness budget lets be in flight at once, (η + 1)·k·B
    (orchestrator/loop/staleness.py): the adaptive concurrency's ceiling."""
    return (run.async_.max_staleness + 1) * run.rollout.batch_size


# config group -> its schema; each group's yaml files extend `/schema/<group>` (see configs/)
GROUP_SCHEMAS: dict[str, type] = {
    "mode": ModeConfig, "cluster": ClusterConfig, "model": ModelConfig, "trainer": TrainerConfig,
    "inference": InferenceConfig, "rollout": RolloutConfig, "task": TaskConfig,
    "algorithm": AlgorithmConfig, "logger": LoggerConfig, "async": AsyncConfig, "eval": EvalConfig,
    "gateway": GatewayGroupConfig,
}
TOP_LEVEL_KEYS = ("run_dir", "seed", "dry_run")


def _attr(group: str) -> str:
    return "async_" if group == "async" else group


def register() -> None:
    """Register each group's schema as `schema/<group>` in Hydra's ConfigStore: outside the groups
    themselves, so a schema is never one of a group's choices (`mode=<schema>` would compose a
    config nobody wrote); a group's yaml files extend it with `- /schema/<group>@_here_`."""
    cs = ConfigStore.instance()
    for group, node in GROUP_SCHEMAS.items():
        cs.store(group="schema", name=group, node=node)


def _unwrap(exc: Exception) -> ConfigError:
    cause = exc.__cause__ or exc.__context__
    return cause if isinstance(cause, ConfigError) else ConfigError(str(exc))


def _refuse_unknown_keys(node: Any, obj: Any, where: str) -> None:
    """A key the schema does not declare (e.g. a typo added with `+`) is an error, not ignored."""
    names = [f.name for f in dataclasses.fields(obj)]
    unknown = sorted(k for k in node.keys() if k not in names)
    if unknown:
        raise ConfigError(unknown_key(f"{where}.{unknown[0]}", names))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value) and f.name in node and OmegaConf.is_dict(node[f.name]):
            _refuse_unknown_keys(node[f.name], value, f"{where}.{f.name}")


def to_run_config(cfg: DictConfig) -> RunConfig:
    """Build and validate the typed config. Raises ConfigError naming the key on a bad value.
    Reads values only (no file system); orchestrator/control/preflight.py runs the file checks."""
    check_finite(cfg, GROUP_SCHEMAS)  # NaN and inf pass every `x <= 0` check below: refused first, in one place
    parts: dict[str, Any] = {}
    for group, schema in GROUP_SCHEMAS.items():
        if group not in cfg:
            raise ConfigError(f"{group}: config group missing from the composed config")
        try:
            obj = OmegaConf.to_object(cfg[group])
        except ConfigError:
            raise
        except Exception as exc:  # omegaconf wraps __post_init__ errors and type errors
            raise _unwrap(exc) from None
        if not isinstance(obj, schema):
            raise ConfigError(f"{group}: does not extend /schema/{group} (got {type(obj).__name__})")
        _refuse_unknown_keys(cfg[group], obj, group)
        parts[_attr(group)] = obj
    unknown = sorted(set(cfg.keys()) - set(GROUP_SCHEMAS) - set(TOP_LEVEL_KEYS) - {"hydra", "experiment"})
    if unknown:
        raise ConfigError(unknown_key(unknown[0], [*GROUP_SCHEMAS, *TOP_LEVEL_KEYS]))
    if "run_dir" not in cfg or OmegaConf.is_missing(cfg, "run_dir") or not str(cfg.run_dir or "").strip():
        raise ConfigError("run_dir must be set (a directory path; empty would write into the current directory)")
    dry_run = cfg.get("dry_run", False)
    if not isinstance(dry_run, bool):
        raise ConfigError(f"dry_run must be true or false, got {dry_run!r}")
    return RunConfig(**parts, run_dir=str(cfg.run_dir), seed=int(cfg.seed), dry_run=dry_run)
