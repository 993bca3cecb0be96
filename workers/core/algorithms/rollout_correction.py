"""Rollout correction: IS weights, rejection masks and diagnostics between π_old and π_rollout.

Pure torch. The trainer calls `compute_rollout_correction` once per mini-batch with π_old
(decoupled mode) or π_θ before the step (bypass mode) as `old_logprobs`; it multiplies the PPO loss
by the returned weights (decoupled mode only) and trains on the returned, narrowed loss mask.
Settings and their math live in `rollout_correction_config.py` (typed, validated, torch-free).

With r_t = π_old(y_t) / π_rollout(y_t), every log ratio clamped to ±20 before exp (as verl):
- IS weights (Yao et al. 2025, fengyao.notion.site/off-policy-rl; IcePop): token level w_t = r_t,
  sequence level w = Π_t r_t on each token of the row; TIS caps at C, an IcePop band zeroes
  weights outside [lower, upper]. Detached; 0 off the mask.
- Rejection masks (MIS): per rule, the k1/k2/k3 statistic per token or per row (sum, mean, max);
  a token is kept only when every rule passes. The returned loss_mask = input mask × keep.
- Diagnostics (`offpolicy_metrics`): KL, k3 KL, perplexities, χ².

Parity: weights, masks and metrics equal verl 0.9.1 `verl/trainer/ppo/rollout_corr_helper.py`
(`compute_rollout_correction_and_rejection_mask`) for reciprocal-symmetric thresholds;
tests/test_rollout_correction_parity.py checks every option. Two deliberate differences:
1. k1 bands bound r itself (lower <= r <= upper), as documented; verl bounds 1/r. Metrics report
   verl's statistic k1 = -log r, so its band is [-log upper, -log lower] in metric space.
2. Sequence statistics skip rows with no trained token (verl counts such a row as a sequence with
   weight 1, statistic 0, and as unmasked in `rollout_rs_seq_masked_fraction`).
3. When an IcePop band zeroes every weight, rollout_is_eff_sample_size is 0 (verl divides by 0).

Metric names are verl's, with the `rollout_corr/` prefix: rollout_is_{mean,max,min,std,
eff_sample_size,ratio_fraction_high,ratio_fraction_low,seq_mean,seq_std,seq_max,seq_min,
seq_max_deviation,seq_fraction_high,seq_fraction_low} (+ rollout_is_oob_ratio for a band);
rollout_rs_{name}_{mean,max,min,fraction_high,fraction_low,std,seq_mean,seq_std,seq_max,seq_min,
seq_max_deviation,seq_fraction_high[,seq_fraction_low],masked_fraction,seq_masked_fraction} per rule
and rollout_rs_masked_fraction, rollout_rs_seq_masked_fraction overall; training_ppl,
training_log_ppl, kl, k3_kl, rollout_ppl, rollout_log_ppl, log_ppl_diff, log_ppl_abs_diff,
log_ppl_diff_max, log_ppl_diff_min, ppl_ratio, chi2_token, chi2_seq.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from workers.core.algorithms.losses import masked_mean, masked_sum
from workers.core.algorithms.rollout_correction_config import (
    IS_LEVELS,
    REJECTION_NAMES,
    IsLevel,
    RejectionRule,
    RolloutCorrectionConfig,
)

__all__ = [
    "IS_LEVELS", "REJECTION_NAMES", "IsLevel", "RejectionRule", "RolloutCorrectionConfig", "RolloutCorrection",
    "compute_rollout_correction", "importance_weights", "truncated_is_weights", "rejection_mask",
    "offpolicy_metrics", "is_weight_metrics",
]

SAFETY_BOUND = 20.0  # |log ratio| bound before exp, as verl; exp(20) ≈ 4.9e8
METRIC_PREFIX = "rollout_corr/"


@dataclass(frozen=True)
class RolloutCorrection:
    """Result for one mini-batch.

    weights: [batch, seq] detached IS weights (0 off the mask), or None when is_level is None.
    loss_mask: [batch, seq] the mask to train with: the input mask times every rejection rule's keep.
    metrics: `rollout_corr/*` scalars (computed on the input mask, as verl).
    """

    weights: torch.Tensor | None
    loss_mask: torch.Tensor
    metrics: dict[str, float]


# --- importance weights ---------------------------------------------------------------------


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
    cfg = RolloutCorrectionConfig(is_level="token", is_threshold=threshold)
    weights, raw, _ = importance_weights(log_ratio, loss_mask, cfg)
    return weights, raw


def importance_weights(
    log_ratio: torch.Tensor, loss_mask: torch.Tensor, cfg: RolloutCorrectionConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """IS weights at cfg.is_level, truncated (TIS) or banded (IcePop).

    Args:
        log_ratio: [batch, seq] log π_old - log π_rollout.
        loss_mask: [batch, seq] 1 on trained tokens.
        cfg: is_level (not None) and thresholds.

    Returns:
        (weights, raw_weights, log_ratio_for_metrics): weights and raw [batch, seq], detached, 0 off
        the mask; log_ratio_for_metrics is log_ratio (token) or the row sums [batch, 1] (sequence),
        unclamped. Source: verl `compute_rollout_correction_weights`.

    Raises:
        ValueError: cfg.is_level is None.
    """
    if cfg.is_level is None:
        raise ValueError("importance_weights needs an is_level ('token' or 'sequence')")
    with torch.no_grad():
        log_ratio = log_ratio.detach()
        if cfg.is_level == "token":
            for_metrics = log_ratio
            raw = torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND))
        else:
            for_metrics = masked_sum(log_ratio, loss_mask, dim=-1).unsqueeze(-1)
            raw = torch.exp(torch.clamp(for_metrics, min=-SAFETY_BOUND, max=SAFETY_BOUND)).expand_as(log_ratio)
        raw = raw * loss_mask
        if cfg.is_threshold_lower is None:
            weights = raw.clamp(max=cfg.is_threshold)
        else:
            inside = (raw >= cfg.is_threshold_lower) & (raw <= cfg.is_threshold)
            weights = torch.where(inside, raw, torch.zeros_like(raw))
        return weights, raw, for_metrics


def is_weight_metrics(
    weights: torch.Tensor,
    raw_weights: torch.Tensor,
    log_ratio_for_metrics: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: RolloutCorrectionConfig,
) -> dict[str, float]:
    """Statistics of IS weights (verl `compute_is_metrics`), unprefixed names.

    Token level: mean, max, min of the applied weights; fractions high/low compare raw weights with
    the upper bound and the lower bound (band lower, or 1/C for TIS). Sequence level: max/min are
    exp of the largest/smallest row log-ratio sum, fractions compare row sums with log bounds.
    Both: std and ESS = 1 / mean((w / mean w)^2) over trained tokens of the weights clamped to
    [0, upper] (Kong 1992 normalised form); per-row means of the weights (seq_*).
    """
    upper = cfg.is_threshold
    lower = 1.0 / upper if cfg.is_threshold_lower is None else cfg.is_threshold_lower
    on = loss_mask.bool()
    rows = loss_mask.sum(dim=-1) > 0  # sequence statistics over rows that train at least one token
    m: dict[str, float] = {"rollout_is_mean": masked_mean(weights, loss_mask).item()}
    if cfg.is_level == "sequence":
        seq_log = log_ratio_for_metrics.squeeze(-1)[rows]
        m["rollout_is_max"] = torch.exp(torch.clamp(seq_log.max(), max=SAFETY_BOUND)).item()
        m["rollout_is_min"] = torch.exp(seq_log.min()).item()
        m["rollout_is_ratio_fraction_high"] = (seq_log > math.log(upper)).float().mean().item()
        m["rollout_is_ratio_fraction_low"] = (seq_log < math.log(lower)).float().mean().item()
    else:
        m["rollout_is_ratio_fraction_high"] = masked_mean((raw_weights > upper).float(), loss_mask).item()
        m["rollout_is_ratio_fraction_low"] = masked_mean((raw_weights < lower).float(), loss_mask).item()
        m["rollout_is_max"] = weights.masked_fill(~on, float("-inf")).max().item()
        m["rollout_is_min"] = weights.masked_fill(~on, float("inf")).min().item()
    bounded = weights.clamp(min=0.0, max=upper)
    mean_w = masked_mean(bounded, loss_mask)
    if loss_mask.sum() > 1:
        var = masked_mean(bounded.square(), loss_mask) - mean_w.square()
        m["rollout_is_std"] = torch.sqrt(torch.clamp(var, min=0.0)).item()
    else:
        m["rollout_is_std"] = 0.0
    normalised = bounded / (mean_w + 1e-8)
    second_moment = masked_mean(normalised.square(), loss_mask).item()
    m["rollout_is_eff_sample_size"] = 1.0 / second_moment if second_moment > 0 else 0.0  # all weights 0

    seq_w = masked_mean(weights, loss_mask, dim=-1)[rows]
    raw_seq_w = masked_mean(raw_weights, loss_mask, dim=-1)[rows]
    m["rollout_is_seq_mean"] = seq_w.mean().item()
    m["rollout_is_seq_std"] = seq_w.std().item() if seq_w.numel() > 1 else 0.0
    m["rollout_is_seq_max"] = seq_w.max().item()
    m["rollout_is_seq_min"] = seq_w.min().item()
    m["rollout_is_seq_max_deviation"] = (seq_w - 1.0).abs().max().item()
    m["rollout_is_seq_fraction_high"] = (raw_seq_w > upper).float().mean().item()
    m["rollout_is_seq_fraction_low"] = (raw_seq_w < lower).float().mean().item()
    if cfg.is_threshold_lower is not None:
        outside = (raw_weights < cfg.is_threshold_lower) | (raw_weights > upper)
        m["rollout_is_oob_ratio"] = masked_mean(outside.float(), loss_mask).item()
    return m


# --- rejection masks ------------------------------------------------------------------------


@dataclass(frozen=True)
class _RuleStat:
    """One rule evaluated on a batch: per-token statistic, per-row statistic, keep, metric bounds."""

    token_stat: torch.Tensor  # [batch, seq] (row statistic broadcast for sequence rules)
    row_stat: torch.Tensor | None  # [batch] for sequence rules
    keep: torch.Tensor  # [batch, seq] bool
    upper: float  # bounds in statistic space, for metrics
    lower: float | None  # k1 only


def _estimators(log_ratio: torch.Tensor) -> dict[str, torch.Tensor]:
    """k1 = -log r, k2 = ½ (log r)², k3 = r - 1 - log r per token (Schulman 2020), log r clamped ±20."""
    lr = torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND)
    return {"k1": -lr, "k2": 0.5 * lr.square(), "k3": torch.exp(lr) - 1.0 - lr}


def _row_max(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    out = values.masked_fill(~mask.bool(), float("-inf")).max(dim=-1).values
    return torch.where(torch.isinf(out) & (out < 0), torch.zeros_like(out), out)


def _evaluate_rule(rule: RejectionRule, k: dict[str, torch.Tensor], mask: torch.Tensor) -> _RuleStat:
    estimator = k[rule.name[-2:]]
    if rule.is_k1:
        # lower <= r <= upper  <=>  -log(upper) <= k1 <= -log(lower); k1 = -log r (or its row sum/mean)
        assert rule.lower is not None  # RejectionRule guarantees it
        hi, lo = -math.log(rule.lower), -math.log(rule.upper)
    else:
        hi, lo = rule.upper, None
    if rule.level == "token":
        token_stat, row_stat = estimator, None
        stat = token_stat
    else:
        if rule.name.startswith("seq_sum_"):
            row_stat = masked_sum(estimator, mask, dim=-1)
        elif rule.name.startswith("seq_mean_"):
            row_stat = masked_mean(estimator, mask, dim=-1)
        else:
            row_stat = _row_max(estimator, mask)
        token_stat = row_stat.unsqueeze(-1).expand_as(mask)
        stat = row_stat
    keep = stat <= hi if lo is None else (stat >= lo) & (stat <= hi)
    if row_stat is not None:
        keep = keep.unsqueeze(-1).expand_as(mask)
    return _RuleStat(token_stat=token_stat, row_stat=row_stat, keep=keep, upper=hi, lower=lo)


def _rule_metrics(name: str, s: _RuleStat, mask: torch.Tensor, rows: torch.Tensor) -> dict[str, float]:
    """Per-rule statistics (verl `compute_rs_metrics` plus the rule's masked fractions)."""
    p = f"rollout_rs_{name}"
    on = mask.bool()
    lower = 0.0 if s.lower is None else s.lower
    seq = (s.row_stat if s.row_stat is not None else masked_mean(s.token_stat, mask, dim=-1))[rows]
    m: dict[str, float] = {f"{p}_mean": masked_mean(s.token_stat, mask).item()}
    if s.row_stat is not None:
        m[f"{p}_max"], m[f"{p}_min"] = seq.max().item(), seq.min().item()
        m[f"{p}_fraction_high"] = (seq > s.upper).float().mean().item()
        m[f"{p}_fraction_low"] = (seq < lower).float().mean().item() if s.lower is not None else 0.0
    else:
        m[f"{p}_max"] = s.token_stat.masked_fill(~on, float("-inf")).max().item()
        m[f"{p}_min"] = s.token_stat.masked_fill(~on, float("inf")).min().item()
        m[f"{p}_fraction_high"] = masked_mean((s.token_stat > s.upper).float(), mask).item()
        m[f"{p}_fraction_low"] = (
            masked_mean((s.token_stat < lower).float(), mask).item() if s.lower is not None else 0.0
        )
    if mask.sum() > 1:
        clamped = s.token_stat.clamp(min=lower, max=s.upper)
        mean_c = masked_mean(clamped, mask)
        var = masked_mean(clamped.square(), mask) - mean_c.square()
        m[f"{p}_std"] = torch.sqrt(torch.clamp(var, min=0.0)).item()
    else:
        m[f"{p}_std"] = 0.0
    m[f"{p}_seq_mean"] = seq.mean().item()
    m[f"{p}_seq_std"] = seq.std().item() if seq.numel() > 1 else 0.0
    m[f"{p}_seq_max"] = seq.max().item()
    m[f"{p}_seq_min"] = seq.min().item()
    m[f"{p}_seq_max_deviation"] = seq.abs().max().item()
    m[f"{p}_seq_fraction_high"] = (seq > s.upper).float().mean().item()
    if s.lower is not None:
        m[f"{p}_seq_fraction_low"] = (seq < lower).float().mean().item()
    keep = s.keep.to(mask.dtype)
    m[f"{p}_masked_fraction"] = masked_mean(1.0 - keep, mask).item()
    m[f"{p}_seq_masked_fraction"] = ((~s.keep) & on).any(dim=-1)[rows].float().mean().item()
    return m


def rejection_mask(
    log_ratio: torch.Tensor, loss_mask: torch.Tensor, rules: tuple[RejectionRule, ...]
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss mask narrowed by every rule (a token stays only if all rules keep it), and metrics.

    Args:
        log_ratio: [batch, seq] log π_old - log π_rollout.
        loss_mask: [batch, seq] 1 on trained tokens (at least one).
        rules: rejection rules (see rollout_correction_config.py for each statistic and bound).

    Returns:
        (mask [batch, seq] = loss_mask × keep, same dtype as loss_mask; unprefixed metrics).
        Source: verl `compute_rollout_rejection_mask` (k1 bands: see the module docstring).
    """
    with torch.no_grad():
        k = _estimators(log_ratio.detach())
        rows = loss_mask.sum(dim=-1) > 0
        on = loss_mask.bool()
        keep_all = torch.ones_like(on)
        metrics: dict[str, float] = {}
        for rule in rules:
            s = _evaluate_rule(rule, k, loss_mask)
            keep_all = keep_all & s.keep
            metrics.update(_rule_metrics(rule.name, s, loss_mask, rows))
        final = keep_all.to(loss_mask.dtype)
        metrics["rollout_rs_masked_fraction"] = masked_mean(1.0 - final, loss_mask).item()
        metrics["rollout_rs_seq_masked_fraction"] = ((~keep_all) & on).any(dim=-1)[rows].float().mean().item()
        return loss_mask * final, metrics


# --- diagnostics ----------------------------------------------------------------------------


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
            # ρ - log ρ - 1 >= 0 for every ρ > 0; float rounding gives -1e-9 on on-policy tokens
            "k3_kl": max(0.0, masked_mean(torch.exp(log_ratio) - log_ratio - 1, loss_mask).item()),
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
    """IS weights, rejection-narrowed training mask and `rollout_corr/*` metrics for one mini-batch.

    Args:
        old_logprobs: [batch, seq] log π_old (decoupled: recomputed by the trainer; bypass: log π_θ
            before the step), no grad needed.
        rollout_logprobs: [batch, seq] log π_rollout from the inference engine.
        loss_mask: [batch, seq] 1 on trained tokens.
        cfg: weight level and thresholds, rejection rules. (cfg.mode is the trainer's business:
            this function computes the same weights in both modes.)

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
    log_ratio = old_logprobs - rollout_logprobs
    metrics: dict[str, float] = {}
    weights = None
    if cfg.is_level is not None:
        weights, raw, for_metrics = importance_weights(log_ratio, loss_mask, cfg)
        metrics.update(is_weight_metrics(weights, raw, for_metrics, loss_mask, cfg))
    train_mask = loss_mask
    if cfg.rs:
        train_mask, rs_metrics = rejection_mask(log_ratio, loss_mask, cfg.rs)
        metrics.update(rs_metrics)
    metrics.update(offpolicy_metrics(old_logprobs, rollout_logprobs, loss_mask))
    return RolloutCorrection(
        weights=weights,
        loss_mask=train_mask,
        metrics={METRIC_PREFIX + k: float(v) for k, v in metrics.items()},
    )
