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

LoRA (`settings.lora_rank` > 0, `load_adapter`): the policy is the base plus an adapter per
version; a request is pinned to the adapter of the version current at its admission and keeps it
to its end, so its tokens all carry that version; up to `max_loras` versions serve at once, and a
version no request uses is unloaded (workers/inference/adapters.py).

Callers: the gateway's replica router (generate), the weight sync (update_weights), tests and
probes (prompt_logprobs). The package's other modules: settings.py (InferenceSettings and the
reports, no vLLM), engine.py (building the engine), vllm_requests.py (requests and outputs in
vLLM's types), segments.py (bookkeeping of resumed requests), swap.py (the pause around a weight
load, the broadcast receiver, `WeightsGate`), vllm_ext.py (the reload inside vLLM's workers).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Callable

from workers.core.types import EngineLoad, GenerateRequest, GenerateResult
from workers.inference.adapters import AdapterVersions
from workers.inference.engine import EXTENSION_CLS, KvCacheUsage, build_engine
from workers.inference.segments import SegmentedGeneration
from workers.inference.settings import (
    DEFAULT_KV_CACHE_BYTES,
    IN_FLIGHT_MODES,
    EngineInfo,
    InferenceSettings,
    InFlightMode,
    SleepReport,
)
from workers.inference.swap import WeightsGate, WeightSwap
from workers.inference.vllm_requests import add_output, last_output, probe_params, sampling_params, tokens_prompt

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

__all__ = [  # the settings and reports live in settings.py; importable from here as before
    "DEFAULT_KV_CACHE_BYTES", "EXTENSION_CLS", "IN_FLIGHT_MODES", "EngineInfo", "InFlightMode", "InferenceSettings",
    "InferenceWorker", "SleepReport", "WeightsGate",
]

logger = logging.getLogger(__name__)

RELOAD_RPC = "reload_weights_from_file"  # WeightReloadExtension method name


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
        self._adapters = AdapterVersions(settings.initial_policy_version) if settings.lora_rank else None

    async def start(self) -> EngineInfo:
        """Build the engine (loads the model, allocates the KV cache). Call once, in the event loop
        that will serve requests. Raises ValueError on conflicting environment settings."""
        if self._engine is not None:
            raise RuntimeError("InferenceWorker.start() called twice")
        self._engine, info = build_engine(self._settings, kv_usage=self._kv_usage)
        self._kv_usage.take_mean()  # the time averages start now, not at construction (startup is not idle time)
        await self._engine.update_weight_version(str(self._version))  # the label of every output
        self._sleep_level = info.sleep_level
        logger.info("vLLM engine for %s started in %.1f s", self._settings.model_path, info.startup_s)
        return info

    def policy_version(self) -> int:
        """Version of the weights loaded now (the version of tokens generated from now on)."""
        return self._version

    def kv_cache_usage(self) -> float:
        """Time-average KV-cache usage (fraction of blocks in use, 0..1) since the last call,
        idle time included (an idle engine holds no blocks); NaN when no time passed."""
        return self._kv_usage.take_mean()

    def kv_cache_blocks(self) -> tuple[int, int] | None:
        """(tokens per KV-cache block, blocks in the cache) of the running engine, None before it
        has sized its cache (see `InferenceSettings.block_size`)."""
        return self._kv_usage.cache_blocks()

    def engine_load(self) -> EngineLoad:
        """vLLM's scheduler stats at its last step and the usage's time integral up to now, for
        `rollout.concurrency=adaptive`."""
        usage, running, waiting = self._kv_usage.last
        integral, now = self._kv_usage.integral()
        return EngineLoad(usage, running, waiting, self._kv_usage.preempted, kv_usage_integral_s=integral,
                          clock_s=now, waiting_integral_s=self._kv_usage.waiting_integral())

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
        async with self._admitted(), self._pinned() as (pinned, lora):
            while True:
                swaps_done_at_submit = self._swaps_done
                final = await last_output(
                    engine.generate(
                        prompt=tokens_prompt(req.prompt_ids + out.ids()),
                        sampling_params=sampling_params(req, out.remaining_tokens()),
                        request_id=out.next_segment_id(), lora_request=lora,
                    )
                )
                add_output(out, req.request_id, final.outputs[0], version=pinned)
                if not (out.finish_reason() == "abort" and self._resumes(swaps_done_at_submit)):
                    break
                if out.remaining_tokens() == 0:  # the budget was spent just as the abort landed
                    return out.result(finish_reason="length", version_if_empty=self._version if pinned is None else pinned)
                logger.debug("request %s aborted by a weight update after %d tokens; resuming", req.request_id, out.num_tokens())
        return out.result(version_if_empty=self._version if pinned is None else pinned)

    async def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """log p(token_t | tokens_<t) for t = 1 .. len-1 under the current weights, temperature 1.

        Returns [len(token_ids) - 1] natural-log values (the prefix cache is bypassed for this
        request, so every position is computed). A probe aborted by a weight update is re-run on
        the new weights. Raises ValueError for fewer than 2 tokens.
        """
        engine = self._require_engine()
        if len(token_ids) < 2:
            raise ValueError(f"prompt_logprobs needs at least 2 tokens, got {len(token_ids)}")
        params = probe_params()
        async with self._admitted(), self._pinned() as (_, lora):
            while True:
                swaps_done_at_submit = self._swaps_done
                final = await last_output(
                    engine.generate(prompt=tokens_prompt(token_ids), sampling_params=params,
                                    request_id=f"probe-{uuid.uuid4().hex}", lora_request=lora)
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

    async def load_adapter(self, path: str, version: int, *, initial: bool = False) -> None:
        """Serve the PEFT adapter directory `path` as policy `version` (LoRA on the base weights;
        `settings.lora_rank` > 0). Requests in flight keep the adapter they started on (nothing is
        paused or reset: vLLM keys its prefix cache by adapter), new requests get `version`; an
        older version is unloaded as soon as no request uses it (workers/inference/adapters.py).
        `initial`: the version may equal the current one (a resumed run's adapter at start).
        Raises RuntimeError without LoRA or when vLLM refuses the adapter, ValueError if `version`
        does not increase, FileNotFoundError when `path` holds no PEFT adapter."""
        from workers.weight_sync.lora import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE

        engine = self._require_engine()
        if self._adapters is None:
            raise RuntimeError("load_adapter on a replica built without LoRA (InferenceSettings.lora_rank=0)")
        if version < self._version or (version == self._version and not initial):
            raise ValueError(f"policy version must increase: current {self._version}, got {version}")
        for name in (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE):
            if not (Path(path) / name).is_file():
                raise FileNotFoundError(f"adapter directory {path} has no {name}")
        t0 = time.perf_counter()
        req = self._adapters.add(version, str(path))
        try:
            loaded = await engine.add_lora(req)
        except Exception as e:  # vLLM re-raises the engine's error as a bare Exception
            raise RuntimeError(f"vLLM could not load adapter {path} as version {version}: {e}") from e
        if not loaded:
            raise RuntimeError(f"vLLM did not load adapter {path} as version {version}")
        self._version = version
        await self._unload(self._adapters.make_current(version))
        logger.info("adapter v%d loaded from %s in %.2f s", version, path, time.perf_counter() - t0)

    def adapter_versions(self) -> list[int]:
        """Versions whose adapter this replica holds loaded now (ascending); [] without LoRA."""
        return [] if self._adapters is None else self._adapters.loaded()

    async def _unload(self, lora_ids: list[int]) -> None:
        for lora_id in lora_ids:
            await self._require_engine().remove_lora(lora_id)

    @asynccontextmanager
    async def _pinned(self) -> AsyncIterator[tuple[int | None, object]]:
        """(version, LoRARequest) a request runs on to its end: the current adapter's (see
        workers/inference/adapters.py), released after; (None, None) without LoRA."""
        if self._adapters is None:
            yield None, None
            return
        version, lora = self._adapters.acquire()
        try:
            yield version, lora
        finally:
            await self._unload(self._adapters.release(version))

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

    async def shutdown(self, timeout_s: float | None = None) -> None:
        """Stop the engine and its processes; safe to call twice. `timeout_s`: how long vLLM waits
        for its engine-core process to exit after SIGTERM before it kills it (None: vLLM's 5 s)."""
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown(timeout=timeout_s)

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
