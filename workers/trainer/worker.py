"""TrainerWorker: an HF causal LM under FSDP2, trained with the PPO clip loss and rollout correction.

A plain class; Ray is applied by the caller (`ray.remote(num_cpus=1)(TrainerWorker)`). One instance
per data-parallel rank: a `TrainerShell` (workers/trainer/shell.py: process group, rollout
correction, metrics, files, weight-sync group) around `FsdpEngine`, which holds this rank's shard
of the float32 weights (`torch.distributed.fsdp.fully_shard` on every decoder layer and on the
root) and of the AdamW state, in the rank's process group (gloo on CPU, NCCL on GPU).

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
- LoRA (`TrainerSettings.lora`, workers/trainer/lora.py): the base is frozen (in bf16 with
  `mixed_precision=bf16`: no fp32 master copy, no gradient, no optimizer state), only the
  adapter trains and holds AdamW state; full weights out are the merged ones, `export_adapter`
  writes the adapter alone.
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
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from workers.core.algorithms.batch import TrainBatch
from workers.core.algorithms.losses import ppo_clip_loss
from workers.trainer.helpers import _tied_parameter_names, token_logprobs, trained_columns
from workers.trainer.lora import (PEFT_PREFIX, adapter_state_dict, load_adapter_weights, merged_state_dict,
                                  set_lora_dropout, wrap_lora)
from workers.trainer.protocol import StepInputs, StepOutcome
from workers.trainer.scale import (
    checkpoint_layers,
    mixed_precision_policy,
    plan_micro_batches,
    split_to_count,
    take_rows,
)
from workers.trainer.settings import TrainerSettings
from workers.trainer.shell import WEIGHTS_FILENAME, RankContext, TrainerShell
from workers.weight_sync.plan import TensorSpec

__all__ = ["FsdpEngine", "TrainerSettings", "TrainerWorker", "WEIGHTS_FILENAME", "token_logprobs"]


class FsdpEngine:
    """The HF FSDP2 engine of one rank (`TrainerEngine`): the model sharded with `fully_shard`,
    AdamW over its shards, token-budget micro-batches (workers/trainer/scale.py)."""

    def __init__(self, cfg: TrainerSettings, ctx: RankContext) -> None:
        from transformers import AutoModelForCausalLM  # heavy import, kept off module import

        self.cfg, self.ctx, self.device = cfg, ctx, ctx.device
        mesh = init_device_mesh(self.device.type, (ctx.world_size,))
        model = AutoModelForCausalLM.from_pretrained(
            cfg.model_path, dtype=torch.float32, attn_implementation=cfg.attn_implementation,
            **cfg.extra_model_kwargs,
        )
        model.to(self.device)
        layers = getattr(getattr(model, "model", None), "layers", None)
        if layers is None:
            raise ValueError(f"{type(model).__name__} has no .model.layers; only HF decoder-only LMs are supported")
        self.hf_model = model  # the HF model (under the adapter with LoRA): config, tied names
        if cfg.lora is not None:  # frozen base, trainable adapter (workers/trainer/lora.py)
            model = wrap_lora(model, cfg.lora, cfg.model_path)
            if cfg.lora_adapter_path:
                load_adapter_weights(model, cfg.lora_adapter_path)
            if cfg.mixed_precision == "bf16":  # the frozen base needs no fp32 master copy
                for p in model.parameters():
                    if not p.requires_grad:
                        p.data = p.data.to(torch.bfloat16)
        if cfg.activation_checkpointing:
            checkpoint_layers(layers)
        for layer in layers:
            fully_shard(layer, mesh=mesh, mp_policy=mixed_precision_policy(cfg.mixed_precision, root=False))
        fully_shard(model, mesh=mesh, mp_policy=mixed_precision_policy(cfg.mixed_precision, root=True))
        model.eval()  # dropout off: π_θ equals π_old before the first step
        self.model = model
        self.optimizer = torch.optim.AdamW(  # with LoRA: the adapter's parameters only
            [p for p in model.parameters() if p.requires_grad], lr=cfg.lr, betas=cfg.betas,
            weight_decay=cfg.weight_decay)
        self._loss_cfg = cfg.policy_loss_config()

    # --- forward passes -------------------------------------------------------------------

    def _forward(self, mb: TrainBatch, *, with_entropy: bool,
                 trained_only: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logprobs, entropy or None) [b, T] for one micro-batch; all-padding tail columns are skipped.
        trained_only: project onto the vocabulary only the columns whose next token is trained
        (helpers.trained_columns); every other token's log-prob is 0."""
        t = mb.trimmed()
        ids = t.input_ids.to(self.device)
        columns = trained_columns(t.loss_mask).to(self.device) if trained_only else None
        out = self.model(input_ids=ids, attention_mask=t.attention_mask.to(self.device), use_cache=False,
                         logits_to_keep=0 if columns is None else columns)
        lp, ent = token_logprobs(out.logits, ids, with_entropy=with_entropy, columns=columns,
                                 temperature=self.cfg.sampling_temperature, top_p=self.cfg.sampling_top_p)
        valid = t.attention_mask.to(self.device, lp.dtype)
        pad = (0, mb.seq_len - t.seq_len)
        lp = torch.nn.functional.pad(lp * valid, pad)
        return lp, None if ent is None else torch.nn.functional.pad(ent * valid, pad)

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch, *, trained_only: bool = False) -> torch.Tensor:
        out = torch.zeros(batch.batch_size, batch.seq_len, dtype=torch.float32)
        for idx in self.micro_batches(batch):
            out[idx] = self._forward(take_rows(batch, idx), with_entropy=False,
                                     trained_only=trained_only)[0].float().cpu()
        return out

    # --- training -------------------------------------------------------------------------

    def micro_batches(self, batch: TrainBatch) -> list[torch.Tensor]:
        """Row indices ([k] long) of each micro-batch of `batch` (scale.plan_micro_batches);
        every rank gets as many micro-batches as the rank with the most (FSDP needs equal forwards).
        Raises ValueError when a rank has too few rows to match."""
        lengths = batch.attention_mask.sum(dim=-1).tolist()
        plan = plan_micro_batches(lengths, micro_batch_size=self.cfg.micro_batch_size,
                                  max_tokens=self.cfg.max_tokens_per_micro_batch)
        if self.ctx.world_size > 1:
            t = torch.tensor([len(plan)], dtype=torch.int64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            plan = split_to_count(plan, int(t.item()))
        self._check_same_micro_batch_count(len(plan))
        return [torch.tensor(mb, dtype=torch.long) for mb in plan]

    def _check_same_micro_batch_count(self, count: int) -> None:
        """FSDP collectives run per forward: every rank must run as many micro-batches, or all hang."""
        if self.ctx.world_size == 1:
            return
        t = torch.tensor([count, -count], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if int(t[0]) != -int(t[1]):
            raise ValueError(
                f"ranks got different numbers of micro-batches (min {-int(t[1])}, max {int(t[0])}); "
                "give every rank the same number of rows"
            )

    def train_step(self, train: TrainBatch, inputs: StepInputs) -> StepOutcome:
        """Per micro-batch: PPO clip loss on π_θ / π_old (times the IS weights), normalised by the
        mini-batch's global counts, backward; then clip the global grad norm and step (unless it is
        not finite). Every rank runs as many micro-batches (`micro_batches`)."""
        self.optimizer.zero_grad(set_to_none=True)
        sums = {"actor/pg_loss": 0.0, "actor/pg_clipfrac": 0.0, "actor/ppo_kl": 0.0, "actor/pg_clipfrac_lower": 0.0,
                "actor/entropy": 0.0}
        current = torch.zeros(train.batch_size, train.seq_len) if inputs.capture_logprobs else None
        if self.cfg.lora is not None and self.cfg.lora.dropout > 0:
            set_lora_dropout(self.model, True)  # the training forward only; off again below
        try:
            return self._accumulate_and_step(train, inputs, sums, current)
        finally:
            if self.cfg.lora is not None:
                set_lora_dropout(self.model, False)

    def _accumulate_and_step(self, train: TrainBatch, inputs: StepInputs, sums: dict[str, float],
                             current: torch.Tensor | None) -> StepOutcome:
        for idx in self.micro_batches(train):
            mb = take_rows(train, idx)
            mask = train.loss_mask[idx].to(self.device)
            lp, ent = self._forward(mb, with_entropy=self.cfg.compute_entropy, trained_only=True)
            if current is not None:
                current[idx] = lp.detach().float().cpu()
            out = ppo_clip_loss(
                lp, inputs.old_logprobs[idx].to(self.device), mb.advantages.to(self.device), mask, self._loss_cfg,
                is_weights=None if inputs.is_weights is None else inputs.is_weights[idx].to(self.device),
                dp_size=self.ctx.world_size, batch_num_tokens=inputs.num_tokens, global_batch_size=inputs.num_seqs,
                seq_num_tokens=None if inputs.seq_num_tokens is None else inputs.seq_num_tokens[idx].to(self.device),
            )
            out.loss.backward()
            n_mb = float(mask.sum().item())
            sums["actor/pg_loss"] += float(out.loss.detach().item())
            sums["actor/pg_clipfrac"] += float(out.pg_clipfrac.item()) * n_mb
            sums["actor/ppo_kl"] += float(out.ppo_kl.item()) * n_mb
            sums["actor/pg_clipfrac_lower"] += float(out.pg_clipfrac_lower.item()) * n_mb
            if ent is not None:
                sums["actor/entropy"] += float((ent * mask).sum().item())
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        grad_norm_value = float(grad_norm.item())
        skipped = not math.isfinite(grad_norm_value)
        if not skipped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepOutcome(sums, grad_norm_value, skipped, current)

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    # --- weights and optimizer state ------------------------------------------------------

    def _gathered(self) -> dict[str, torch.Tensor]:
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def full_state_dict(self, *, merge: bool = True) -> dict[str, torch.Tensor]:
        """HF names, fp32, tied aliases left out. With LoRA: the merged weights (`merge`), or the
        frozen base alone (`merge=False`, what a checkpoint stores beside the adapter)."""
        sd = self._gathered()
        if self.cfg.lora is not None:
            sd = merged_state_dict(sd, self.cfg.lora.scaling if merge else 0.0)
        tied = _tied_parameter_names(self.hf_model)
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

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """The LoRA adapter under PEFT's saved names (fp32, on CPU; collective). Raises
        RuntimeError without `model.lora`."""
        if self.cfg.lora is None:
            raise RuntimeError("adapter_state_dict needs model.lora (this trainer trains every weight)")
        return adapter_state_dict(self._gathered())

    def weight_specs(self) -> list[TensorSpec]:
        tied = _tied_parameter_names(self.hf_model)
        if self.cfg.lora is not None:  # the merged weights under HF names (see full_tensors)
            shapes = {k.replace(PEFT_PREFIX, "", 1).replace(".base_layer.", "."): tuple(t.shape)
                      for k, t in self.model.state_dict().items() if ".lora_" not in k}
            return [TensorSpec(n, s, self.cfg.weight_sync_dtype) for n, s in shapes.items() if n not in tied]
        return [TensorSpec(name, tuple(t.shape), self.cfg.weight_sync_dtype)
                for name, t in self.model.state_dict().items() if name not in tied]

    def full_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor on this device) one parameter at a time: a collective all-gather per
        tensor, so every rank must iterate to the end together. With LoRA the merged weights,
        gathered at once (`full_state_dict`)."""
        if self.cfg.lora is not None:
            yield from self.full_state_dict().items()
            return
        tied = _tied_parameter_names(self.hf_model)
        for name, t in self.model.state_dict().items():
            if name in tied:
                continue
            t = t.detach()
            yield name, (t.full_tensor() if hasattr(t, "full_tensor") else t)

    def write_hf_metadata(self, directory: str) -> None:
        from transformers import AutoTokenizer

        self.hf_model.config.save_pretrained(directory)
        if getattr(self.hf_model, "generation_config", None) is not None:
            self.hf_model.generation_config.save_pretrained(directory)
        try:
            tok = AutoTokenizer.from_pretrained(self.cfg.model_path)
        except (OSError, ValueError):  # the source directory has no tokenizer: weights only
            return
        tok.save_pretrained(directory)

    def optimizer_state(self) -> dict[str, Any]:
        return get_optimizer_state_dict(
            self.model, self.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, optim_state_dict=state,
                                 options=StateDictOptions(full_state_dict=True))


class TrainerWorker(TrainerShell):
    """One data-parallel rank of the HF FSDP2 trainer. See the module docstring for the invariants.

    Args:
        cfg: TrainerSettings.
        rank, world_size: this rank in the data-parallel group.
        init_method: `tcp://HOST:PORT` of a rendezvous store already served
            (workers/weight_sync/rendezvous.py `host_store`), shared by all ranks; None hosts one
            in this process, which only works for world_size 1.

    Raises:
        ValueError: world_size > 1 without init_method, or rank out of range.
    """

    def __init__(
        self, cfg: TrainerSettings, *, rank: int = 0, world_size: int = 1, init_method: str | None = None
    ) -> None:
        super().__init__(cfg, lambda ctx: FsdpEngine(cfg, ctx), rank=rank, world_size=world_size,
                         init_method=init_method)

    @property
    def model(self) -> torch.nn.Module:
        """The FSDP2-sharded HF model."""
        return self.engine.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.engine.optimizer

    def micro_batches(self, batch: TrainBatch) -> list[torch.Tensor]:
        """Row indices of each micro-batch of `batch` (see `FsdpEngine.micro_batches`)."""
        return self.engine.micro_batches(batch)
