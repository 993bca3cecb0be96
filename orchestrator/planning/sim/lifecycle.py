"""The A2A rollout lifecycle alone: a saturated pool of coding-agent rollouts on the simulated
engines, with no training loop, to measure what a warm pool buys.

`simulate_lifecycle` keeps `container_slots` rollouts in the system (a finished one is replaced at
once by the next task of an endless backlog, as a rollout harness over a large dataset does), each
through `SimAgents`' lifecycle (orchestrator/planning/sim/agent.py: container slot, session rate,
cold start and setup, rollout slot, turns on the `SimReplica`s, rollout slot back, teardown,
container slot back). The policy never changes (no trainer, no weight push), so what it measures
is the rollout side only: inference requests (model turns) per minute, rollout-slot utilisation,
the wait for a rollout slot and setup p50/p90, over the horizon after `warmup_s`. This is the
comparison agentcore-rl-toolkit reports (a warm pool of 256 containers against 128 rollout
slots); the same caps inside the product's own loop are `Scenario.container_slots` /
`Scenario.rollout_slots` (orchestrator/planning/sim/run.py).

Invariant: the same workload, caps, replicas, horizon and seed give the same figures; container
slots held never exceed `container_slots` nor rollout slots `rollout_slots` (the peaks are in the
figures).
"""

from __future__ import annotations

import time

from orchestrator.planning.sim.agent import SimAgents
from orchestrator.planning.sim.clock import VirtualLoop
from orchestrator.planning.sim.engine import SimReplica
from orchestrator.planning.sim.run import engine_spec
from orchestrator.planning.sim.workload import Workload
from workers.core.types import RolloutRequest, Sample


class _Horizon(Exception):
    """The simulated horizon was reached."""


def simulate_lifecycle(w: Workload, *, rollout_slots: int, container_slots: int, replicas: int, hours: float,
                       seed: int = 0, warmup_s: float | None = None) -> dict:
    """Run the saturated pool for `hours` of simulated time on `replicas` engines (the workload's
    `engine`, its calibrated scales applied); the figures between `warmup_s` (default: a quarter
    of the horizon) and the horizon (see `SimAgents.lifecycle_figures`), plus rollouts finished
    per minute, requests at an engine per replica (time average) and the wall time (s). Raises
    ValueError on caps below 1, rollout_slots > container_slots, or no time left to measure."""
    horizon = hours * 3600.0
    warmup = horizon / 4 if warmup_s is None else warmup_s
    if replicas < 1 or not 0 <= warmup < horizon:
        raise ValueError(f"replicas must be >= 1 and 0 <= warmup_s < hours * 3600, got replicas={replicas}, "
                         f"warmup_s={warmup:g}, hours={hours:g}")
    t_wall = time.perf_counter()
    loop = VirtualLoop()
    engines = [SimReplica(loop, engine_spec(w), i) for i in range(replicas)]
    agents = SimAgents(loop, engines, w.agent, seed=seed, env_scale=w.env_time_scale,
                       container_slots=container_slots, rollout_slots=rollout_slots)
    tasks = iter(range(10 ** 12))
    finished: list[float] = []
    marks: dict[str, dict] = {}

    def submit() -> None:
        i = next(tasks)
        agents.start(RolloutRequest(group_id=i, input_id=f"task{i}", sample_index=0, row={"p_success": 0.5}),
                     on_done)

    def on_done(sample: Sample) -> None:
        finished.append(loop.now)
        submit()

    def mark(name: str) -> None:
        for r in engines:
            r.load()  # brings its integrals up to now
        marks[name] = {**agents.lifecycle_mark(), "busy": sum(r.busy_integral for r in engines),
                       "awake": sum(r.awake_s for r in engines)}
        if name == "end":
            raise _Horizon

    for _ in range(container_slots):
        submit()
    loop.schedule(warmup, mark, "start")
    loop.schedule(horizon, mark, "end")
    try:
        loop.drain()
    except _Horizon:
        pass
    finally:
        loop.close()
    a, b = marks["start"], marks["end"]
    dt = b["t_s"] - a["t_s"]
    return {"workload": w.name, "hours": hours, "warmup_s": warmup, "seed": seed, "replicas": replicas,
            **agents.lifecycle_figures(a, b),
            "rollouts_finished_per_min": sum(1 for t in finished if a["t_s"] < t <= b["t_s"]) / dt * 60.0,
            "inference_concurrency": (b["busy"] - a["busy"]) / (b["awake"] - a["awake"]),
            "episodes": agents.episodes, "wall_s": time.perf_counter() - t_wall}
