"""VerlTrainerWorker: TrainerWorker's interface over verl's training engine (`trainer.name=verl`).

A plain class; Ray is applied by the caller, as for TrainerWorker (workers/trainer/worker.py). One instance
per data-parallel rank. The model, its sharding, the optimizer, micro-batching and the optimizer step
are verl 0.9.1's `BaseEngine` (built through `verl.workers.engine.EngineRegistry`): `fsdp` (FSDP2 over
the HF model; runs on CPU with gloo through workers/trainer_verl_parts.PlatformCPU) or `megatron`
(verl's Megatron-Core engine; GPU only, needs megatron-core and mbridge). The algorithm is ours: the
engine's loss hook computes `workers.core.algorithms.losses.ppo_clip_loss`, and rollout correction,
rejection and their metrics run exactly as in TrainerWorker.update, so both trainers share it.

Invariants (same as TrainerWorker, which a test checks to ~1e-5 on the same batch):
- Log-probs use TrainBatch's alignment (workers/trainer_verl_parts.engine_to_batch_alignment).
- `update` takes exactly one optimizer step (verl's `BaseEngine.train_batch`: zero grad,
  forward/backward per micro-batch, clip the global grad norm, step unless it is not finite); the loss
  is normalised over the whole mini-batch (the engine's global token count, or our global sequence
  count for seq-mean modes), so verl's token-budget micro-batching does not change the gradient.
- The model stays in eval mode inside verl's train context (dropout off: π_θ == π_old at first),
  except with `activation_checkpointing`: HF only checkpoints layers in train mode, so the model's
  configured dropout (0 in the Qwen2 family and our tiny model) then applies.
- fp32 weights, compute and optimizer state unless `mixed_precision="bf16"` (verl's FSDP mixed
  precision: bf16 params in compute, fp32 reduction and master weights).
- `export_weights` / `save_optimizer` write the same files as TrainerWorker (HF names, full fp32
  tensors; AdamW state keyed by HF names), so checkpoints move between the two trainers.

Callers: orchestrator/main.py when `trainer.name=verl`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from workers.core.algorithms.batch import TrainBatch
from workers.core.algorithms.rollout_correction import compute_rollout_correction
from workers.trainer.settings import _VERL_BACKEND, TrainerSettings, VerlSettings
from workers.trainer.worker import WEIGHTS_FILENAME
from workers.trainer.helpers import _atomic_write, _tied_parameter_names, free_loopback_init_method, plan_update
from workers.trainer.verl_parts import (
    PPOLossFunction,
    engine_to_batch_alignment,
    to_verl_batch,
    use_verl_cpu_platform,
)
from workers.weight_sync.broadcast import SendReport, bucket_bytes_of, send_weights
from workers.weight_sync.plan import TensorSpec
from workers.weight_sync.transport import BucketTransport, WeightGroupInfo, open_transport

@dataclass(frozen=True)
class VerlConfigs:
    """verl's own config objects for one engine: HFModelConfig, FSDPEngineConfig or
    McoreEngineConfig, FSDPOptimizerConfig or McoreOptimizerConfig."""

    model: object
    engine: object
    optimizer: object


def verl_configs(cfg: TrainerSettings, vc: VerlSettings) -> VerlConfigs:
    """Translate our settings into verl's configs (pure; builds no model). AdamW with `cfg.lr`,
    betas, weight decay, grad clip; constant LR, no warm-up. fsdp: fp32 weights and compute unless
    `mixed_precision=bf16`; megatron: bf16 compute (verl's Megatron engine has no fp32 compute).
    Raises verl's own errors (AssertionError / ValueError) for combinations it refuses."""
    from verl.workers.config import (
        FSDPEngineConfig,
        FSDPOptimizerConfig,
        HFModelConfig,
        McoreEngineConfig,
        McoreOptimizerConfig,
    )

    model = HFModelConfig(
        path=cfg.model_path, load_tokenizer=False, use_remove_padding=vc.use_remove_padding,
        enable_gradient_checkpointing=cfg.activation_checkpointing,
        override_config={"attn_implementation": vc.attn_implementation},
    )
    optim = dict(lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay, clip_grad=cfg.grad_clip,
                 lr_warmup_steps=0, total_training_steps=1)
    if vc.strategy == "megatron":
        engine = McoreEngineConfig(
            strategy="megatron", seed=cfg.seed, use_remove_padding=vc.use_remove_padding, dtype="bfloat16",
            tensor_model_parallel_size=vc.tensor_model_parallel_size,
            pipeline_model_parallel_size=vc.pipeline_model_parallel_size,
        )
        return VerlConfigs(model, engine, McoreOptimizerConfig(optimizer="adam", **optim))
    precision = "bf16" if cfg.mixed_precision == "bf16" else "fp32"
    engine = FSDPEngineConfig(
        strategy="fsdp2", model_dtype="fp32", seed=cfg.seed, use_torch_compile=vc.use_torch_compile,
        mixed_precision={"param_dtype": precision, "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
        use_remove_padding=vc.use_remove_padding,
    )
    return VerlConfigs(model, engine, FSDPOptimizerConfig(lr_scheduler_type="constant", **optim))


def check_verl_available(verl_cfg: VerlSettings, *, cuda: bool) -> None:
    """Raise RuntimeError naming what is missing when verl's `strategy` engine cannot run here:
    verl or its pure-Python dependencies (peft, accelerate, datasets, codetiming) not importable, or
    megatron without CUDA / megatron-core. Cheap enough to call before any actor starts."""
    import importlib.util

    missing = [m for m in ("verl", "peft", "accelerate", "datasets", "codetiming", "tensordict")
               if importlib.util.find_spec(m) is None]
    if missing:
        raise RuntimeError(f"trainer.name=verl needs the packages {missing} (pip install -e '.[gpu]')")
    if verl_cfg.strategy == "megatron":
        if not cuda:
            raise RuntimeError(
                "trainer.verl.strategy=megatron needs CUDA GPUs: verl's Megatron engine runs on "
                "megatron-core's CUDA kernels (no CPU path); use trainer.verl.strategy=fsdp on CPU"
            )
        if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("mbridge") is None:
            raise RuntimeError("trainer.verl.strategy=megatron needs megatron-core and mbridge installed")


class VerlTrainerWorker:
    """One data-parallel rank driving verl's engine. Same public methods as TrainerWorker.

    Args:
        cfg: TrainerSettings (shared with TrainerWorker; `extra_model_kwargs` and weight sync
            buckets are not used here).
        verl: VerlSettings.
        rank, world_size, init_method: as TrainerWorker.

    Raises:
        ValueError: bad rank / world size; RuntimeError: the engine cannot run here
            (`check_verl_available`).
    """

    def __init__(
        self,
        cfg: TrainerSettings,
        verl: VerlSettings | None = None,
        *,
        rank: int = 0,
        world_size: int = 1,
        init_method: str | None = None,
    ) -> None:
        if not (0 <= rank < world_size):
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        if world_size > 1 and init_method is None:
            raise ValueError("world_size > 1 needs an init_method shared by all ranks")
        if cfg.extra_model_kwargs:
            raise ValueError("trainer=verl loads the model through verl's HFModelConfig: extra_model_kwargs "
                             f"{sorted(cfg.extra_model_kwargs)} are not supported (use trainer.verl.*)")
        self.cfg, self.verl_cfg = cfg, verl or VerlSettings()
        use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
        check_verl_available(self.verl_cfg, cuda=use_cuda)
        if not use_cuda:
            use_verl_cpu_platform()  # before verl's engine modules are imported
        self.rank, self.world_size = rank, world_size
        self.device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
        self._owns_process_group = not dist.is_initialized()
        if self._owns_process_group:
            dist.init_process_group(backend="nccl" if use_cuda else "gloo",
                                    init_method=init_method or free_loopback_init_method(),
                                    rank=rank, world_size=world_size)
        elif dist.get_world_size() != world_size:
            raise ValueError(f"a process group of size {dist.get_world_size()} exists; asked for {world_size}")
        torch.manual_seed(cfg.seed)
        self.engine = self._build_engine()
        self._loss_cfg = cfg.policy_loss_config()
        self._rc_cfg = cfg.rollout_correction_config()
        self.num_updates = 0
        self._weight_transport: BucketTransport | None = None

    # --- engine construction --------------------------------------------------------------

    def _build_engine(self):
        from verl.trainer.config import CheckpointConfig
        from verl.workers.engine import EngineRegistry

        c = verl_configs(self.cfg, self.verl_cfg)
        engine = EngineRegistry.new(
            model_type="language_model", backend=_VERL_BACKEND[self.verl_cfg.strategy], model_config=c.model,
            engine_config=c.engine, optimizer_config=c.optimizer, checkpoint_config=CheckpointConfig(),
        )
        engine.initialize()
        return engine

    def _micro_batch_tokens(self, batch: TrainBatch) -> int:
        """verl's per-micro-batch token budget (sum of real row lengths): the configured
        `max_tokens_per_micro_batch`, else micro_batch_size x the longest row."""
        longest = int(batch.attention_mask.sum(dim=-1).max())
        budget = self.cfg.max_tokens_per_micro_batch or self.cfg.micro_batch_size * longest
        return max(budget, longest)

    def _global_sum(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        if self.world_size > 1:
            dist.all_reduce(t)
        return float(t.item())

    # --- forward passes -------------------------------------------------------------------

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """log π(token t | tokens < t) under the current weights (verl `infer_batch`, no grad).

        Returns [B, T] float32 on CPU; column 0 and padding are 0.
        """
        td = to_verl_batch(batch, micro_batch_tokens=self._micro_batch_tokens(batch), calculate_entropy=False,
                           use_remove_padding=self.verl_cfg.use_remove_padding)
        with self.engine.eval_mode():
            out = self.engine.infer_batch(td, loss_function=None)
        lp = engine_to_batch_alignment(out["model_output"]["log_probs"], batch.seq_len)
        return lp.float().cpu() * batch.attention_mask

    # --- training -------------------------------------------------------------------------

    def update(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on this rank's share of a mini-batch; see TrainerWorker.update for the
        steps and the metrics (same names and meanings). The forward/backward, grad clipping and
        the step are verl's engine; the loss is ours (workers/trainer_verl_parts.PPOLossFunction).

        Raises:
            ValueError: the batch has no trained token, or a rejected reward token in a batch
                without SampleTable.
        """
        rc_cfg = self._rc_cfg
        plan = plan_update(batch, rc_cfg, self.compute_logprobs)
        train, old_logprobs, rc, is_weights, extra = plan.train, plan.old_logprobs, plan.rc, plan.is_weights, plan.extra
        loss_mask = train.loss_mask
        num_tokens = self._global_sum(float(loss_mask.sum().item()))
        num_seqs = self._global_sum(float((loss_mask.sum(dim=-1) > 0).sum().item()))

        loss_fn = PPOLossFunction(self._loss_cfg, batch.batch_size, batch.seq_len, capture_logprobs=rc is None)
        skipped, grad_norm_value = num_tokens == 0, 0.0
        if not skipped:
            td = to_verl_batch(
                train, old_logprobs=old_logprobs, is_weights=is_weights,
                micro_batch_tokens=self._micro_batch_tokens(train), calculate_entropy=self.cfg.compute_entropy,
                global_batch_size=num_seqs, use_remove_padding=self.verl_cfg.use_remove_padding,
            )
            with self.engine.train_mode():
                if not self.cfg.activation_checkpointing:  # HF checkpoints layers in train mode only
                    self.engine.module.eval()  # verl's train context calls .train(): keep dropout off
                out = self.engine.train_batch(td, loss_function=loss_fn)
            grad_norm_value = float(out["metrics"]["grad_norm"])
            skipped = not math.isfinite(grad_norm_value)  # verl skipped the step (zeroed the grads)
        if rc is None:  # bypass without rules: π_θ before the step came from the training forward
            rc = compute_rollout_correction(loss_fn.logprobs, batch.rollout_logprobs, batch.loss_mask, rc_cfg)
        self.num_updates += 1

        local_tokens = float(loss_mask.sum().item())
        sums = dict(loss_fn.sums)
        if not self.cfg.compute_entropy:
            sums.pop("actor/entropy")
        metrics = {"actor/pg_loss": self._global_sum(sums.pop("actor/pg_loss") / self.world_size)}
        for name, total in sums.items():
            metrics[name] = total / local_tokens if local_tokens > 0 else 0.0
        metrics.update({
            "actor/grad_norm": grad_norm_value,
            "actor/num_tokens": num_tokens,
            "actor/lr": float(self.engine.optimizer.param_groups[0]["lr"]),
            "actor/step_skipped": 1.0 if skipped else 0.0,
        })
        metrics.update(rc.metrics)
        metrics.update(extra)
        return metrics

    # --- weights out ----------------------------------------------------------------------

    def hf_model(self) -> torch.nn.Module:
        """The HF model inside verl's FSDP wrapper (FSDP2 shards it in place)."""
        return getattr(self.engine.module, "_fsdp_wrapped_module", self.engine.module)

    def _tied(self) -> set[str]:
        return _tied_parameter_names(self.hf_model()) if self.verl_cfg.strategy == "fsdp" else set()

    def _full_tensors(self):
        """(HF name, full tensor on the engine's device) one parameter at a time, from verl's
        `get_per_tensor_param` (a collective gather per tensor: every rank iterates to the end)."""
        tied = self._tied()
        params, _ = self.engine.get_per_tensor_param()
        for name, tensor in params:
            if name not in tied:
                yield name, tensor.detach()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 weights under HF names, on CPU (every rank must call this). Tied aliases are
        left out as in TrainerWorker."""
        return {name: t.to("cpu", torch.float32).clone().contiguous() for name, t in self._full_tensors()}

    # --- weights out: bucketed broadcast (workers/weight_sync/broadcast.py) ------------------

    def weight_specs(self) -> list[TensorSpec]:
        """Name, full shape and sync dtype of every tensor `broadcast_weights` sends, in its order
        (fsdp: read from the sharded state dict without gathering; megatron: gathers once)."""
        if self.verl_cfg.strategy != "fsdp":
            return [TensorSpec(n, tuple(t.shape), self.cfg.weight_sync_dtype) for n, t in self._full_tensors()]
        from verl.utils.model import convert_weight_keys

        tied = self._tied()
        sd = convert_weight_keys(self.engine.module.state_dict(), self.hf_model())
        return [TensorSpec(n, tuple(t.shape), self.cfg.weight_sync_dtype) for n, t in sd.items() if n not in tied]

    def open_weight_group(self, info: WeightGroupInfo) -> None:
        """Rank 0 joins the weight-sync group `info` as its sender (as TrainerWorker)."""
        if self.rank == 0:
            if self._weight_transport is not None:
                raise RuntimeError("this trainer already joined a weight-sync group")
            self._weight_transport = open_transport(info, 0, self.device)

    def broadcast_weights(self, version: int) -> SendReport | None:
        """Send the current full weights as `version` in buckets of `weight_sync_bucket_mb` (every
        rank must call it; rank 0 returns the SendReport). Raises RuntimeError before
        `open_weight_group`."""
        if self.rank == 0 and self._weight_transport is None:
            raise RuntimeError("broadcast_weights before open_weight_group")
        tensors = self._full_tensors()
        if self.rank != 0:
            for _ in tensors:
                pass
            return None
        return send_weights(self._weight_transport, self.weight_specs(), tensors, version=version,
                            bucket_bytes=bucket_bytes_of(self.cfg.weight_sync_bucket_mb))

    def export_weights(self, path: str) -> str:
        """Write the full weights as one safetensors file at `path` (temp file + rename); return path.
        Every rank must call it; only rank 0 writes."""
        sd = self.full_state_dict()
        if self.rank == 0:
            _atomic_write(path, lambda tmp: save_file(sd, tmp, metadata={"format": "pt"}))
        if self.world_size > 1:
            dist.barrier()
        return path

    def save_hf(self, directory: str) -> str:
        """Write an HF model directory (config, generation config, weights, tokenizer files when the
        source has them) that `from_pretrained` loads; return directory."""
        if self.rank == 0:
            from transformers import AutoConfig, AutoTokenizer, GenerationConfig

            os.makedirs(directory, exist_ok=True)
            AutoConfig.from_pretrained(self.cfg.model_path).save_pretrained(directory)
            try:
                GenerationConfig.from_pretrained(self.cfg.model_path).save_pretrained(directory)
            except OSError:
                pass  # the source has no generation config
            try:
                AutoTokenizer.from_pretrained(self.cfg.model_path).save_pretrained(directory)
            except (OSError, ValueError):
                pass  # the source has no tokenizer: weights only
        self.export_weights(os.path.join(directory, WEIGHTS_FILENAME))
        return directory

    # --- checkpoint: optimizer state ------------------------------------------------------

    def _require_fsdp(self, what: str) -> None:
        if self.verl_cfg.strategy != "fsdp":
            raise NotImplementedError(f"{what} with trainer.verl.strategy=megatron: use verl's engine.save_checkpoint")

    def save_optimizer(self, path: str) -> str:
        """Write the full AdamW state (HF parameter names, the same file TrainerWorker writes) and
        `num_updates` to `path`; return path. Every rank must call it; only rank 0 writes."""
        self._require_fsdp("save_optimizer")
        osd = get_optimizer_state_dict(self.engine.module, self.engine.optimizer,
                                       options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank == 0:
            _atomic_write(path, lambda tmp: torch.save({"optimizer": osd, "num_updates": self.num_updates}, tmp))
        if self.world_size > 1:
            dist.barrier()
        return path

    def load_optimizer(self, path: str) -> None:
        """Load a `save_optimizer` file (from either trainer) and restore `num_updates`.
        Raises ValueError when the file is not an optimizer checkpoint."""
        self._require_fsdp("load_optimizer")
        blob = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(blob, dict) or "optimizer" not in blob or "num_updates" not in blob:
            raise ValueError(f"{path} is not an optimizer checkpoint written by save_optimizer")
        set_optimizer_state_dict(self.engine.module, self.engine.optimizer, optim_state_dict=blob["optimizer"],
                                 options=StateDictOptions(full_state_dict=True))
        self.num_updates = int(blob["num_updates"])

    def close(self) -> None:
        """Release the weight-sync group, and the process group if this worker created it."""
        if self._weight_transport is not None:
            self._weight_transport.close()
            self._weight_transport = None
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_process_group = False
