"""`inference` group: the vLLM replicas; maps to each replica's InferenceSettings
(workers/inference/settings.py), whose defaults the fields it shares take (`default_of`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from orchestrator.config.async_ import SYNC_IN_FLIGHT, AsyncConfig
from orchestrator.config.cluster import ClusterConfig
from orchestrator.config.defaults import default_of
from orchestrator.config.errors import check, one_of
from orchestrator.config.mode import ModeConfig
from workers.inference.settings import InferenceSettings
from workers.weight_sync.lora import versions_served

INFERENCE_ENGINES = ("vllm_cpu", "vllm")  # vllm_cpu: vLLM's CPU build; vllm: vLLM on CUDA GPUs
INFERENCE_DTYPES = ("float32", "bfloat16")  # also the dtype weight sync sends (workers/weight_sync/plan.py)
LORA_SYNC_MODES = ("adapter", "merged")  # model.lora's weight sync: the adapter alone, or merged full weights


@dataclass
class InferenceConfig:
    """vLLM replicas. `kv_cache_gib`: KV-cache size per replica in GiB (required on CPU; on GPU
    null lets vLLM size it from `gpu_memory_utilization`, the fraction of each GPU's memory the
    engine may use for weights, activations and KV cache). `max_num_batched_tokens`: tokens per
    engine step (null: vLLM's default; chunked prefill on GPU; on vLLM's CPU build prompts are never
    split, so it must hold a whole `max_model_len` prompt there). `block_size`: tokens per KV-cache
    block (vLLM's `--block-size`; null: the platform's default, 128 on CPU, 16 on CUDA; the unit in
    which the cache fills and `perf/kv_cache_usage` moves). `enable_prefix_caching`: reuse the KV of
    shared prompt prefixes (a multi-turn agent's history). `enforce_eager`: no CUDA graphs.
    `lora_sync` (with `model.lora`): "adapter" sends only the adapter each sync and the engines serve
    it as a vLLM LoRA adapter (file backend only), "merged" merges it into full weights and syncs
    those by `trainer.weight_sync.backend` (for engines or models that cannot serve LoRA)."""

    name: str = "vllm_cpu"
    replicas: int = 1
    max_model_len: int = default_of(InferenceSettings, "max_model_len")
    kv_cache_gib: Optional[float] = 1.0
    max_num_seqs: int = default_of(InferenceSettings, "max_num_seqs")
    dtype: str = default_of(InferenceSettings, "dtype")
    gpu_memory_utilization: float = default_of(InferenceSettings, "gpu_memory_utilization")
    max_num_batched_tokens: Optional[int] = default_of(InferenceSettings, "max_num_batched_tokens")
    block_size: Optional[int] = default_of(InferenceSettings, "block_size")
    enable_prefix_caching: bool = default_of(InferenceSettings, "enable_prefix_caching")
    enforce_eager: bool = default_of(InferenceSettings, "enforce_eager")
    # dead replicas replaced over the run, then the run stops; null: DEFAULT_REPLICA_RESTARTS where a
    # replica can be replaced (file weight sync, disaggregated), 0 elsewhere (`replica_restarts`)
    max_restarts: Optional[int] = None
    health_check_s: float = 2.0  # seconds between the supervisor's liveness checks of the replicas
    replica_wait_s: float = 300.0  # a turn with no healthy replica waits this long for a replacement
    lora_sync: str = "adapter"

    def __post_init__(self) -> None:
        one_of(self.name, "inference.name", INFERENCE_ENGINES)
        check(self.replicas >= 1, "inference.replicas", "must be >= 1", self.replicas)
        check(self.max_model_len >= 16, "inference.max_model_len", "must be >= 16", self.max_model_len)
        check(self.kv_cache_gib is not None or self.name == "vllm", "inference.kv_cache_gib",
              "must be set with inference=vllm_cpu (vLLM's CPU build needs an explicit KV-cache size)",
              self.kv_cache_gib)
        check(self.kv_cache_gib is None or self.kv_cache_gib > 0, "inference.kv_cache_gib", "must be > 0",
              self.kv_cache_gib)
        check(0 < self.gpu_memory_utilization <= 1, "inference.gpu_memory_utilization", "must be in (0, 1]",
              self.gpu_memory_utilization)
        check(self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 16, "inference.max_num_batched_tokens", "must be null or >= 16",
              self.max_num_batched_tokens)
        # vLLM's CPU build runs without chunked prefill (workers/inference/engine.py): a step must fit a whole prompt
        check(self.name != "vllm_cpu" or self.max_num_batched_tokens is None
              or self.max_num_batched_tokens >= self.max_model_len, "inference.max_num_batched_tokens",
              f"must be null or >= inference.max_model_len={self.max_model_len} with inference=vllm_cpu (no chunked "
              "prefill on CPU: vLLM's CPU build cannot resume a seeded request's sampler after a split prompt)",
              self.max_num_batched_tokens)
        step = 32 if self.name == "vllm_cpu" else 16  # vLLM's CPU attention kernel takes multiples of 32 only
        check(self.block_size is None or (self.block_size > 0 and self.block_size % step == 0), "inference.block_size",
              f"must be null (vLLM's default: 128 tokens on CPU, 16 on GPU) or a positive multiple of {step} with "
              f"inference={self.name}", self.block_size)
        one_of(self.dtype, "inference.dtype", INFERENCE_DTYPES)
        check(self.max_restarts is None or self.max_restarts >= 0, "inference.max_restarts", "must be null or >= 0",
              self.max_restarts)
        check(self.health_check_s > 0, "inference.health_check_s", "must be > 0", self.health_check_s)
        one_of(self.lora_sync, "inference.lora_sync", LORA_SYNC_MODES)
        check(self.replica_wait_s >= 0, "inference.replica_wait_s", "must be >= 0", self.replica_wait_s)


def inference_settings(inf: InferenceConfig, *, mode: ModeConfig, async_: AsyncConfig, cluster: ClusterConfig,
                       seed: int, model_path: str, replica: int, initial_policy_version: int,
                       lora_rank: int = 0) -> InferenceSettings:
    """Settings of replica `replica` (its sampling seed is `seed + replica`). Sync mode drains
    requests in flight at a weight update; async mode applies `async.in_flight`. Colocated
    engines are built with sleep mode (they sleep while the trainer updates on their GPUs).
    `lora_rank` (`model.lora.rank`, served as an adapter with `lora_sync=adapter`): the engine
    serves LoRA adapters up to that rank, as many versions at once as
    workers/weight_sync/lora.py `versions_served` says (requests keep the version they started on)."""
    return InferenceSettings(
        model_path=model_path, dtype=inf.dtype, max_model_len=inf.max_model_len,
        kv_cache_bytes=None if inf.kv_cache_gib is None else int(inf.kv_cache_gib * 2**30),
        gpu_memory_utilization=inf.gpu_memory_utilization, max_num_batched_tokens=inf.max_num_batched_tokens,
        block_size=inf.block_size, enable_prefix_caching=inf.enable_prefix_caching, enforce_eager=inf.enforce_eager,
        max_num_seqs=inf.max_num_seqs, seed=seed + replica,
        in_flight=async_.in_flight if mode.name == "async" else SYNC_IN_FLIGHT,  # type: ignore[arg-type]
        resume_aborted=async_.resume_aborted, tensor_parallel_size=cluster.inference.tensor_parallel_size,
        enable_sleep_mode=cluster.name == "colocated", initial_policy_version=initial_policy_version,
        lora_rank=lora_rank if inf.lora_sync == "adapter" else 0,
        max_loras=versions_served(async_mode=mode.name == "async", max_staleness=async_.max_staleness))
