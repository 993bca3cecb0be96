"""PPO clipped policy loss and loss aggregation.

Pure torch. The trainer calls `ppo_clip_loss` once per micro-batch and backpropagates its `loss`;
with `batch_num_tokens` (token-mean) or `global_batch_size` (seq-mean modes) set to the mini-batch
totals, the micro-batch losses sum to the mini-batch loss, so gradient accumulation is exact.

Formulas:
- PPO clip (Schulman et al. 2017, arXiv:1707.06347, eq. 7), per token with r = π_θ / π_old:
  L = max(-A·r, -A·clip(r, 1 - ε_low, 1 + ε_high)).
- Dual clip (Ye et al. 2020, arXiv:1912.09729, §4.1): for A < 0, L = min(L, -A·c), c > 1.
- Rollout correction: L is multiplied by detached per-token importance weights before aggregation.
Semantics, clamps and metric names follow verl 0.9.1 `verl/trainer/ppo/core_algos.py`
(`compute_policy_loss_vanilla`, `agg_loss`); tests/test_algorithms_verl_parity.py checks them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.core.algorithms.loss_modes import LOSS_AGG_MODES, LossAggMode  # noqa: F401  (re-exported)
LOG_RATIO_CLAMP = 20.0  # |log r| bound before exp, as verl; exp(20) ≈ 4.9e8


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of values where mask != 0 (values off the mask, even NaN, are ignored)."""
    valid = torch.where(mask.bool(), values, torch.zeros_like(values))
    return (valid * mask).sum() if dim is None else (valid * mask).sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of values where mask != 0; 0 for an empty mask (denominator + 1e-8, as verl)."""
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(values, mask, dim) / (count + 1e-8)


@dataclass(frozen=True)
class PolicyLossConfig:
    """PPO clip settings. clip_ratio_c=None turns dual clip off (verl always applies it, c=3)."""

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float | None = 3.0
    loss_agg_mode: LossAggMode = "token-mean"

    def __post_init__(self) -> None:
        if not (0.0 <= self.clip_ratio_low < 1.0):
            raise ValueError(f"clip_ratio_low must be in [0, 1), got {self.clip_ratio_low}")
        if self.clip_ratio_high < 0.0:
            raise ValueError(f"clip_ratio_high must be >= 0, got {self.clip_ratio_high}")
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c (dual clip) must be > 1, got {self.clip_ratio_c}")
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {self.loss_agg_mode!r}")


@dataclass(frozen=True)
class PolicyLossOutput:
    """Loss of one (micro-)batch plus detached diagnostics (masked means over its tokens).

    loss: scalar with grad. pg_clipfrac: fraction of tokens where the clipped term won.
    ppo_kl: mean of log π_old - log π_θ (k1 estimate of KL(π_old || π_θ)).
    pg_clipfrac_lower: fraction of tokens where the dual clip bound won (A < 0).
    """

    loss: torch.Tensor
    pg_clipfrac: torch.Tensor
    ppo_kl: torch.Tensor
    pg_clipfrac_lower: torch.Tensor

    def metrics(self) -> dict[str, float]:
        """verl's metric names: actor/pg_loss, actor/pg_clipfrac, actor/ppo_kl, actor/pg_clipfrac_lower."""
        return {
            "actor/pg_loss": float(self.loss.detach().item()),
            "actor/pg_clipfrac": float(self.pg_clipfrac.item()),
            "actor/ppo_kl": float(self.ppo_kl.item()),
            "actor/pg_clipfrac_lower": float(self.pg_clipfrac_lower.item()),
        }


def aggregate_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    mode: LossAggMode,
    *,
    dp_size: int = 1,
    batch_num_tokens: float | torch.Tensor | None = None,
    global_batch_size: float | torch.Tensor | None = None,
    seq_num_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a [batch, seq] loss matrix to a scalar (verl `agg_loss`).

    token-mean:          Σ L·m / N_tokens
    seq-mean-token-mean: Σ_seq (Σ_t L·m / n_seq) / N_seqs
    seq-mean-token-sum:  Σ_seq (Σ_t L·m) / N_seqs
    N_tokens (batch_num_tokens) and N_seqs (global_batch_size) default to this batch's own counts
    (N_seqs: rows with >= 1 token); pass the mini-batch totals (summed over data-parallel ranks) when
    accumulating micro-batches. The trainer passes as N_seqs the mini-batch's rollouts with a trained
    token (`TrainBatch.num_trained_rollouts`), not its rows: a rollout split into several rows (history
    compaction, a sub-agent) adds each row's token-loss sum but counts once, so seq-mean-token-sum is
    Σ_rollout (Σ_t L·m) / N_rollouts, the agentcore-rl-toolkit 0.2.0 contract (rows add token-loss
    mass, the denominator is the rollout count before the split); token-mean never sees rows at all.
    For seq-mean-token-mean the trainer passes `seq_num_tokens` ([batch]: the trained tokens of each
    row's rollout, `TrainBatch.rollout_num_tokens`) as n_seq, so a rollout's rows together give its
    one token mean: Σ_rollout (Σ_t L·m / n_rollout) / N_rollouts. Without it n_seq is the row's own
    count (verl's per-sequence mean). The result is multiplied by dp_size because FSDP averages gradients
    over ranks.

    Raises ValueError for an unknown mode, or dp_size > 1 without the global count it needs.
    """
    if mode == "token-mean":
        if batch_num_tokens is None:
            if dp_size > 1:
                raise ValueError("batch_num_tokens (global) is required when dp_size > 1")
            batch_num_tokens = loss_mask.sum()
        return masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    if mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        tokens_per_seq = loss_mask.sum(dim=-1)
        seq_sums = (loss_mat * loss_mask).sum(dim=-1)
        denom = tokens_per_seq if seq_num_tokens is None else seq_num_tokens.to(tokens_per_seq.dtype)
        seq_losses = seq_sums / (denom + 1e-8) if mode == "seq-mean-token-mean" else seq_sums
        seq_mask = (tokens_per_seq > 0).to(loss_mat.dtype)
        if global_batch_size is None:
            if dp_size > 1:
                raise ValueError("global_batch_size is required when dp_size > 1")
            global_batch_size = seq_mask.sum()
        return masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size
    raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {mode!r}")


def ppo_clip_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: PolicyLossConfig,
    *,
    is_weights: torch.Tensor | None = None,
    dp_size: int = 1,
    batch_num_tokens: float | torch.Tensor | None = None,
    global_batch_size: float | torch.Tensor | None = None,
    seq_num_tokens: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """PPO clipped (optionally dual-clipped) policy loss, optionally importance-weighted.

    Args:
        log_prob: [batch, seq] log π_θ(token), with grad.
        old_log_prob: [batch, seq] log π_old(token), no grad needed.
        advantages: [batch, seq].
        loss_mask: [batch, seq] 1 on trained tokens.
        cfg: clip ratios and aggregation mode.
        is_weights: [batch, seq] rollout-correction weights (detached here), or None.
        dp_size, batch_num_tokens, global_batch_size, seq_num_tokens: see `aggregate_loss`.

    Returns:
        PolicyLossOutput (loss with grad; diagnostics detached, masked means over this batch).

    Raises:
        ValueError: shapes differ.
    """
    shape = log_prob.shape
    for name, t in (("old_log_prob", old_log_prob), ("advantages", advantages), ("loss_mask", loss_mask)):
        if t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, log_prob has {tuple(shape)}")
    if is_weights is not None and is_weights.shape != shape:
        raise ValueError(f"is_weights has shape {tuple(is_weights.shape)}, log_prob has {tuple(shape)}")

    neg_approx_kl = torch.clamp(log_prob - old_log_prob, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    ratio = torch.exp(neg_approx_kl)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high)
    losses = torch.maximum(unclipped, clipped)
    with torch.no_grad():
        ppo_kl = masked_mean(-neg_approx_kl, loss_mask)
        pg_clipfrac = masked_mean((clipped > unclipped).to(loss_mask.dtype), loss_mask)
    if cfg.clip_ratio_c is not None:
        dual = -advantages * cfg.clip_ratio_c
        with torch.no_grad():
            pg_clipfrac_lower = masked_mean(((losses > dual) & (advantages < 0)).to(loss_mask.dtype), loss_mask)
        losses = torch.where(advantages < 0, torch.minimum(dual, losses), losses)
    else:
        pg_clipfrac_lower = torch.zeros((), dtype=loss_mask.dtype, device=loss_mask.device)
    if is_weights is not None:
        losses = losses * is_weights.detach()
    loss = aggregate_loss(
        losses,
        loss_mask,
        cfg.loss_agg_mode,
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
        seq_num_tokens=seq_num_tokens,
    )
    return PolicyLossOutput(
        loss=loss, pg_clipfrac=pg_clipfrac, ppo_kl=ppo_kl.detach(), pg_clipfrac_lower=pg_clipfrac_lower
    )
