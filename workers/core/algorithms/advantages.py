"""GRPO outcome advantages: one scalar reward per sample, normalised within its group.

Pure torch. Called by the loop (through batching) once per group set, before mini-batches are cut.

Formula (DeepSeekMath, Shao et al. 2024, arXiv:2402.03300, §4.1.2 "outcome supervision"):
    A_i = (r_i - mean(r_group)) / (std(r_group) + eps)
with `std` the unbiased sample std (torch.std default), as in verl 0.9.1
`verl/trainer/ppo/core_algos.py::compute_grpo_outcome_advantage`. With `norm_adv_by_std=False`
the division is skipped (Dr. GRPO, Liu et al. 2025, arXiv:2503.20783).

Invariant: a group whose rewards are all equal gets advantage exactly 0 for every sample.
verl's float32 arithmetic breaks this (mean of 7 copies of 0.1 differs from 0.1 by ~7e-9, the std is
~8e-9, and the quotient is ~0.007 instead of 0); we detect equal rewards and write 0. A group of one
sample follows verl: mean 0 and std 1, so A = r / (1 + eps).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

GRPO_EPSILON = 1e-6  # added to the group std before dividing; verl's default


def grpo_outcome_advantages(
    rewards: torch.Tensor,
    group_index: Sequence[int] | torch.Tensor,
    *,
    epsilon: float = GRPO_EPSILON,
    norm_adv_by_std: bool = True,
) -> torch.Tensor:
    """Per-sample GRPO advantages.

    Args:
        rewards: [num_samples] float, one outcome reward per sample.
        group_index: [num_samples] group id of each sample (any hashable ints; order free).
        epsilon: added to the group std before dividing.
        norm_adv_by_std: divide by the group std (GRPO) or not (Dr. GRPO).

    Returns:
        [num_samples] advantages, same dtype as rewards.

    Raises:
        ValueError: rewards is not 1-D, lengths differ, or a reward is not finite.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [num_samples], got shape {tuple(rewards.shape)}")
    index = torch.as_tensor(group_index)
    if index.shape != rewards.shape:
        raise ValueError(f"group_index has shape {tuple(index.shape)}, rewards has {tuple(rewards.shape)}")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards must be finite")
    with torch.no_grad():
        out = torch.empty_like(rewards)
        for gid in torch.unique(index):
            members = (index == gid).nonzero(as_tuple=True)[0]
            scores = rewards[members]
            if scores.numel() == 1:  # verl: mean 0, std 1 for a lone sample
                mean, std = torch.zeros((), dtype=scores.dtype), torch.ones((), dtype=scores.dtype)
            else:
                mean, std = scores.mean(), scores.std()
            if scores.numel() > 1 and bool((scores == scores[0]).all()):
                out[members] = 0.0  # equal rewards: no signal (see module docstring)
            elif norm_adv_by_std:
                out[members] = (scores - mean) / (std + epsilon)
            else:
                out[members] = scores - mean
    return out


def broadcast_to_tokens(advantages: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Put each sequence's scalar advantage on its trained tokens.

    Args:
        advantages: [batch] one advantage per sequence.
        loss_mask: [batch, seq] 1 on trained tokens.

    Returns:
        [batch, seq] advantages[b] where loss_mask[b, t] is 1, else 0 (dtype of loss_mask's float).

    Raises:
        ValueError: shapes do not line up.
    """
    if advantages.dim() != 1 or loss_mask.dim() != 2 or advantages.shape[0] != loss_mask.shape[0]:
        raise ValueError(
            f"need advantages [batch] and loss_mask [batch, seq], got {tuple(advantages.shape)} "
            f"and {tuple(loss_mask.shape)}"
        )
    return advantages.unsqueeze(-1) * loss_mask.to(advantages.dtype)
