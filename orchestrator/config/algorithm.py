"""`algorithm` group: advantages, PPO clip and rollout correction. The trainer's settings take
these values (orchestrator/config/trainer.py `trainer_settings`); rollout correction is parsed
and checked once by workers/core/algorithms/rollout_correction_config.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

from orchestrator.config.defaults import default_of
from orchestrator.config.errors import ConfigError, check, one_of
from workers.core.algorithms.loss_modes import LOSS_AGG_MODES
from workers.trainer.settings import TrainerSettings
from workers.core.algorithms.rollout_correction_config import RejectionRule, parse_is_threshold
from workers.core.algorithms.rollout_correction_config import RolloutCorrectionConfig as TypedRolloutCorrection

ALGORITHM_NAMES = ("grpo",)


@dataclass
class RejectionRuleConfig:
    """One rejection rule of `algorithm.rollout_correction.rs`. `name`: one of token_k{1,2,3},
    seq_sum_k{1,2,3}, seq_mean_k{1,2,3}, seq_max_k{2,3}. k2/k3 rules take `threshold` (keep
    stat <= threshold); k1 rules bound the ratio π_old/π_rollout (or its product / geometric mean):
    `lower` and `upper`, or `threshold` C for the band [1/C, C]."""

    name: str = MISSING
    threshold: Optional[float] = None
    lower: Optional[float] = None
    upper: Optional[float] = None


@dataclass
class RolloutCorrectionConfig:
    """Rollout correction between π_rollout, π_old and π_θ (workers/core/algorithms/rollout_correction_config.py).

    mode: decoupled (π_old recomputed; IS weights π_old/π_rollout) | bypass (π_old := π_rollout).
    is_level: token | sequence | null (no IS weights; diagnostics only).
    is_threshold: TIS cap C (> 1), or a quoted IcePop band "lo_hi" (weights outside it are 0).
    rs: rejection rules; a token is trained only if every rule keeps it.
    `typed()` parses and checks them (also at construction) and returns the typed form.
    """

    mode: str = default_of(TypedRolloutCorrection, "mode")
    is_level: Optional[str] = default_of(TypedRolloutCorrection, "is_level")
    is_threshold: Any = default_of(TypedRolloutCorrection, "is_threshold")
    rs: list[RejectionRuleConfig] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.typed()  # parses and checks; writes nothing into this config

    def typed(self) -> TypedRolloutCorrection:
        """The validated, typed settings the trainer takes (`TrainerSettings.rollout_correction`).
        Raises ConfigError naming the key."""
        key = "algorithm.rollout_correction"
        try:
            upper, lower = parse_is_threshold(self.is_threshold, f"{key}.is_threshold")
            rules = tuple(
                RejectionRule.from_spec(
                    r.name, threshold=r.threshold, lower=r.lower, upper=r.upper, key=f"{key}.rs[{i}]"
                )
                for i, r in enumerate(self.rs)
            )
            return TypedRolloutCorrection(
                mode=self.mode, is_level=self.is_level, is_threshold=upper,  # type: ignore[arg-type]
                is_threshold_lower=lower, rs=rules,
            )
        except ConfigError:
            raise
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


@dataclass
class AlgorithmConfig:
    """Advantages and loss. GRPO outcome advantages, PPO clip, token-mean aggregation."""

    name: str = "grpo"
    norm_adv_by_std: bool = True
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    loss_agg_mode: str = default_of(TrainerSettings, "loss_agg_mode")  # passed on by config/trainer.py
    filter_zero_variance: bool = True
    # async mode: a mini-batch that has consumed this many x B filtered groups without B trainable
    # ones stops the run (the policy solved the task, or cannot start it); 0: no cap. verl's
    # dynamic sampling bounds the same loop (DAPO recipe, algorithm.filter_groups.max_num_gen_batches)
    max_gen_batches: int = 10
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)

    def __post_init__(self) -> None:
        one_of(self.name, "algorithm.name", ALGORITHM_NAMES)
        check(0 < self.clip_ratio_low < 1, "algorithm.clip_ratio_low", "must be in (0, 1)", self.clip_ratio_low)
        check(self.clip_ratio_high > 0, "algorithm.clip_ratio_high", "must be > 0", self.clip_ratio_high)
        one_of(self.loss_agg_mode, "algorithm.loss_agg_mode", LOSS_AGG_MODES)
        check(isinstance(self.max_gen_batches, int) and not isinstance(self.max_gen_batches, bool)
              and self.max_gen_batches >= 0, "algorithm.max_gen_batches", "must be an integer >= 0 (0: no cap)",
              self.max_gen_batches)
