"""Where the CPU goes: CPU seconds (user + system) each part of the run used during a step.

A step probe (orchestrator/wiring/training.py wires it after the actor directory's refresh) logs, at every
step's end, `perf/cpu_s/<part>` = CPU seconds the part's processes used since the previous step's
end, and `perf/cpu_s/total`. Parts (`PARTS`): `driver` (this process: the loop, the rollout pool's
dispatch, metric logging), `trainer` (trainer ranks), `inference` (the replicas' actors and vLLM's
engine-core processes under them), `gateway`, `rollout` (the rollout actors: ACR invokes, result
pickup), `local_stack` (`rollout=local`: the ACR emulator, its agent processes, moto S3) and
`other` (whatever else descends from the driver: Ray's GCS and raylet, the trajectory buffer's
actors, idle Ray workers, the reaper). On one machine, `perf/cpu_s/total` over the step's time is
how many cores the run kept busy; scripts/workload_from_run.py fits the simulator's machine model
from it (orchestrator/planning/sim/machine.py). `perf/cpu_s/machine` is what every process of the machine
used (/proc/stat), so `machine - total` is what other jobs on the same machine took from the run.

How a process finds its part: every process of the driver's tree belongs to its nearest
ancestor-or-self that is a named root (`roots()`: name -> PID, as `run_dir/actors.json` and
`pids.json` name them; `part_of_name` maps a name to its part), else to `other`; the driver itself
is `driver`. Invariants: each PID is counted in exactly one part at a sample; a part's figure is
never negative (a PID's CPU seconds are taken from its previous reading, 0 for a process that
started since; a process that exited since the previous sample loses its last interval); the
parts sum to `total`. Cost: one `stat` read per process of the machine (parent PID and CPU
times), in a worker thread (~10 ms on a 2-core machine).
"""

from __future__ import annotations

import asyncio
import os
from typing import Callable

PARTS = ("driver", "trainer", "inference", "gateway", "rollout", "local_stack", "other")
_PREFIXES = (("inference-", "inference"), ("trainer-rank-", "trainer"), ("rollout-", "rollout"),
             ("gateway", "gateway"), ("emulator", "local_stack"), ("moto", "local_stack"),
             ("agent-", "local_stack"))


def part_of_name(name: str) -> str:
    """The part a named process belongs to (`inference-0` -> `inference`); `other` if unknown."""
    return next((part for prefix, part in _PREFIXES if name.startswith(prefix)), "other")


def attribute(parents: dict[int, int], roots: dict[int, str], driver: int) -> dict[int, str]:
    """PID -> part for the driver and every descendant of it in `parents` (PID -> parent PID):
    the part of the nearest ancestor-or-self in `roots` (PID -> part), else `other`; the driver
    is `driver`. Processes outside the driver's tree are left out."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    out = {driver: "driver"}
    stack = [(c, roots.get(c, "other")) for c in children.get(driver, ())]
    while stack:
        pid, part = stack.pop()
        if pid in out:  # a cycle in a racy /proc read: keep the first
            continue
        out[pid] = part
        stack.extend((c, roots.get(c, part)) for c in children.get(pid, ()))
    return out


class CpuLedger:
    """Turns readings of cumulative CPU seconds per PID into CPU seconds per part since the
    previous reading (see the module docstring for the invariants). Pure: no /proc."""

    def __init__(self) -> None:
        self._last: dict[int, float] = {}
        self._machine_s: float | None = None

    def baseline(self, cpu_s: dict[int, float], machine_s: float | None = None) -> None:
        """Take `cpu_s` (PID -> cumulative CPU seconds) and `machine_s` as the starting point."""
        self._last = dict(cpu_s)
        self._machine_s = machine_s

    def on_sample(self, cpu_s: dict[int, float], parts: dict[int, str], machine_s: float | None = None
                  ) -> dict[str, float]:
        """CPU seconds per part (every part of `PARTS`, and `total`) since the previous reading;
        `cpu_s` and `parts` cover the same PIDs. A reused PID whose reading went down counts from 0.
        With `machine_s` (the machine's cumulative busy CPU seconds): `machine`, its growth."""
        out = dict.fromkeys(PARTS, 0.0)
        for pid, now in cpu_s.items():
            before = self._last.get(pid, 0.0)
            out[parts.get(pid, "other")] += now - before if now >= before else now
        self._last = dict(cpu_s)
        out["total"] = sum(out[p] for p in PARTS)
        if machine_s is not None:
            if self._machine_s is not None:
                out["machine"] = max(0.0, machine_s - self._machine_s)
            self._machine_s = machine_s
        return out


def _machine_busy_s() -> float:
    """CPU seconds the machine's cores have been busy since boot (every process; /proc/stat)."""
    import psutil

    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)


def _read_procs() -> dict[int, tuple[int, float]]:
    """PID -> (parent PID, user + system CPU seconds) of every process (one `stat` read each)."""
    import psutil

    out = {}
    for p in psutil.process_iter(["ppid", "cpu_times"]):
        ppid, t = p.info["ppid"], p.info["cpu_times"]
        if ppid is not None and t is not None:
            out[p.pid] = (ppid, t.user + t.system)
    return out


class CpuProbe:
    """The step probe (`await probe()` -> `{"perf/cpu_s/<part>": seconds}`); `roots()` gives the
    run's named processes (name -> PID) at each call."""

    def __init__(self, roots: Callable[[], dict[str, int]], driver: int | None = None) -> None:
        self._roots, self._driver = roots, driver if driver is not None else os.getpid()
        self._ledger = CpuLedger()
        cpu_s, _, machine_s = self._sample()
        self._ledger.baseline(cpu_s, machine_s)

    def _sample(self) -> tuple[dict[int, float], dict[int, str], float]:
        roots = {pid: part_of_name(name) for name, pid in self._roots().items()}
        procs = _read_procs()
        parts = attribute({pid: ppid for pid, (ppid, _) in procs.items()}, roots, self._driver)
        return {pid: procs[pid][1] for pid in parts if pid in procs}, parts, _machine_busy_s()

    async def __call__(self) -> dict[str, float]:
        cpu_s, parts, machine_s = await asyncio.to_thread(self._sample)
        return {f"perf/cpu_s/{k}": v for k, v in self._ledger.on_sample(cpu_s, parts, machine_s).items()}
