"""One shared CPU machine (`machine:` in a workload): every part of the run that needs CPU shares its cores.

On a GPU cluster the trainer and the engines run on separate GPUs and never slow each other
(no `machine` section: nothing here runs). On one CPU machine (`cluster=local`, this project's
development machine) the driver, the rollout actors, the ACR emulator and its agents, moto, the
gateway, the engines, the trainer and Ray's own processes all run on `cores` cores. The model is
processor sharing (the kernel's fair scheduler in the fluid limit): at each moment the parts that
work want D cores in all,

- `background_cores` always (what a run burns per second whatever it does: Ray's GCS and raylet,
  idle engines and actors polling, the reaper; scripts/workload_from_run.py writes 0 and counts
  it in the rollouts' work, its `fit_cpu` says why),
- `engine_cores` per engine while it decodes (0 where the engines' CPU is counted in the
  rollouts' work, as scripts/workload_from_run.py fits it: the engines still run at speed s),
- `trainer_cores` while the trainer updates,
- 1 per job of CPU work in progress: a rollout's own work (`rollout_start_cpu_s` when it starts:
  the driver's dispatch, the rollout actor's ACR invoke, the emulator and the agent taking the
  task; `agent.overhead_s` after its last turn: the result's way back through S3, the rollout
  actor's pickup, the stop, the sample's store), a sample-store call of the loops,

and every part runs at speed `s = min(1, cores / D)` of its speed alone (`share_speed`): an
engine's step time is divided by s, a job of w CPU seconds (seconds at full speed) takes w / s
while s holds. So a sync step, where a batch's rollouts start together, pays their start work as
a burst, and an async run, with many rollouts in flight, cannot finish rollouts faster than the
cores do their work: the rollout side's throughput is bounded by the machine.

Invariant: every job's work is done exactly once, at the speed in force over each interval. The
machine keeps V = ∫ s dt since the start; all jobs progress at the same s, so a job started at
V0 with w to do ends when V = V0 + w, and the next end comes off a heap: O(log n) per event
whatever the number of jobs. The engines' speed is set at every change of D.
Callers: orchestrator/planning/sim/run.py (wiring), agent.py (rollouts' work, store calls), parts.py (trainer).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from dataclasses import dataclass
from typing import Callable

from orchestrator.planning.sim.clock import VirtualLoop

EPS = 1e-12  # tolerance on the work counter (seconds at full speed)


@dataclass(frozen=True)
class MachineSpec:
    """`cores`: CPU cores of the machine; `engine_cores`: cores an engine keeps busy while it
    decodes; `trainer_cores`: while the trainer updates; `background_cores`: always;
    `rollout_start_cpu_s`: CPU seconds of a rollout's own work when it starts; `store_rpc_s`:
    CPU seconds per sample-store call, `store_sample_s` per sample it names."""

    cores: float
    engine_cores: float
    trainer_cores: float = 1.0
    background_cores: float = 0.0
    rollout_start_cpu_s: float = 0.0
    store_rpc_s: float = 0.0
    store_sample_s: float = 0.0

    def __post_init__(self) -> None:
        if self.cores <= 0 or not (0 <= self.engine_cores <= self.cores and 0 < self.trainer_cores <= self.cores):
            raise ValueError(f"machine: cores > 0, 0 <= engine_cores <= cores, 0 < trainer_cores <= cores, got {self}")
        if min(self.background_cores, self.rollout_start_cpu_s, self.store_rpc_s, self.store_sample_s) < 0:
            raise ValueError(f"machine: background_cores and CPU times must be >= 0, got {self}")


def share_speed(cores: float, demand: float) -> float:
    """Processor sharing: the speed (fraction of its speed alone) of every part when the parts at
    work want `demand` cores in all, each no more than `cores`: 1 while the demand fits, else
    each gets its demand's share of the cores, cores / demand."""
    return 1.0 if demand <= cores else cores / demand


class SharedCpu:
    """The shared machine (see the module docstring). `engines`: objects with `busy()` (decoding)
    and `set_speed(s)`, which call `engines_changed()` when they start or stop decoding."""

    def __init__(self, loop: VirtualLoop, spec: MachineSpec, engines: list) -> None:
        self.loop, self.spec, self.engines = loop, spec, engines
        self.speed = 1.0
        self._v = 0.0  # work a job running since the start would have done (seconds at full speed)
        self._t = 0.0  # time `_v` was brought up to
        self._jobs_demand = 0.0  # cores the jobs in progress want
        self._busy_engines = 0
        self._heap: list[tuple[float, int, float, Callable[[], None]]] = []
        self._ids = itertools.count()
        self._gen = 0
        self.busy_s = 0.0  # ∫ min(D, cores) dt: core-seconds used (for reports and tests)
        self.slowed_s = 0.0  # time with s < 1

    # --- queries ------------------------------------------------------------------------------

    def demand(self) -> float:
        """Cores wanted now."""
        s = self.spec
        return s.background_cores + self._busy_engines * s.engine_cores + self._jobs_demand

    def jobs(self) -> int:
        """Jobs of CPU work in progress."""
        return len(self._heap)

    # --- work ---------------------------------------------------------------------------------

    def start(self, work_s: float, on_done: Callable[[], None], demand: float = 1.0) -> None:
        """Start a job of `work_s` CPU seconds wanting `demand` cores; `on_done()` runs once when it
        is done (at once for no work)."""
        if work_s <= 0:
            on_done()
            return
        self._advance()
        heapq.heappush(self._heap, (self._v + work_s, next(self._ids), demand, on_done))
        self._jobs_demand += demand
        self._update()

    async def run(self, work_s: float, demand: float = 1.0) -> float:
        """Do `work_s` CPU seconds wanting `demand` cores; returns the time it took."""
        t0 = self.loop.now
        if work_s > 0:
            fut = asyncio.get_running_loop().create_future()
            self.start(work_s, lambda: fut.done() or fut.set_result(None), demand)
            await fut
        return self.loop.now - t0

    async def run_trainer(self, work_s: float) -> float:
        """A trainer update of `work_s` seconds alone (it wants `trainer_cores`)."""
        return await self.run(work_s, self.spec.trainer_cores)

    def engines_changed(self) -> None:
        """An engine started or stopped decoding."""
        busy = sum(1 for e in self.engines if e.busy())
        if busy != self._busy_engines:
            self._advance()
            self._busy_engines = busy
            self._update()

    # --- the sharing --------------------------------------------------------------------------

    def _advance(self) -> None:
        now = self.loop.now
        dt = now - self._t
        if dt > 0:
            self._v += dt * self.speed
            self.busy_s += dt * min(self.demand(), self.spec.cores)
            if self.speed < 1.0:
                self.slowed_s += dt
            self._t = now

    def _update(self) -> None:
        """Speed for the demand now; engines told; the next job end scheduled."""
        speed = share_speed(self.spec.cores, self.demand())
        if speed != self.speed:
            self.speed = speed
            for e in self.engines:
                e.set_speed(speed)
        self._gen += 1
        if self._heap:
            self.loop.schedule(self._t + max(0.0, self._heap[0][0] - self._v) / self.speed, self._on_end, self._gen)

    def _on_end(self, gen: int) -> None:
        if gen != self._gen:
            return
        self._advance()
        done = []
        while self._heap and self._heap[0][0] <= self._v + EPS:
            _, _, demand, on_done = heapq.heappop(self._heap)
            self._jobs_demand -= demand
            done.append(on_done)
        if not self._heap:
            self._jobs_demand = 0.0  # no drift from float sums
        self._update()
        for fn in done:
            fn()
