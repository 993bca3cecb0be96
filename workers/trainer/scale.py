"""What the trainer needs at GPU scale: token-budget micro-batches, bf16 mixed precision, activation
checkpointing. Used by workers/trainer/worker.py; the planner is pure logic (lists of ints).

Micro-batch invariant: every row of the mini-batch is in exactly one micro-batch; with a token
budget B, a micro-batch's padded token count (rows x longest row) is <= B unless it holds a single
row longer than B. The loss of every micro-batch is normalised by the whole mini-batch's token (or
sequence) count (`ppo_clip_loss(batch_num_tokens=..., global_batch_size=...)`), so the sum of the
micro-batch gradients equals the gradient of the mini-batch as one batch, however rows are grouped
or reordered (a row is never split across micro-batches).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from workers.core.algorithms.batch import TrainBatch
from workers.trainer.order import plan_micro_batches  # noqa: F401  (re-exported: the micro-batch plan)
from workers.trainer.settings import MIXED_PRECISION_MODES, MixedPrecision


def split_to_count(plan: list[list[int]], count: int) -> list[list[int]]:
    """Split the micro-batches with the most rows in halves until there are `count` of them (FSDP
    ranks must run the same number of forwards). Returns a new plan; the input is unchanged.

    Raises ValueError when count < len(plan), or when fewer than `count` rows exist.
    """
    if count < len(plan):
        raise ValueError(f"cannot merge {len(plan)} micro-batches into {count}")
    out = [list(mb) for mb in plan]
    while len(out) < count:
        j = max(range(len(out)), key=lambda k: len(out[k]))
        if len(out[j]) < 2:
            raise ValueError(f"this rank has {sum(map(len, out))} rows; another rank needs {count} micro-batches")
        half = len(out[j]) // 2
        out[j:j + 1] = [out[j][:half], out[j][half:]]
    return out


def padded_tokens(lengths: Sequence[int], plan: list[list[int]]) -> list[int]:
    """rows x longest row of each micro-batch (the tokens its forward pass computes)."""
    return [len(mb) * max(int(lengths[i]) for i in mb) for mb in plan]


def take_rows(batch: TrainBatch, idx: torch.Tensor) -> TrainBatch:
    """Rows `idx` ([k] long) of `batch`, in that order (a copy; the SampleTable is dropped)."""
    return TrainBatch(
        input_ids=batch.input_ids[idx], attention_mask=batch.attention_mask[idx], loss_mask=batch.loss_mask[idx],
        rollout_logprobs=batch.rollout_logprobs[idx], advantages=batch.advantages[idx],
    )


def mixed_precision_policy(mode: MixedPrecision | None, *, root: bool):
    """FSDP2 MixedPrecisionPolicy: bf16 params for compute, fp32 gradient reduction; the root casts
    its outputs (logits) to fp32. None -> the default policy (everything in the fp32 master weights).
    Raises ValueError for an unknown mode."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if mode is None:
        return MixedPrecisionPolicy()
    if mode not in MIXED_PRECISION_MODES:
        raise ValueError(f"trainer.mixed_precision must be null or one of {MIXED_PRECISION_MODES}, got {mode!r}")

    return MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32 if root else None
    )


def checkpoint_layers(layers: Sequence[torch.nn.Module]) -> None:
    """Activation checkpointing per decoder layer: with grad enabled a layer keeps only its inputs
    and recomputes its activations during backward (torch.utils.checkpoint, non-reentrant); no-grad
    passes run plainly. Done by wrapping each layer's `forward` (parameter names and the model's
    eval mode stay as they are; HF's `gradient_checkpointing_enable` acts only in train mode, and
    we keep eval mode for dropout-free π_θ == π_old). Apply before `fully_shard`, as torchtitan
    applies checkpoint_wrapper before sharding."""
    from torch.utils.checkpoint import checkpoint

    for layer in layers:
        inner = layer.forward

        def forward(*args, _inner=inner, **kwargs):
            if not torch.is_grad_enabled():
                return _inner(*args, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        layer.forward = forward
