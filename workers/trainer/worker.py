"""TrainerWorker: an HF causal LM under FSDP2, trained with the PPO clip loss and rollout correction.

A plain class; Ray is applied by the caller (`ray.remote(num_cpus=1)(TrainerWorker)`). One instance
per data-parallel rank: each joins a torch.distributed process group (gloo on CPU, NCCL on GPU) and
holds its shard of the float32 weights (`torch.distributed.fsdp.fully_shard` on every decoder layer
and on the root) and of the AdamW state.

Invariants:
- Log-probs use TrainBatch's alignment: logprob[b, t] = log p(token t | tokens < t); column 0 and
  padding columns are 0.
- `update` takes exactly one optimizer step per call (none when every token is rejected) and
  normalises the loss over the whole mini-batch (token-mean by default), whatever the micro-batch
  size. Rollout correction (`TrainerSettings.rollout_correction`):
  decoupled mode recomputes π_old from the current weights before any gradient is taken
  (π_rollout -> π_old -> π_θ; PPO ratio π_θ/π_old, IS weights π_old/π_rollout multiply the loss);
  bypass mode sets π_old := π_rollout (PPO ratio π_θ/π_rollout, no IS weights applied, as verl's
  ppo_clip bypass) and runs no extra forward pass unless rejection rules are set (their masks and
  the group advantages they change must be known before the first backward, so one no-grad pass
  computes log π_θ). Within one `update` π_θ does not change before the step, so bypass-mode
  weights, masks and metrics use log π_θ exactly where decoupled mode uses π_old.
- Rejected tokens (rejection rules) leave the loss mask, hence the loss, its normaliser and the
  gradient; a sample whose reward token is rejected is excluded from its group's advantage
  statistics (`workers/core/algorithms/rejection.py`).
- Dropout is off (the model stays in eval mode), so on the first micro-batch π_θ == π_old exactly.
- `export_weights` writes the full, unsharded fp32 state dict under HF parameter names, atomically.
- `broadcast_weights` sends the same tensors (in `weight_sync_dtype`) in buckets to the weight-sync
  group (workers/weight_sync/broadcast.py), gathering one parameter at a time.
- At GPU scale (workers/trainer/scale.py): micro-batches by token budget
  (`max_tokens_per_micro_batch`), bf16 mixed precision (fp32 master weights, optimizer state and
  gradient reduction), activation checkpointing per decoder layer. None of them changes the
  gradient of a mini-batch beyond float rounding (bf16 compute does, by design).

Callers: the training loops (through a Ray actor handle) and weight sync (`export_weights` /
`full_state_dict`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from workers.core.algorithms.batch import TrainBatch
from workers.core.algorithms.losses import LossAggMode, PolicyLossConfig, ppo_clip_loss
from workers.core.algorithms.rollout_correction import (
    RolloutCorrectionConfig,
    compute_rollout_correction,
)
from workers.trainer.settings import TrainerSettings
from workers.trainer.helpers import (  # noqa: F401  (free_loopback_init_method, token_logprobs: public here)
    plan_update,
    _atomic_write,
    _tied_parameter_names,
    free_loopback_init_method,
    token_logprobs,
)
from workers.trainer.scale import (
    MixedPrecision,
    checkpoint_layers,
    mixed_precision_policy,
    plan_micro_batches,
    split_to_count,
    take_rows,
)
from workers.weight_sync.broadcast import SendReport, bucket_bytes_of, send_weights
from workers.weight_sync.plan import TensorSpec, dtype_from_name
from workers.weight_sync.transport import BucketTransport, WeightGroupInfo, open_transport

WEIGHTS_FILENAME = "model.safetensors"  # single-file HF checkpoint name


class TrainerWorker:
    """One data-parallel rank of the trainer. See the module docstring for the invariants.

    Args:
        cfg: TrainerSettings.
        rank, world_size: this rank in the data-parallel group.
        init_method: torch.distributed rendezvous URL; None picks a free loopback port, which only
            works for world_size 1 (ranks of a larger group must share one URL).

    Raises:
        ValueError: world_size > 1 without init_method, or rank out of range.
    """

    def __init__(
        self, cfg: TrainerSettings, *, rank: int = 0, world_size: int = 1, init_method: str | None = None
    ) -> None:
        if not (0 <= rank < world_size):
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        if world_size > 1 and init_method is None:
            raise ValueError("world_size > 1 needs an init_method shared by all ranks")
        from transformers import AutoModelForCausalLM  # heavy import, kept off module import

        self.cfg = cfg
        self.rank, self.world_size = rank, world_size
        use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
        self.device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
        self._owns_process_group = not dist.is_initialized()
        if self._owns_process_group:
            dist.init_process_group(
                backend="nccl" if use_cuda else "gloo",
                init_method=init_method or free_loopback_init_method(),
                rank=rank,
                world_size=world_size,
            )
        elif dist.get_world_size() != world_size:
            raise ValueError(f"a process group of size {dist.get_world_size()} exists; asked for {world_size}")
        mesh = init_device_mesh(self.device.type, (world_size,))

        torch.manual_seed(cfg.seed)
        model = AutoModelForCausalLM.from_pretrained(
            cfg.model_path, dtype=torch.float32, attn_implementation=cfg.attn_implementation,
            **cfg.extra_model_kwargs,
        )
        model.to(self.device)
        layers = getattr(getattr(model, "model", None), "layers", None)
        if layers is None:
            raise ValueError(f"{type(model).__name__} has no .model.layers; only HF decoder-only LMs are supported")
        if cfg.activation_checkpointing:
            checkpoint_layers(layers)
        for layer in layers:
            fully_shard(layer, mesh=mesh, mp_policy=mixed_precision_policy(cfg.mixed_precision, root=False))
        fully_shard(model, mesh=mesh, mp_policy=mixed_precision_policy(cfg.mixed_precision, root=True))
        model.eval()  # dropout off: π_θ equals π_old before the first step
        self.model = model
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay
        )
        self._loss_cfg = cfg.policy_loss_config()
        self._rc_cfg = cfg.rollout_correction_config()
        self.num_updates = 0
        self._weight_transport: BucketTransport | None = None

    # --- forward passes -------------------------------------------------------------------

    def _forward(self, mb: TrainBatch, *, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logprobs, entropy or None) [b, T] for one micro-batch; all-padding tail columns are skipped."""
        t = mb.trimmed()
        ids = t.input_ids.to(self.device)
        out = self.model(input_ids=ids, attention_mask=t.attention_mask.to(self.device), use_cache=False)
        lp, ent = token_logprobs(out.logits, ids, with_entropy=with_entropy)
        valid = t.attention_mask.to(self.device, lp.dtype)
        pad = (0, mb.seq_len - t.seq_len)
        lp = torch.nn.functional.pad(lp * valid, pad)
        return lp, None if ent is None else torch.nn.functional.pad(ent * valid, pad)

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """log π(token t | tokens < t) under the current weights, no grad.

        Returns [B, T] float32 on CPU; column 0 and padding are 0.
        """
        out = torch.zeros(batch.batch_size, batch.seq_len, dtype=torch.float32)
        for idx in self.micro_batches(batch):
            out[idx] = self._forward(take_rows(batch, idx), with_entropy=False)[0].float().cpu()
        return out

    # --- training -------------------------------------------------------------------------

    def micro_batches(self, batch: TrainBatch) -> list[torch.Tensor]:
        """Row indices ([k] long) of each micro-batch of `batch` (trainer_scale.plan_micro_batches);
        every rank gets as many micro-batches as the rank with the most (FSDP needs equal forwards).
        Raises ValueError when a rank has too few rows to match."""
        lengths = batch.attention_mask.sum(dim=-1).tolist()
        plan = plan_micro_batches(lengths, micro_batch_size=self.cfg.micro_batch_size,
                                  max_tokens=self.cfg.max_tokens_per_micro_batch)
        if self.world_size > 1:
            t = torch.tensor([len(plan)], dtype=torch.int64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            plan = split_to_count(plan, int(t.item()))
        self._check_same_micro_batch_count(len(plan))
        return [torch.tensor(mb, dtype=torch.long) for mb in plan]

    def _check_same_micro_batch_count(self, count: int) -> None:
        """FSDP collectives run per forward: every rank must run as many micro-batches, or all hang."""
        if self.world_size == 1:
            return
        t = torch.tensor([count, -count], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if int(t[0]) != -int(t[1]):
            raise ValueError(
                f"ranks got different numbers of micro-batches (min {-int(t[1])}, max {int(t[0])}); "
                "give every rank the same number of rows"
            )

    def _global_sum(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        if self.world_size > 1:
            dist.all_reduce(t)
        return float(t.item())

    def update(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on this rank's share of a mini-batch.

        Steps: log π_old (decoupled: recomputed, no grad; bypass: the rollout log-probs); IS
        weights, rejection masks and `rollout_corr/*` metrics from π_old (bypass: π_θ before the
        step) vs π_rollout; rejection narrows the loss mask and recomputes the advantages of groups
        that lost a sample (`apply_rejection`); per micro-batch, PPO clip loss on π_θ / π_old
        (times the IS weights in decoupled mode), normalised by the mini-batch's global token (or
        sequence) count after rejection, backward; clip the global grad norm; AdamW step (skipped
        when the grad norm is not finite, or when no token is left to train on any rank).

        Returns metrics: actor/pg_loss, actor/grad_norm, actor/pg_clipfrac, actor/ppo_kl,
        actor/pg_clipfrac_lower, actor/entropy (token-weighted means over this rank's micro-batches),
        actor/num_tokens (global, after rejection), actor/lr, actor/step_skipped (1.0 if the step was
        skipped), and rollout_corr/* (this rank's mini-batch; with rejection rules also
        rs_excluded_sample_fraction and rs_recomputed_groups).

        Raises:
            ValueError: the batch has no trained token, (world_size > 1) ranks hold different
                numbers of micro-batches, or a rejected reward token in a batch without SampleTable.
        """
        rc_cfg = self._rc_cfg
        plan = plan_update(batch, rc_cfg, self.compute_logprobs)
        train, old_logprobs, rc, is_weights, extra = plan.train, plan.old_logprobs, plan.rc, plan.is_weights, plan.extra
        loss_mask = train.loss_mask
        num_tokens = self._global_sum(float(loss_mask.sum().item()))
        num_seqs = self._global_sum(float((loss_mask.sum(dim=-1) > 0).sum().item()))

        self.optimizer.zero_grad(set_to_none=True)
        sums = {"actor/pg_loss": 0.0, "actor/pg_clipfrac": 0.0, "actor/ppo_kl": 0.0, "actor/pg_clipfrac_lower": 0.0}
        if self.cfg.compute_entropy:
            sums["actor/entropy"] = 0.0
        current = torch.zeros(batch.batch_size, batch.seq_len)  # bypass without rules: log π_θ for the metrics
        if num_tokens > 0:
            for idx in self.micro_batches(train):
                mb = take_rows(train, idx)
                mask = loss_mask[idx].to(self.device)
                lp, ent = self._forward(mb, with_entropy=self.cfg.compute_entropy)
                if rc is None:
                    current[idx] = lp.detach().float().cpu()
                out = ppo_clip_loss(
                    lp,
                    old_logprobs[idx].to(self.device),
                    mb.advantages.to(self.device),
                    mask,
                    self._loss_cfg,
                    is_weights=None if is_weights is None else is_weights[idx].to(self.device),
                    dp_size=self.world_size,
                    batch_num_tokens=num_tokens,
                    global_batch_size=num_seqs,
                )
                out.loss.backward()
                n_mb = float(mask.sum().item())
                sums["actor/pg_loss"] += float(out.loss.detach().item()) / self.world_size
                sums["actor/pg_clipfrac"] += float(out.pg_clipfrac.item()) * n_mb
                sums["actor/ppo_kl"] += float(out.ppo_kl.item()) * n_mb
                sums["actor/pg_clipfrac_lower"] += float(out.pg_clipfrac_lower.item()) * n_mb
                if ent is not None:
                    sums["actor/entropy"] += float((ent * mask).sum().item())
        if rc is None:  # bypass without rules: π_θ before the step came from the training forward
            rc = compute_rollout_correction(current, batch.rollout_logprobs, batch.loss_mask, rc_cfg)

        skipped = num_tokens == 0
        grad_norm_value = 0.0
        if not skipped:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
            if hasattr(grad_norm, "full_tensor"):
                grad_norm = grad_norm.full_tensor()
            grad_norm_value = float(grad_norm.item())
            skipped = not math.isfinite(grad_norm_value)
            if not skipped:
                self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.num_updates += 1

        local_tokens = float(loss_mask.sum().item())
        metrics = {"actor/pg_loss": self._global_sum(sums.pop("actor/pg_loss"))}
        for name, total in sums.items():
            metrics[name] = total / local_tokens if local_tokens > 0 else 0.0
        metrics.update(
            {
                "actor/grad_norm": grad_norm_value,
                "actor/num_tokens": num_tokens,
                "actor/lr": float(self.optimizer.param_groups[0]["lr"]),
                "actor/step_skipped": 1.0 if skipped else 0.0,
            }
        )
        metrics.update(rc.metrics)
        metrics.update(extra)
        return metrics

    # --- weights out ----------------------------------------------------------------------

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 weights under HF names, on CPU (complete on rank 0; every rank must call this).

        Tied parameters (e.g. lm_head.weight with tie_word_embeddings) appear once, under the name HF
        saves them as, so the dict loads with `from_pretrained` and vLLM's loaders.
        """
        sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        tied = _tied_parameter_names(self.model)
        seen: set[int] = set()
        out: dict[str, torch.Tensor] = {}
        for name, tensor in sd.items():
            if name in tied:
                continue
            t = tensor.detach().to(torch.float32)
            if t.data_ptr() in seen:  # any other alias: give it its own storage for safetensors
                t = t.clone()
            seen.add(t.data_ptr())
            out[name] = t.contiguous()
        return out

    def export_weights(self, path: str) -> str:
        """Write the full weights as one safetensors file at `path` (temp file + rename); return path.

        Every rank must call it (the gather is collective); only rank 0 writes.
        """
        sd = self.full_state_dict()
        if self.rank == 0:
            _atomic_write(path, lambda tmp: save_file(sd, tmp, metadata={"format": "pt"}))
        if self.world_size > 1:
            dist.barrier()
        return path

    # --- weights out: bucketed broadcast (workers/weight_sync/broadcast.py) ------------------

    def weight_specs(self) -> list[TensorSpec]:
        """Name, full shape and sync dtype of every tensor `broadcast_weights` sends (HF names, tied
        aliases left out as in `full_state_dict`), in state-dict order."""
        tied = _tied_parameter_names(self.model)
        return [TensorSpec(name, tuple(t.shape), self.cfg.weight_sync_dtype)
                for name, t in self.model.state_dict().items() if name not in tied]

    def _full_tensors(self):
        """(name, full tensor on this device) one parameter at a time: a collective all-gather per
        tensor, so every rank must iterate to the end together."""
        tied = _tied_parameter_names(self.model)
        for name, t in self.model.state_dict().items():
            if name in tied:
                continue
            t = t.detach()
            yield name, (t.full_tensor() if hasattr(t, "full_tensor") else t)

    def open_weight_group(self, info: WeightGroupInfo) -> None:
        """Rank 0 joins the weight-sync group `info` as its sender (blocks until every receiver
        joined with a collective backend); other ranks only take part in the gathers later."""
        if self.rank == 0:
            if self._weight_transport is not None:
                raise RuntimeError("this trainer already joined a weight-sync group")
            self._weight_transport = open_transport(info, 0, self.device)

    def broadcast_weights(self, version: int) -> SendReport | None:
        """Send the current full weights as `version` to every receiver of the weight-sync group, in
        buckets of `weight_sync_bucket_mb` (every rank must call it; rank 0 returns the SendReport,
        others None). Raises RuntimeError before `open_weight_group`."""
        tensors = self._full_tensors()
        if self.rank != 0:
            for _ in tensors:
                pass
            return None
        if self._weight_transport is None:
            raise RuntimeError("broadcast_weights before open_weight_group")
        return send_weights(self._weight_transport, self.weight_specs(), tensors, version=version,
                            bucket_bytes=bucket_bytes_of(self.cfg.weight_sync_bucket_mb))

    def save_hf(self, directory: str) -> str:
        """Write an HF model directory (config.json, generation config, model.safetensors, tokenizer
        files when the source directory has them) that `from_pretrained` loads; return directory."""
        if self.rank == 0:
            os.makedirs(directory, exist_ok=True)
            self.model.config.save_pretrained(directory)
            if getattr(self.model, "generation_config", None) is not None:
                self.model.generation_config.save_pretrained(directory)
            self._write_tokenizer(directory)
        self.export_weights(os.path.join(directory, WEIGHTS_FILENAME))
        return directory

    def _write_tokenizer(self, directory: str) -> None:
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(self.cfg.model_path)
        except (OSError, ValueError):  # the source directory has no tokenizer: weights only
            return
        tok.save_pretrained(directory)

    def close(self) -> None:
        """Release the weight-sync group, and the process group if this worker created it."""
        if self._weight_transport is not None:
            self._weight_transport.close()
            self._weight_transport = None
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_process_group = False

    # --- checkpoint: optimizer state ------------------------------------------------------

    def save_optimizer(self, path: str) -> str:
        """Write the full (unsharded) AdamW state and `num_updates` to `path` with torch.save
        (temp file + rename); return path. Every rank must call it (the gather is collective);
        only rank 0 writes. Parameter keys are HF names, so the file is world-size independent."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        osd = get_optimizer_state_dict(
            self.model, self.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if self.rank == 0:
            _atomic_write(path, lambda tmp: torch.save({"optimizer": osd, "num_updates": self.num_updates}, tmp))
        if self.world_size > 1:
            dist.barrier()
        return path

    def load_optimizer(self, path: str) -> None:
        """Load a `save_optimizer` file into this rank's optimizer (every rank reads `path`) and
        restore `num_updates`. Raises ValueError when the file is not an optimizer checkpoint."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        blob = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(blob, dict) or "optimizer" not in blob or "num_updates" not in blob:
            raise ValueError(f"{path} is not an optimizer checkpoint written by save_optimizer")
        set_optimizer_state_dict(
            self.model, self.optimizer, optim_state_dict=blob["optimizer"],
            options=StateDictOptions(full_state_dict=True),
        )
        self.num_updates = int(blob["num_updates"])


