"""One shared CPU machine (`machine:` in a workload): trainer and rollout side share its cores.

On a GPU cluster the trainer and the engines run on separate GPUs and never slow each other
(no `machine` section: nothing here runs). On one CPU machine (`cluster=local`, this project's
development machine) they share `cores` by processor sharing: the trainer's side (its update,
the driver's sample-store calls) wants 1 core (`cluster.torch_threads=1`), the rollout side
wants `rollout_cores` while it works: the engine decoding, or a rollout in its own CPU time
(`agent.overhead_s`: ACR invoke, the agent's HTTP and S3 calls, the result's way back). When
both work and the demand exceeds the cores, each gets its demand's share of the cores and
progresses at that over what it gets alone (`share_speeds`). Invariant: a trainer update's
work (seconds at full speed) is done exactly once, at the speed in force over each interval;
the engines' speed is set at every change of the trainer's state (orchestrator/sim/engine.py scales its step time by 1 / speed).
Shorter jobs (a rollout's overhead, a store call) take the speed in force when they start.

`store_rpc_s` is the sample store's round trip (a Ray actor in the product): every store call
of the loops costs it, and reading samples `store_sample_s` more per sample (deserialising
them; orchestrator/sim/agent.py `SimStore`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from orchestrator.sim.clock import VirtualLoop


@dataclass(frozen=True)
class MachineSpec:
    """`cores`: CPU cores of the machine; `rollout_cores`: cores the inference side keeps busy
    while the engine decodes; `store_rpc_s`: seconds per sample-store call, `store_sample_s`:
    seconds per sample read."""

    cores: float
    rollout_cores: float
    store_rpc_s: float = 0.0
    store_sample_s: float = 0.0

    def __post_init__(self) -> None:
        if self.cores <= 0 or self.rollout_cores <= 0 or min(self.store_rpc_s, self.store_sample_s) < 0:
            raise ValueError(f"machine: cores and rollout_cores must be > 0, store times >= 0, got {self}")


def share_speeds(cores: float, demands: list[float]) -> list[float]:
    """Processor sharing: each job's speed, as a fraction of its speed alone, when jobs wanting
    `demands` cores run together on `cores` cores. A job gets d · cores / total cores once the
    total exceeds the cores, and alone min(d, cores): speed = d · cores / (total · min(d, cores)),
    1 while the total fits."""
    total = sum(demands)
    if total <= cores:
        return [1.0] * len(demands)
    return [d * cores / (total * min(d, cores)) for d in demands]


class SharedCpu:
    """The shared machine. `engines`: objects with `busy()` (sequences running) and
    `set_speed(s)`; `others`: more of the rollout side, with `busy()`. Each calls
    `rollout_changed()` when it turns busy or idle."""

    def __init__(self, loop: VirtualLoop, spec: MachineSpec, engines: list, others: list | None = None) -> None:
        self.loop, self.spec, self.engines = loop, spec, engines
        self.rollout_parts = [*engines, *(others or [])]
        self.trainer_busy = False
        self._changed = asyncio.Event()
        self.overlap_s = 0.0  # time the trainer ran slowed by the rollout side

    def _contended(self) -> tuple[float, float]:
        """(trainer side, rollout side) speeds while both work."""
        t, r = share_speeds(self.spec.cores, [1.0, self.spec.rollout_cores])
        return t, r

    def rollout_busy(self) -> bool:
        return any(p.busy() for p in self.rollout_parts)

    def rollout_speed(self) -> float:
        """The rollout side's speed now: slowed while the trainer updates."""
        return self._contended()[1] if self.trainer_busy else 1.0

    def trainer_side_speed(self) -> float:
        """The trainer side's speed now: slowed while the rollout side works."""
        return self._contended()[0] if self.rollout_busy() else 1.0

    def rollout_changed(self) -> None:
        if self.trainer_busy:
            self._changed.set()

    def _set_engines(self, busy: bool) -> None:
        s = self._contended()[1] if busy else 1.0
        for e in self.engines:
            e.set_speed(s)

    async def run(self, work_s: float) -> float:
        """Run `work_s` seconds (at full speed) of trainer work; returns the time it took."""
        t0 = self.loop.now
        self.trainer_busy = True
        self._set_engines(True)
        try:
            left = work_s
            while left > 1e-12:
                speed = self.trainer_side_speed()
                self._changed.clear()
                start = self.loop.now
                try:
                    await asyncio.wait_for(self._changed.wait(), timeout=left / speed)
                except asyncio.TimeoutError:
                    pass
                dt = self.loop.now - start
                left -= dt * speed
                if speed < 1.0:
                    self.overlap_s += dt
        finally:
            self.trainer_busy = False
            self._set_engines(False)
        return self.loop.now - t0
