"""Building one replica's vLLM engine: `build_engine` (settings -> a running `AsyncLLM`), the
KV-cache usage hook, and what vLLM's engine processes need to import our worker extension.

Invariants: the engine is built with `kv_cache_bytes` exactly (a `VLLM_CPU_KVCACHE_SPACE` in the
environment would override it, so it is refused), with `WeightReloadExtension` mixed into its
workers (`EXTENSION_CLS`, imported by vLLM by dotted path). vLLM is imported inside
`build_engine` only.

Callers: `InferenceWorker.start` (workers/inference/worker.py).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from workers.inference.settings import EngineInfo, InferenceSettings

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

logger = logging.getLogger("workers.inference.worker")

EXTENSION_CLS = "workers.inference.vllm_ext.WeightReloadExtension"  # imported by vLLM's worker by dotted path
KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"  # vLLM's legacy CPU env; it would override kv_cache_bytes
MP_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"  # "0" lets the model worker live in the engine-core process


def build_engine(s: InferenceSettings, *, kv_usage: "KvCacheUsage") -> tuple["AsyncLLM", EngineInfo]:
    """Build the engine (loads the model, allocates the KV cache); returns it and what was
    measured. `EngineInfo.sleep_level` is 1 where vLLM sleep mode is available and asked for, else
    0. The caller labels it with its policy version before any request. Raises ValueError on conflicting environment settings."""
    if s.kv_cache_bytes is None and current_platform_is_cpu():
        raise ValueError("inference.kv_cache_bytes must be set on CPU (vLLM's CPU build sizes no KV cache from "
                         "gpu_memory_utilization)")
    if os.environ.get(KV_CACHE_ENV):
        raise ValueError(
            f"{KV_CACHE_ENV}={os.environ[KV_CACHE_ENV]!r} is set and would override "
            f"inference.kv_cache_bytes={s.kv_cache_bytes}; unset it and use kv_cache_bytes"
        )
    _make_package_importable_by_engine_processes()
    t0 = time.perf_counter()  # startup_s covers the vLLM import too
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform
    from vllm.v1.engine.async_llm import AsyncLLM

    in_core = s.worker_in_engine_process and current_platform.is_cpu()
    if in_core:
        os.environ[MP_ENV] = "0"
    sleep_level = 1 if s.enable_sleep_mode and current_platform.is_sleep_mode_available() else 0
    if s.enable_sleep_mode and not sleep_level:
        logger.warning("vLLM on %s has no sleep mode: sleep() pauses scheduling only and releases no memory",
                       current_platform.device_type)
    # an actor holding its GPUs runs TP workers as local processes ("mp"), not as Ray actors
    backend = "uni" if in_core else ("mp" if s.tensor_parallel_size > 1 else None)
    args = AsyncEngineArgs(
        model=s.model_path,
        dtype=s.dtype,
        max_model_len=s.max_model_len,
        max_num_seqs=s.max_num_seqs,
        max_num_batched_tokens=s.max_num_batched_tokens,
        block_size=s.block_size,  # None: vLLM's default for the platform (128 on CPU, 16 on CUDA)
        kv_cache_memory_bytes=s.kv_cache_bytes,  # None on GPU: sized from gpu_memory_utilization
        gpu_memory_utilization=s.gpu_memory_utilization,
        seed=s.seed,
        enforce_eager=s.enforce_eager,
        enable_prefix_caching=s.enable_prefix_caching,
        # vLLM's CPU build cannot rewind a seeded request's generator after a partial prefill
        # ("CPU Generator does not use offset": the engine dies); every rollout request is seeded
        # (workers/core/seeds.py), so on CPU a prompt is never split across steps
        enable_chunked_prefill=False if current_platform.is_cpu() else None,
        logprobs_mode=s.logprobs_mode,
        skip_tokenizer_init=True,  # token-in/token-out: the gateway owns the tokenizer
        worker_extension_cls=EXTENSION_CLS,
        distributed_executor_backend=backend,
        tensor_parallel_size=s.tensor_parallel_size,
        enable_sleep_mode=bool(sleep_level),
        disable_log_stats=True,
        **lora_engine_args(s),
    )
    # built inside the return expression, never bound to a local: vLLM's lazy imports keep this
    # frame (and so its locals) alive past shutdown, which would keep the engine alive too
    return AsyncLLM.from_engine_args(args, stat_loggers=[kv_usage.logger_factory()]), EngineInfo(
        startup_s=time.perf_counter() - t0,
        max_model_len=s.max_model_len,
        kv_cache_bytes=s.kv_cache_bytes,
        max_num_seqs=s.max_num_seqs,
        sleep_level=sleep_level,
    )


VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's `max_lora_rank` choices


def lora_engine_args(s: InferenceSettings) -> dict:
    """vLLM's LoRA arguments for `s.lora_rank` > 0 (none otherwise): `max_lora_rank` the smallest
    choice that holds the rank, `max_loras` adapters in one batch, one more kept loaded in host
    memory (`max_cpu_loras`) so a new version loads while `max_loras` older ones still serve."""
    if not s.lora_rank:
        return {}
    rank = next(r for r in VLLM_MAX_LORA_RANKS if r >= s.lora_rank)
    return {"enable_lora": True, "max_lora_rank": rank, "max_loras": s.max_loras, "max_cpu_loras": s.max_loras + 1}


def current_platform_is_cpu() -> bool:
    """vLLM's platform is its CPU build (imports vLLM)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _make_package_importable_by_engine_processes() -> None:
    """vLLM's engine processes import `workers.inference.vllm_ext` by name; put this repo on PYTHONPATH so
    they can, whatever the launcher (pytest, Ray worker, script) put on sys.path."""
    root = str(Path(__file__).resolve().parents[2])
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *paths])


class KvCacheUsage:
    """KV-cache usage from vLLM's stat-logger hook (one record per engine step) as time integrals
    (seconds, on `clock`, idle time included: an idle engine holds no blocks).

    vLLM computes `SchedulerStats.kv_cache_usage` after a step has freed the blocks of the requests
    that finished in it, and before the next step admits waiting ones. Held from one record to the
    next, as vLLM's own gauge is read, that value misses the blocks every step holds while it runs:
    for requests that live a few steps (a 5-token answer) it reads half the occupancy (measured:
    a 6-block cache serving 30 requests at once read 0.41-0.53 while 4 of its 5 usable blocks were
    held). So the step that ends at a record is credited its *occupancy*: its usage after freeing
    plus the blocks it freed (`freed`: the finished requests' blocks, from
    `IterationStats.finished_requests`, as a fraction of the cache), for the time it ran: the
    engine's recent step time (`step_s`, an exponential mean of back-to-back intervals, pauses
    left out), or the whole interval when shorter. The rest of the interval (the engine idle, or
    paused by a weight update with its requests held) keeps the previous record's usage. For
    requests that live many steps it is the same as the held value. The queue (`num_waiting`,
    requests the scheduler could not admit) is integrated the same way, held between records.
    `take_mean` is the usage's time average since its last call; `integral` / `waiting_integral`
    let any number of readers (the adaptive concurrency gate) average over their own windows.
    Keeps the last step's (usage after freeing, running, waiting) and the preemptions
    (`IterationStats.num_preempted_reqs`) summed. The hook is vLLM's `StatLoggerBase`; passing it
    enables stats without vLLM's default console/Prometheus loggers."""

    STEP_EMA = 0.2  # weight of the newest back-to-back step interval in `step_s`
    STEP_OUTLIER = 4.0  # a busy interval over this x `step_s` is a pause (weight update), not a step

    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._t = clock()  # time of the last record (or creation)
        self._integral = 0.0  # ∫ usage dt up to self._t, usage-seconds
        self._waiting_integral = 0.0  # ∫ requests waiting dt up to self._t, request-seconds
        self._taken = (self._integral, self._t)  # (integral, time) at the last take_mean
        self.last = (0.0, 0, 0)  # (kv usage 0..1 after freeing, requests running, requests waiting) at the last step
        self.preempted = 0  # requests vLLM preempted since the engine started
        self.step_s: float | None = None  # recent engine step time (seconds), None before two back-to-back steps
        self._cache_config = None  # vLLM's CacheConfig, set when the engine builds its stat logger

    def add(self, usage: float, running: int = 0, waiting: int = 0, preempted: int = 0, freed: float = 0.0) -> None:
        """One engine step's record: `usage` after it freed `freed` (both fractions of the cache)."""
        now = self._clock()
        dt = max(0.0, now - self._t)
        busy = bool(self.last[1] or self.last[2])  # the engine had work since the last record: it stepped on
        if busy and (self.step_s is None or dt <= self.STEP_OUTLIER * self.step_s):
            self.step_s = dt if self.step_s is None else (1 - self.STEP_EMA) * self.step_s + self.STEP_EMA * dt
        # the step ran the last `ran` seconds of dt; before it the blocks after the previous record
        # were held (idle: none; a paused engine, e.g. during a weight update: its running requests')
        ran = min(dt, self.step_s) if self.step_s is not None else (dt if busy else 0.0)
        self._integral += min(1.0, usage + freed) * ran + self.last[0] * (dt - ran)
        self._waiting_integral += self.last[2] * dt
        self._t = now
        self.last = (usage, running, waiting)
        self.preempted += preempted

    def integral(self) -> tuple[float, float]:
        """(∫ usage dt in usage-seconds since creation, now in seconds on `clock`): the last
        step's usage after freeing is held up to now."""
        now = self._clock()
        return self._integral + self.last[0] * max(0.0, now - self._t), now

    def waiting_integral(self) -> float:
        """∫ requests waiting dt (request-seconds) since creation, up to now (the last step's
        queue held); read with `integral`'s clock for a window's mean queue."""
        return self._waiting_integral + self.last[2] * max(0.0, self._clock() - self._t)

    def cache_blocks(self) -> tuple[int, int] | None:
        """(tokens per KV block, blocks in the cache, vLLM's null block included) once the engine
        has sized its cache, else None."""
        c = self._cache_config
        if c is None or not c.block_size or not c.num_gpu_blocks:
            return None
        return int(c.block_size), int(c.num_gpu_blocks)

    def take_mean(self) -> float:
        """Time-average usage (0..1) since the last call (or creation); NaN if no time passed."""
        integral, now = self.integral()
        i0, t0 = self._taken
        self._taken = (integral, now)
        return (integral - i0) / (now - t0) if now > t0 else float("nan")

    def logger_factory(self):
        from vllm.v1.metrics.loggers import StatLoggerBase

        sink = self

        class _KvUsageLogger(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0) -> None:
                self._cache = vllm_config.cache_config  # num_gpu_blocks is set once the engine has sized its cache
                sink._cache_config = self._cache

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
                if scheduler_stats is not None:
                    finished = getattr(iteration_stats, "finished_requests", None) or ()
                    sink.add(float(scheduler_stats.kv_cache_usage), int(scheduler_stats.num_running_reqs),
                             int(scheduler_stats.num_waiting_reqs),
                             int(getattr(iteration_stats, "num_preempted_reqs", 0) or 0),
                             freed_fraction(finished, self._cache.block_size, self._cache.num_gpu_blocks))

            def log_engine_initialized(self) -> None:
                pass

        return _KvUsageLogger


def freed_fraction(finished, block_size: int | None, num_gpu_blocks: int | None) -> float:
    """Fraction of the cache (vLLM's usage scale: its blocks less the null block) that the
    requests finished in one step held: each request `r` (vLLM `FinishedRequestStats`) held
    ceil((r.num_prompt_tokens + r.num_generation_tokens - 1) / block_size) blocks (its last token
    is sampled, never cached). An upper bound where finished requests shared prefix blocks with
    running ones; 0 before the cache is sized."""
    if not finished or not block_size or not num_gpu_blocks or num_gpu_blocks <= 1:
        return 0.0
    blocks = sum(-(-max(1, r.num_prompt_tokens + r.num_generation_tokens - 1) // block_size) for r in finished)
    return blocks / (num_gpu_blocks - 1)
