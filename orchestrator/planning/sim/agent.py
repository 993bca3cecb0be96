"""Simulated agents behind the rollout pool's seam: one ACR session per rollout, multi-turn.

`SimAgents.start` plays one episode in the A2A contract's bounded lifecycle (the real worker's:
workers/rollout/worker.py, workers/rollout/lifecycle.py): it takes a **container slot**
(`container_slots`, the open-session cap; FIFO), then the ACR session is created under the
cluster-wide creation rate (`agent.session_rate_per_s`, a token bucket as ACR enforces it); on one
shared CPU machine the rollout's start work runs (`machine.rollout_start_cpu_s`,
orchestrator/planning/sim/machine.py); it cold-starts and **sets up** (`agent.setup_s`), then takes a
**rollout slot** (`rollout_slots`, the inference budget; FIFO) and loops turns: the context so far
goes to the inference replica the gateway's own `ReplicaRouter` (workers/gateway/router.py) picks,
holding its lease for the turn, the agent's tokens are generated there, the tool / environment
answers after a heavy-tailed time with its own tokens, until the episode's turn count or
`agent.max_context_tokens` is reached; a final environment time (tests, reward) ends the run and
gives the rollout slot back; the rollout's own time after its last turn (`agent.overhead_s`: CPU
work on a shared machine, done at its speed; a delay elsewhere) is its teardown, after which the
container slot goes back. With more container slots than rollout slots, containers set up while
they wait for a rollout slot: a warm pool. A cap of None is no cap, and a workload without
`agent.setup_s` sets up in no time: then the episode runs exactly as it did before the lifecycle
was modelled (same draws, same events).

The finished rollout becomes a real `Sample` (workers/core/types.py). Its rows are compact: one
generated "token" per distinct policy version of each turn, which is exactly what staleness needs
(`Sample.version_range`); the real token counts go to `SimAgents.tokens[session_id]`
(trained tokens, generated tokens, oldest version), which the simulated trainer reads for the
sessions of its train order, as a trainer rank reads the rows of its order.

`SimRolloutActor.run_many` is what the real `RolloutPool` (workers/rollout/pool.py) calls on each
actor, so the pool's own request spreading runs unchanged. Invariant: every started episode
calls its `on_done` exactly once with a sample whose status is terminal; container slots held <=
`container_slots` and rollout slots held <= `rollout_slots` at every event, a rollout slot is held
only by an episode whose setup is done and goes back before its container slot.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import statistics
from collections import defaultdict
from typing import Callable

from orchestrator.planning.sim.clock import VirtualLoop
from orchestrator.planning.sim.engine import CacheOwner, Request, SimReplica
from orchestrator.planning.sim.machine import SharedCpu
from orchestrator.planning.sim.slots import SlotQueue
from orchestrator.planning.sim.workload import AgentSpec, Dist
from workers.core.types import RolloutRequest, RolloutResult, Sample, SampleInfo, TrajectoryRow
from workers.gateway.router import ReplicaRouter


class Session(CacheOwner):
    """One episode in flight."""

    __slots__ = ("req", "sid", "t0", "ctx", "turns_left", "generated", "versions", "lease", "on_done",
                 "reward", "delay_s", "t_created", "t_ready", "setup_s", "slot_wait_s", "holds_rollout_slot")

    def __init__(self, req: RolloutRequest, sid: str, t0: float, on_done: Callable[[Sample], None]) -> None:
        super().__init__()
        self.req, self.sid, self.t0, self.on_done = req, sid, t0, on_done
        self.ctx = self.turns_left = self.generated = 0
        self.versions: list[int] = []
        self.lease = None  # the router's lease of the turn in flight
        self.reward = 0.0
        self.delay_s = 0.0  # cold start + setup drawn for it (seconds)
        self.t_created = self.t_ready = 0.0  # its ACR session created; its setup done (virtual time)
        self.setup_s: float | None = None  # seconds from session creation to setup done
        self.slot_wait_s: float | None = None  # seconds from setup done to a rollout slot held
        self.holds_rollout_slot = False


class SimAgents:
    """Plays episodes on `replicas` (see the module docstring); `env_scale` multiplies every
    environment time (the calibrated free parameter). `container_slots` / `rollout_slots`: the
    lifecycle's two caps (None: no cap). `setup_spans` and `slot_waits` keep (virtual time, seconds)
    of every setup done and every rollout slot taken, for `lifecycle_figures`."""

    def __init__(self, loop: VirtualLoop, replicas: list[SimReplica], spec: AgentSpec, *, seed: int,
                 env_scale: float = 1.0, container_slots: int | None = None,
                 rollout_slots: int | None = None) -> None:
        if container_slots is not None and rollout_slots is not None and rollout_slots > container_slots:
            raise ValueError(f"rollout_slots={rollout_slots} > container_slots={container_slots}: a rollout slot "
                             "is held inside a container slot, so the extra ones could never be used")
        self.loop, self.replicas, self.spec, self.env_scale = loop, replicas, spec, env_scale
        self.router = ReplicaRouter(replicas)  # type: ignore[arg-type]
        self.rng = random.Random(seed)
        self.tokens: dict[str, tuple[int, int]] = {}
        self._next_session_t = 0.0
        self._ids = itertools.count()
        self.episodes = self.turns = self.context_capped = 0
        self.cpu: SharedCpu | None = None  # one shared CPU machine: the rollouts' own work runs on it
        self.containers: SlotQueue[Session] = SlotQueue(container_slots)
        self.rollout_slots: SlotQueue[Session] = SlotQueue(rollout_slots)
        # the A2A contract's spans go on the samples (as the real worker's do) once its lifecycle is modelled
        self.a2a = rollout_slots is not None or spec.setup_s != Dist("const")
        self.setup_spans: list[tuple[float, float]] = []
        self.slot_waits: list[tuple[float, float]] = []

    def start(self, req: RolloutRequest, on_done: Callable[[Sample], None]) -> None:
        now = self.loop.now
        s = Session(req, f"g{req.group_id}-s{req.sample_index}-{next(self._ids)}", now, on_done)
        sp, rng = self.spec, self.rng
        s.turns_left = max(1, int(round(sp.turns.draw(rng))))
        s.ctx = max(1, int(sp.prompt_tokens.draw(rng)))
        p = float(req.row.get("p_success", 0.5))
        if sp.constant_reward_fraction is None:
            s.reward = 1.0 if rng.random() < p else 0.0
        else:  # a constant prompt rewards every sample alike; the others draw distinct rewards
            s.reward = p if req.row.get("constant") else rng.random()
        self.episodes += 1
        s.delay_s = sp.cold_start_s.draw(rng) + sp.setup_s.draw(rng)  # const 0 draws nothing: adds 0.0
        if self.containers.request(s, now):
            self._open(s)

    def _open(self, s: Session) -> None:
        """It holds a container slot: the session is created under the rate, cold-starts, sets up."""
        now = self.loop.now
        s.t0 = now  # latency_s: the session's life, not the wait for a container slot (as the worker)
        t_create = max(now, self._next_session_t)  # ACR's session-creation rate
        self._next_session_t = t_create + 1.0 / self.spec.session_rate_per_s
        s.t_created = t_create
        if self.cpu is None or self.cpu.spec.rollout_start_cpu_s <= 0:
            self.loop.schedule(t_create + s.delay_s, self._ready, s)
        else:  # the start work (invoke, the agent taking the task) on the machine, then cold start and setup
            self.loop.schedule(t_create, self.cpu.start, self.cpu.spec.rollout_start_cpu_s,
                               lambda: self.loop.schedule(self.loop.now + s.delay_s, self._ready, s))

    def _ready(self, s: Session) -> None:
        """Setup done: take a rollout slot (or wait for one, the container kept warm)."""
        now = self.loop.now
        s.t_ready, s.setup_s = now, now - s.t_created
        self.setup_spans.append((now, s.setup_s))
        if self.rollout_slots.request(s, now):
            self._run(s)

    def _run(self, s: Session) -> None:
        """It holds a rollout slot: the agent runs its turns."""
        now = self.loop.now
        s.holds_rollout_slot, s.slot_wait_s = True, now - s.t_ready
        self.slot_waits.append((now, s.slot_wait_s))
        self._turn(s)

    async def resize_rollout_slots(self, n: int) -> None:
        """The rollout-slot cap steered (orchestrator/loop/slot_steering.py): warm containers it
        admits start their runs now."""
        for s in self.rollout_slots.resize(n, self.loop.now):
            self.loop.schedule(self.loop.now, self._run, s)

    async def rollout_slot_stats(self):
        return self.rollout_slots.stats()

    def _end_run(self, s: Session) -> None:
        """The run is over: its rollout slot goes back (to the next warm container, if one waits)."""
        if s.holds_rollout_slot:
            s.holds_rollout_slot = False
            nxt = self.rollout_slots.release(self.loop.now)
            if nxt is not None:
                self.loop.schedule(self.loop.now, self._run, nxt)

    def _turn(self, s: Session) -> None:
        need = min(max(1, int(self.spec.agent_tokens_per_turn.draw(self.rng))),
                   self.spec.max_context_tokens - s.ctx)
        if need < 1:
            self.context_capped += 1
            self._end_run(s)
            self._finish(s)
            return
        self.turns += 1
        s.lease = self.router.lease(s.sid)
        replica: SimReplica = s.lease.__enter__()  # released when the turn ends, as the gateway's call does
        replica.submit(Request(s.ctx, need, s, self._turn_done))

    def _turn_done(self, req: Request) -> None:
        s: Session = req.session  # type: ignore[assignment]
        s.lease.__exit__(None, None, None)
        end = req.ctx + req.need  # a preempted request resumes with its decoded tokens in its context
        s.generated += end - s.ctx
        s.ctx = end
        s.versions.append(req.v_first if req.v_first is not None else req.v_last)
        if req.v_last != s.versions[-1]:
            s.versions.append(req.v_last)
        s.turns_left -= 1
        rng, sp = self.rng, self.spec
        if s.turns_left <= 0:
            self.loop.schedule(self.loop.now + self.env_scale * sp.final_time_s.draw(rng), self._overhead, s)
            return
        s.ctx = min(sp.max_context_tokens, s.ctx + max(0, int(sp.env_tokens_per_turn.draw(rng))))
        self.loop.schedule(self.loop.now + self.env_scale * sp.env_time_s.draw(rng), self._turn, s)

    def _overhead(self, s: Session) -> None:
        """The rollout's own time after its last turn (teardown, its rollout slot given back first):
        CPU work on a shared machine, else a delay."""
        self._end_run(s)
        dt = self.spec.overhead_s.draw(self.rng)
        if self.cpu is not None:
            self.cpu.start(dt, lambda: self._finish(s))
        elif dt > 0:
            self.loop.schedule(self.loop.now + dt, self._finish, s)
        else:
            self._finish(s)

    def _finish(self, s: Session) -> None:
        k = max(1, len(s.versions))
        self.router.forget(s.sid)
        versions = tuple(s.versions) or (self.replicas[0].version,)
        row = TrajectoryRow((0,) * k, (1,) * k, (0.0,) * k, versions[:k])
        self.tokens[s.sid] = (s.ctx, s.generated, min(versions[:k]))
        nxt = self.containers.release(self.loop.now)  # the session stopped: its container slot goes back
        if nxt is not None:
            self.loop.schedule(self.loop.now, self._open, nxt)
        spans = (s.setup_s, s.slot_wait_s) if self.a2a else (None, None)
        s.on_done(Sample(session_id=s.sid, group_id=s.req.group_id, input_id=s.req.input_id,
                         sample_index=s.req.sample_index, rows=(row,), reward=s.reward, status="completed",
                         latency_s=self.loop.now - s.t0, setup_s=spans[0], rollout_slot_wait_s=spans[1]))

    def lifecycle_mark(self) -> dict:
        """Counters at this moment, for `lifecycle_figures` over the time between two marks."""
        now = self.loop.now
        return {"t_s": now, "turns": self.turns, "rollout_slot_s": self.rollout_slots.held_s(now),
                "container_slot_s": self.containers.held_s(now)}

    def lifecycle_figures(self, a: dict, b: dict) -> dict:
        """The lifecycle's figures between marks `a` and `b`: inference requests (model turns
        started) per minute, rollout-slot utilisation (slot-seconds held / (slots x seconds); NaN
        without a cap) and the mean held, the mean wait for a rollout slot (s), setup p50/p90 (s,
        session creation to setup done: cold start and `agent.setup_s`), and containers held."""
        dt = b["t_s"] - a["t_s"]
        if dt <= 0:
            raise ValueError(f"lifecycle_figures needs a later second mark, got {a['t_s']} .. {b['t_s']}")
        cap = self.rollout_slots.capacity
        held = (b["rollout_slot_s"] - a["rollout_slot_s"]) / dt
        setups = [x for t, x in self.setup_spans if a["t_s"] < t <= b["t_s"]]
        waits = [x for t, x in self.slot_waits if a["t_s"] < t <= b["t_s"]]
        p50, p90 = (statistics.quantiles(setups, n=10, method="inclusive")[4::4] if len(setups) > 1
                    else (setups or [math.nan]) * 2)
        return {"inference_requests_per_min": (b["turns"] - a["turns"]) / dt * 60.0,
                "rollout_slots": cap, "container_slots": self.containers.capacity,
                "rollout_slot_utilisation": held / cap if cap else math.nan, "rollout_slots_held_mean": held,
                "container_slots_held_mean": (b["container_slot_s"] - a["container_slot_s"]) / dt,
                "rollout_slot_wait_s_mean": statistics.fmean(waits) if waits else math.nan,
                "setup_s_p50": p50, "setup_s_p90": p90,
                "rollout_slots_peak": self.rollout_slots.peak, "container_slots_peak": self.containers.peak}


class SimStore:
    """The loop's SampleStore in memory: partition -> group id -> samples. Every call the loops
    make costs `rpc_s` seconds (the product's store is a Ray actor: one round trip each), and
    `sample_s` more per sample it names: CPU work on a shared machine (`cpu`)."""

    def __init__(self, rpc_s: float = 0.0, sample_s: float = 0.0, cpu: SharedCpu | None = None) -> None:
        self._parts: dict[str, dict[int, list[Sample]]] = defaultdict(lambda: defaultdict(list))
        self.rpc_s, self.sample_s, self._cpu = rpc_s, sample_s, cpu

    async def _rpc(self, samples: int = 0) -> None:
        dt = self.rpc_s + self.sample_s * samples
        if self._cpu is not None:
            await self._cpu.run(dt)
        elif dt > 0:
            await asyncio.sleep(dt)

    def put(self, samples: list[Sample], partition: str) -> None:
        part = self._parts[partition]
        for s in samples:
            part[s.group_id].append(s)

    async def clear(self, partition: str) -> None:
        await self._rpc()
        self._parts.pop(partition, None)

    async def clear_samples(self, partition: str, samples: list[SampleInfo]) -> None:
        await self._rpc(len(samples))
        part = self._parts.get(partition, {})
        gone = {s.session_id for s in samples}
        for g in {s.group_id for s in samples}:
            part[g] = [s for s in part.get(g, ()) if s.session_id not in gone]
            if not part[g]:
                part.pop(g, None)


class SimRolloutActor:
    """What `RolloutPool` calls on an actor (`run_many`), over the simulated agents."""

    def __init__(self, agents: SimAgents, store: SimStore) -> None:
        self._agents, self._store = agents, store

    async def run_many(self, reqs: list[RolloutRequest], partition: str) -> list[RolloutResult]:
        loop = asyncio.get_running_loop()
        futs = []
        for r in reqs:
            fut = loop.create_future()
            self._agents.start(r, lambda s, fut=fut: fut.done() or fut.set_result(s))
            futs.append(fut)
        samples = await asyncio.gather(*futs)
        self._store.put(list(samples), partition)
        return [RolloutResult(s.info()) for s in samples]
