"""Settings and reports of an inference replica: what `InferenceWorker` takes and returns.

Light on purpose (no vLLM, no torch at import): the config layer maps `inference.*` onto
`InferenceSettings` and takes `IN_FLIGHT_MODES` as the one list of `inference.in_flight` choices;
a bad value raises ValueError naming the `inference.*` key when the settings are built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

DEFAULT_KV_CACHE_BYTES = 64 * 2**20  # tiny model: 2 layers x 2 KV heads x 64 dims x fp32 -> 32k tokens
InFlightMode = Literal["drain", "continue", "abort_resume"]
IN_FLIGHT_MODES: tuple[InFlightMode, ...] = get_args(InFlightMode)
LogprobsMode = Literal["processed_logprobs", "raw_logprobs"]
LOGPROBS_MODES: tuple[LogprobsMode, ...] = get_args(LogprobsMode)


@dataclass(frozen=True)
class InferenceSettings:
    """Engine settings of one replica.

    kv_cache_bytes: KV-cache size in bytes (on CPU always explicit: vLLM otherwise sizes it from a
        fraction of host memory; `VLLM_CPU_KVCACHE_SPACE` must be unset: it would override this).
        None (GPU only): vLLM sizes it from `gpu_memory_utilization`, the fraction of the GPU's
        memory the engine may take for weights, activations and KV cache.
    logprobs_mode: "processed_logprobs" returns log π of the distribution sampled from (after
        temperature/top-p); "raw_logprobs" returns log-softmax of the raw logits.
    worker_in_engine_process: run the model in vLLM's engine-core process (executor "uni",
        sets `VLLM_ENABLE_V1_MULTIPROCESSING=0` in this process) instead of a third process.
        On a small CPU host this starts faster and decodes several times faster; vLLM warns that
        OpenMP threads are then not pinned. Use False on many-core CPU hosts; ignored on GPU.
    initial_policy_version: version reported before the first `update_weights`.
    in_flight: what a weight update does to requests in flight: "drain" (wait for them, sync
        mode), "continue" (keep them running across the swap) or "abort_resume" (abort, then
        resume them under the new weights); see workers/inference/worker.py's docstring.
    resume_aborted: with in_flight="abort_resume", False ends an aborted request with
        finish_reason "abort" and its partial tokens instead of resuming it.
    tensor_parallel_size: GPUs of this engine (the Ray actor holds them; vLLM's "mp" executor
        runs one worker per GPU inside the actor). On CPU the in-process engine takes only 1.
    enable_sleep_mode: build the engine so that `sleep()` releases device memory (vLLM sleep
        mode, level 1). Where the platform has no sleep mode (vLLM's CPU build), the engine is
        built without it and `sleep()` only pauses scheduling (level 0); see `SleepReport`.
    lora_rank: > 0 serves the policy as a LoRA adapter of up to this rank on the base
        (`load_adapter`; vLLM `enable_lora`, `max_lora_rank` the smallest choice that holds it);
        0: no LoRA. max_loras: adapter versions served at once (vLLM `max_loras`): in async mode
        `async.max_staleness + 1`, since a request keeps the adapter of the version it started on.
    """

    model_path: str
    dtype: str = "float32"
    max_model_len: int = 512
    kv_cache_bytes: int | None = DEFAULT_KV_CACHE_BYTES
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    block_size: int | None = None
    seed: int = 0
    enforce_eager: bool = True
    enable_prefix_caching: bool = True
    logprobs_mode: LogprobsMode = "processed_logprobs"
    worker_in_engine_process: bool = True
    initial_policy_version: int = 0
    in_flight: InFlightMode = "drain"
    resume_aborted: bool = True
    tensor_parallel_size: int = 1
    enable_sleep_mode: bool = False
    lora_rank: int = 0
    max_loras: int = 1

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("inference.model_path must be set")
        for key in ("max_model_len", "kv_cache_bytes", "max_num_seqs"):
            if getattr(self, key) is not None and getattr(self, key) <= 0:
                raise ValueError(f"inference.{key} must be > 0, got {getattr(self, key)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"inference.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.block_size is not None and (self.block_size <= 0 or self.block_size % 16):
            raise ValueError(f"inference.block_size must be null or a positive multiple of 16, got {self.block_size}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens <= 0:
            raise ValueError(f"inference.max_num_batched_tokens must be > 0, got {self.max_num_batched_tokens}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"inference.logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        if self.initial_policy_version < 0:
            raise ValueError(f"inference.initial_policy_version must be >= 0, got {self.initial_policy_version}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"inference.tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if not 0 <= self.lora_rank <= 512:
            raise ValueError(f"model.lora.rank must be in 0..512 to be served by vLLM, got {self.lora_rank}")
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.in_flight not in IN_FLIGHT_MODES:
            raise ValueError(f"inference.in_flight must be one of {IN_FLIGHT_MODES}, got {self.in_flight!r}")


@dataclass(frozen=True)
class EngineInfo:
    """What `start()` measured: wall time to import vLLM and build the engine (engine-core process
    spawn, model load, KV-cache allocation), and the limits it runs with."""

    startup_s: float
    max_model_len: int
    kv_cache_bytes: int | None  # None: sized by vLLM from gpu_memory_utilization
    max_num_seqs: int
    sleep_level: int = 0  # what sleep() does: 0 pauses scheduling only, 1 also frees device memory


@dataclass(frozen=True)
class SleepReport:
    """One `sleep()` / `wake_up()`. level 0: scheduling paused only (vLLM's CPU build has no sleep
    mode); level 1: weights offloaded to host memory, KV cache dropped (GPU). elapsed_s: wall time."""

    level: int
    released_memory: bool
    elapsed_s: float
