"""Typed config schema of a run, registered in Hydra's ConfigStore, validated where declared.

One module per config group under `configs/` (mode, cluster, model, trainer, inference, rollout,
task, algorithm, logger, async, eval, gateway); each holds its group's dataclass and the mapping from the group
to the settings of the worker it configures (`inference_settings`, `trainer_settings`,
`gateway_config`, `rollout_settings`, ...). `OmegaConf.to_object` turns the composed config into
these dataclasses, which runs each `__post_init__`; a bad value raises `ConfigError` whose message
starts with the dotted key (`rollout.n must be >= 1, got 0`). Validation reads values only; the
file-system checks are orchestrator/control/preflight.py's. One source per setting: a field that
maps onto a worker's settings dataclass takes its default from that dataclass (`defaults.py`
`default_of`), and a value that dataclass checks is checked there only (the group builds the
settings once while validating). Nothing here imports Ray, torch or vLLM (the light settings
modules are imported; heavier worker classes when a mapping function is called), so a bad config
fails in about a second, before any process starts. Choice lists are defined once, in the worker module that gives them
their meaning where that module is light, else in the group's module here.

Modules (one per config group, then what they share):
  mode.py, cluster.py, model.py, trainer.py, inference.py, rollout.py, task.py, algorithm.py,
  logger.py, async_.py, eval.py, gateway.py   the groups of the same names
  run.py           RunConfig (cross-group checks), the group -> schema table, Hydra registration
  defaults.py      `default_of`: a field's default read from the worker settings that own it
  errors.py        ConfigError and the checks every group uses
  finite.py        every float of the composed config is a number (NaN and infinities refused)
  hydra_errors.py  Hydra's own composition failures as `config error:` lines naming the key
  reference.py     the flat reference of every key, default and help (docs/config_reference.md)
"""

from orchestrator.config.algorithm import AlgorithmConfig, RejectionRuleConfig, RolloutCorrectionConfig
from orchestrator.config.async_ import AsyncConfig
from orchestrator.config.cluster import ClusterConfig, InferencePlacementConfig, TrainerPlacementConfig
from orchestrator.config.errors import ConfigError
from orchestrator.config.eval import EvalConfig, eval_rollout_settings, eval_settings
from orchestrator.config.gateway import GatewayGroupConfig, gateway_net
from orchestrator.config.inference import InferenceConfig, inference_settings
from orchestrator.config.logger import LoggerConfig
from orchestrator.config.mode import ModeConfig
from orchestrator.config.model import LoraConfig, ModelConfig, gateway_config, lora_settings
from orchestrator.config.rollout import (AcrConfig, AcrLimitsSchema, RolloutConfig, acr_client_config, acr_region,
                                         buffer_config, pool_limits, rollout_settings)
from orchestrator.config.run import (GROUP_SCHEMAS, RunConfig, async_loop_settings, register, sync_loop_settings,
                                     to_run_config)
from orchestrator.config.task import TaskConfig, sampler_settings
from orchestrator.config.trainer import (TrainerConfig, VerlEngineConfig, WeightSyncConfig, trainer_class,
                                         trainer_settings, verl_settings)
from orchestrator.tasks import TASK_NAMES

__all__ = [
    "AcrConfig", "AcrLimitsSchema", "AlgorithmConfig", "AsyncConfig", "ClusterConfig", "ConfigError", "EvalConfig", "GatewayGroupConfig",
    "GROUP_SCHEMAS", "InferenceConfig", "InferencePlacementConfig", "LoggerConfig", "ModeConfig", "ModelConfig",
    "RejectionRuleConfig", "RolloutConfig", "RolloutCorrectionConfig", "RunConfig", "TASK_NAMES", "TaskConfig",
    "TrainerConfig", "TrainerPlacementConfig", "VerlEngineConfig", "WeightSyncConfig", "acr_client_config", "acr_region",
    "async_loop_settings", "buffer_config", "eval_rollout_settings", "eval_settings", "gateway_config", "gateway_net", "lora_settings", "LoraConfig", "inference_settings", "pool_limits", "register",
    "rollout_settings", "sampler_settings", "sync_loop_settings", "to_run_config", "trainer_class", "trainer_settings",
    "verl_settings",
]
