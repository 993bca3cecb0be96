"""A simulated inference replica: continuous batching over a KV cache counted in tokens.

The model is vLLM's scheduler at the granularity of events, not of steps. Every running sequence
gains one token per engine step, and a step takes `step_base_s + step_per_seq_s · running`
seconds (divided by `speed`, below 1 while a trainer on the same CPU machine slows it:
orchestrator/planning/sim/machine.py); admitting a request first spends `prefill_s_per_token` per uncached prompt token, during
which no sequence decodes (a prefill lengthens the steps it joins). Between two events the batch
does not change, so every running sequence has decoded the same number of steps `V` since
an event-independent origin: a sequence admitted at `V0` with `need` tokens to generate finishes at
`V0 + need`, and the KV tokens in use are `Σ ctx0 + n·V − Σ V0`; both are kept in O(1) and the next
completion comes off a heap, so an event costs O(log n) whatever the batch size.

Scheduling, as vLLM's V1 scheduler does it: requests wait in FCFS order and are admitted while
`max_num_seqs` allows and their whole context fits in the free KV; when decoding fills the cache
the most recently admitted sequence is preempted (its blocks freed, recomputed on re-admission,
first in the queue). Prefix caching: a finished turn's blocks stay cached until as many tokens
have since been written as were free, so a session's next turn on the same replica (the
gateway's router is sticky) prefills only its new tokens while its context is still cached.

Invariant (checked by `check()` and tests/test_sim.py): 0 <= KV in use <= capacity after every
event, every submitted request finishes exactly once (its callback runs once), and a sequence
generates exactly the tokens it asked for. Callers: orchestrator/planning/sim/agent.py (requests),
orchestrator/planning/sim/parts.py (weights, sleep, load probe).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass
from typing import Callable

from workers.core.types import EngineLoad
from orchestrator.planning.sim.clock import VirtualLoop

EPS = 1e-9  # tolerance on the per-sequence step counter (steps)
WATERMARK = 0.01  # fraction of the KV cache an admission must leave free (vLLM's block watermark)


@dataclass(frozen=True)
class EngineSpec:
    """One replica's hardware: KV capacity in tokens, batch cap, step-time model (seconds)."""

    kv_tokens: int
    max_num_seqs: int
    step_base_s: float
    step_per_seq_s: float
    prefill_s_per_token: float
    gpus: int

    def __post_init__(self) -> None:
        if self.kv_tokens < 1 or self.max_num_seqs < 1 or self.gpus < 1:
            raise ValueError(f"engine: kv_tokens, max_num_seqs and gpus must be >= 1, got {self}")
        if min(self.step_base_s, self.step_per_seq_s, self.prefill_s_per_token) < 0:
            raise ValueError(f"engine: step times must be >= 0, got {self}")


class Request:
    """One model turn: `ctx` tokens of context (prompt), `need` tokens to generate. `on_done(req)`
    runs once when it finishes; `v_first`/`v_last` are the policy versions of its first and
    last generated token; `session` is any object with `cache` fields (prefix-cache state)."""

    __slots__ = ("ctx", "need", "on_done", "session", "v_first", "v_last", "v0", "active", "preempted")

    def __init__(self, ctx: int, need: int, session: "CacheOwner", on_done: Callable[["Request"], None]) -> None:
        self.ctx, self.need, self.session, self.on_done = ctx, need, session, on_done
        self.v_first: int | None = None
        self.v_last = -1
        self.v0 = 0.0
        self.active = False
        self.preempted = 0


class CacheOwner:
    """What a replica remembers of a session's last freed context (prefix cache)."""

    __slots__ = ("cache_replica", "cache_epoch", "cache_mark", "cache_tokens")

    def __init__(self) -> None:
        self.cache_replica: SimReplica | None = None
        self.cache_epoch = self.cache_mark = 0.0
        self.cache_tokens = 0


class SimReplica:
    """See the module docstring. `version`: the policy version tokens are generated with now."""

    def __init__(self, loop: VirtualLoop, spec: EngineSpec, index: int = 0) -> None:
        self.loop, self.spec, self.index = loop, spec, index
        self.version = 0
        self.asleep = False
        self.speed = 1.0  # fraction of its own speed (a shared CPU machine: orchestrator/planning/sim/machine.py)
        self.on_busy_change: Callable[[], None] | None = None  # called when it starts or stops decoding
        self._was_busy = False
        self._v = 0.0  # steps every running sequence has decoded since the origin
        self._t = 0.0  # time `_v` and the integrals were brought up to
        self._stall_until = 0.0  # prefill / weight reload: no decoding before this time
        self._n = 0
        self._c0 = 0  # Σ ctx at admission of running sequences
        self._s0 = 0.0  # Σ v0 of running sequences
        self._decoded_done = 0.0  # tokens decoded by sequences no longer running
        self._prefilled = 0  # tokens written by prefills
        self._heap: list[tuple[float, int, Request]] = []
        self._order: list[Request] = []  # admission order, for LIFO preemption (lazy deletion)
        self._ids = itertools.count()
        self.waiting: deque[Request] = deque()
        self._event_gen = 0
        self._cache_epoch = 0  # bumped when the cache is dropped (sleep)
        # accounting
        self.preemptions = 0
        self.finished = 0
        self.prefill_tokens = 0
        self.cached_tokens = 0
        self.busy_integral = 0.0  # ∫ (running + waiting) dt over awake time
        self.kv_integral = 0.0  # ∫ kv_usage dt over awake time
        self.awake_s = 0.0

    # --- queries ------------------------------------------------------------------------------

    def kv_used(self) -> float:
        return self._c0 + self._n * self._v - self._s0

    def num_in_flight(self) -> int:
        return self._n + len(self.waiting)

    def load(self) -> EngineLoad:
        """vLLM's scheduler stats as an inference replica reads them (orchestrator/loop/concurrency.py)."""
        self._advance(self.loop.now)
        return EngineLoad(kv_cache_usage=self.kv_used() / self.spec.kv_tokens, num_running=self._n,
                          num_waiting=len(self.waiting), num_preempted=self.preemptions)

    def busy(self) -> bool:
        """Sequences are running (the engine decodes)."""
        return self._n > 0

    def set_speed(self, speed: float) -> None:
        """Run at `speed` (0 < speed <= 1) of the spec's step time from now on."""
        if speed != self.speed:
            self._advance(self.loop.now)
            self.speed = speed
            self._reschedule()

    def check(self) -> None:
        kv = self.kv_used()
        if kv < -1e-6 or kv > self.spec.kv_tokens + 1e-6 or self._n < 0:
            raise AssertionError(f"replica {self.index}: KV {kv} of {self.spec.kv_tokens}, running {self._n}")

    # --- requests -----------------------------------------------------------------------------

    def submit(self, req: Request) -> None:
        """Queue `req` (FCFS); it is admitted as soon as it fits. Raises ValueError when its
        context alone exceeds the KV capacity (it could never run)."""
        if req.ctx + req.need > self.spec.kv_tokens * (1 - WATERMARK):
            raise ValueError(f"request of {req.ctx}+{req.need} tokens exceeds the KV capacity {self.spec.kv_tokens}")
        self._advance(self.loop.now)
        self.waiting.append(req)
        n = self._n
        self._admit()
        if self._n != n:
            self._reschedule()

    # --- weights and sleep --------------------------------------------------------------------

    def load_weights(self, version: int, reload_s: float) -> None:
        """New weights: tokens from now on carry `version`; decoding pauses `reload_s` seconds
        (running sequences continue afterwards, as `inference.in_flight=continue`)."""
        now = self.loop.now
        self._advance(now)
        self.version = version
        self._stall_until = max(self._stall_until, now) + reload_s
        self._reschedule()

    def sleep(self) -> None:
        """Colocated: the engine releases its GPUs (the KV cache and its prefix cache are dropped)."""
        self._advance(self.loop.now)
        if self._n or self.waiting:
            raise RuntimeError(f"replica {self.index} put to sleep with {self._n} running, {len(self.waiting)} waiting")
        self.asleep = True
        self._cache_epoch += 1

    def wake_up(self) -> None:
        self._advance(self.loop.now)
        self.asleep = False
        self._reschedule()

    # --- the scheduler ------------------------------------------------------------------------

    def _step_s(self) -> float:
        return (self.spec.step_base_s + self.spec.step_per_seq_s * self._n) / self.speed

    def _advance(self, now: float) -> None:
        t = self._t
        dt = now - t
        if dt <= 0:
            return
        self._t = now
        if self.asleep:
            return
        n = self._n
        kv0 = self._c0 + n * self._v - self._s0
        dv = 0.0
        if n:
            dec = now - (t if t > self._stall_until else self._stall_until)
            if dec > 0:
                dv = dec * self.speed / (self.spec.step_base_s + self.spec.step_per_seq_s * n)
                self._v += dv
        self.busy_integral += (n + len(self.waiting)) * dt
        self.kv_integral += (kv0 + 0.5 * n * dv) * dt / self.spec.kv_tokens
        self.awake_s += dt

    def _written(self) -> float:
        return self._prefilled + self._decoded_done + self._n * self._v - self._s0

    def _admit(self) -> None:
        spec, now = self.spec, self.loop.now
        while self.waiting and self._n < spec.max_num_seqs and not self.asleep:
            req = self.waiting[0]
            if self.kv_used() + req.ctx > spec.kv_tokens * (1 - WATERMARK):
                return  # head of line waits for free blocks (FCFS)
            self.waiting.popleft()
            s = req.session
            cached = 0
            if (s.cache_replica is self and s.cache_epoch == self._cache_epoch
                    and self._written() - s.cache_mark <= spec.kv_tokens - self.kv_used()):
                cached = min(s.cache_tokens, req.ctx)
            prefill = req.ctx - cached
            self._prefilled += prefill
            self.prefill_tokens += prefill
            self.cached_tokens += cached
            self._stall_until = max(self._stall_until, now) + prefill * spec.prefill_s_per_token
            req.v0, req.active = self._v, True
            if req.v_first is None:
                req.v_first = self.version
            self._n += 1
            self._c0 += req.ctx
            self._s0 += req.v0
            heapq.heappush(self._heap, (req.v0 + req.need, next(self._ids), req))
            self._order.append(req)

    def _remove(self, req: Request) -> float:
        """Take a running request out; returns the tokens it decoded in this admission."""
        decoded = self._v - req.v0
        req.active = False
        self._n -= 1
        self._c0 -= req.ctx
        self._s0 -= req.v0
        self._decoded_done += decoded
        s = req.session
        s.cache_replica, s.cache_epoch, s.cache_mark = self, self._cache_epoch, self._written()
        s.cache_tokens = req.ctx + int(round(decoded))
        return decoded

    def _preempt_last(self) -> None:
        while self._order:
            req = self._order.pop()
            if req.active:
                decoded = int(round(self._remove(req)))
                again = Request(req.ctx + decoded, req.need - decoded, req.session, req.on_done)
                again.v_first, again.preempted = req.v_first, req.preempted + 1
                self.waiting.appendleft(again)
                self.preemptions += 1
                return
        raise AssertionError("KV full with no running sequence")

    def _on_event(self, gen: int) -> None:
        if gen != self._event_gen:
            return
        self._advance(self.loop.now)
        heap, done = self._heap, []
        while heap and (not heap[0][2].active or heap[0][0] <= self._v + EPS):
            _, _, req = heapq.heappop(heap)
            if req.active:
                self._remove(req)
                req.v_last = self.version
                done.append(req)
        preempted = False
        while self._n and self.kv_used() > self.spec.kv_tokens - 1e-6:
            self._preempt_last()
            preempted = True
        if len(self._order) > 2 * self._n + 64:
            self._order = [r for r in self._order if r.active]
        if not preempted or not self._n:  # as vLLM: no admission in a step that preempted
            self._admit()
        self._reschedule()
        self.finished += len(done)
        for req in done:
            req.on_done(req)

    def _reschedule(self) -> None:
        self._event_gen += 1
        if self.on_busy_change is not None and self._was_busy != (self._n > 0):
            self._was_busy = self._n > 0
            self.on_busy_change()
        if self.asleep or not self._n:
            return
        heap = self._heap
        while heap and not heap[0][2].active:
            heapq.heappop(heap)
        step = self._step_s()
        start = max(self.loop.now, self._stall_until)
        t_done = start + max(0.0, heap[0][0] - self._v) * step
        v_full = (self.spec.kv_tokens - self._c0 + self._s0) / self._n
        t_full = start + max(0.0, v_full - self._v) * step
        self.loop.schedule(min(t_done, t_full), self._on_event, self._event_gen)
