"""Rollout correction: importance weights between π_old (trainer) and π_rollout (inference engine).

Pure torch. The trainer calls `compute_rollout_correction` once per mini-batch, after recomputing
π_old (decoupled mode: three policies π_rollout, π_old, π_θ), and multiplies the PPO loss by the
returned weights.

Implemented now: token-level truncated importance sampling (TIS),
    w_t = min(exp(log π_old(y_t) - log π_rollout(y_t)), C),   detached, 0 off the loss mask,
with the log ratio clamped to ±20 before exp (Yao et al. 2025, "Your efficient RL framework secretly
brings you off-policy RL training", fengyao.notion.site/off-policy-rl; verl 0.9.1
`verl/trainer/ppo/rollout_corr_helper.py::compute_rollout_correction_weights`, rollout_is="token").

Room to grow without changing callers: `RolloutCorrectionConfig.is_level` (later "sequence"),
rejection masks (the returned `loss_mask` is where they will be applied; today it is the input
mask), and bypass mode (π_old := π_rollout, weights 1) are config fields of their own.

Metric names are verl's, with the `rollout_corr/` prefix: rollout_is_{mean,max,min,std,
eff_sample_size,ratio_fraction_high,ratio_fraction_low,seq_mean,seq_std,seq_max,seq_min,
seq_max_deviation,seq_fraction_high,seq_fraction_low} and the off-policy diagnostics training_ppl,
training_log_ppl, kl, k3_kl, rollout_ppl, rollout_log_ppl, log_ppl_diff, log_ppl_abs_diff,
log_ppl_diff_max, log_ppl_diff_min, ppl_ratio, chi2_token, chi2_seq.
One deliberate difference: sequence-level statistics skip rows with no trained token (verl counts
such a row as a sequence with weight 0 and log-prob 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from orchestrator.algorithms.losses import masked_mean, masked_sum

IsLevel = Literal["token"]
IS_LEVELS: tuple[IsLevel, ...] = ("token",)
SAFETY_BOUND = 20.0  # |log ratio| bound before exp, as verl; exp(20) ≈ 4.9e8
METRIC_PREFIX = "rollout_corr/"


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """is_level: aggregation of the IS weight (None: no weights, diagnostics only).
    is_threshold: truncation C of the weights (TIS), > 1.
    """

    is_level: IsLevel | None = "token"
    is_threshold: float = 2.0

    def __post_init__(self) -> None:
        if self.is_level is not None and self.is_level not in IS_LEVELS:
            raise ValueError(f"rollout_correction.is_level must be one of {IS_LEVELS} or None, got {self.is_level!r}")
        if not (math.isfinite(self.is_threshold) and self.is_threshold > 1.0):
            raise ValueError(f"rollout_correction.is_threshold must be a finite number > 1, got {self.is_threshold}")


@dataclass(frozen=True)
class RolloutCorrection:
    """Result for one mini-batch.

    weights: [batch, seq] detached IS weights (0 off the mask), or None when is_level is None.
    loss_mask: [batch, seq] the mask to train with (rejection masks will narrow it; today = input).
    metrics: `rollout_corr/*` scalars.
    """

    weights: torch.Tensor | None
    loss_mask: torch.Tensor
    metrics: dict[str, float]


def truncated_is_weights(
    log_ratio: torch.Tensor, loss_mask: torch.Tensor, threshold: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token TIS weights.

    Args:
        log_ratio: [batch, seq] log π_old - log π_rollout.
        loss_mask: [batch, seq] 1 on trained tokens.
        threshold: C; weights above it are set to C.

    Returns:
        (weights, raw_weights), both [batch, seq], detached, 0 off the mask; raw is before truncation.
    """
    with torch.no_grad():
        raw = torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND)) * loss_mask
        return raw.clamp(max=threshold), raw


def is_weight_metrics(
    weights: torch.Tensor, raw_weights: torch.Tensor, loss_mask: torch.Tensor, threshold: float
) -> dict[str, float]:
    """Statistics of token IS weights (verl `compute_is_metrics`, token level), unprefixed names.

    Fractions high/low compare the raw weights with C and 1/C; mean, max, min, std and ESS use the
    applied weights; ESS = 1 / mean((w / mean w)^2) over trained tokens (Kong 1992 normalised form).
    """
    lower = 1.0 / threshold
    m: dict[str, float] = {
        "rollout_is_mean": masked_mean(weights, loss_mask).item(),
        "rollout_is_ratio_fraction_high": masked_mean((raw_weights > threshold).float(), loss_mask).item(),
        "rollout_is_ratio_fraction_low": masked_mean((raw_weights < lower).float(), loss_mask).item(),
    }
    on = loss_mask.bool()
    m["rollout_is_max"] = weights.masked_fill(~on, float("-inf")).max().item()
    m["rollout_is_min"] = weights.masked_fill(~on, float("inf")).min().item()
    bounded = weights.clamp(min=0.0, max=threshold)
    mean_w = masked_mean(bounded, loss_mask)
    if loss_mask.sum() > 1:
        var = masked_mean(bounded.square(), loss_mask) - mean_w.square()
        m["rollout_is_std"] = torch.sqrt(torch.clamp(var, min=0.0)).item()
    else:
        m["rollout_is_std"] = 0.0
    normalised = bounded / (mean_w + 1e-8)
    m["rollout_is_eff_sample_size"] = 1.0 / masked_mean(normalised.square(), loss_mask).item()

    rows = loss_mask.sum(dim=-1) > 0  # sequence statistics over rows that train at least one token
    seq_w = masked_mean(weights, loss_mask, dim=-1)[rows]
    raw_seq_w = masked_mean(raw_weights, loss_mask, dim=-1)[rows]
    m["rollout_is_seq_mean"] = seq_w.mean().item()
    m["rollout_is_seq_std"] = seq_w.std().item() if seq_w.numel() > 1 else 0.0
    m["rollout_is_seq_max"] = seq_w.max().item()
    m["rollout_is_seq_min"] = seq_w.min().item()
    m["rollout_is_seq_max_deviation"] = (seq_w - 1.0).abs().max().item()
    m["rollout_is_seq_fraction_high"] = (raw_seq_w > threshold).float().mean().item()
    m["rollout_is_seq_fraction_low"] = (raw_seq_w < lower).float().mean().item()
    return m


def offpolicy_metrics(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor
) -> dict[str, float]:
    """Gap between trainer and rollout policies (verl `compute_offpolicy_metrics`), unprefixed names.

    kl = mean(log π_rollout - log π_old) (k1 of KL(π_rollout || π_old));
    k3_kl = mean(ρ - log ρ - 1) with ρ = π_old / π_rollout (Schulman's k3 estimator);
    *_ppl = batch mean of per-sequence exp(-mean token log-prob); log_ppl_diff = per-sequence
    mean log π_rollout - mean log π_old; chi2_token = E[ρ²] - 1; chi2_seq = E_seq[(Πρ)²] - 1.
    """
    with torch.no_grad():
        rows = loss_mask.sum(dim=-1) > 0
        mean_lp_old = masked_mean(old_logprobs, loss_mask, dim=-1)[rows]
        mean_lp_rollout = masked_mean(rollout_logprobs, loss_mask, dim=-1)[rows]
        log_ratio = old_logprobs - rollout_logprobs
        log_ppl_diff = mean_lp_rollout - mean_lp_old
        rho = torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND))
        seq_log_ratio = masked_sum(log_ratio, loss_mask, dim=-1)[rows]
        seq_log_ratio = torch.clamp(seq_log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND)
        return {
            "training_ppl": torch.exp(-mean_lp_old).mean().item(),
            "training_log_ppl": (-mean_lp_old).mean().item(),
            "kl": masked_mean(rollout_logprobs - old_logprobs, loss_mask).item(),
            "k3_kl": masked_mean(torch.exp(log_ratio) - log_ratio - 1, loss_mask).item(),
            "rollout_ppl": torch.exp(-mean_lp_rollout).mean().item(),
            "rollout_log_ppl": (-mean_lp_rollout).mean().item(),
            "log_ppl_diff": log_ppl_diff.mean().item(),
            "log_ppl_abs_diff": log_ppl_diff.abs().mean().item(),
            "log_ppl_diff_max": log_ppl_diff.max().item(),
            "log_ppl_diff_min": log_ppl_diff.min().item(),
            "ppl_ratio": torch.exp(log_ppl_diff).mean().item(),
            "chi2_token": (masked_mean(rho.square(), loss_mask) - 1.0).item(),
            "chi2_seq": (torch.exp(2.0 * seq_log_ratio).mean() - 1.0).item(),
        }


def compute_rollout_correction(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: RolloutCorrectionConfig,
) -> RolloutCorrection:
    """IS weights, training mask and `rollout_corr/*` metrics for one mini-batch.

    Args:
        old_logprobs: [batch, seq] log π_old, recomputed by the trainer (no grad needed).
        rollout_logprobs: [batch, seq] log π_rollout from the inference engine.
        loss_mask: [batch, seq] 1 on trained tokens.
        cfg: weight level and truncation.

    Raises:
        ValueError: shapes differ, or the mask has no trained token.
    """
    if old_logprobs.shape != rollout_logprobs.shape or old_logprobs.shape != loss_mask.shape:
        raise ValueError(
            f"old_logprobs {tuple(old_logprobs.shape)}, rollout_logprobs {tuple(rollout_logprobs.shape)} "
            f"and loss_mask {tuple(loss_mask.shape)} must have the same shape"
        )
    if not bool(loss_mask.any()):
        raise ValueError("loss_mask has no trained token; rollout correction needs at least one")
    old_logprobs = old_logprobs.detach()
    metrics: dict[str, float] = {}
    weights = None
    if cfg.is_level == "token":
        weights, raw = truncated_is_weights(old_logprobs - rollout_logprobs, loss_mask, cfg.is_threshold)
        metrics.update(is_weight_metrics(weights, raw, loss_mask, cfg.is_threshold))
    metrics.update(offpolicy_metrics(old_logprobs, rollout_logprobs, loss_mask))
    return RolloutCorrection(
        weights=weights,
        loss_mask=loss_mask,
        metrics={METRIC_PREFIX + k: float(v) for k, v in metrics.items()},
    )
