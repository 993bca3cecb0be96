"""InferenceWorker: one vLLM engine replica, token-in/token-out, with versioned weight reloads.

A plain class (callers apply `ray.remote` where they create actors). It implements the
`InferenceEngine` protocol of workers/core/types.py on any vLLM build: the CPU build locally,
CUDA in production. vLLM is imported in `start()` only, so importing this module is cheap.

Invariant (the policy-version contract): every generated token carries the version of the weights
that produced it (`GenerateResult.token_versions`; `policy_version` is the last token's). The
engine labels its own outputs (vLLM's weight-version spans): the label changes only while the
scheduler is paused, together with the weights, so a label can never disagree with the weights.
What a weight update does to requests in flight is `InferenceSettings.in_flight`:
- "drain" (sync mode): `update_weights` stops admitting new requests (they wait), waits for the
  in-flight ones to finish, reloads, and re-opens admission (`WeightsGate`). Every result has one
  version; an update waits for the longest running request (up to its whole `max_tokens`).
- "continue": the engine pauses with requests kept (`pause_generation(mode="keep")`: at most the
  step under way finishes), reloads, preempts the kept requests so that their KV cache is
  recomputed from prompt + tokens so far under the NEW weights, and resumes. A result's tokens
  switch version exactly at the update; every token's log-prob is that of its own version (no
  stale KV is reused, unlike a keep-the-cache in-flight update). Cost: one prefill of prompt +
  tokens so far per running request, paid by the requests after the update, as in "abort_resume".
- "abort_resume": the engine pauses aborting every request (`mode="abort"`: partial tokens come
  back); after the reload each aborted request is resubmitted with prompt + partial tokens and
  `max_tokens` minus the tokens it already has (the original budget is never exceeded), and the
  result concatenates the segments (ids, log-probs, versions). With `resume_aborted=False` the
  request ends instead with finish_reason "abort" and its partial tokens (the gateway answers 503
  and records nothing, so aborted samples never reach the trainer).
In "continue" and "abort_resume", an update is bounded by one engine step (the pause) plus the
reload and a cache reset, whatever the requests in flight; new requests are queued by the engine
meanwhile. Every request returns exactly one result or raises; none is dropped by an update.

Sampling contract: only `GenerateRequest.stop_token_ids` end a generation with "stop" (the engine's
own EOS is ignored, `ignore_eos=True`), so the caller (the gateway) decides the stop set. Returned
log-probs are the sampled token's log-probability under the distribution actually sampled from
(`logprobs_mode="processed_logprobs"`: after temperature and top-p), i.e. log π_rollout;
`prompt_logprobs` returns plain log-softmax of the logits (temperature 1), for probes. A seeded
request resumed after an abort ("abort_resume") continues with a fresh generator of the same seed,
so it is reproducible but differs from the same request run without an update.

Callers: the gateway's replica router (generate), the weight sync (update_weights), tests and
probes (prompt_logprobs). Segment bookkeeping of resumed requests: workers/inference/segments.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Literal

from workers.core.types import FinishReason, GenerateRequest, GenerateResult
from workers.inference.segments import SegmentedGeneration, versions_from_spans
from workers.inference.swap import WeightSwap

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

EXTENSION_CLS = "workers.inference.vllm_ext.WeightReloadExtension"  # imported by vLLM's worker by dotted path
RELOAD_RPC = "reload_weights_from_file"  # WeightReloadExtension method name
KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"  # vLLM's legacy CPU env; it would override kv_cache_bytes
MP_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"  # "0" lets the model worker live in the engine-core process
DEFAULT_KV_CACHE_BYTES = 64 * 2**20  # tiny model: 2 layers x 2 KV heads x 64 dims x fp32 -> 32k tokens
_FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}
InFlightMode = Literal["drain", "continue", "abort_resume"]
IN_FLIGHT_MODES: tuple[InFlightMode, ...] = ("drain", "continue", "abort_resume")


@dataclass(frozen=True)
class InferenceSettings:
    """Engine settings of one replica.

    kv_cache_bytes: KV-cache size in bytes, always explicit (on CPU vLLM otherwise sizes it from a
        fraction of host memory). `VLLM_CPU_KVCACHE_SPACE` must be unset: it would override this.
    logprobs_mode: "processed_logprobs" returns log π of the distribution sampled from (after
        temperature/top-p); "raw_logprobs" returns log-softmax of the raw logits.
    worker_in_engine_process: run the model in vLLM's engine-core process (executor "uni",
        sets `VLLM_ENABLE_V1_MULTIPROCESSING=0` in this process) instead of a third process.
        On a small CPU host this starts faster and decodes several times faster; vLLM warns that
        OpenMP threads are then not pinned. Use False on many-core CPU hosts; ignored on GPU.
    initial_policy_version: version reported before the first `update_weights`.
    in_flight: what a weight update does to requests in flight: "drain" (wait for them, sync
        mode), "continue" (keep them running across the swap) or "abort_resume" (abort, then
        resume them under the new weights); see the module docstring.
    resume_aborted: with in_flight="abort_resume", False ends an aborted request with
        finish_reason "abort" and its partial tokens instead of resuming it.
    tensor_parallel_size: GPUs of this engine (the Ray actor holds them; vLLM's "mp" executor
        runs one worker per GPU inside the actor). On CPU the in-process engine takes only 1.
    enable_sleep_mode: build the engine so that `sleep()` releases device memory (vLLM sleep
        mode, level 1). Where the platform has no sleep mode (vLLM's CPU build), the engine is
        built without it and `sleep()` only pauses scheduling (level 0); see `SleepReport`.
    """

    model_path: str
    dtype: str = "float32"
    max_model_len: int = 512
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    seed: int = 0
    enforce_eager: bool = True
    enable_prefix_caching: bool = True
    logprobs_mode: Literal["processed_logprobs", "raw_logprobs"] = "processed_logprobs"
    worker_in_engine_process: bool = True
    initial_policy_version: int = 0
    in_flight: InFlightMode = "drain"
    resume_aborted: bool = True
    tensor_parallel_size: int = 1
    enable_sleep_mode: bool = False

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("inference.model_path must be set")
        for key in ("max_model_len", "kv_cache_bytes", "max_num_seqs"):
            if getattr(self, key) <= 0:
                raise ValueError(f"inference.{key} must be > 0, got {getattr(self, key)}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens <= 0:
            raise ValueError(f"inference.max_num_batched_tokens must be > 0, got {self.max_num_batched_tokens}")
        if self.logprobs_mode not in ("processed_logprobs", "raw_logprobs"):
            raise ValueError(f"inference.logprobs_mode must be processed_logprobs or raw_logprobs, got {self.logprobs_mode!r}")
        if self.initial_policy_version < 0:
            raise ValueError(f"inference.initial_policy_version must be >= 0, got {self.initial_policy_version}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"inference.tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.in_flight not in IN_FLIGHT_MODES:
            raise ValueError(f"inference.in_flight must be one of {IN_FLIGHT_MODES}, got {self.in_flight!r}")


@dataclass(frozen=True)
class EngineInfo:
    """What `start()` measured: wall time to import vLLM and build the engine (engine-core process
    spawn, model load, KV-cache allocation), and the limits it runs with."""

    startup_s: float
    max_model_len: int
    kv_cache_bytes: int
    max_num_seqs: int
    sleep_level: int = 0  # what sleep() does: 0 pauses scheduling only, 1 also frees device memory


@dataclass(frozen=True)
class SleepReport:
    """One `sleep()` / `wake_up()`. level 0: scheduling paused only (vLLM's CPU build has no sleep
    mode); level 1: weights offloaded to host memory, KV cache dropped (GPU). elapsed_s: wall time."""

    level: int
    released_memory: bool
    elapsed_s: float


class WeightsGate:
    """Admission control that keeps requests and weight updates apart (asyncio, one event loop).

    Invariant: while an update holds the gate, no request is in flight; a waiting update blocks new
    requests (writer preference), so an update waits at most for the requests already running.
    """

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._in_flight = 0
        self._updating = False
        self._updates_waiting = 0

    def num_in_flight(self) -> int:
        return self._in_flight

    def update_pending(self) -> bool:
        """True while an update waits for the gate or holds it."""
        return self._updating or self._updates_waiting > 0

    @asynccontextmanager
    async def request(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self.update_pending())
            self._in_flight += 1
        try:
            yield
        finally:
            async with self._cond:
                self._in_flight -= 1
                self._cond.notify_all()

    @asynccontextmanager
    async def update(self) -> AsyncIterator[None]:
        async with self._cond:
            self._updates_waiting += 1
            try:
                await self._cond.wait_for(lambda: not self._updating and self._in_flight == 0)
            finally:
                self._updates_waiting -= 1
                self._cond.notify_all()
            self._updating = True
        try:
            yield
        finally:
            async with self._cond:
                self._updating = False
                self._cond.notify_all()


class InferenceWorker(WeightSwap):
    """One vLLM `AsyncLLM` engine; see the module docstring for the version and sampling contracts.
    The swap under `update_weights` and the broadcast receiver: workers/inference/swap.py."""

    def __init__(self, settings: InferenceSettings) -> None:
        self._settings = settings
        self._engine: AsyncLLM | None = None
        self._version = settings.initial_policy_version
        self._gate = WeightsGate()  # "drain" only
        self._kv_usage = KvCacheUsage()
        self._swap_lock = asyncio.Lock()  # "continue" / "abort_resume": one swap at a time
        self._swaps_begun = 0  # swaps that paused (or are about to pause) the engine
        self._swaps_done = 0  # swaps that resumed it
        self._swaps_waiting = 0
        self._running = 0  # requests in flight outside the gate ("continue" / "abort_resume")
        self._sleep_level = 0  # set by start(): 1 where vLLM sleep mode is available and asked for
        self._asleep = False

    async def start(self) -> EngineInfo:
        """Build the engine (loads the model, allocates the KV cache). Call once, in the event loop
        that will serve requests. Raises ValueError on conflicting environment settings."""
        if self._engine is not None:
            raise RuntimeError("InferenceWorker.start() called twice")
        s = self._settings
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
        self._sleep_level = 1 if s.enable_sleep_mode and current_platform.is_sleep_mode_available() else 0
        if s.enable_sleep_mode and not self._sleep_level:
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
            kv_cache_memory_bytes=s.kv_cache_bytes,
            seed=s.seed,
            enforce_eager=s.enforce_eager,
            enable_prefix_caching=s.enable_prefix_caching,
            logprobs_mode=s.logprobs_mode,
            skip_tokenizer_init=True,  # token-in/token-out: the gateway owns the tokenizer
            worker_extension_cls=EXTENSION_CLS,
            distributed_executor_backend=backend,
            tensor_parallel_size=s.tensor_parallel_size,
            enable_sleep_mode=bool(self._sleep_level),
            disable_log_stats=True,
        )
        self._engine = AsyncLLM.from_engine_args(args, stat_loggers=[self._kv_usage.logger_factory()])
        await self._engine.update_weight_version(str(self._version))  # the label of every output
        info = EngineInfo(
            startup_s=time.perf_counter() - t0,
            max_model_len=s.max_model_len,
            kv_cache_bytes=s.kv_cache_bytes,
            max_num_seqs=s.max_num_seqs,
            sleep_level=self._sleep_level,
        )
        logger.info("vLLM engine for %s started in %.1f s", s.model_path, info.startup_s)
        return info

    def policy_version(self) -> int:
        """Version of the weights loaded now (the version of tokens generated from now on)."""
        return self._version

    def kv_cache_usage(self) -> float:
        """Mean KV-cache usage (fraction of blocks in use, 0..1) over the engine steps since the
        last call; NaN when the engine ran no step in between."""
        return self._kv_usage.take_mean()

    def num_in_flight(self) -> int:
        """Requests admitted and not finished (generate and prompt_logprobs calls)."""
        return self._gate.num_in_flight() + self._running

    def update_pending(self) -> bool:
        """True while a weight update waits or runs ("drain": new requests wait meanwhile)."""
        return self._gate.update_pending() or self._swaps_waiting > 0 or self._swaps_begun > self._swaps_done

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        """Generate from `req.prompt_ids`; returns sampled ids, their log-probs and versions.

        At most `req.max_tokens` tokens in total, also when an update makes the request resume
        ("abort_resume"). Raises ValueError for an empty prompt or max_tokens < 1, RuntimeError if
        the engine is not started or reports an error. Cancelling the call aborts the request in
        the engine.
        """
        engine = self._require_engine()
        if not req.prompt_ids:
            raise ValueError(f"request {req.request_id}: prompt_ids is empty")
        if req.max_tokens < 1:
            raise ValueError(f"request {req.request_id}: max_tokens must be >= 1, got {req.max_tokens}")
        out = SegmentedGeneration(req.request_id, req.max_tokens)
        async with self._admitted():
            while True:
                swaps_done_at_submit = self._swaps_done
                final = await _last_output(
                    engine.generate(
                        prompt=_tokens_prompt(req.prompt_ids + out.ids()),
                        sampling_params=_sampling_params(req, out.remaining_tokens()),
                        request_id=out.next_segment_id(),
                    )
                )
                _add_output(out, req.request_id, final.outputs[0])
                if not (out.finish_reason() == "abort" and self._resumes(swaps_done_at_submit)):
                    break
                if out.remaining_tokens() == 0:  # the budget was spent just as the abort landed
                    return out.result(finish_reason="length", version_if_empty=self._version)
                logger.debug("request %s aborted by a weight update after %d tokens; resuming", req.request_id, out.num_tokens())
        return out.result(version_if_empty=self._version)

    async def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """log p(token_t | tokens_<t) for t = 1 .. len-1 under the current weights, temperature 1.

        Returns [len(token_ids) - 1] natural-log values (the prefix cache is bypassed for this
        request, so every position is computed). A probe aborted by a weight update is re-run on
        the new weights. Raises ValueError for fewer than 2 tokens.
        """
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        engine = self._require_engine()
        if len(token_ids) < 2:
            raise ValueError(f"prompt_logprobs needs at least 2 tokens, got {len(token_ids)}")
        params = SamplingParams(
            max_tokens=1,
            temperature=0.0,
            prompt_logprobs=0,  # only the actual next token at each position
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        async with self._admitted():
            while True:
                swaps_done_at_submit = self._swaps_done
                final = await _last_output(
                    engine.generate(prompt=_tokens_prompt(token_ids), sampling_params=params, request_id=f"probe-{uuid.uuid4().hex}")
                )
                aborted = str(final.outputs[0].finish_reason) == "abort"
                if not (aborted and self._swaps_begun > swaps_done_at_submit):
                    break
        positions = final.prompt_logprobs
        if aborted or positions is None or len(positions) != len(token_ids):
            raise RuntimeError("engine returned no prompt log-probs")
        return [float(positions[t][token_ids[t]].logprob) for t in range(1, len(token_ids))]

    async def update_weights(self, path: str, version: int) -> None:
        """Reload all weights from the safetensors file at `path` and make `version` current.

        What happens to requests in flight is `settings.in_flight` (see the module docstring):
        "drain" waits for them and holds new ones; "continue" and "abort_resume" return after one
        engine step plus the reload. Raises ValueError if `version` is not greater than the current
        one, FileNotFoundError if `path` is missing, ValueError if it is not a safetensors file
        with tensors (all checked before requests are touched), RuntimeError if the engine reports
        a failure during the reload: the engine is resumed, but its weights may be partly loaded
        (vLLM's CPU reload then kills the engine, and in-flight requests raise); treat the replica
        as broken.
        """
        self._require_engine()
        self._check_update(path, version)

        async def load(engine: AsyncLLM) -> None:
            counts = await engine.collective_rpc(RELOAD_RPC, args=(str(path),))
            if not counts or min(counts) <= 0:
                raise RuntimeError(f"weight reload from {path} loaded no tensors (per worker: {counts})")

        await self._swap(version, load, f"from {path}", check=lambda: self._check_update(path, version))

    async def sleep(self) -> SleepReport:
        """Stop generating so a co-located trainer can use the GPU (cluster=colocated).

        Requests in flight are kept (vLLM pause mode "keep"; with level 1 their KV cache is
        dropped and recomputed after waking) and new ones queue until `wake_up()`. Level 1 (GPU
        sleep mode) offloads weights to host memory and frees the KV cache; level 0 (vLLM's CPU
        build) only pauses scheduling: `SleepReport.released_memory` says which happened.
        Raises RuntimeError if not started or already asleep.
        """
        engine = self._require_engine()
        if self._asleep:
            raise RuntimeError("InferenceWorker.sleep() called while asleep")
        t0 = time.perf_counter()
        await engine.sleep(level=self._sleep_level, mode="keep")
        self._asleep = True
        return SleepReport(self._sleep_level, self._sleep_level >= 1, time.perf_counter() - t0)

    async def wake_up(self) -> SleepReport:
        """Undo `sleep()`: restore weights and KV cache (level 1) and resume scheduling; the
        requests kept by `sleep()` continue. Raises RuntimeError if not asleep or if vLLM reports
        that part of the engine's memory is still asleep."""
        engine = self._require_engine()
        if not self._asleep:
            raise RuntimeError("InferenceWorker.wake_up() called while awake")
        t0 = time.perf_counter()
        awake = await engine.wake_up(None if self._sleep_level >= 1 else ["scheduling"])
        if not awake:
            raise RuntimeError("vLLM reports the engine is not fully awake after wake_up()")
        self._asleep = False
        return SleepReport(self._sleep_level, self._sleep_level >= 1, time.perf_counter() - t0)

    def is_asleep(self) -> bool:
        return self._asleep  # between sleep() and wake_up()

    async def shutdown(self) -> None:
        """Stop the engine and its processes; safe to call twice."""
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown()

    # -- internals -------------------------------------------------------------------------

    def _check_update(self, path: str, version: int) -> None:
        """Refuse an update before the engine is touched: a reload that fails half-way leaves the
        model with unloaded (meta) tensors and the engine dies at its next step."""
        from safetensors import SafetensorError, safe_open

        if version <= self._version:
            raise ValueError(f"policy version must increase: current {self._version}, got {version}")
        if not Path(path).is_file():
            raise FileNotFoundError(f"weights file {path} does not exist")
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:  # reads the header only
                num_tensors = len(list(f.keys()))
        except SafetensorError as e:
            raise ValueError(f"weights file {path} is not a readable safetensors file: {e}") from e
        if num_tensors == 0:
            raise ValueError(f"weights file {path} holds no tensors")

    async def _reload(self, engine: AsyncLLM, load: Callable[[AsyncLLM], Awaitable[None]], version: int) -> None:
        """`load(engine)`, drop every KV block computed with the old weights, relabel the outputs.

        Runs while nothing is scheduled (drained, or paused). `reset_running_requests=True`
        preempts the requests kept by a "continue" pause: they recompute their KV cache from
        prompt + generated tokens with the new weights when scheduled again.
        """
        await load(engine)
        if not await engine.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError("prefix cache reset failed after weight reload")
        await engine.update_weight_version(str(version))
        self._version = version

    def _resumes(self, swaps_done_at_submit: int) -> bool:
        """Whether an aborted segment submitted when `swaps_done_at_submit` swaps had finished was
        aborted by a swap and must be resumed (a swap began since: its pause aborted it)."""
        return (
            self._settings.in_flight == "abort_resume"
            and self._settings.resume_aborted
            and self._swaps_begun > swaps_done_at_submit
        )

    @asynccontextmanager
    async def _admitted(self) -> AsyncIterator[None]:
        if self._settings.in_flight == "drain":
            async with self._gate.request():
                yield
            return
        self._running += 1
        try:
            yield
        finally:
            self._running -= 1

    def _require_engine(self) -> AsyncLLM:
        if self._engine is None:
            raise RuntimeError("InferenceWorker is not started (call start() first) or was shut down")
        return self._engine


def _add_output(segments: SegmentedGeneration, request_id: str, out: Any) -> None:
    """Append one finished vLLM `CompletionOutput` (FINAL_ONLY: all of the segment's tokens).
    Raises RuntimeError on a missing log-prob or version label, or an unknown finish reason."""
    ids = [int(t) for t in out.token_ids]
    positions = out.logprobs or []
    if len(positions) != len(ids):
        raise RuntimeError(f"request {request_id}: engine returned no log-prob for some tokens")
    reason = _FINISH_REASONS.get(str(out.finish_reason))
    if reason is None:
        raise RuntimeError(f"request {request_id}: engine finished with {out.finish_reason!r}")
    segments.add(
        ids,
        [float(pos[tok].logprob) for tok, pos in zip(ids, positions)],
        versions_from_spans(request_id, out.weight_versions, len(ids)),
        reason,
    )


def _tokens_prompt(ids: Any) -> Any:
    from vllm import TokensPrompt

    return TokensPrompt(prompt_token_ids=[int(t) for t in ids])


def _sampling_params(req: GenerateRequest, max_tokens: int) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        n=1,
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        seed=req.seed,
        stop_token_ids=list(req.stop_token_ids),
        ignore_eos=True,
        logprobs=0,  # only the sampled token's log-prob
        detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


async def _last_output(stream: AsyncIterator[Any]) -> Any:
    final = None
    async for out in stream:
        final = out
    if final is None or not final.finished:
        raise RuntimeError("engine stream ended without a finished output")
    return final


def _make_package_importable_by_engine_processes() -> None:
    """vLLM's engine processes import `workers.inference.vllm_ext` by name; put this repo on PYTHONPATH so
    they can, whatever the launcher (pytest, Ray worker, script) put on sys.path."""
    root = str(Path(__file__).resolve().parent.parent)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *paths])


class KvCacheUsage:
    """Collects `SchedulerStats.kv_cache_usage` from vLLM's stat-logger hook (one record per engine
    step) and reports the mean since the last read. The hook is vLLM's `StatLoggerBase`; passing it
    enables stats without vLLM's default console/Prometheus loggers."""

    def __init__(self) -> None:
        self._sum = 0.0
        self._n = 0

    def add(self, usage: float) -> None:
        self._sum += usage
        self._n += 1

    def take_mean(self) -> float:
        mean = self._sum / self._n if self._n else float("nan")
        self._sum, self._n = 0.0, 0
        return mean

    def logger_factory(self):
        from vllm.v1.metrics.loggers import StatLoggerBase

        sink = self

        class _KvUsageLogger(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
                if scheduler_stats is not None:
                    sink.add(float(scheduler_stats.kv_cache_usage))

            def log_engine_initialized(self) -> None:
                pass

        return _KvUsageLogger
