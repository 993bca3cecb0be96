"""Typed config schema of a run, registered in Hydra's ConfigStore, validated where declared.

Every group under `configs/` (mode, cluster, model, trainer, inference, rollout, task,
algorithm, logger) fills one dataclass below. `OmegaConf.to_object` turns the composed config
into these dataclasses, which runs each `__post_init__`; a bad value raises `ConfigError` whose
message starts with the dotted key (`rollout.n must be >= 1, got 0`). Nothing here imports Ray,
torch or vLLM, so a bad config fails in about a second, before any process starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from workers.core.algorithms.rollout_correction_config import RejectionRule, parse_is_threshold
from workers.core.algorithms.rollout_correction_config import RolloutCorrectionConfig as TypedRolloutCorrection


class ConfigError(ValueError):
    """A config value is invalid; the message names the dotted key."""


def _check(cond: bool, key: str, msg: str, value: Any) -> None:
    if not cond:
        raise ConfigError(f"{key} {msg}, got {value!r}")


def _one_of(value: str, key: str, choices: tuple[str, ...]) -> None:
    _check(value in choices, key, f"must be one of {list(choices)}", value)


@dataclass
class ModeConfig:
    """Sync or async training loop. `sync_every`: optimizer updates (mini-batches) per weight sync
    (verl: `parameter_sync_step`)."""

    name: str = "sync"
    sync_every: int = 1

    def __post_init__(self) -> None:
        _one_of(self.name, "mode.name", ("sync", "async"))
        _check(self.sync_every >= 1, "mode.sync_every", "must be >= 1", self.sync_every)


@dataclass
class TrainerPlacementConfig:
    """Trainer GPUs (`cluster.trainer`): `nodes` x `gpus_per_node` ranks, one GPU each (0: CPU, cluster=local)."""

    nodes: int = 1
    gpus_per_node: int = 0


@dataclass
class InferencePlacementConfig:
    """Inference GPUs (`cluster.inference`): `replicas` engines of `tensor_parallel_size` GPUs each.
    `replicas` must equal `inference.replicas` (the cluster yamls interpolate it from there)."""

    replicas: int = 1
    tensor_parallel_size: int = 1


@dataclass
class ClusterConfig:
    """Where actors go (workers/core/placement.py). `name`: local (no GPUs), disaggregated (trainer
    and inference on separate GPUs) or colocated (they share GPUs; inference sleeps during updates).
    `num_cpus` / `num_gpus`: logical CPUs / GPUs of a Ray cluster the driver starts itself (None:
    the machine's; ignored when joining a cluster). `placement_timeout_s`: wait for placement groups."""

    name: str = "local"
    address: str | None = None
    num_cpus: int | None = None
    num_gpus: int | None = None
    trainer_replicas: int = 1
    torch_threads: int = 1
    trainer: TrainerPlacementConfig = field(default_factory=TrainerPlacementConfig)
    inference: InferencePlacementConfig = field(default_factory=InferencePlacementConfig)
    placement_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        _one_of(self.name, "cluster.name", ("local", "disaggregated", "colocated"))
        _check(self.trainer_replicas == 1, "cluster.trainer_replicas", "must be 1 on a CPU cluster", self.trainer_replicas)
        _check(self.torch_threads >= 1, "cluster.torch_threads", "must be >= 1", self.torch_threads)
        _check(self.num_gpus is None or self.num_gpus >= 0, "cluster.num_gpus", "must be >= 0", self.num_gpus)
        _check(self.placement_timeout_s > 0, "cluster.placement_timeout_s", "must be > 0", self.placement_timeout_s)
        try:
            self.placement_spec()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def placement_spec(self):
        """The typed request of workers/core/placement.py (raises ValueError naming the key)."""
        from workers.core.placement import PlacementSpec

        return PlacementSpec(mode=self.name, trainer_nodes=self.trainer.nodes,  # type: ignore[arg-type]
                             trainer_gpus_per_node=self.trainer.gpus_per_node,
                             inference_replicas=self.inference.replicas,
                             tensor_parallel_size=self.inference.tensor_parallel_size)


@dataclass
class ModelConfig:
    """The policy. `path`: a Hugging Face model dir; None builds (once) and uses the tiny default.

    chat_template: a Jinja file replacing the tokenizer's chat template in the gateway (vLLM's
    `--chat-template`), e.g. for a model whose own template renders no tools.
    tool_call_parser: the gateway's tool-call format: "auto" (from the template), "hermes",
    "qwen3_coder" or "none" (requests offering tools are then refused with a 400).
    """

    name: str = "tiny"
    path: str | None = None
    served_name: str = "policy"
    chat_template: str | None = None
    tool_call_parser: str = "auto"

    def __post_init__(self) -> None:
        _check(self.tool_call_parser in ("auto", "hermes", "qwen3_coder", "none"), "model.tool_call_parser",
               "must be one of auto, hermes, qwen3_coder, none", self.tool_call_parser)
        if self.chat_template is not None:
            _check(Path(self.chat_template).is_file(), "model.chat_template", "must be a Jinja file", self.chat_template)
        if self.path is not None:
            _check(Path(self.path).is_dir() and (Path(self.path) / "config.json").is_file(), "model.path",
                   "must be a local Hugging Face model directory (with config.json)", self.path)


WEIGHT_SYNC_BACKENDS = ("file", "shm", "cuda_ipc", "gloo", "nccl")
WEIGHT_SYNC_WIRED = WEIGHT_SYNC_BACKENDS  # all built by workers/weight_sync/setup.py (nccl / cuda_ipc need CUDA)


@dataclass
class WeightSyncConfig:
    """Trainer -> inference weight transfer (workers/weight_sync*.py). `backend`: file (one
    safetensors file every replica reloads) | shm (bucketed broadcast through /dev/shm, one node)
    | cuda_ipc (the same through CUDA IPC buffers, trainer and inference on one GPU) | gloo
    (bucketed broadcast over a TCP process group) | nccl (the same over NCCL, GPU).
    `bucket_mb`: broadcast bucket size in MiB (verl: update_weights_bucket_megabytes). The sent
    dtype is `inference.dtype`."""

    backend: str = "file"
    bucket_mb: float = 512.0

    def __post_init__(self) -> None:
        _one_of(self.backend, "trainer.weight_sync.backend", WEIGHT_SYNC_BACKENDS)
        _check(self.backend in WEIGHT_SYNC_WIRED, "trainer.weight_sync.backend",
               f"is not wired into the run yet (wired: {list(WEIGHT_SYNC_WIRED)})", self.backend)
        _check(self.bucket_mb > 0, "trainer.weight_sync.bucket_mb", "must be > 0", self.bucket_mb)


@dataclass
class VerlEngineConfig:
    """`trainer.verl.*`, read only when `trainer.name=verl` (workers/trainer/verl_worker.py): `strategy`
    fsdp (verl's FSDP2 engine; CPU or GPU) | megatron (verl's Megatron-Core engine; GPU only);
    `use_remove_padding` packs sequences (flash-attn varlen, GPU); `attn_implementation` is the HF
    attention verl loads the model with; `tensor/pipeline_model_parallel_size`: Megatron only."""

    strategy: str = "fsdp"
    use_remove_padding: bool = False
    attn_implementation: str = "sdpa"
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1

    def __post_init__(self) -> None:
        _one_of(self.strategy, "trainer.verl.strategy", ("fsdp", "megatron"))
        _check(self.tensor_model_parallel_size >= 1, "trainer.verl.tensor_model_parallel_size", "must be >= 1",
               self.tensor_model_parallel_size)
        _check(self.pipeline_model_parallel_size >= 1, "trainer.verl.pipeline_model_parallel_size",
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
    lr: float = 7e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    micro_batch_size: int = 32
    seed: int = 0
    # checkpoints (verl's names): every `save_freq` steps (<= 0: never), keep the newest
    # `max_ckpt_to_keep`; `resume_mode`: disable | auto (latest under run_dir, if any) | resume_path
    save_freq: int = 0
    max_ckpt_to_keep: int = 2
    resume_mode: str = "disable"
    resume_from_path: str | None = None
    max_tokens_per_micro_batch: Optional[int] = None
    mixed_precision: Optional[str] = None
    activation_checkpointing: bool = False
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    verl: VerlEngineConfig = field(default_factory=VerlEngineConfig)  # trainer.name=verl only

    def __post_init__(self) -> None:
        _one_of(self.name, "trainer.name", ("fsdp", "verl"))
        _check(self.max_tokens_per_micro_batch is None or self.max_tokens_per_micro_batch >= 1,
               "trainer.max_tokens_per_micro_batch", "must be null or >= 1", self.max_tokens_per_micro_batch)
        _check(self.mixed_precision in (None, "bf16"), "trainer.mixed_precision", "must be null or bf16",
               self.mixed_precision)
        _check(self.max_ckpt_to_keep >= 1, "trainer.max_ckpt_to_keep", "must be >= 1", self.max_ckpt_to_keep)
        _one_of(self.resume_mode, "trainer.resume_mode", ("disable", "auto", "resume_path"))
        _check((self.resume_mode == "resume_path") == bool(self.resume_from_path), "trainer.resume_from_path",
               "must be set exactly when trainer.resume_mode=resume_path", self.resume_from_path)
        _check(self.total_steps >= 1, "trainer.total_steps", "must be >= 1", self.total_steps)
        _check(self.lr > 0, "trainer.lr", "must be > 0", self.lr)
        _check(self.grad_clip > 0, "trainer.grad_clip", "must be > 0", self.grad_clip)
        _check(self.micro_batch_size >= 1, "trainer.micro_batch_size", "must be >= 1", self.micro_batch_size)


@dataclass
class InferenceConfig:
    """vLLM replicas. `kv_cache_gib`: KV-cache size per replica in GiB (explicit on CPU)."""

    name: str = "vllm_cpu"
    replicas: int = 1
    max_model_len: int = 512
    kv_cache_gib: float = 1.0
    max_num_seqs: int = 64
    dtype: str = "float32"

    def __post_init__(self) -> None:
        _one_of(self.name, "inference.name", ("vllm_cpu",))
        _check(self.replicas >= 1, "inference.replicas", "must be >= 1", self.replicas)
        _check(self.max_model_len >= 16, "inference.max_model_len", "must be >= 16", self.max_model_len)
        _check(self.kv_cache_gib > 0, "inference.kv_cache_gib", "must be > 0", self.kv_cache_gib)
        _one_of(self.dtype, "inference.dtype", ("float32", "bfloat16"))


@dataclass
class AcrLimitsSchema:
    """Cluster-wide ACR limits (workers/acr/limits.py), each held by one named Ray actor.

    requests_per_s: cap on EVERY ACR request (invoke, get, stop, command, botocore retries
    included) in any 1 s window; headroom: fraction of it the token bucket holds back for the
    delay between a grant and its request (see AcrLimitsConfig).
    max_open_sessions: ACR sessions open at once (invoked, not yet stopped), whole cluster.
    """

    requests_per_s: float = 25.0
    headroom: float = 0.2
    max_open_sessions: int = 1000

    def __post_init__(self) -> None:
        _check(self.requests_per_s > 0, "rollout.acr.limits.requests_per_s", "must be > 0", self.requests_per_s)
        _check(0 <= self.headroom < 1, "rollout.acr.limits.headroom", "must be in [0, 1)", self.headroom)
        _check(self.max_open_sessions >= 1, "rollout.acr.limits.max_open_sessions", "must be >= 1",
               self.max_open_sessions)


@dataclass
class AcrConfig:
    """ACR endpoint. With `rollout=local` the emulator and moto S3 are started on loopback and
    `agent_runtime_arn` / `s3_bucket` point at them; otherwise they name real AWS resources."""

    agent_runtime_arn: str = "arn:aws:bedrock-agentcore:us-west-2:000000000000:runtime/letters-agent"
    qualifier: str = "DEFAULT"
    s3_bucket: str = "rollouts"
    region: str = "us-west-2"
    num_agents: int = 2
    session_rate_per_s: float = 25.0
    agent_cmd: str | None = None
    agent_env: dict[str, str] = field(default_factory=dict)  # extra env vars of the agent processes
    limits: AcrLimitsSchema = field(default_factory=lambda: AcrLimitsSchema())
    retry_mode: str = "standard"  # botocore retry mode for throttling / 5xx
    max_attempts: int = 8  # botocore total attempts per call
    runtime_error_attempts: int = 3  # invocations of one session on RuntimeClientError (424)


@dataclass
class RolloutConfig:
    """Rollout pool. `n`: samples per prompt (group size); `batch_size`: prompts per step;
    `timeout_s`: per-rollout deadline (seconds) after which the rollout is `expired`."""

    name: str = "local"
    n: int = 4
    batch_size: int = 8
    num_workers: int = 2
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    timeout_s: float = 120.0
    poll_initial_s: float = 0.02
    poll_max_s: float = 0.5
    max_context_tokens: int = 512
    contract: str = "s3"  # s3: `_rollout` + result in S3 | http: `_config` + `_agentcore_runtime` records
    http_background: bool = False  # http: start in the background and poll `get` (else the start answers)
    push_grace_s: float = 5.0  # s3: once agents POST results, S3 polling starts this long after the invoke
    result_host: str = "127.0.0.1"  # where rollout actors take posted results ("" = S3 polling only)
    max_consecutive_bad_results: int = 32  # agent results in a row without a usable reward: stop the run
    acr: AcrConfig = field(default_factory=AcrConfig)

    def __post_init__(self) -> None:
        _one_of(self.name, "rollout.name", ("local", "aws"))
        _check(self.n >= 1, "rollout.n", "must be >= 1", self.n)
        _check(self.batch_size >= 1, "rollout.batch_size", "must be >= 1", self.batch_size)
        _check(self.num_workers >= 1, "rollout.num_workers", "must be >= 1", self.num_workers)
        _check(self.max_tokens >= 1, "rollout.max_tokens", "must be >= 1", self.max_tokens)
        _check(self.temperature > 0, "rollout.temperature", "must be > 0", self.temperature)
        _check(0 < self.top_p <= 1, "rollout.top_p", "must be in (0, 1]", self.top_p)
        _check(self.timeout_s > 0, "rollout.timeout_s", "must be > 0", self.timeout_s)
        _one_of(self.contract, "rollout.contract", ("s3", "http"))
        _check(self.push_grace_s >= 0, "rollout.push_grace_s", "must be >= 0", self.push_grace_s)
        _check(self.max_consecutive_bad_results >= 1, "rollout.max_consecutive_bad_results", "must be >= 1",
               self.max_consecutive_bad_results)
        _one_of(self.acr.retry_mode, "rollout.acr.retry_mode", ("standard", "adaptive", "legacy"))
        _check(self.acr.max_attempts >= 1, "rollout.acr.max_attempts", "must be >= 1", self.acr.max_attempts)
        _check(self.acr.runtime_error_attempts >= 1, "rollout.acr.runtime_error_attempts", "must be >= 1",
               self.acr.runtime_error_attempts)
        _check(self.poll_initial_s > 0, "rollout.poll_initial_s", "must be > 0", self.poll_initial_s)
        _check(self.poll_max_s >= self.poll_initial_s, "rollout.poll_max_s", "must be >= rollout.poll_initial_s",
               self.poll_max_s)
        _check(self.max_context_tokens > self.max_tokens, "rollout.max_context_tokens",
               f"must be > rollout.max_tokens={self.max_tokens} (prompt + answer must fit)", self.max_context_tokens)
        _check(bool(self.acr.region), "rollout.acr.region", "must not be empty", self.acr.region)
        _check(self.acr.num_agents >= 1, "rollout.acr.num_agents", "must be >= 1", self.acr.num_agents)
        _check(self.acr.session_rate_per_s > 0, "rollout.acr.session_rate_per_s", "must be > 0",
               self.acr.session_rate_per_s)


TASK_NAMES: tuple[str, ...] = ("letters", "gsm8k")  # keys of orchestrator.main.TASKS (a test keeps them equal)


@dataclass
class TaskConfig:
    """Dataset and its agent (orchestrator.main.TASKS maps `name` to a row loader and an agent app).

    num_prompts: rows generated (letters) or drawn from the file (gsm8k; null: every row), cycled
        through epochs. seed: which rows. data_path: the task's JSONL file (gsm8k); a relative
        path resolves against the repository root. max_turns: model turns an agent may take per
        episode (sent to the agent in each row of multi-turn tasks).
    """

    name: str = "letters"
    num_prompts: Optional[int] = 512
    seed: int = 0
    data_path: Optional[str] = None
    max_turns: int = 1

    def __post_init__(self) -> None:
        _one_of(self.name, "task.name", TASK_NAMES)
        if self.num_prompts is not None or self.name == "letters":
            _check(self.num_prompts is not None and self.num_prompts >= 1, "task.num_prompts", "must be >= 1",
                   self.num_prompts)
        _check(self.max_turns >= 1, "task.max_turns", "must be >= 1", self.max_turns)
        if self.name == "gsm8k":
            from workers.core.tasks.gsm8k import resolve_data_path

            try:
                resolve_data_path(self.data_path)
            except (FileNotFoundError, ValueError) as exc:
                raise ConfigError(str(exc)) from None


@dataclass
class RejectionRuleConfig:
    """One rejection rule of `algorithm.rollout_correction.rs`. `name`: one of token_k{1,2,3},
    seq_sum_k{1,2,3}, seq_mean_k{1,2,3}, seq_max_k{2,3}. k2/k3 rules take `threshold` (keep
    stat <= threshold); k1 rules bound the ratio π_old/π_rollout (or its product / geometric mean):
    `lower` and `upper`, or `threshold` C for the band [1/C, C]."""

    name: str = MISSING
    threshold: Optional[float] = None
    lower: Optional[float] = None
    upper: Optional[float] = None


@dataclass
class RolloutCorrectionConfig:
    """Rollout correction between π_rollout, π_old and π_θ (workers/core/algorithms/rollout_correction_config.py).

    mode: decoupled (π_old recomputed; IS weights π_old/π_rollout) | bypass (π_old := π_rollout).
    is_level: token | sequence | null (no IS weights; diagnostics only).
    is_threshold: TIS cap C (> 1), or a quoted IcePop band "lo_hi" (weights outside it are 0).
    rs: rejection rules; a token is trained only if every rule keeps it.
    The typed form is parsed once here and read with `typed()`.
    """

    mode: str = "decoupled"
    is_level: Optional[str] = "token"
    is_threshold: Any = 2.0
    rs: list[RejectionRuleConfig] = field(default_factory=list)

    def __post_init__(self) -> None:
        key = "algorithm.rollout_correction"
        try:
            upper, lower = parse_is_threshold(self.is_threshold, f"{key}.is_threshold")
            rules = tuple(
                RejectionRule.from_spec(
                    r.name, threshold=r.threshold, lower=r.lower, upper=r.upper, key=f"{key}.rs[{i}]"
                )
                for i, r in enumerate(self.rs)
            )
            self._typed = TypedRolloutCorrection(
                mode=self.mode, is_level=self.is_level, is_threshold=upper,  # type: ignore[arg-type]
                is_threshold_lower=lower, rs=rules,
            )
        except ConfigError:
            raise
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def typed(self) -> TypedRolloutCorrection:
        """The validated, typed settings the trainer takes (`TrainerSettings.rollout_correction`)."""
        return self._typed


@dataclass
class AlgorithmConfig:
    """Advantages and loss. GRPO outcome advantages, PPO clip, token-mean aggregation."""

    name: str = "grpo"
    norm_adv_by_std: bool = True
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    loss_agg_mode: str = "token-mean"
    filter_zero_variance: bool = True
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)

    def __post_init__(self) -> None:
        _one_of(self.name, "algorithm.name", ("grpo",))
        _check(0 < self.clip_ratio_low < 1, "algorithm.clip_ratio_low", "must be in (0, 1)", self.clip_ratio_low)
        _check(self.clip_ratio_high > 0, "algorithm.clip_ratio_high", "must be > 0", self.clip_ratio_high)
        _one_of(self.loss_agg_mode, "algorithm.loss_agg_mode", ("token-mean",))


@dataclass
class LoggerConfig:
    """Metric sinks: any of console, jsonl, wandb (offline unless `wandb_mode` says otherwise)."""

    sinks: list[str] = field(default_factory=lambda: ["console", "jsonl", "wandb"])
    wandb_project: str = "acr-rl"
    wandb_mode: str = "offline"

    def __post_init__(self) -> None:
        for s in self.sinks:
            _one_of(s, "logger.sinks", ("console", "jsonl", "wandb"))
        _one_of(self.wandb_mode, "logger.wandb_mode", ("offline", "online", "disabled"))


@dataclass
class AsyncConfig:
    """Async mode (`mode=async`; the config key is `async`, the attribute `RunConfig.async_`).

    max_staleness: η in policy versions; at most (η + v + 1)·B groups admitted by version v.
    on_stale: a sample older than η at update time is dropped (`expired`) or trained with its
        loss mask zeroed (`train_masked`: kept for group statistics, no gradient).
    in_flight: generation in flight at a weight sync keeps running (`continue`; tokens carry the
        version that produced them) or is aborted and resumed (`abort_resume`).
    resume_aborted: with `abort_resume`, resume aborted requests (False: they fail and are never trained).
    """

    max_staleness: int = 1
    on_stale: str = "drop"
    in_flight: str = "continue"
    resume_aborted: bool = True

    def __post_init__(self) -> None:
        _check(self.max_staleness >= 0, "async.max_staleness", "must be >= 0", self.max_staleness)
        _one_of(self.on_stale, "async.on_stale", ("drop", "train_masked"))
        _one_of(self.in_flight, "async.in_flight", ("continue", "abort_resume"))


@dataclass
class RunConfig:
    """The whole run. `run_dir`: where metrics.jsonl, summary.json and checkpoints go."""

    mode: ModeConfig = field(default_factory=ModeConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    async_: AsyncConfig = field(default_factory=AsyncConfig)
    run_dir: str = MISSING
    seed: int = 0

    def __post_init__(self) -> None:
        groups = self.rollout.batch_size
        _check(groups % self.mode.sync_every == 0, "mode.sync_every",
               f"must divide rollout.batch_size={groups} so each mini-batch holds whole groups",
               self.mode.sync_every)
        if self.algorithm.name == "grpo":
            _check(self.rollout.n >= 2, "rollout.n", "must be >= 2 for GRPO (a group of one has no baseline)",
                   self.rollout.n)
        run_dir = Path(self.run_dir)
        _check(not run_dir.exists() or run_dir.is_dir(), "run_dir", "exists and is not a directory", self.run_dir)
        resuming = self.trainer.resume_mode == "auto" and (run_dir / "checkpoints" / "latest").is_file()
        _check(resuming or not (run_dir / "metrics.jsonl").exists(), "run_dir",
               "already holds a run (metrics.jsonl) and no checkpoint to resume from; choose a new run_dir "
               "(or resume one saved with trainer.save_freq > 0 using trainer.resume_mode=auto)", self.run_dir)
        _check(self.cluster.inference.replicas == self.inference.replicas, "cluster.inference.replicas",
               f"must equal inference.replicas={self.inference.replicas} (set inference.replicas)",
               self.cluster.inference.replicas)
        _check(self.rollout.max_tokens < self.inference.max_model_len, "rollout.max_tokens",
               f"must be < inference.max_model_len={self.inference.max_model_len}", self.rollout.max_tokens)
        _check(self.trainer.weight_sync.backend not in ("nccl", "cuda_ipc") or self.cluster.name != "local",
               "trainer.weight_sync.backend", "needs CUDA GPUs: use cluster=disaggregated or cluster=colocated "
               "(cluster=local runs on CPU; use file, shm or gloo)", self.trainer.weight_sync.backend)

    @property
    def samples_per_step(self) -> int:
        return self.rollout.batch_size * self.rollout.n


# config group -> its schema; each group's yaml files extend `<group>_schema` (see configs/)
GROUP_SCHEMAS: dict[str, type] = {
    "mode": ModeConfig, "cluster": ClusterConfig, "model": ModelConfig, "trainer": TrainerConfig,
    "inference": InferenceConfig, "rollout": RolloutConfig, "task": TaskConfig,
    "algorithm": AlgorithmConfig, "logger": LoggerConfig, "async": AsyncConfig,
}


def _attr(group: str) -> str:
    return "async_" if group == "async" else group


def register() -> None:
    """Register each group's schema as `<group>/<group>_schema` in Hydra's ConfigStore."""
    cs = ConfigStore.instance()
    for group, node in GROUP_SCHEMAS.items():
        cs.store(group=group, name=f"{group}_schema", node=node)


def _unwrap(exc: Exception) -> ConfigError:
    cause = exc.__cause__ or exc.__context__
    return cause if isinstance(cause, ConfigError) else ConfigError(str(exc))


def _refuse_unknown_keys(node: Any, obj: Any, where: str) -> None:
    """A key the schema does not declare (e.g. a typo added with `+`) is an error, not ignored."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(obj)}
    unknown = sorted(k for k in node.keys() if k not in names)
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: unknown config key (known: {sorted(names)})")
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value) and f.name in node and OmegaConf.is_dict(node[f.name]):
            _refuse_unknown_keys(node[f.name], value, f"{where}.{f.name}")


def to_run_config(cfg: DictConfig) -> RunConfig:
    """Build and validate the typed config. Raises ConfigError naming the key on a bad value."""
    parts: dict[str, Any] = {}
    for group, schema in GROUP_SCHEMAS.items():
        if group not in cfg:
            raise ConfigError(f"{group}: config group missing from the composed config")
        try:
            obj = OmegaConf.to_object(cfg[group])
        except ConfigError:
            raise
        except Exception as exc:  # omegaconf wraps __post_init__ errors and type errors
            raise _unwrap(exc) from None
        if not isinstance(obj, schema):
            raise ConfigError(f"{group}: does not extend {group}_schema (got {type(obj).__name__})")
        _refuse_unknown_keys(cfg[group], obj, group)
        parts[_attr(group)] = obj
    unknown = sorted(set(cfg.keys()) - set(GROUP_SCHEMAS) - {"run_dir", "seed", "hydra", "experiment"})
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown config key (known: {sorted(GROUP_SCHEMAS)} run_dir seed)")
    if "run_dir" not in cfg or OmegaConf.is_missing(cfg, "run_dir") or not str(cfg.run_dir or "").strip():
        raise ConfigError("run_dir must be set (a directory path; empty would write into the current directory)")
    return RunConfig(**parts, run_dir=str(cfg.run_dir), seed=int(cfg.seed))
