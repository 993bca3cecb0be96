"""`trainer` group: optimizer, loop length, checkpoints, weight sync and the verl engine; maps to
the trainer worker's TrainerSettings / VerlSettings (workers/trainer/settings.py) and its actor class.

Choice lists are the worker modules': verl strategies and mixed-precision modes are
workers/trainer/settings.py's Literals, weight-sync backends workers/weight_sync/setup.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, get_args

from orchestrator.config.algorithm import AlgorithmConfig
from orchestrator.config.cluster import ClusterConfig
from orchestrator.config.errors import check, one_of
from orchestrator.config.inference import InferenceConfig
from orchestrator.config.defaults import default_of
from workers.trainer.settings import MixedPrecision, TrainerSettings, VerlStrategy
from workers.weight_sync.setup import BROADCAST_BACKENDS, FILE_BACKEND

if TYPE_CHECKING:
    from workers.trainer.settings import LoraSettings, VerlSettings

TRAINER_NAMES = ("fsdp", "verl")  # trainer_class() below maps each to its actor class
WEIGHT_SYNC_BACKENDS = (FILE_BACKEND, *BROADCAST_BACKENDS)
CUDA_WEIGHT_SYNC_BACKENDS = ("cuda_ipc", "nccl")  # need CUDA devices: refused on cluster=local
RESUME_MODES = ("disable", "auto", "resume_path")  # orchestrator/control/run_checkpoint.py find_resume_checkpoint


@dataclass
class WeightSyncConfig:
    """Trainer -> inference weight transfer (workers/weight_sync/). `backend`: file (one
    safetensors file every replica reloads) | shm (bucketed broadcast through /dev/shm, one node)
    | cuda_ipc (the same through CUDA IPC buffers, trainer and inference on one GPU) | gloo
    (bucketed broadcast over a TCP process group) | nccl (the same over NCCL, GPU).
    `bucket_mb`: broadcast bucket size in MiB (verl: update_weights_bucket_megabytes). The sent
    dtype is `inference.dtype`. `probe`: after every sync, each engine scores a fixed probe
    sequence and the trainer compares with its own log-probs (workers/weight_sync/probe.py): a max
    |difference| over `probe_atol` stops the run naming the version; null atol: 1e-3 with
    inference.dtype=float32, 5e-2 with bfloat16. Off with cluster=colocated and trainer=verl."""

    backend: str = "file"
    bucket_mb: float = 512.0
    probe: bool = True
    probe_atol: Optional[float] = None

    def __post_init__(self) -> None:
        one_of(self.backend, "trainer.weight_sync.backend", WEIGHT_SYNC_BACKENDS)
        check(self.bucket_mb > 0, "trainer.weight_sync.bucket_mb", "must be > 0", self.bucket_mb)
        check(self.probe_atol is None or self.probe_atol > 0, "trainer.weight_sync.probe_atol", "must be null or > 0",
              self.probe_atol)


@dataclass
class VerlEngineConfig:
    """`trainer.verl.*`, read only when `trainer.name=verl` (workers/trainer/verl_worker.py): `strategy`
    fsdp (verl's FSDP2 engine; CPU or GPU) | megatron (verl's Megatron-Core engine; GPU only);
    `use_remove_padding` packs sequences (flash-attn varlen, GPU); `attn_implementation` is the HF
    attention verl loads the model with; `tensor/pipeline_model_parallel_size`: Megatron only."""

    strategy: str = "fsdp"
    use_remove_padding: bool = False
    attn_implementation: str = "sdpa"
    tensor_model_parallel_size: int = 1  # megatron only
    pipeline_model_parallel_size: int = 1  # megatron only

    def __post_init__(self) -> None:
        one_of(self.strategy, "trainer.verl.strategy", get_args(VerlStrategy))
        check(self.tensor_model_parallel_size >= 1, "trainer.verl.tensor_model_parallel_size", "must be >= 1",
              self.tensor_model_parallel_size)
        check(self.pipeline_model_parallel_size >= 1, "trainer.verl.pipeline_model_parallel_size",
              "must be >= 1", self.pipeline_model_parallel_size)


@dataclass
class TrainerConfig:
    """Optimizer and loop length. `total_steps`: training steps (one batch of groups each).
    GPU scale: `max_tokens_per_micro_batch` (token budget per forward/backward, rows x longest
    row; null: `micro_batch_size` rows), `mixed_precision` (null | bf16: FSDP2 bf16 compute, fp32
    master weights and gradient reduction), `activation_checkpointing` (recompute each decoder
    layer in backward)."""

    name: str = "fsdp"
    total_steps: int = 60
    lr: float = default_of(TrainerSettings, "lr")
    weight_decay: float = default_of(TrainerSettings, "weight_decay")
    grad_clip: float = default_of(TrainerSettings, "grad_clip")
    micro_batch_size: int = default_of(TrainerSettings, "micro_batch_size")
    seed: int = default_of(TrainerSettings, "seed")
    # checkpoints (verl's names): every `save_freq` steps (<= 0: never), keep the newest
    # `max_ckpt_to_keep`; `resume_mode`: disable | auto (latest under run_dir, if any) | resume_path
    save_freq: int = 0
    max_ckpt_to_keep: int = 2
    resume_mode: str = "disable"
    resume_from_path: str | None = None
    # a dead trainer rank: restart the whole trainer group (and the replicas, the rollout pool) from the
    # last checkpoint inside the run, this many times over the run (0: the run stops; resume it)
    max_restarts: int = 0
    # validation on `task.val_split` (the `eval` group's n and sampling): every `test_freq` steps
    # (<= 0: never) and, with `val_before_train`, once before the first step (verl's names)
    test_freq: int = 0
    val_before_train: bool = False
    max_tokens_per_micro_batch: Optional[int] = None
    mixed_precision: Optional[str] = None
    activation_checkpointing: bool = False
    collective_timeout_s: float = 600.0  # gloo / NCCL collective timeout: a rank whose peer died fails after this long
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    verl: VerlEngineConfig = field(default_factory=VerlEngineConfig)  # trainer.name=verl only

    def __post_init__(self) -> None:
        one_of(self.name, "trainer.name", TRAINER_NAMES)
        check(self.max_tokens_per_micro_batch is None or self.max_tokens_per_micro_batch >= 1,
              "trainer.max_tokens_per_micro_batch", "must be null or >= 1", self.max_tokens_per_micro_batch)
        precisions = get_args(MixedPrecision)
        check(self.mixed_precision is None or self.mixed_precision in precisions, "trainer.mixed_precision",
              f"must be null or {' | '.join(precisions)}", self.mixed_precision)
        check(self.max_restarts >= 0, "trainer.max_restarts", "must be >= 0", self.max_restarts)
        check(self.max_restarts == 0 or self.save_freq > 0, "trainer.max_restarts",
              f"needs trainer.save_freq > 0 (a restart continues from the last checkpoint; got save_freq="
              f"{self.save_freq})", self.max_restarts)
        check(self.max_ckpt_to_keep >= 1, "trainer.max_ckpt_to_keep", "must be >= 1", self.max_ckpt_to_keep)
        one_of(self.resume_mode, "trainer.resume_mode", RESUME_MODES)
        check((self.resume_mode == "resume_path") == bool(self.resume_from_path), "trainer.resume_from_path",
              "must be set exactly when trainer.resume_mode=resume_path", self.resume_from_path)
        check(self.total_steps >= 1, "trainer.total_steps", "must be >= 1", self.total_steps)
        check(self.collective_timeout_s > 0, "trainer.collective_timeout_s", "must be > 0", self.collective_timeout_s)
        check(self.lr > 0, "trainer.lr", "must be > 0", self.lr)
        check(self.grad_clip > 0, "trainer.grad_clip", "must be > 0", self.grad_clip)
        check(self.micro_batch_size >= 1, "trainer.micro_batch_size", "must be >= 1", self.micro_batch_size)


def trainer_settings(t: TrainerConfig, *, algorithm: AlgorithmConfig, inference: InferenceConfig,
                     model_path: str, sampling: tuple[float, float] = (1.0, 1.0), lora: LoraSettings | None = None,
                     lora_adapter_path: str | None = None) -> TrainerSettings:
    """What every trainer rank is built with (workers/trainer/settings.py); the PPO clip and the
    rollout correction come from `algorithm`, the sent weights' dtype from `inference.dtype`, the
    scored distribution from the rollouts' `sampling` (temperature, top_p); `lora`
    (orchestrator/config/model.py lora_settings) and the adapter a resumed run starts from."""
    alg = algorithm
    return TrainerSettings(
        model_path=model_path, lr=t.lr, weight_decay=t.weight_decay, grad_clip=t.grad_clip,
        clip_ratio_low=alg.clip_ratio_low, clip_ratio_high=alg.clip_ratio_high, loss_agg_mode=alg.loss_agg_mode,  # type: ignore[arg-type]
        rollout_correction=alg.rollout_correction.typed(), seed=t.seed, micro_batch_size=t.micro_batch_size,
        max_tokens_per_micro_batch=t.max_tokens_per_micro_batch, mixed_precision=t.mixed_precision,  # type: ignore[arg-type]
        activation_checkpointing=t.activation_checkpointing, weight_sync_dtype=inference.dtype,
        weight_sync_bucket_mb=t.weight_sync.bucket_mb, sampling_temperature=sampling[0], sampling_top_p=sampling[1],
        collective_timeout_s=t.collective_timeout_s, lora=lora, lora_adapter_path=lora_adapter_path)


def verl_settings(v: VerlEngineConfig) -> VerlSettings:
    """`trainer.verl.*` as the verl engine's VerlSettings."""
    from workers.trainer.settings import VerlSettings

    return VerlSettings(strategy=v.strategy, use_remove_padding=v.use_remove_padding,  # type: ignore[arg-type]
                        attn_implementation=v.attn_implementation,
                        tensor_model_parallel_size=v.tensor_model_parallel_size,
                        pipeline_model_parallel_size=v.pipeline_model_parallel_size)


def trainer_class(t: TrainerConfig, *, cluster: ClusterConfig) -> tuple[type, dict]:
    """The trainer actor class for `trainer.name` and its extra constructor kwargs (imports torch).
    trainer=verl checks here that verl's engine can run (raises RuntimeError naming what is missing)."""
    if t.name == "fsdp":
        from workers.trainer.worker import TrainerWorker

        return TrainerWorker, {}
    from workers.trainer.verl_worker import VerlTrainerWorker, check_verl_available

    settings = verl_settings(t.verl)
    check_verl_available(settings, cuda=cluster.trainer.gpus_per_node > 0)
    return VerlTrainerWorker, {"verl": settings}
