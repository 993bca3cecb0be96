"""Settings of a trainer rank: what `TrainerWorker` (HF FSDP2) and `VerlTrainerWorker` take.

Light on purpose (no torch at import): the config layer maps `trainer.*` onto these, and a bad
value raises ValueError naming the `trainer.*` key when the settings are built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, get_args

from workers.core.algorithms.rollout_correction_config import RolloutCorrectionConfig

if TYPE_CHECKING:  # defined once, beside the loss (a torch module); checked by policy_loss_config()
    from workers.core.algorithms.losses import LossAggMode

MixedPrecision = Literal["bf16"]  # trainer.mixed_precision modes besides null (applied in workers/trainer/scale.py)
MIXED_PRECISION_MODES: tuple[MixedPrecision, ...] = get_args(MixedPrecision)


@dataclass(frozen=True)
class LoraSettings:
    """A LoRA adapter (PEFT) on the policy: W x + (alpha / rank) B A x on each module of
    `target_modules` (("all-linear",): every linear layer but the output head). `init`: "default"
    (PEFT's Kaiming A, B = 0) or "gaussian"; both start as the base model. `dropout`: PEFT's
    lora_dropout, active in the training forward only (workers/trainer/lora.py)."""

    rank: int
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("all-linear",)
    init: str = "default"

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"model.lora.rank must be >= 1 for an adapter, got {self.rank}")
        if self.alpha <= 0:
            raise ValueError(f"model.lora.alpha must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"model.lora.dropout must be in [0, 1), got {self.dropout}")
        if self.init not in ("default", "gaussian"):
            raise ValueError(f"model.lora.init must be default or gaussian, got {self.init!r}")

    @property
    def scaling(self) -> float:
        """alpha / rank: the factor of B A in the adapted layer."""
        return self.alpha / self.rank


@dataclass(frozen=True)
class TrainerSettings:
    """What a TrainerWorker needs. Ratios are PPO's ε; thresholds are IS weight caps.

    model_path: HF model directory (config.json + safetensors); nothing is downloaded.
    lr, betas, weight_decay: AdamW. grad_clip: max global grad norm (clip_grad_norm_), > 0.
    clip_ratio_low / clip_ratio_high: PPO clip range (default: clip_ratio for both).
    clip_ratio_c: dual-clip bound for negative advantages (> 1), None to disable.
    rollout_correction: mode (decoupled | bypass), IS level and thresholds, rejection rules
        (workers/core/algorithms/rollout_correction_config.py); default: decoupled, token TIS C=2.
    micro_batch_size: rows per forward/backward; gradients accumulate to one step per mini-batch.
    max_tokens_per_micro_batch: token budget per forward/backward (rows x longest row); None: use
        micro_batch_size. With a budget, rows are packed longest first (workers/trainer/scale.py).
    mixed_precision: None (fp32 everywhere) or "bf16" (FSDP2 bf16 params in compute, fp32 grad
        reduction, fp32 master weights and optimizer state).
    activation_checkpointing: recompute each decoder layer's activations in backward.
    weight_sync_dtype: dtype of the tensors `broadcast_weights` sends (the inference dtype).
    compute_entropy: log actor/entropy (costs one softmax over the vocabulary per micro-batch).
    device: "auto" picks CUDA when available, else CPU.
    sampling_temperature / sampling_top_p: the rollouts' sampling settings; log-probs are of the
        tempered, top-p-truncated distribution the engine sampled from (helpers.sampling_logits),
        as the engine's `processed_logprobs` are. trainer=verl scores the temperature only (verl's
        actor), so it refuses top_p < 1.
    lora: train only a LoRA adapter on the frozen base (`LoraSettings`), None: every weight.
    lora_adapter_path: a PEFT adapter directory to start the adapter from (a resumed checkpoint's
        `lora_adapter/`); None: the adapter's init.
    """

    model_path: str
    lr: float = 7e-4  # the embedded default's; `trainer.lr` reads it (orchestrator/config/trainer.py)
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float | None = 3.0
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    seed: int = 0
    micro_batch_size: int = 32
    max_tokens_per_micro_batch: int | None = None
    mixed_precision: MixedPrecision | None = None
    activation_checkpointing: bool = False
    weight_sync_dtype: str = "float32"
    weight_sync_bucket_mb: float = 512.0
    collective_timeout_s: float = 600.0  # gloo / NCCL: a collective whose peer died fails after this long
    loss_agg_mode: LossAggMode = "token-mean"
    attn_implementation: str = "sdpa"
    compute_entropy: bool = True
    device: Literal["auto", "cpu", "cuda"] = "auto"
    extra_model_kwargs: dict = field(default_factory=dict)
    sampling_temperature: float = 1.0
    sampling_top_p: float = 1.0
    lora: LoraSettings | None = None
    lora_adapter_path: str | None = None

    def __post_init__(self) -> None:
        if self.lora_adapter_path is not None and self.lora is None:
            raise ValueError("lora_adapter_path needs model.lora (an adapter to load it into)")
        if self.sampling_temperature <= 0:
            raise ValueError(f"rollout.temperature must be > 0 for training, got {self.sampling_temperature}")
        if not 0 < self.sampling_top_p <= 1:
            raise ValueError(f"rollout.top_p must be in (0, 1], got {self.sampling_top_p}")
        if self.lr <= 0:
            raise ValueError(f"trainer.lr must be > 0, got {self.lr}")
        if self.grad_clip <= 0:
            raise ValueError(f"trainer.grad_clip must be > 0, got {self.grad_clip}")
        if self.micro_batch_size < 1:
            raise ValueError(f"trainer.micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.max_tokens_per_micro_batch is not None and self.max_tokens_per_micro_batch < 1:
            raise ValueError(
                f"trainer.max_tokens_per_micro_batch must be >= 1 or None, got {self.max_tokens_per_micro_batch}"
            )
        if self.mixed_precision is not None and self.mixed_precision not in MIXED_PRECISION_MODES:
            raise ValueError(
                f"trainer.mixed_precision must be null or one of {MIXED_PRECISION_MODES}, got {self.mixed_precision!r}")
        from workers.weight_sync.broadcast import bucket_bytes_of
        from workers.weight_sync.plan import dtype_from_name

        dtype_from_name(self.weight_sync_dtype)
        bucket_bytes_of(self.weight_sync_bucket_mb)
        self.policy_loss_config()  # validates clip ratios and loss_agg_mode
        if not isinstance(self.rollout_correction, RolloutCorrectionConfig):
            raise ValueError(
                "trainer rollout_correction must be a RolloutCorrectionConfig, "
                f"got {type(self.rollout_correction).__name__}"
            )

    def policy_loss_config(self):
        """The PPO loss settings (workers/core/algorithms/losses.py PolicyLossConfig)."""
        from workers.core.algorithms.losses import PolicyLossConfig

        low = self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low
        high = self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high
        return PolicyLossConfig(
            clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=self.clip_ratio_c, loss_agg_mode=self.loss_agg_mode
        )

    def rollout_correction_config(self) -> RolloutCorrectionConfig:
        return self.rollout_correction


VerlStrategy = Literal["fsdp", "megatron"]
_VERL_BACKEND = {"fsdp": "fsdp2", "megatron": "megatron"}  # our strategy name -> verl EngineRegistry backend


@dataclass(frozen=True)
class VerlSettings:
    """verl-specific options (`trainer.verl.*`).

    strategy: fsdp (verl's FSDP2 engine, backend "fsdp2"; CPU or GPU) | megatron (GPU only).
    use_remove_padding: pack the sequences of a micro-batch (flash-attn varlen; GPU) instead of
        padding them (sdpa; works everywhere).
    attn_implementation: HF attention implementation verl loads the model with (sdpa on CPU).
    use_torch_compile: let verl torch.compile its entropy kernel (needs a compiler toolchain).
    tensor_model_parallel_size, pipeline_model_parallel_size: Megatron parallel sizes.
    """

    strategy: VerlStrategy = "fsdp"
    use_remove_padding: bool = False
    attn_implementation: str = "sdpa"
    use_torch_compile: bool = False
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.strategy not in _VERL_BACKEND:
            raise ValueError(f"trainer.verl.strategy must be fsdp or megatron, got {self.strategy!r}")
        if self.tensor_model_parallel_size < 1 or self.pipeline_model_parallel_size < 1:
            raise ValueError("trainer.verl tensor/pipeline_model_parallel_size must be >= 1")
