"""Typed rollout-correction settings: mode, IS weights, rejection rules. No torch, no Ray.

Imported by the Hydra schema (`orchestrator/config/algorithm.py`, which must load without torch), by the
trainer's `TrainerSettings`, and by `rollout_correction.py`, which applies them.

Invariant: once a `RolloutCorrectionConfig` exists, every threshold is a validated float; nothing
downstream parses strings. The one string form users may write, the IcePop band "lo_hi" of
`is_threshold`, is parsed once by `parse_is_threshold` while the config is validated.

Semantics (ratio r = π_old / π_rollout per token; in bypass mode π_old := π_θ before the step):
- IS weights, level "token": w_t = r_t; level "sequence": w = Π_t r_t on every token of the row.
  TIS (`is_threshold_lower` None): w <- min(w, C). IcePop band: w <- 0 outside [lower, upper].
- Rejection rules (all must pass for a token to stay in the loss): k1 = -log r, k2 = ½(log r)²,
  k3 = r - 1 - log r (Schulman's KL estimators of KL(π_rollout || π_old)), per token (`token_*`)
  or per row as the masked sum, mean or max (`seq_sum_*`, `seq_mean_*`, `seq_max_*`); a row
  statistic keeps or rejects the whole row. k2/k3 rules keep stat <= threshold. k1 rules bound the
  ratio: lower <= r <= upper (token), lower <= Π r <= upper (seq_sum), lower <= (Π r)^(1/n) <= upper
  (seq_mean). verl 0.9.1 applies its k1 band to 1/r instead; the two agree when lower = 1/upper.
Source: verl 0.9.1 `verl/trainer/ppo/rollout_corr_helper.py`; Yao et al. 2025 (TIS); IcePop
(Ling team 2025); Schulman 2020, "Approximating KL divergence" (k1, k2, k3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, get_args

RolloutCorrectionMode = Literal["decoupled", "bypass"]
IsLevel = Literal["token", "sequence"]
RejectionName = Literal[
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
]
MODES: tuple[str, ...] = get_args(RolloutCorrectionMode)
IS_LEVELS: tuple[str, ...] = get_args(IsLevel)
REJECTION_NAMES: tuple[str, ...] = get_args(RejectionName)
KEY = "algorithm.rollout_correction"  # dotted prefix of every error message


def _positive_finite(value: object, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{key} must be a number, got {value!r}")
    v = float(value)
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"{key} must be a finite number > 0, got {value!r}")
    return v


@dataclass(frozen=True)
class RejectionRule:
    """One rejection mask (MIS). `name` picks estimator and statistic (module docstring).

    k1 rules: keep lower <= ratio statistic <= upper (both required, 0 < lower <= upper).
    k2/k3 rules: keep statistic <= upper (lower must be None).
    Raises ValueError naming `key` (set by the caller for messages) on a bad value.
    """

    name: RejectionName
    upper: float
    lower: float | None = None
    key: str = field(default=f"{KEY}.rs", compare=False, repr=False)  # dotted key for error messages

    def __post_init__(self) -> None:
        if self.name not in REJECTION_NAMES:
            raise ValueError(f"{self.key}.name must be one of {list(REJECTION_NAMES)}, got {self.name!r}")
        _positive_finite(self.upper, f"{self.key}.upper")
        if self.is_k1:
            if self.lower is None:
                raise ValueError(f"{self.key}.lower is required for {self.name} (a ratio band lower <= r <= upper)")
            _positive_finite(self.lower, f"{self.key}.lower")
            if self.lower > self.upper:
                raise ValueError(f"{self.key}.lower must be <= upper={self.upper}, got {self.lower!r}")
        elif self.lower is not None:
            raise ValueError(f"{self.key}.lower is only for k1 rules; {self.name} keeps stat <= threshold")

    @property
    def is_k1(self) -> bool:
        return self.name.endswith("k1")

    @property
    def level(self) -> Literal["token", "sequence"]:
        return "token" if self.name.startswith("token_") else "sequence"

    @classmethod
    def from_spec(
        cls,
        name: str,
        *,
        threshold: float | None = None,
        lower: float | None = None,
        upper: float | None = None,
        key: str = f"{KEY}.rs",
    ) -> RejectionRule:
        """Build from config fields: `threshold` alone, or (k1 only) `lower` and `upper`.

        k1 with `threshold` C means the symmetric band [1/C, C] (C >= 1); k2/k3 take `threshold`.
        Raises ValueError naming `key` when the fields do not fit the rule.
        """
        if name not in REJECTION_NAMES:
            raise ValueError(f"{key}.name must be one of {list(REJECTION_NAMES)}, got {name!r}")
        if threshold is not None and (lower is not None or upper is not None):
            raise ValueError(f"{key}: give either threshold or lower/upper, not both")
        if name.endswith("k1"):
            if threshold is not None:
                c = _positive_finite(threshold, f"{key}.threshold")
                if c < 1.0:
                    raise ValueError(
                        f"{key}.threshold of {name} is the band [1/C, C] and must be >= 1, got {threshold!r}"
                    )
                return cls(name=name, lower=1.0 / c, upper=c, key=key)  # type: ignore[arg-type]
            if lower is None or upper is None:
                raise ValueError(f"{key}: {name} needs threshold, or both lower and upper")
            return cls(name=name, lower=_positive_finite(lower, f"{key}.lower"),  # type: ignore[arg-type]
                       upper=_positive_finite(upper, f"{key}.upper"), key=key)
        if lower is not None or upper is not None:
            raise ValueError(f"{key}: {name} takes a single threshold (keep stat <= threshold), not lower/upper")
        if threshold is None:
            raise ValueError(f"{key}.threshold is required for {name}")
        return cls(name=name, upper=_positive_finite(threshold, f"{key}.threshold"), key=key)  # type: ignore[arg-type]


def parse_is_threshold(value: object, key: str = f"{KEY}.is_threshold") -> tuple[float, float | None]:
    """(upper, lower) from a TIS cap C (number, or a numeric string) or an IcePop band "lo_hi".

    Raises ValueError naming `key`: not a number or band, non-positive, lo > hi, or a bool.
    YAML reads an unquoted `0.5_2` as the number 0.52; quote bands ("0.5_2.0").
    """
    if isinstance(value, bool):
        raise ValueError(f"{key} must be a number or a 'lo_hi' band string, got {value!r}")
    if isinstance(value, (int, float)):
        return _positive_finite(value, key), None
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{key} must be a number or a 'lo_hi' band string, got {value!r}")
    spec = value.strip()
    if "_" not in spec:
        try:
            return _positive_finite(float(spec), key), None
        except ValueError:
            raise ValueError(f"{key} must be a number or a 'lo_hi' band string, got {value!r}") from None
    lo_s, hi_s = spec.split("_", 1)
    try:
        lo, hi = float(lo_s), float(hi_s)
    except ValueError:
        raise ValueError(f"{key} band must be 'lo_hi' with two numbers (e.g. '0.5_2.0'), got {value!r}") from None
    lo, hi = _positive_finite(lo, key), _positive_finite(hi, key)
    if lo > hi:
        raise ValueError(f"{key} band lower bound must be <= upper, got {value!r}")
    return hi, lo


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """How the trainer corrects for π_rollout != π_old (see the module docstring for the math).

    mode: "decoupled" (π_old recomputed before each update; PPO ratio π_θ/π_old; IS weights
        π_old/π_rollout multiply the loss) or "bypass" (π_old := π_rollout, no recompute; PPO
        ratio π_θ/π_rollout; IS weights are reported but not applied, as verl's ppo_clip bypass).
    is_level: "token", "sequence", or None (no weights; diagnostics only).
    is_threshold: TIS cap C (> 1), or the band's upper bound when is_threshold_lower is set.
    is_threshold_lower: IcePop band lower bound (weights outside [lower, upper] become 0).
    rs: rejection rules, all of which must pass for a token to be trained.
    """

    mode: RolloutCorrectionMode = "decoupled"
    is_level: IsLevel | None = "token"
    is_threshold: float = 2.0
    is_threshold_lower: float | None = None
    rs: tuple[RejectionRule, ...] = ()

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"{KEY}.mode must be one of {list(MODES)}, got {self.mode!r}")
        if self.is_level is not None and self.is_level not in IS_LEVELS:
            raise ValueError(f"{KEY}.is_level must be one of {list(IS_LEVELS)} or None, got {self.is_level!r}")
        _positive_finite(self.is_threshold, f"{KEY}.is_threshold")
        if self.is_threshold_lower is None:
            if self.is_threshold <= 1.0:
                raise ValueError(
                    f"{KEY}.is_threshold (TIS cap C) must be > 1, got {self.is_threshold!r}; "
                    "for an IcePop band write a quoted 'lo_hi' string such as '0.5_2.0'"
                )
        else:
            _positive_finite(self.is_threshold_lower, f"{KEY}.is_threshold")
            if self.is_threshold_lower > self.is_threshold:
                raise ValueError(f"{KEY}.is_threshold band lower bound must be <= upper, got "
                                 f"{self.is_threshold_lower}_{self.is_threshold}")
        if not isinstance(self.rs, tuple) or not all(isinstance(r, RejectionRule) for r in self.rs):
            raise ValueError(f"{KEY}.rs must be a tuple of RejectionRule, got {self.rs!r}")
        names = [r.name for r in self.rs]
        if len(set(names)) != len(names):
            raise ValueError(f"{KEY}.rs names each rule at most once, got {names}")

    @property
    def is_band(self) -> bool:
        """True for IcePop (zero outside the band), False for TIS (cap at C)."""
        return self.is_threshold_lower is not None

    @property
    def applies_weights(self) -> bool:
        """Whether IS weights multiply the loss (decoupled mode with an IS level)."""
        return self.mode == "decoupled" and self.is_level is not None
