"""Small helpers of the trainer ranks (workers/trainer/shell.py and its engines): per-token log-probs
in TrainBatch alignment, names of tied weights, atomic file writes, the rollout-correction plan of
an update. Pure functions of their inputs."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from workers.core.algorithms.batch import TrainBatch
    from workers.core.algorithms.rollout_correction import RolloutCorrection, RolloutCorrectionConfig


def sampling_logits(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                    top_p: float = 1.0) -> torch.Tensor:
    """The logits of the distribution the engine sampled from: divided by the temperature, and
    outside the top-p nucleus set to -inf, exactly as vLLM's sampler does before it reports
    `processed_logprobs` (vllm/v1/sample/sampler.py: apply_temperature, then
    ops/topk_topp_sampler.py: apply_top_k_top_p_pytorch; verl's actor divides by the rollout
    temperature the same way, verl/workers/actor/dp_actor.py).

    Args:
        logits: [..., V] float logits; targets: [...] the sampled ids, always kept in the nucleus
            (a token the engine sampled is in its nucleus; rounding here must not make it -inf).
        temperature: > 0. top_p: in (0, 1]; 1 keeps every token (no sort).
    Returns:
        [..., V] logits, differentiable in the kept entries (the nucleus itself is a constant).
    """
    out = logits / temperature if temperature != 1.0 else logits
    if top_p >= 1.0:
        return out
    with torch.no_grad():
        sort, idx = out.sort(dim=-1, descending=False)
        cum = sort.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum <= 1 - top_p
        drop_sorted[..., -1] = False  # at least one token
        drop = torch.zeros_like(drop_sorted).scatter_(-1, idx, drop_sorted)
        drop.scatter_(-1, targets.unsqueeze(-1), False)
    return out.masked_fill(drop, float("-inf"))


def trained_columns(loss_mask: torch.Tensor) -> torch.Tensor:
    """The logits columns a loss over `loss_mask` [B, T] reads: [K] long, ascending, the columns j
    (logits[:, j] predicts token j + 1) whose next token is trained in at least one row.

    The trainer projects only these hidden states onto the vocabulary (HF `logits_to_keep`): prompt and
    tool-output tokens, most of an agent row, need no [V]-wide logits (151,669 floats per token on
    Qwen3), which is most of the memory and time of a forward on long rows."""
    return loss_mask[:, 1:].any(dim=0).nonzero().squeeze(-1)


def token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, *, with_entropy: bool = True,
    temperature: float = 1.0, top_p: float = 1.0, columns: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-prob and entropy in TrainBatch alignment, of the sampling distribution.

    Args:
        logits: [B, T, V] next-token logits (logits[:, t] predicts token t + 1); with `columns`,
            [B, K, V]: the logits of those columns only (what HF returns for `logits_to_keep=columns`).
        input_ids: [B, T].
        temperature / top_p: the rollout's sampling settings (sampling_logits): log-probs are of
            the distribution the engine sampled from, so that on-policy π_θ equals π_rollout.
        columns: [K] long, the columns `logits` holds (`trained_columns`); None: all of them.

    Returns:
        (logprobs, entropy), both [B, T] float32; column 0 is 0 in both, and so is every token whose
        predicting column is not in `columns`. entropy[b, t] is the entropy of the distribution
        token t was drawn from; it is detached, and None unless with_entropy.
    """
    if columns is None:
        columns = torch.arange(input_ids.shape[1] - 1, device=input_ids.device)
        logits = logits[:, :-1]
    targets = input_ids[:, columns + 1]
    logits = sampling_logits(logits.float(), targets, temperature=temperature, top_p=top_p)
    lse = torch.logsumexp(logits, dim=-1)
    lp = torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1) - lse

    def placed(values: torch.Tensor) -> torch.Tensor:  # [B, K] -> [B, T] at the tokens the columns predict
        return values.new_zeros(input_ids.shape).index_copy(1, columns + 1, values)

    if not with_entropy:
        return placed(lp), None
    with torch.no_grad():
        p = torch.softmax(logits, dim=-1)
        ent = lse - (p * logits.masked_fill(p == 0, 0.0)).sum(dim=-1)
    return placed(lp), placed(ent.detach())


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


@torch.no_grad()
def raw_token_logprobs(engine: Any, token_ids: list[int]) -> list[float]:
    """log softmax(logits)[t-1, token t] for t = 1 .. len-1 (temperature 1, no top-p) from one
    forward of `engine.model` (an HF causal LM, or its FSDP / PEFT wrapper; every rank of a sharded
    model must call it). Raises ValueError for fewer than 2 tokens, RuntimeError for an engine
    without an HF `model`."""
    if len(token_ids) < 2:
        raise ValueError(f"probe needs at least 2 tokens, got {len(token_ids)}")
    model = getattr(engine, "model", None)
    if model is None:
        raise RuntimeError(f"{type(engine).__name__} has no HF model to score a probe with")
    device = next(model.parameters()).device
    ids = torch.tensor([token_ids], dtype=torch.long, device=device)
    logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
    lp = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)
    return [float(x) for x in lp.cpu()]
