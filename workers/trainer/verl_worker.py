"""VerlTrainerWorker: TrainerWorker's interface over verl's training engine (`trainer.name=verl`).

A plain class; Ray is applied by the caller, as for TrainerWorker (workers/trainer/worker.py). One instance
per data-parallel rank: the same `TrainerShell` (workers/trainer/shell.py) around `VerlEngine`. The model, its sharding, the optimizer, micro-batching and the optimizer step
are verl 0.9.1's `BaseEngine` (built through `verl.workers.engine.EngineRegistry`): `fsdp` (FSDP2 over
the HF model; runs on CPU with gloo through workers/trainer/verl_parts.PlatformCPU) or `megatron`
(verl's Megatron-Core engine; GPU only, needs megatron-core and mbridge). The algorithm is ours: the
engine's loss hook computes `workers.core.algorithms.losses.ppo_clip_loss`, and rollout correction,
rejection and their metrics run in the shell's `update`, so both trainers share them.

Invariants (same as TrainerWorker, which a test checks to ~1e-5 on the same batch):
- Log-probs use TrainBatch's alignment (workers/trainer/verl_parts.engine_to_batch_alignment).
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
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from workers.core.algorithms.batch import TrainBatch
from workers.trainer.helpers import _tied_parameter_names
from workers.trainer.protocol import StepInputs, StepOutcome
from workers.trainer.settings import _VERL_BACKEND, TrainerSettings, VerlSettings
from workers.trainer.shell import RankContext, TrainerShell, pick_device
from workers.trainer.verl_parts import (
    PPOLossFunction,
    engine_to_batch_alignment,
    to_verl_batch,
    use_verl_cpu_platform,
)
from workers.weight_sync.plan import TensorSpec

__all__ = ["VerlEngine", "VerlSettings", "VerlTrainerWorker", "check_verl_available", "verl_configs"]


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


class VerlEngine:
    """verl's training engine for one rank (`TrainerEngine`): model, sharding, optimizer,
    micro-batching and the step are verl's `BaseEngine`; the loss is ours (`PPOLossFunction`)."""

    def __init__(self, cfg: TrainerSettings, vc: VerlSettings, ctx: RankContext) -> None:
        from verl.trainer.config import CheckpointConfig
        from verl.workers.engine import EngineRegistry

        self.cfg, self.verl_cfg, self.ctx = cfg, vc, ctx
        c = verl_configs(cfg, vc)
        self.engine = EngineRegistry.new(
            model_type="language_model", backend=_VERL_BACKEND[vc.strategy], model_config=c.model,
            engine_config=c.engine, optimizer_config=c.optimizer, checkpoint_config=CheckpointConfig(),
        )
        self.engine.initialize()
        self._loss_cfg = cfg.policy_loss_config()

    def _micro_batch_tokens(self, batch: TrainBatch) -> int:
        """verl's per-micro-batch token budget (sum of real row lengths): the configured
        `max_tokens_per_micro_batch`, else micro_batch_size x the longest row."""
        longest = int(batch.attention_mask.sum(dim=-1).max())
        budget = self.cfg.max_tokens_per_micro_batch or self.cfg.micro_batch_size * longest
        return max(budget, longest)

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch, *, trained_only: bool = False) -> torch.Tensor:
        """verl `infer_batch`, no grad, realigned to TrainBatch; [B, T] float32 on CPU. verl's engine
        scores every token, so `trained_only` changes nothing here."""
        td = to_verl_batch(batch, micro_batch_tokens=self._micro_batch_tokens(batch), calculate_entropy=False,
                           use_remove_padding=self.verl_cfg.use_remove_padding,
                           temperature=self.cfg.sampling_temperature)
        with self.engine.eval_mode():
            out = self.engine.infer_batch(td, loss_function=None)
        lp = engine_to_batch_alignment(out["model_output"]["log_probs"], batch.seq_len)
        return lp.float().cpu() * batch.attention_mask

    def train_step(self, train: TrainBatch, inputs: StepInputs) -> StepOutcome:
        """verl's `train_batch` with our loss hook: zero grad, forward/backward per micro-batch,
        clip the global grad norm, step unless it is not finite."""
        loss_fn = PPOLossFunction(self._loss_cfg, train.batch_size, train.seq_len,
                                  capture_logprobs=inputs.capture_logprobs, seq_num_tokens=inputs.seq_num_tokens)
        td = to_verl_batch(
            train, old_logprobs=inputs.old_logprobs, is_weights=inputs.is_weights,
            micro_batch_tokens=self._micro_batch_tokens(train), calculate_entropy=self.cfg.compute_entropy,
            global_batch_size=inputs.num_seqs, use_remove_padding=self.verl_cfg.use_remove_padding,
            temperature=self.cfg.sampling_temperature,
        )
        with self.engine.train_mode():
            if not self.cfg.activation_checkpointing:  # HF checkpoints layers in train mode only
                self.engine.module.eval()  # verl's train context calls .train(): keep dropout off
            out = self.engine.train_batch(td, loss_function=loss_fn)
        grad_norm = float(out["metrics"]["grad_norm"])
        # a non-finite norm: verl skipped the step (zeroed the grads)
        return StepOutcome(dict(loss_fn.sums), grad_norm, not math.isfinite(grad_norm), loss_fn.logprobs)

    def lr(self) -> float:
        return float(self.engine.optimizer.param_groups[0]["lr"])

    # --- weights and optimizer state ------------------------------------------------------

    def hf_model(self) -> torch.nn.Module:
        """The HF model inside verl's FSDP wrapper (FSDP2 shards it in place)."""
        return getattr(self.engine.module, "_fsdp_wrapped_module", self.engine.module)

    def _tied(self) -> set[str]:
        return _tied_parameter_names(self.hf_model()) if self.verl_cfg.strategy == "fsdp" else set()

    def full_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor on the engine's device) one parameter at a time, from verl's
        `get_per_tensor_param` (a collective gather per tensor: every rank iterates to the end)."""
        tied = self._tied()
        params, _ = self.engine.get_per_tensor_param()
        for name, tensor in params:
            if name not in tied:
                yield name, tensor.detach()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {name: t.to("cpu", torch.float32).clone().contiguous() for name, t in self.full_tensors()}

    def weight_specs(self) -> list[TensorSpec]:
        """fsdp: read from the sharded state dict without gathering; megatron: gathers once."""
        if self.verl_cfg.strategy != "fsdp":
            return [TensorSpec(n, tuple(t.shape), self.cfg.weight_sync_dtype) for n, t in self.full_tensors()]
        from verl.utils.model import convert_weight_keys

        tied = self._tied()
        sd = convert_weight_keys(self.engine.module.state_dict(), self.hf_model())
        return [TensorSpec(n, tuple(t.shape), self.cfg.weight_sync_dtype) for n, t in sd.items() if n not in tied]

    def write_hf_metadata(self, directory: str) -> None:
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        AutoConfig.from_pretrained(self.cfg.model_path).save_pretrained(directory)
        try:
            GenerationConfig.from_pretrained(self.cfg.model_path).save_pretrained(directory)
        except OSError:
            pass  # the source has no generation config
        try:
            AutoTokenizer.from_pretrained(self.cfg.model_path).save_pretrained(directory)
        except (OSError, ValueError):
            pass  # the source has no tokenizer: weights only

    def _require_fsdp(self, what: str) -> None:
        if self.verl_cfg.strategy != "fsdp":
            raise NotImplementedError(f"{what} with trainer.verl.strategy=megatron: use verl's engine.save_checkpoint")

    def optimizer_state(self) -> dict[str, Any]:
        """The full AdamW state under HF parameter names (the state TrainerWorker saves)."""
        self._require_fsdp("save_optimizer")
        return get_optimizer_state_dict(self.engine.module, self.engine.optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        self._require_fsdp("load_optimizer")
        set_optimizer_state_dict(self.engine.module, self.engine.optimizer, optim_state_dict=state,
                                 options=StateDictOptions(full_state_dict=True))


class VerlTrainerWorker(TrainerShell):
    """One data-parallel rank driving verl's engine. Same public methods as TrainerWorker.

    Args:
        cfg: TrainerSettings (shared with TrainerWorker; `extra_model_kwargs` is not used here).
        verl: VerlSettings.
        rank, world_size, init_method: as TrainerWorker.

    Raises:
        ValueError: bad rank / world size, or `extra_model_kwargs` set; RuntimeError: the engine
            cannot run here (`check_verl_available`).
    """

    def __init__(self, cfg: TrainerSettings, verl: VerlSettings | None = None, *, rank: int = 0,
                 world_size: int = 1, init_method: str | None = None) -> None:
        if cfg.extra_model_kwargs:
            raise ValueError("trainer=verl loads the model through verl's HFModelConfig: extra_model_kwargs "
                             f"{sorted(cfg.extra_model_kwargs)} are not supported (use trainer.verl.*)")
        if cfg.sampling_top_p < 1:
            raise ValueError(f"trainer=verl scores the tempered distribution without top-p truncation, so it cannot "
                             f"match rollouts sampled with rollout.top_p={cfg.sampling_top_p}; use rollout.top_p=1 "
                             "or trainer=fsdp")
        self.verl_cfg = verl or VerlSettings()
        device = pick_device(cfg)
        check_verl_available(self.verl_cfg, cuda=device.type == "cuda")
        if device.type != "cuda":
            use_verl_cpu_platform()  # before verl's engine modules are imported
        super().__init__(cfg, lambda ctx: VerlEngine(cfg, self.verl_cfg, ctx), rank=rank, world_size=world_size,
                         init_method=init_method, device=device)

    def hf_model(self) -> torch.nn.Module:
        """The HF model inside verl's FSDP wrapper (FSDP2 shards it in place)."""
        return self.engine.hf_model()
