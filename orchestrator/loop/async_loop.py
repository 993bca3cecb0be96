"""The async loop: generation never stops; the trainer updates as mini-batches fill.

A producer task admits groups while the staleness controller has capacity (at most
(η + v + 1)·k·B groups admitted by policy version v, at most `max_running_groups` in flight, and
none past the run's last update: orchestrator/loop/staleness.py) and runs each group's n
rollouts as its own task; finished groups queue up. The consumer (this loop) takes finished
groups, filters them, checks every sample's staleness (trainer version − oldest token version),
trains `sync_every` mini-batches of B groups, pushes weights and bumps the version, which frees
capacity. The loop holds only the samples' metadata: the results the rollout pool returned for
each finished group (it never lists the buffer). A trained group's rows stay in the buffer until
the trainer ranks have read them for its update, then go, with those of the update's other groups,
in one request by the keys the results carry (`clear_samples`); an untrained group's go at once,
and whatever is left at the end with the partition.

Invariants: every dispatched rollout reaches exactly one terminal state in the ledger
(`completed` = trained, `filtered`, `failed`, `expired` = too stale, or still running when the
run ended); a group that is not trained gives its admission capacity back; no sample staler
than η is trained with a gradient. A producer task that dies stops the run.

Validation (`parts.validator`) runs as its own lane (orchestrator/loop/validation.py ValidationLane):
started when a due version is pushed, on its own rollout pool, never admitted, never trained;
its metrics join the next step's record (`val/policy_version` names the version measured).

Called by `main.py` with the same parts as the sync loop plus the staleness controller.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from orchestrator.loop.batching import Group, assemble, train_order
from orchestrator.loop.common import (LoopParts, LoopPosition, LoopReport, close_sample, close_trained, close_untrained,
                                       dispatch_group, end_step, finish, ledger_key, report_groups, run_rollouts,
                                       step_metrics, start_position, sync_weights)
from orchestrator.loop.staleness import AdmissionState
from orchestrator.loop.staleness import Admission, SampleStaleness, StalenessPolicy, judge_samples, staleness_metrics
from orchestrator.loop.staleness_gate import AdmissionGate
from orchestrator.loop.validation import ValidationLane
from workers.core.types import RolloutRequest, SampleInfo
from workers.weight_sync.protocol import WeightSync

PARTITION = "async"  # one buffer partition; groups are cleared one by one once consumed
GROUP_WAIT_S = 0.5  # the consumer re-checks the producer's health at least this often (seconds)


@dataclass(frozen=True)
class AsyncLoopSettings:
    total_steps: int  # weight syncs; each follows `sync_every` optimizer updates
    groups_per_update: int  # B: trainable groups per mini-batch
    n: int  # samples per group
    sync_every: int
    max_staleness: int  # η, in policy versions
    on_stale: str  # "drop" | "train_masked"
    filter_zero_variance: bool
    max_gen_batches: int = 0  # a mini-batch stops the run after this many x B filtered groups (0: no cap)
    drain_timeout_s: float = 60.0  # bound on waiting for in-flight groups at the end (seconds; async.drain_timeout_s)
    max_running_groups: int | None = None  # groups in flight at once (staleness.fixed_max_running; None: no cap)


@dataclass(frozen=True)
class _SyncVersion:
    """The admission controller's version source: the weight sync's version, read each time."""

    weights: WeightSync

    def current(self) -> int:
        return self.weights.version()


class _Stopped(Exception):
    """The loop ends early (the message says why): raised inside a step, the run ends after its last one."""


@dataclass
class _InFlight:
    """Groups admitted and not yet taken by an update: their dataset rows, for checkpoints."""

    next_group: int = 0
    rows: dict[int, dict] = field(default_factory=dict)
    errors: list[BaseException] = field(default_factory=list)  # raised by group tasks: they stop the run

    def on_group_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.errors.append(task.exception())

    def admit(self, row: dict) -> int:
        gid, self.next_group = self.next_group, self.next_group + 1
        self.rows[gid] = row
        return gid


@dataclass(frozen=True)
class _Finished:
    """A group whose rollouts all returned: their samples' metadata, in sample order."""

    group_id: int
    samples: list[SampleInfo]


@dataclass
class _StepStats:
    facts: list[SampleStaleness] = field(default_factory=list)
    masked: set[str] = field(default_factory=set)  # ledger keys trained with a zero loss mask
    wait_s: float = 0.0
    samples: list[SampleInfo] = field(default_factory=list)  # every sample the step collected (expired ones too)
    trained: list[SampleInfo] = field(default_factory=list)  # those its updates took
    unfreed: list[SampleInfo] = field(default_factory=list)  # collected, still in the buffer: freed after the update

    def take_unfreed(self) -> list[SampleInfo]:
        out, self.unfreed = self.unfreed, []
        return out


async def run_async(parts: LoopParts, cfg: AsyncLoopSettings, *, start: LoopPosition | None = None) -> LoopReport:
    """Run async steps up to `cfg.total_steps` (from `start.step + 1` when resuming from a
    checkpoint: the staleness counters are re-seeded from the restored version, and the pending
    rows of `start` are dispatched first by the prompt source); returns ledger counts and the
    final policy version."""
    start = start_position(parts, start)
    version = _SyncVersion(parts.weights)
    controller = Admission(version, max_staleness=cfg.max_staleness, groups_per_update=cfg.groups_per_update,
                           updates_per_version=cfg.sync_every, max_running=cfg.max_running_groups,
                           total_groups=cfg.total_steps * cfg.sync_every * cfg.groups_per_update)
    if start.step:
        controller.restore(AdmissionState(start.policy_version, start.trained_groups))
    inflight = _InFlight(next_group=start.next_group_id)
    policy = StalenessPolicy(cfg.max_staleness, cfg.on_stale)
    gate = AdmissionGate(controller)
    ready: asyncio.Queue[_Finished] = asyncio.Queue()
    running: set[asyncio.Task] = set()
    stop = asyncio.Event()
    producer = asyncio.create_task(_produce(parts, cfg, gate, ready, running, stop, inflight), name="producer")
    lane = ValidationLane(parts.validator, cfg.total_steps) if parts.validator is not None else None
    if lane is not None:
        lane.on_version(version.current(), start.step)
    finished = False  # an error or an interrupt cancels in-flight groups at once instead of waiting
    stopped, last_step = None, start.step
    try:
        for step in range(start.step + 1, cfg.total_steps + 1):
            t_step = parts.clock()
            st = _StepStats()
            update_metrics: list[dict[str, float]] = []
            t_update = 0.0
            for _ in range(cfg.sync_every):
                groups = await _collect(parts, cfg, policy, controller, gate, ready, producer, version.current(), st,
                                        inflight)
                t0 = parts.clock()
                masked = {s.session_id for g in groups for s in g.samples if ledger_key(s) in st.masked}
                update_metrics.append(await parts.trainer.update(train_order(PARTITION, tuple(groups), masked)))
                await parts.store.clear_samples(PARTITION, st.take_unfreed())  # read by the ranks: done
                st.trained.extend(s for g in groups for s in g.samples)
                t_update += parts.clock() - t0
                close_trained(parts.ledger, groups, st.masked)
                for _ in groups:
                    controller.on_finished(kept=True)
                controller.on_trained(len(groups))
            t0 = parts.clock()
            await sync_weights(parts)
            gate.notify()
            t_sync = parts.clock() - t0
            if lane is not None:
                lane.on_version(version.current(), step)
            metrics = step_metrics(parts, samples=st.samples, updates=update_metrics, t_gen=st.wait_s,
                                   t_update=t_update, t_sync=t_sync, step_s=parts.clock() - t_step,
                                   version=version.current(), trained=st.trained)
            metrics.update({"timing_s/wait_for_batch": st.wait_s,  # async: the wait for generation
                            **staleness_metrics(st.facts), "async/masked_stale": float(len(st.masked))})
            if lane is not None:
                metrics.update(lane.take())
            # pending rows and prompt cursor are read with no await between (end_step calls this then)
            await end_step(parts, step, metrics, lambda: LoopPosition(step, version.current(), inflight.next_group,
                                                                      controller.counts().trained,
                                                                      tuple(inflight.rows.values())))
            last_step = step
        finished = True
    except _Stopped as exc:  # the run cannot work (orchestrator/loop/early_stop.py): in-flight groups are cancelled
        stopped = str(exc)
    finally:
        stop.set()
        if lane is not None and not finished:
            await lane.cancel()
        gate.notify()
        await _drain(parts, producer, running, ready, cfg.drain_timeout_s if finished else 0.0)
    if stopped is not None:
        return finish(parts, last_step, version.current(), stopped=stopped)
    if lane is not None and (last := await lane.finish()):
        parts.logger.log(cfg.total_steps, last)  # the validation of the final weights
    return finish(parts, cfg.total_steps, version.current())


async def _produce(parts: LoopParts, cfg: AsyncLoopSettings, gate: AdmissionGate, ready: asyncio.Queue,
                   running: set[asyncio.Task], stop: asyncio.Event, inflight: "_InFlight") -> None:
    """Admit groups while capacity lasts; each group runs as its own task and queues its results when done."""
    limit = parts.concurrency  # rollout.concurrency=adaptive: engine load decides too (None: staleness only)
    while not stop.is_set():
        if not await gate.acquire(timeout_s=GROUP_WAIT_S):
            continue
        if limit is not None:  # after the staleness slot: a producer held by the staleness budget never looks
            try:  # like a full concurrency window (which would grow it for nothing)
                await limit.acquire()
            except BaseException:  # cancelled (the run stops): the staleness slot goes back
                gate.release()
                raise
        if stop.is_set():
            gate.release()
            if limit is not None:
                limit.release()
            return
        row = parts.prompts.next_rows(1)[0]
        gid = inflight.admit(row)
        reqs = dispatch_group(parts.ledger, row, gid, cfg.n)

        async def run_group(gid: int = gid, reqs: list[RolloutRequest] = reqs) -> None:
            try:
                samples = await run_rollouts(parts, reqs, PARTITION)
            finally:
                if limit is not None:
                    limit.release()
            ready.put_nowait(_Finished(gid, samples))

        task = asyncio.create_task(run_group(), name=f"group-{gid}")
        running.add(task)
        task.add_done_callback(running.discard)
        task.add_done_callback(inflight.on_group_done)


async def _collect(parts: LoopParts, cfg: AsyncLoopSettings, policy: StalenessPolicy,
                   controller: Admission, gate: AdmissionGate, ready: asyncio.Queue,
                   producer: asyncio.Task, version: int, st: _StepStats, inflight: "_InFlight") -> list[Group]:
    """Take finished groups until B trainable ones are in hand; close the others in the ledger.

    Staleness is judged against `version`, the trainer's version at this update: stale samples
    are dropped (`expired`) or kept loss-masked, per `async.on_stale`.
    """
    groups: list[Group] = []
    no_signal = _NoSignal(cfg.max_gen_batches * cfg.groups_per_update)
    while len(groups) < cfg.groups_per_update:
        t0 = parts.clock()
        done = await _next_ready(ready, producer, inflight)
        st.wait_s += parts.clock() - t0
        samples = done.samples  # metadata; the rows stay in the buffer for the ranks
        inflight.rows.pop(done.group_id, None)  # every sample of the group reaches its terminal state below
        st.samples.extend(samples)
        report_groups(parts.prompts, samples)
        completed = [s for s in samples if s.trainable]  # completed, or truncated with a reward (rollout.overflow)
        verdict = judge_samples(completed, version, policy)
        st.facts.extend(verdict.facts)
        by_key = {ledger_key(s): s for s in samples}  # judge_samples re-labels a stale one "expired"
        for s in verdict.expired:
            close_sample(parts.ledger, by_key[ledger_key(s)], "expired")
        st.masked.update(ledger_key(s) for s, f in zip(completed, verdict.facts) if f.stale and policy.on_stale != "drop")
        batch = assemble([*verdict.train, *(s for s in samples if not s.trainable)],
                         filter_zero_variance=cfg.filter_zero_variance)
        close_untrained(parts.ledger, batch)
        if parts.first_rollouts is not None and (why := parts.first_rollouts.observe(samples)) is not None:
            raise _Stopped(why)
        if not batch.trainable:
            await parts.store.clear_samples(PARTITION, samples)  # nothing of it trains: its rows go now
            controller.on_finished(kept=False)  # capacity back: the producer may admit another group
            gate.notify()
            if (why := no_signal.observe(batch.filtered, len(groups), cfg.groups_per_update)) is not None:
                raise _Stopped(why)
            continue
        st.unfreed.extend(samples)  # the whole group's rows go once the update read its trainable ones
        groups.extend(batch.trainable)
    return groups


@dataclass
class _NoSignal:
    """Counts the groups one mini-batch consumed that were filtered (equal rewards: no GRPO signal).

    Past `limit` of them (`algorithm.max_gen_batches` x B; 0: never) the mini-batch cannot be
    expected to fill: generation would go on forever, paying for every rollout. verl's dynamic
    sampling stops at the same point (DAPO recipe, `max_num_gen_batches`)."""

    limit: int
    groups: int = 0
    reward_sum: float = 0.0
    samples: int = 0

    def observe(self, filtered: tuple[SampleInfo, ...], have: int, want: int) -> str | None:
        """Count one untrained group; the stop message once `limit` is reached, else None."""
        if not filtered:
            return None  # failed or expired, not a lack of signal
        self.groups += 1
        self.reward_sum += sum(float(s.reward) for s in filtered)  # type: ignore[arg-type]
        self.samples += len(filtered)
        if not self.limit or self.groups < self.limit:
            return None
        mean = self.reward_sum / self.samples
        return (f"{self.groups} groups had equal rewards within each group (mean reward {mean:.3f}: no GRPO "
                f"signal) while one mini-batch still waited for {want - have} of {want} trainable groups; "
                f"generation would not end (algorithm.max_gen_batches={self.limit // want}): set "
                "algorithm.filter_zero_variance=false to train on anyway, or give the task harder prompts")


async def _next_ready(ready: asyncio.Queue, producer: asyncio.Task, inflight: _InFlight) -> _Finished:
    """Next finished group; re-raises if the producer or a group's rollouts died (for example a
    `ContractError`: a dataset row or an agent broke the contract), which must stop the run."""
    while True:
        if inflight.errors:
            raise inflight.errors[0]
        if producer.done():
            producer.result()  # raises its exception
            raise RuntimeError("the producer stopped before the run finished")
        try:  # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a Ctrl-C's cancellation
            async with asyncio.timeout(GROUP_WAIT_S):
                return await ready.get()
        except TimeoutError:
            continue


async def _drain(parts: LoopParts, producer: asyncio.Task, running: set[asyncio.Task], ready: asyncio.Queue,
                 timeout_s: float) -> None:
    """Stop admitting, let in-flight groups finish (at most `timeout_s` seconds, then cancel them),
    close their rollouts as `expired`."""
    producer.cancel()
    await asyncio.gather(producer, return_exceptions=True)
    if running:
        _, pending = await asyncio.wait(set(running), timeout=timeout_s) if timeout_s > 0 else (set(), set(running))
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    while not ready.empty():
        ready.get_nowait()
    await parts.store.clear(PARTITION)  # finished groups never trained (and any a stopped step held)
    for key in parts.ledger.open_rollouts():
        parts.ledger.on_terminal(key, "expired")  # generated after the last update: never trained
