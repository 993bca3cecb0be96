"""Small helpers of the trainer ranks (workers/trainer/shell.py and its engines): per-token log-probs
in TrainBatch alignment, names of tied weights, atomic file writes, the rollout-correction plan of
an update. Pure functions of their inputs."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from workers.core.algorithms.batch import TrainBatch
    from workers.core.algorithms.rollout_correction import RolloutCorrection, RolloutCorrectionConfig


def token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, *, with_entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-prob and entropy in TrainBatch alignment.

    Args:
        logits: [B, T, V] next-token logits (logits[:, t] predicts token t + 1).
        input_ids: [B, T].

    Returns:
        (logprobs, entropy), both [B, T] float32; column 0 is 0 in both. entropy[b, t] is the entropy
        of the distribution token t was drawn from; it is detached, and None unless with_entropy.
    """
    logits = logits[:, :-1].float()
    targets = input_ids[:, 1:].unsqueeze(-1)
    lse = torch.logsumexp(logits, dim=-1)
    lp = torch.gather(logits, -1, targets).squeeze(-1) - lse
    zero = torch.zeros_like(lp[:, :1])
    if not with_entropy:
        return torch.cat([zero, lp], dim=1), None
    with torch.no_grad():
        ent = lse - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)
    return torch.cat([zero, lp], dim=1), torch.cat([zero, ent.detach()], dim=1)


def _tied_parameter_names(model: torch.nn.Module) -> set[str]:
    """Names HF leaves out of a checkpoint because they alias another parameter."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return set()
    keys = getattr(model, "_tied_weights_keys", None) or {}
    return set(keys.keys() if isinstance(keys, dict) else keys)


def _atomic_write(path: str, write: Callable[[str], None]) -> None:
    """Call `write(tmp)` on a temp file beside `path`, then rename it to `path`: readers see the
    old file or the complete new one, never a partial write. The temp file is removed on error."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".partial-", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


@dataclass(frozen=True)
class UpdatePlan:
    """What one optimizer update trains on, after rollout correction (shared by TrainerWorker and
    VerlTrainerWorker so both trainers apply the same algorithm).

    train: the batch to train on (rejection may have narrowed its loss mask and recomputed group
    advantages). old_logprobs: log π_old [rows, seq] (decoupled: recomputed before the update;
    bypass: π_rollout). rc: weights, masks and `rollout_corr/*` metrics, or None in bypass mode
    without rejection rules (then the metrics come from the training forward's log π_θ).
    is_weights: IS weights [rows, seq] or None. extra: rejection metrics.
    """

    train: "TrainBatch"
    old_logprobs: torch.Tensor
    rc: "RolloutCorrection | None"
    is_weights: torch.Tensor | None
    extra: dict[str, float]


def plan_update(batch: "TrainBatch", rc_cfg: "RolloutCorrectionConfig",
                logprobs: Callable[["TrainBatch"], torch.Tensor]) -> UpdatePlan:
    """Rollout correction before an update (verl's `rollout_corr_helper` semantics): decoupled mode
    recomputes π_old with `logprobs` (no grad) and computes weights and masks from π_old / π_rollout;
    bypass with rejection rules needs the masks before the first backward, so it computes them from
    the current policy; rejection then narrows the loss mask (`apply_rejection`).

    Raises:
        ValueError: the batch has no trained token.
    """
    from workers.core.algorithms.rejection import apply_rejection
    from workers.core.algorithms.rollout_correction import compute_rollout_correction

    if batch.num_loss_tokens == 0:
        raise ValueError("update got a batch with no trained token (loss_mask is all 0)")
    rc = None
    old_logprobs = None
    if rc_cfg.mode == "decoupled":
        old_logprobs = logprobs(batch)
        rc = compute_rollout_correction(old_logprobs, batch.rollout_logprobs, batch.loss_mask, rc_cfg)
    elif rc_cfg.rs:  # bypass with rejection: masks must be known before the first backward
        rc = compute_rollout_correction(logprobs(batch), batch.rollout_logprobs, batch.loss_mask, rc_cfg)
    extra: dict[str, float] = {}
    train = batch
    if rc is not None and rc_cfg.rs:
        outcome = apply_rejection(batch, rc.loss_mask)
        train, extra = outcome.batch, outcome.metrics()
    if rc_cfg.mode == "bypass":
        old_logprobs = train.rollout_logprobs  # π_old := π_rollout
    is_weights = rc.weights if rc is not None and rc_cfg.applies_weights else None
    return UpdatePlan(train, old_logprobs, rc, is_weights, extra)
