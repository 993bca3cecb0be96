"""RolloutPool: the driver-side handle that spreads rollouts over the rollout actors
(workers/rollout/actor.py), and survives losing one.

Invariant: `RolloutPool.run_all` returns one result per request (a `RolloutResult`: the stored
sample's metadata and the outcome-only fields, the one account the driver gets of a rollout), or raises (a ContractError from
any actor stops the run; Ray re-raises it as an instance of ContractError). `shutdown` cancels
rollouts still running; each stops its ACR session on the way out, and `shutdown` returns only
once every ACR stop has ended (the driver stops the local emulator right after).

Losing an actor (its process died: SIGKILL, OOM, node loss). Without `PoolRecovery` the call
raises. With it, the pool gives every attempt its ACR session id before dispatch, and when an
actor dies: a new actor replaces it (`rollout/actors_lost`), the session-cap slots it held
are given back (`release_owner`), the buffer says which of its attempts stored a sample, and
workers/rollout/recovery.py decides the rest: re-dispatch once under a new session id
(`rollout/redispatched`) or store a failed sample with reason `actor_lost`; the ACR and gateway
sessions of every lost attempt are stopped through a live actor. Every request still ends with
exactly one stored sample and one result. To kill one for a chaos test: the actors are named
`rollout-{i}-{6 hex}`; the driver lists their PIDs in `run_dir/actors.json`; SIGKILL one.

The open-session journal (workers/acr/journal.py, with `journal`): every attempt's session is
recorded before its dispatch and forgotten when its result says it was stopped, when the stop of
a lost session ended (stopped or not open), or at `shutdown` (all but what the actors still hold
open). What a driver killed outright leaves there, its reaper and the next start stop.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from workers.acr.journal import JournalWriter
from workers.acr.limits import SessionCapClient
from workers.core.calls import actor_died
from workers.core.types import RolloutRequest, RolloutResult, Sample
from workers.rollout.actor import PoolOptions, rollout_actor_spawner, sink_for
from workers.rollout.clients import RolloutActorClient, SampleStoreClient
from workers.rollout.contract import new_session_id
from workers.rollout.recovery import ACTOR_LOST, Attempt, plan_lost
from workers.rollout.worker import RolloutSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolRecovery:
    """How a pool survives the death of a rollout actor (see the module docstring).

    spawn(): a new rollout actor, as (handle, name); store: the trajectory buffer's `put(samples,
    partition)` and `sample_infos(partition)` (an object or actor handle); sessions_cap: the
    session-cap service (`release_owner(name)`), or None; exp_id: prefix of new session ids;
    max_redispatch: re-dispatches of one request after losses (`rollout.redispatch_lost`);
    rollouts_cap: the rollout-slot cap service (`rollout.rollout_slots`), or None.
    """

    spawn: Callable[[], tuple[Any, str]]
    store: Any
    exp_id: str
    sessions_cap: Any = None
    max_redispatch: int = 1
    rollouts_cap: Any = None


class RolloutPool:
    """Driver-side handle on the rollout actors (Ray handles, or RolloutActor objects in one
    process): spreads requests over them round-robin; with `recovery`, replaces a dead actor and
    settles its rollouts (names: the actors' Ray names, in order); with `journal` (it needs
    `recovery`, which names the sessions before dispatch), records every session in the run's
    open-session journal before its dispatch and forgets it once it is known to be stopped."""

    def __init__(self, actors: list[Any], *, recovery: PoolRecovery | None = None, names: Sequence[str] = (),
                 journal: JournalWriter | None = None) -> None:
        if not actors:
            raise ValueError("RolloutPool needs at least one rollout actor")
        if recovery is not None and len(names) != len(actors):
            raise ValueError(f"a recovering pool needs one name per actor: {len(names)} names, {len(actors)} actors")
        if journal is not None and recovery is None:
            raise ValueError("a journaling pool needs PoolRecovery: it names each session before dispatch")
        self._journal = journal
        self._actors = list(actors)
        self._names = list(names) or [""] * len(actors)
        self._recovery = recovery
        self._dead: dict[int, str] = {}  # id of a replaced actor handle -> its name (for later messages)
        self._next = 0
        self.counts: Counter[str] = Counter()  # rollout/actors_lost, rollout/redispatched, rollout/failed/actor_lost

    async def prepare(self) -> None:
        """Have every actor build its worker now (`RolloutActor.prepare`); optional."""
        await asyncio.gather(*(RolloutActorClient(a).prepare() for a in self._actors))

    async def run_all(self, reqs: list[RolloutRequest], partition: str) -> list[RolloutResult]:
        """Run every request; results in request order. Raises what an actor raised (a lost actor
        too, unless the pool recovers)."""
        rec = self._recovery
        attempts = [Attempt(r, r.session_id or (new_session_id(rec.exp_id, r.group_id, r.sample_index) if rec else ""))
                    for r in reqs]
        return await self._dispatch(attempts, partition)

    async def _dispatch(self, attempts: list[Attempt], partition: str) -> list[RolloutResult]:
        shards: list[list[int]] = [[] for _ in self._actors]
        for i in range(len(attempts)):
            shards[(self._next + i) % len(shards)].append(i)
        self._next = (self._next + len(attempts)) % len(self._actors)
        used = [(a, idx) for a, idx in zip(self._actors, shards) if idx]
        results = await asyncio.gather(*(self._run_shard(a, [attempts[i] for i in idx], partition) for a, idx in used))
        out: list[RolloutResult | None] = [None] * len(attempts)
        for (_, idx), got in zip(used, results):
            for i, o in zip(idx, got):
                out[i] = o
        return out  # type: ignore[return-value]

    async def _run_shard(self, actor: Any, attempts: list[Attempt], partition: str) -> list[RolloutResult]:
        reqs = [replace(a.req, session_id=a.session_id or None) for a in attempts]
        if self._journal is not None:
            self._journal.record(a.session_id for a in attempts)
        try:
            outcomes = await RolloutActorClient(actor).run_many(reqs, partition)
        except Exception as exc:
            if self._recovery is None or not actor_died(exc):
                raise
            return await self._recover(actor, attempts, partition, exc)
        if self._journal is not None:
            self._journal.forget(o.session_id for o in outcomes if not o.session_open)
        return outcomes

    async def _recover(self, dead: Any, attempts: list[Attempt], partition: str,
                       exc: BaseException) -> list[RolloutResult]:
        rec = self._recovery
        assert rec is not None
        name = await self._replace(dead)
        log.warning("rollout actor %s died (%s); settling its %d rollouts", name, type(exc).__name__, len(attempts))
        store = SampleStoreClient(rec.store)
        infos = {i.session_id: i for i in await store.sample_infos(partition)}
        plan = plan_lost(attempts, infos.keys(), max_redispatch=rec.max_redispatch,
                         new_session_id=lambda r: new_session_id(rec.exp_id, r.group_id, r.sample_index))
        await self._stop_lost(list(plan.to_stop))
        lost: dict[str, Sample] = {}
        if plan.failed:
            error = f"{ACTOR_LOST}: rollout actor {name} died running this rollout"
            lost = {a.session_id: Sample(session_id=a.session_id, group_id=a.req.group_id, input_id=a.req.input_id,
                                         sample_index=a.req.sample_index, rows=(), reward=None, status="failed",
                                         latency_s=0.0, error=error) for a in plan.failed}
            await store.put(list(lost.values()), partition)
            self.counts["rollout/failed"] += len(plan.failed)
            self.counts[f"rollout/failed/{ACTOR_LOST}"] += len(plan.failed)
        self.counts["rollout/redispatched"] += len(plan.redispatch)
        again = iter(await self._dispatch(list(plan.redispatch), partition) if plan.redispatch else [])
        settled = {a.session_id for a in plan.settled}
        out = []
        for a in attempts:  # plan_lost keeps the order: the re-dispatched ones come back in turn
            if a.session_id in settled:  # stored before the actor died: the buffer's tags are its account
                out.append(RolloutResult(infos[a.session_id]))
            elif a.session_id in lost:
                out.append(RolloutResult(lost[a.session_id].info(), reason=ACTOR_LOST))
            else:
                out.append(next(again))
        return out

    async def _replace(self, dead: Any) -> str:
        """Swap a new actor in for `dead` (once, however many shards saw it die) and give back the
        session slots it held; returns the dead actor's name."""
        rec = self._recovery
        assert rec is not None
        if not any(a is dead for a in self._actors):
            return self._dead.get(id(dead), "(replaced)")
        i = next(i for i, a in enumerate(self._actors) if a is dead)
        name = self._names[i]
        self._dead[id(dead)] = name
        self._actors[i], self._names[i] = rec.spawn()  # no await before this: one replacement per death
        self.counts["rollout/actors_lost"] += 1
        if rec.sessions_cap is not None and name:
            self.counts["rollout/slots_released"] += await SessionCapClient(rec.sessions_cap).release_owner(name)
        if rec.rollouts_cap is not None and name:
            self.counts["rollout/rollout_slots_released"] += await SessionCapClient(rec.rollouts_cap).release_owner(name)
        return name

    async def _stop_lost(self, session_ids: list[str]) -> None:
        if not session_ids:
            return
        try:
            ends = await RolloutActorClient(self._actors[0]).stop_lost_sessions(session_ids)
        except Exception as exc:  # noqa: BLE001 - visible; kept in the journal (the reaper or the next start stops them)
            log.warning("stopping %d sessions of a lost rollout actor failed: %s", len(session_ids), exc)
            self.counts["acr/stop_failed"] += len(session_ids)
            return
        self.counts["rollout/lost_sessions_stopped"] += sum(e == "stopped" for e in ends)
        if self._journal is not None:
            self._journal.forget(s for s, e in zip(session_ids, ends) if e != "failed")

    def named_actors(self) -> dict[str, Any]:
        """The live rollout actors by Ray name (replacements included)."""
        return dict(zip(self._names, self._actors))

    async def acr_stats(self) -> dict[str, int]:
        return _sum(await self._each(lambda a: a.acr_stats()))

    async def resize_rollout_slots(self, n: int) -> None:
        """Set the cluster-wide rollout-slot cap to `n` (orchestrator/loop/slot_steering.py).
        Raises RuntimeError for a pool without one."""
        cap = self._recovery.rollouts_cap if self._recovery else None
        if cap is None:
            raise RuntimeError("this rollout pool has no rollout-slot cap (rollout.rollout_slots)")
        await SessionCapClient(cap).set_capacity(n)

    async def slot_stats(self) -> dict[str, Any]:
        """The cluster-wide slot caps' `LimitStats` (workers/acr/limits/): "container" (the
        open-session cap) and, under `rollout.rollout_slots`, "rollout"; {} for a pool without caps."""
        rec = self._recovery
        caps = {"container": rec.sessions_cap if rec else None, "rollout": rec.rollouts_cap if rec else None}
        got = await asyncio.gather(*(SessionCapClient(c).stats() for c in caps.values() if c is not None))
        return dict(zip([k for k, c in caps.items() if c is not None], got))

    async def acr_counts(self) -> dict[str, int]:
        """This process's cumulative ACR counters, summed over the live actors: `acr/requests` (HTTP
        attempts), `acr/retries`, `acr/throttled` (throttles that reached a rollout) and the stop
        counters (`acr/stop_failed`, `acr/stop_recovered`, the pool's own included); with them the
        failure reasons `rollout/failed/{reason}`, which a checkpoint carries the same way."""
        stats, counts = await asyncio.gather(self.acr_stats(), self.rollout_counts())
        return {**{f"acr/{k}": int(stats.get(k, 0)) for k in ("requests", "retries", "throttled")},
                **{k: v for k, v in counts.items() if k.startswith(("acr/", "rollout/failed/"))}}

    async def rollout_counts(self) -> dict[str, int]:
        """Summed `rollout/...` counts of every live actor (terminal states and failure reasons),
        plus the pool's own: actors lost, rollouts re-dispatched or failed `actor_lost`."""
        return _sum([*await self._each(lambda a: a.rollout_counts()), dict(self.counts)])

    async def _each(self, ask: Callable[[RolloutActorClient], Awaitable[dict[str, int]]]) -> list[dict[str, int]]:
        got = await asyncio.gather(*(ask(RolloutActorClient(a)) for a in self._actors), return_exceptions=True)
        for g in got:
            if isinstance(g, BaseException) and not actor_died(g):
                raise g
        return [g for g in got if not isinstance(g, BaseException)]  # a dead actor, not replaced yet: nothing

    async def shutdown(self) -> None:
        """Shut every actor down (each stops the sessions of its cancelled rollouts). When all of
        them answered, the journal forgets every session of this run but those still open."""
        got = await asyncio.gather(*(RolloutActorClient(a).shutdown() for a in self._actors), return_exceptions=True)
        if self._journal is not None and not any(isinstance(g, BaseException) for g in got):
            self._journal.forget_all_but(s for g in got for s in (g or ()))


def _sum(dicts: list[dict[str, int]]) -> dict[str, int]:
    total: Counter[str] = Counter()
    for d in dicts:
        total.update(d)
    return dict(total)



async def start_rollout_pool(settings: RolloutSettings, *, num_workers: int, limits: Any, acr: Any, result_host: str,
                             gateway: Any, buffer_handle: Any, store: Any = None,
                             redispatch_lost: int = 1, journal: JournalWriter | None = None,
                             limits_suffix: str = "") -> RolloutPool:
    """Start the named cluster-wide limit actors (`limits`: workers.acr.limits.AcrLimitsConfig)
    and `num_workers` rollout actors whose ACR clients use `acr` (workers.acr.client.AcrClientConfig);
    return the pool, which replaces a dead actor and re-dispatches its rollouts `redispatch_lost`
    times (`store`: the caller's TrajectoryBuffer, else one connected to `buffer_handle`). The
    driver maps its `rollout` config group to these typed settings. Awaits the limit actors (not
    the rollout actors: `RolloutPool.prepare`), so a driver's event loop stays free meanwhile.
    `journal`: the run's open-session journal (workers/acr/journal.py), or None; `limits_suffix`:
    the limit actors' name suffix (`start_limit_actors`)."""
    from workers.acr.limits import start_limit_actors

    handles = await start_limit_actors(limits, suffix=limits_suffix)
    options = PoolOptions(limits=handles, result_host=result_host, acr=acr)
    spawn = rollout_actor_spawner(settings, gateway, buffer_handle, options=options)
    actors, names = zip(*(spawn() for _ in range(num_workers)))
    recovery = PoolRecovery(spawn=spawn, store=store if store is not None else sink_for(buffer_handle), exp_id=settings.exp_id,
                            sessions_cap=handles.sessions, max_redispatch=redispatch_lost,
                            rollouts_cap=handles.rollouts)
    return RolloutPool(list(actors), recovery=recovery, names=names, journal=journal)
