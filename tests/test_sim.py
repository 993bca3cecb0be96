"""The cluster simulator (orchestrator/planning/sim/) and adaptive concurrency (orchestrator/loop/concurrency.py):
virtual clock, the simulated replica's invariants, the AIMD controller, workload validation, and
that a simulated run executes the product's own loop code (not a copy)."""

import asyncio
import json
import math
import random
import statistics
import sys
from pathlib import Path

import pytest

import orchestrator.loop.batching as batching
import orchestrator.loop.async_loop as loop_async
import orchestrator.loop.common as loop_common
import orchestrator.loop.sync_loop as loop_sync
import orchestrator.loop.staleness as staleness
import orchestrator.loop.staleness_gate as staleness_gate
from orchestrator.loop.concurrency import AimdConcurrency, ConcurrencyGate
from orchestrator.planning.sim.clock import SimDeadlock, VirtualLoop, run_virtual
from orchestrator.planning.sim.engine import CacheOwner, EngineSpec, Request, SimReplica
from orchestrator.planning.sim.run import CONFIGS, Scenario, simulate
from orchestrator.planning.sim.workload import WorkloadError, load_workload, parse_workload
from orchestrator.planning.simulate import main as planner
from workers.core.types import EngineLoad
from workers.gateway.router import ReplicaRouter
from workers.rollout.pool import RolloutPool

# --- virtual clock -----------------------------------------------------------------------------


def test_virtual_loop_jumps_to_the_next_timer_in_order():
    seen = []

    async def main():
        loop = asyncio.get_running_loop()
        loop.schedule(7.0, seen.append, "hw@7")
        await asyncio.sleep(3600)  # an hour of virtual time costs nothing
        seen.append(("sleep", loop.time()))
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(5):
                await asyncio.sleep(10)
        fut = loop.create_future()
        loop.schedule(loop.time() + 2, fut.set_result, "done")
        return await fut, loop.time()

    (value, t), loop = run_virtual(main)
    assert value == "done" and t == pytest.approx(3607.0)  # 3600 + 5 (timeout) + 2
    assert seen == ["hw@7", ("sleep", 3600.0)]  # the hardware event at t=7 ran first, in time order


def test_virtual_loop_reports_a_deadlock_instead_of_hanging():
    async def main():
        await asyncio.get_running_loop().create_future()  # nothing will ever set it

    with pytest.raises(SimDeadlock):
        run_virtual(main)


# --- simulated replica -------------------------------------------------------------------------

SPEC = EngineSpec(kv_tokens=20_000, max_num_seqs=16, step_base_s=0.01, step_per_seq_s=0.001,
                  prefill_s_per_token=1e-5, gpus=1)


def _drive(replica_fn):
    loop = VirtualLoop()
    out = replica_fn(loop)
    loop.drain()
    loop.close()
    return out


def test_replica_finishes_every_request_once_with_its_tokens_and_never_overfills_the_cache():
    """Randomized: 300 requests whose contexts together need ~10x the KV capacity, so requests
    wait and decoding preempts; every request still ends exactly once with all its tokens."""
    rng = random.Random(3)
    done: dict[int, int] = {}
    state = {}

    def setup(loop):
        r = SimReplica(loop, SPEC)
        state["r"] = r

        def submit(i):
            req = Request(rng.randint(100, 4000), rng.randint(1, 3000), CacheOwner(), lambda q, i=i: finish(i, q))
            state.setdefault("need", {})[i] = req.ctx + req.need
            r.submit(req)
            r.check()

        def finish(i, q):
            assert i not in done, f"request {i} finished twice"
            done[i] = q.ctx + q.need  # a preempted request resumes with its decoded tokens in its context
            r.check()

        for i in range(300):
            loop.schedule(rng.uniform(0, 50), submit, i)
        return r

    r = _drive(setup)
    assert sorted(done) == list(range(300))
    assert done == state["need"]  # every request generated exactly what it asked for
    assert r.preemptions > 0  # the cache was the binding limit: vLLM-style preemption happened
    assert r.kv_used() == pytest.approx(0, abs=1e-6) and r.num_in_flight() == 0


def test_prefix_cache_serves_a_sessions_next_turn_while_the_cache_is_not_overwritten():
    def setup(loop):
        r = SimReplica(loop, SPEC)
        s = CacheOwner()
        r.submit(Request(1000, 10, s, lambda q: loop.schedule(loop.now + 1, r.submit,
                                                                 Request(1010 + 50, 10, s, lambda q: None))))
        return r

    r = _drive(setup)
    assert r.cached_tokens == 1010  # the second turn prefilled only its 50 new tokens
    assert r.prefill_tokens == 1000 + 50


# --- adaptive concurrency (pure) ---------------------------------------------------------------


def _load(usage, waiting=0, preempted=0):
    return [EngineLoad(kv_cache_usage=usage, num_running=1, num_waiting=waiting, num_preempted=preempted)]


def test_adaptive_limit_grows_one_group_per_interval_while_below_target_and_binding():
    c = AimdConcurrency(kv_target=0.8, min_groups=2, interval_s=2.0)
    c.observe(_load(0.1), now_s=0.0, running_groups=2)
    assert c.limit == 3  # binding (2 running of 2) and below target: +1
    c.observe(_load(0.1), now_s=1.0, running_groups=3)
    assert c.limit == 3  # within the interval: no change
    c.observe(_load(0.1), now_s=2.0, running_groups=1)
    assert c.limit == 3  # not binding (1 of 3 running): no reason to grow
    assert c.may_admit(2) and not c.may_admit(3)


@pytest.mark.parametrize("load", [_load(0.85), _load(0.5, waiting=3)])
def test_adaptive_limit_drops_when_the_cache_is_full_or_requests_queue(load):
    c = AimdConcurrency(kv_target=0.8, min_groups=1, interval_s=1.0, decrease=0.5)
    c.limit = 40
    c.observe(load, now_s=10.0, running_groups=40)
    assert c.limit == 20  # 0.5 x the limit
    c.observe(load, now_s=10.5, running_groups=40)
    assert c.limit == 20  # at most one decrease per interval


def test_adaptive_decrease_cuts_the_window_not_the_groups_running_between_bursts():
    # Short bursty rollouts: the cache is congested at a moment when few groups run. Cutting to
    # decrease x running (2 groups here) collapsed the limit to 1 on the real engine; the window is cut.
    c = AimdConcurrency(kv_target=0.8, min_groups=1, interval_s=1.0, decrease=0.9)
    c.limit = 20
    c.observe(_load(0.5, waiting=4), now_s=10.0, running_groups=2)
    assert c.limit == 18


def test_adaptive_limit_drops_on_a_new_preemption_and_never_below_the_minimum():
    c = AimdConcurrency(kv_target=0.8, min_groups=3, interval_s=1.0, decrease=0.5)
    c.observe(_load(0.2, preempted=5), now_s=0.0, running_groups=3)  # first sight: a baseline, not news
    assert c.limit == 4
    c.observe(_load(0.2, preempted=6), now_s=5.0, running_groups=4)
    assert c.limit == 3  # max(min_groups, 0.5 x 4)


def _timed(*engines, waiting=0):
    """Each engine as (usage snapshot, usage integral, clock[, waiting integral])."""
    return [EngineLoad(kv_cache_usage=u, num_running=1, num_waiting=waiting, num_preempted=0, kv_usage_integral_s=i,
                       clock_s=t, waiting_integral_s=rest[0] if rest else 0.0) for u, i, t, *rest in engines]


def test_adaptive_decides_on_the_time_average_over_a_full_window_not_the_snapshot():
    # A real engine's usage swings between bursts; with its usage integral the policy decides on the
    # time average over >= interval_s of the engine's clock (the mean over engines).
    c = AimdConcurrency(kv_target=0.8, min_groups=1, interval_s=2.0, decrease=0.5)
    c.limit = 10
    c.observe(_timed((0.95, 0.0, 100.0), (0.95, 0.0, 500.0)), now_s=0.0, running_groups=10)
    assert c.limit == 5 and c.usage == 0.95  # no window yet: the snapshot (over target) decides
    c.observe(_timed((0.95, 0.6, 101.0), (0.95, 0.6, 501.0)), now_s=1.0, running_groups=5)
    assert c.usage == 0.95  # 1 s of the engines' clocks < interval_s: still no full window
    # 2 s in: engine 0 averaged 0.3, engine 1 0.5 (each on its own clock); the snapshot says 0.95
    c.observe(_timed((0.95, 0.6, 102.0), (0.95, 1.0, 502.0)), now_s=2.0, running_groups=5)
    assert c.usage == pytest.approx(0.4) and c.limit == 6  # below target on average, binding: +1
    c.observe(_timed((0.1, 0.6, 103.0), (0.1, 1.0, 503.0)), now_s=4.0, running_groups=6)
    assert c.usage == pytest.approx(0.4) and c.limit == 7  # the last full window's average until the next
    # a replica replaced (its integral restarts): the window restarts, the snapshot decides meanwhile
    c.observe(_timed((0.2, 0.6, 104.0), (0.2, 0.1, 10.0)), now_s=6.0, running_groups=7)
    assert c.usage == pytest.approx(0.2) and c.limit == 8


def test_a_bounded_producer_never_grows_the_window():
    # The gate counts only granted groups: a producer that never asks (held by the staleness
    # budget) leaves the limit where it is however long the engines stay below target.
    c = AimdConcurrency(kv_target=0.8, min_groups=4, interval_s=1.0)
    for t in range(10):
        c.observe(_load(0.1), now_s=float(t), running_groups=3)
    assert c.limit == 4 and c.increases == 0


def test_adaptive_judges_the_queue_by_its_time_average_not_the_last_steps_snapshot():
    # vLLM's stats are taken after a step frees its finished requests and before the next admits the
    # waiting ones, so a burst shows "3 waiting" at nearly every sample; the queue's time average
    # over the window decides: a brief queue (0.2 requests on average) is not congestion, a
    # standing one (1.5) is.
    c = AimdConcurrency(kv_target=0.8, min_groups=1, interval_s=2.0, decrease=0.5, max_waiting=0.5)
    c.limit = 10
    c.observe(_timed((0.3, 0.0, 100.0, 0.0), waiting=3), now_s=0.0, running_groups=10)
    assert c.limit == 5  # no full window yet: the snapshot (3 waiting > 0.5) decides
    c.observe(_timed((0.3, 0.8, 102.0, 0.4), waiting=3), now_s=2.0, running_groups=5)
    assert (c.usage, c.waiting) == (pytest.approx(0.4), pytest.approx(0.2)) and c.limit == 6
    c.observe(_timed((0.3, 1.6, 104.0, 3.4), waiting=0), now_s=4.0, running_groups=6)
    assert c.waiting == pytest.approx(1.5) and c.limit == 3  # a standing queue: cut, though none waits now


@pytest.mark.parametrize("kw,key", [({"kv_target": 0}, "kv_target"), ({"min_groups": 0}, "min_groups"),
                                    ({"interval_s": 0}, "interval_s"), ({"decrease": 1.0}, "decrease"),
                                    ({"max_waiting": -1}, "max_waiting")])
def test_adaptive_config_errors_name_the_key(kw, key):
    with pytest.raises(ValueError, match=f"rollout.adaptive.{key}"):
        AimdConcurrency(**kw)


def test_concurrency_gate_waits_until_the_engines_have_room():
    usage = {"v": 0.95}

    async def main():
        loop = asyncio.get_running_loop()

        async def loads():
            return _load(usage["v"])

        gate = ConcurrencyGate(AimdConcurrency(min_groups=1, interval_s=1.0), loads, clock=loop.time)
        await gate.acquire()  # the starting limit (min_groups) is always granted
        waiter = asyncio.ensure_future(gate.acquire())
        await asyncio.sleep(30)
        assert not waiter.done()  # cache over target: no second group
        usage["v"] = 0.3
        await asyncio.wait_for(waiter, 10)
        assert 30 <= gate.blocked_s <= 31  # refused from t=0 until the poll after the cache emptied
        assert gate.metrics()["rollout/concurrency_blocked_s"] == gate.blocked_s
        gate.release()
        return gate.running

    assert run_virtual(main)[0] == 1


# --- workloads ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["reference", "gsm8k_tools"])
def test_shipped_workloads_load(name):
    w = load_workload(name)
    assert w.name == name and w.agent.max_context_tokens <= w.engine["kv_tokens_per_replica"]


def test_workload_errors_name_the_key():
    raw = json.loads(json.dumps(load_workload("gsm8k_tools").__dict__, default=lambda o: o.__dict__))
    raw["agent"]["turns"] = {"dist": "poisson"}
    with pytest.raises(WorkloadError, match="agent.turns"):
        parse_workload(raw)


# --- the simulator runs the product's loop -----------------------------------------------------


def _code_ids(*fns):
    return {id(getattr(f, "__func__", f).__code__): f.__qualname__ for f in fns}


@pytest.mark.parametrize("config", ["sync_1", "async_1"])
def test_a_simulated_run_executes_the_products_loop_code(config, tmp_path):
    """The simulator must drive the shipped loop, not a copy: the code objects of the loop, the
    ledger, batching, staleness admission, the rollout pool's spreading, the router and (async)
    the adaptive gate must all run, and the run writes the real run's file names."""
    wanted = _code_ids(loop_common.dispatch_group, loop_common.step_metrics, batching.assemble,
                       batching.RolloutLedger.on_terminal, RolloutPool.run_all, ReplicaRouter.lease)
    if config == "sync_1":
        wanted |= _code_ids(loop_sync.run_sync, batching.split_groups)
    else:
        wanted |= _code_ids(loop_async.run_async, loop_async._produce, staleness.Admission.on_admitted,
                            staleness.judge_samples, staleness_gate.AdmissionGate.acquire, ConcurrencyGate.acquire)
    ran: set[int] = set()

    def profiler(frame, event, arg):
        if event == "call":
            ran.add(id(frame.f_code))

    sc = CONFIGS[config]
    sc = Scenario(sc.mode, sc.sync_every, sc.colocated, gpus=4,
                  policy="adaptive" if config == "async_1" else "fixed")
    sys.setprofile(profiler)
    try:
        f = simulate(load_workload("gsm8k_tools"), sc, hours=0.02, out_dir=tmp_path)
    finally:
        sys.setprofile(None)
    missing = [name for cid, name in wanted.items() if cid not in ran]
    assert not missing, f"the simulator did not run the product's {missing}"
    assert f["steps"] >= 2 and f["tokens_per_min_per_gpu"] > 0
    assert {p.name for p in tmp_path.iterdir()} >= {"metrics.jsonl", "summary.json", "timeline.jsonl"}
    first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert {"perf/throughput", "perf/inference_concurrency", "perf/kv_cache_usage", "rollout/dispatched"} <= set(first)


def test_planner_writes_the_acceptance_keys(tmp_path, capsys):
    out = tmp_path / "f.json"
    assert planner(["workload=gsm8k_tools", "gpus=4", "hours=0.02", "--policy", "adaptive", "--out", str(out)]) == 0
    f = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"{c} is not standard JSON"))
    for key in ("kv_usage_mean", "throughput_ratio_vs_sync1", "staleness_max", "staleness_mean", "eta",
                "sim_hours", "wall_s"):
        assert key in f
    assert f["sim_hours"] >= 0.02
    # staleness_* are over every judged sample, the ones dropped as too stale included (issue 26)
    assert 0 <= f["staleness_mean"] <= f["staleness_max"] and 0 < f["kv_usage_mean"] <= 1


def test_planner_refuses_a_bad_setting(capsys):
    assert planner(["workload=nope"]) == 2
    assert "config error" in capsys.readouterr().err
    with pytest.raises(ValueError, match="adaptive needs mode=async"):
        Scenario("sync", policy="adaptive")


@pytest.mark.parametrize("argv, message", [
    (["hours=-1"], "gpus must be >= 1 and hours > 0, got gpus=64, hours=-1"),
    (["gpus=0", "hours=1"], "gpus must be >= 1"),
    (["gpus=8", "hours=0.2", "--config", "sync_1", "--out", "/nonexistent/d/f.json"], "--out /nonexistent/d/f.json: no directory"),
    (["gpus=8", "hours=0.0005", "--config", "sync_1"], "hours=0.0005: the simulation ended after"),
    (["gpus=8", "hours=0.2", "--policy", "fixed"], "gpus=8 leaves no inference replica of 8 GPUs (engine.gpus_per_replica; disaggregated: 4 trainer, 4 inference; it needs at least 9"),
    # issue 29: what a new user hit
    (["gpus=16", "hours=0.01", "--sweep", "--grid", "small"], "--sweep: the sync_1 baseline could not be measured: hours=0.01"),
    (["gpus=abc"], "gpus must be an integer, got 'abc'"),
    (["hours=soon"], "hours must be a number, got 'soon'"),
    (["gpus=16", "--sync-every", "0"], "--sync-every must be >= 1, got 0"),
    (["gpus=16", "--eta", "-1"], "--eta must be >= 0, got -1"),
    (["gpus=16", "--config", "sync_1", "--eta", "2"], "--config sync_1 is a sync configuration (colocated, no staleness): --eta do not apply"),
    (["gpus=16", "--config", "sync_2", "--trainer-gpus", "4"], "--trainer-gpus do not apply"),
])
def test_planner_names_a_bad_horizon_size_or_out_path_before_it_runs(argv, message, capsys):
    """A new user's mistakes: exit 2 with one line, never a traceback after the whole simulation."""
    assert planner(["workload=reference", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: ") and message in err, err


def test_planner_refuses_a_run_dir_that_is_a_file(tmp_path, capsys):
    f = tmp_path / "notes.txt"
    f.write_text("x")
    assert planner(["workload=gsm8k_tools", "gpus=4", "hours=0.02", f"run_dir={f}"]) == 2
    assert f"run_dir={f} is a file" in capsys.readouterr().err


def test_the_flags_apply_on_top_of_a_named_configuration(tmp_path):
    """`--config async_2 --eta 2 --sync-every 4 --trainer-gpus 2` simulates that, not async_2 as is."""
    out = tmp_path / "f.json"
    assert planner(["workload=gsm8k_tools", "gpus=4", "hours=0.05", "--config", "async_2", "--eta", "2",
                    "--sync-every", "4", "--trainer-gpus", "1", "--out", str(out)]) == 0
    sc = json.loads(out.read_text())["scenario"]
    assert (sc["mode"], sc["max_staleness"], sc["sync_every"], sc["trainer_gpus"]) == ("async", 2, 4, 1)


ROLLOUT_SIDE = ("driver", "inference", "gateway", "rollout", "local_stack", "other")


def _write_run(run_dir: Path, step_s: list[float], cpu: tuple[float, float, float] | None = None,
               prompt_tokens: int | None = None) -> None:
    """A sync run's files: 8 rollouts a step, 2 turns each, 5 generated tokens per turn, updates
    of 0.5 s + 0.01 s per sample, step i `step_s[i]` long (all but 0.8 s of it generation). With `cpu`
    = (CPU s per rollout, cores per second, trainer cores): its `perf/cpu_s/*` record, the
    rollout side's spread evenly over its parts. With `prompt_tokens`: `perf/total_num_tokens`, that
    many prompt tokens per trained sample besides its generated ones."""
    (run_dir / "config.yaml").write_text(
        "mode: {name: sync, sync_every: 1}\nrollout: {batch_size: 2, n: 4, max_context_tokens: 512,"
        " acr: {session_rate_per_s: 25.0}}\nalgorithm: {filter_zero_variance: true}\ninference: {max_num_seqs: 64}\n")
    rows = []
    for step, dt in enumerate(step_s, 1):
        done = 8 if step % 2 else 6
        r = {"step": step, "timing_s/step": dt, "timing_s/gen": dt - 0.8,
             "timing_s/update_actor": 0.5 + 0.01 * done,
             "timing_s/update_weights": 0.1, "rollout/dispatched": 8.0 * step, "rollout/completed": 8.0 * step,
             "rollout/step_completed": float(done), "gateway/turns_served": 16.0 * step,
             "actor/num_tokens": 10.0 * done, "rollout/latency_s_p50": 1.0, "rollout/latency_s_max": dt - 0.9,
             "perf/inference_concurrency": 2.0, "reward/mean": 0.4}
        if prompt_tokens is not None:
            r["perf/total_num_tokens"] = float(done * prompt_tokens + r["actor/num_tokens"])
        if cpu is not None:
            per_part = (cpu[0] * 8 + cpu[1] * dt) / len(ROLLOUT_SIDE)
            r |= {f"perf/cpu_s/{p}": per_part for p in ROLLOUT_SIDE}
            r["perf/cpu_s/trainer"] = cpu[2] * (r["timing_s/update_actor"] + r["timing_s/update_weights"])
        rows.append(r)
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_workload_from_run_fits_turns_tokens_and_trainer_from_a_runs_files(tmp_path):
    """A run of 6 steps (see `_write_run`): the fitted workload loads and holds those figures."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from workload_from_run import fit

    _write_run(tmp_path, [2.3] * 6)
    raw = fit(tmp_path, prompt_tokens=40, kv_tokens=100_000, warmup_steps=2)
    w = parse_workload(raw)
    assert w.agent.turns.value == 2.0  # 16 turns / 8
    assert w.agent.agent_tokens_per_turn.mean() == 5.5  # uniform on [5, 6): 5 whole tokens on average
    assert w.trainer["fixed_s"] == pytest.approx(0.5)
    assert w.batch == {"prompts_per_mini_batch": 2, "prompts_per_step": 2, "n": 4, "reference_gpus": 1}
    # the store's round trip: a step's 2.3 s less generation, update (0.56 or 0.58 s) and weight sync
    assert w.machine["store_rpc_s"] == pytest.approx(2.3 - 1.5 - 0.1 - 0.57, abs=0.011)
    # no CPU record: the engine keeps the cores busy while it decodes (the assumption it falls back on)
    assert w.machine["engine_cores"] == w.machine["cores"] and "background_cores" not in w.machine


def test_workload_from_run_measures_prompt_tokens_from_total_num_tokens(tmp_path):
    """A run that logs perf/total_num_tokens gives its prompt tokens per sample (31 here) and the
    update's tokens; one that does not needs --prompt-tokens, and the error says so."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from workload_from_run import fit

    _write_run(tmp_path, [2.3] * 6, prompt_tokens=31)
    raw = fit(tmp_path, kv_tokens=100_000, warmup_steps=2, calibrate_hours=0)
    assert raw["agent"]["prompt_tokens"]["value"] == pytest.approx(31.0)
    assert raw["calibration"]["measured"]["trajectory_tokens_per_sample"] == pytest.approx(31.0 + 10.0)
    assert fit(tmp_path, prompt_tokens=12, kv_tokens=100_000, warmup_steps=2,
               calibrate_hours=0)["agent"]["prompt_tokens"]["value"] == 12  # given wins
    _write_run(tmp_path, [2.3] * 6)
    with pytest.raises(ValueError, match=r"no 'perf/total_num_tokens'.*--prompt-tokens"):
        fit(tmp_path, kv_tokens=100_000, warmup_steps=2, calibrate_hours=0)


def test_workload_from_run_fits_the_machine_from_the_runs_cpu_record(tmp_path):
    """A run whose rollout side used 0.05 CPU s per rollout plus 0.3 cores per second, its
    trainer 0.8 cores while it updated: the fit puts all of the rollout side's CPU on the rollouts
    dispatched (no background), half at a rollout's start and half at its end, and finds the
    trainer's cores; the environment scale is calibrated so the simulated run takes the run's
    mean step time."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from workload_from_run import fit

    step_s = [2.3, 3.0, 2.0, 4.0, 2.5, 3.5]
    _write_run(tmp_path, step_s, cpu=(0.05, 0.3, 0.8))
    raw = fit(tmp_path, prompt_tokens=40, kv_tokens=100_000, warmup_steps=2, calibrate_hours=0)
    m = raw["machine"]
    per_rollout = 0.05 + 0.3 * sum(step_s[2:]) / (8 * len(step_s[2:]))  # 8 rollouts dispatched per step
    assert m["rollout_start_cpu_s"] == pytest.approx(per_rollout / 2)
    assert raw["agent"]["overhead_s"]["value"] == pytest.approx(per_rollout / 2)
    assert m["background_cores"] == 0.0 and m["trainer_cores"] == pytest.approx(0.8)
    assert m["engine_cores"] == 0.0  # its CPU is in the rollouts' work
    raw = fit(tmp_path, prompt_tokens=40, kv_tokens=100_000, warmup_steps=2, calibrate_hours=0.05)
    rec = raw["calibration"]["machine_fit"]
    target = statistics.fmean(step_s[2:])
    assert rec["target_step_s"] == pytest.approx(target)
    assert rec["simulated_step_s"] == pytest.approx(target, rel=0.03)
    f = simulate(parse_workload(raw), Scenario("sync", 1, True, gpus=1, sleeps=False), hours=0.05, warmup_steps=2)
    assert f["step_s_mean"] == pytest.approx(rec["simulated_step_s"])  # the written workload is the calibrated one


def test_the_rollout_sides_cpu_is_all_counted_per_rollout_dispatched():
    """Saturated or not, the rollout side's CPU seconds over the rollouts dispatched in the steps
    used (counted from the step before them), with no background split off."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from workload_from_run import fit_cpu

    parts = ("driver", "inference", "gateway", "rollout", "local_stack", "other")
    rows, dispatched = [], 100.0
    for step, (n, dt) in enumerate([(30, 1.5), (50, 2.0), (40, 2.5), (60, 3.0)], 1):
        dispatched += n
        rows.append({"rollout/dispatched": dispatched, "timing_s/step": dt, "perf/cpu_s/machine": 1.96 * dt,
                     "perf/cpu_s/trainer": 0.06 * dt, **{f"perf/cpu_s/{p}": 1.9 * dt / len(parts) for p in parts}})
    cpu = fit_cpu(rows, {"rollout/dispatched": 100.0})
    assert cpu["background_cores"] == 0.0
    assert cpu["rollout_cpu_s"] == pytest.approx(1.9 * 9.0 / 180)  # rollout-side CPU s / rollouts dispatched
    assert fit_cpu([{k: v for k, v in r.items() if k != "perf/cpu_s/gateway"} for r in rows], {}) is None  # no record


def test_fit_warns_about_a_scale_its_run_did_not_determine():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from workload_from_run import fit_warnings

    raw = {"calibration": {"machine_fit": {"engine_scale": 0.4, "env_scale": 0.02, "at_bound": ["env_scale"]}}}
    (warning,) = fit_warnings(raw)
    assert warning.startswith("calibration.machine_fit.env_scale stopped at its bound (0.02)")
    assert fit_warnings({"calibration": {"machine_fit": {"at_bound": []}}}) == []


@pytest.mark.parametrize("overrides,key", [(["rollout.concurrency=adaptive"], "rollout.concurrency"),
                                           (["mode=async", "rollout.concurrency=sometimes"], "rollout.concurrency"),
                                           (["mode=async", "rollout.concurrency=aimd",
                                             "rollout.adaptive.kv_target=1.5"], "rollout.adaptive.kv_target"),
                                           (["mode=async", "rollout.concurrency=adaptive",
                                             "rollout.adaptive.cancel_above=0.5"], "rollout.adaptive.cancel_above")])
def test_rollout_concurrency_config_errors_name_the_key(overrides, key):
    from orchestrator.config import ConfigError
    from stand_ins import compose_config

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        compose_config(overrides)


def test_concurrency_config_builds_the_policy_it_names():
    from orchestrator.config.rollout import concurrency_policy
    from orchestrator.config.run import staleness_window_groups
    from orchestrator.loop.throughput_concurrency import ThroughputConcurrency
    from stand_ins import compose_config

    cfg = compose_config(["mode=async", "rollout.concurrency=aimd", "rollout.adaptive.kv_target=0.6"])
    assert cfg.rollout.concurrency == "aimd" and concurrency_policy(cfg.rollout).kv_target == 0.6
    cfg = compose_config(["mode=async", "rollout.concurrency=adaptive", "rollout.adaptive.trim_at=0.7",
                          "async.max_staleness=2"])
    policy = concurrency_policy(cfg.rollout, max_groups=staleness_window_groups(cfg))
    assert isinstance(policy, ThroughputConcurrency) and policy.settings.trim_at == 0.7
    assert policy.max_groups == 3 * cfg.rollout.batch_size  # (eta + 1) k B: the staleness window


# --- one shared CPU machine (cluster=local) -----------------------------------------------------


def test_share_speed_slows_every_part_only_when_they_want_more_cores_than_there_are():
    from orchestrator.planning.sim.machine import share_speed

    assert share_speed(2, 1.0) == 1.0 and share_speed(2, 2.0) == 1.0
    assert share_speed(2, 3.0) == pytest.approx(2 / 3) and share_speed(2, 32.0) == pytest.approx(1 / 16)


def test_processor_sharing_of_many_jobs_with_a_late_one():
    """2 cores, 4 jobs of 1 s at t=0: speed 1/2. A 0.25 s job joins at t=1 (the four have 0.5 s
    left): speed 2/5, it ends after 0.25 / 0.4 = 0.625 s at 1.625, the four have 0.25 s left
    then, at speed 1/2 they end at 2.125. A job alone runs at full speed."""
    from orchestrator.planning.sim.machine import MachineSpec, SharedCpu

    async def main():
        loop = asyncio.get_running_loop()
        cpu = SharedCpu(loop, MachineSpec(cores=2, engine_cores=1), [])
        ends: dict[str, float] = {}
        for i in range(4):
            cpu.start(1.0, lambda i=i: ends.setdefault(f"a{i}", loop.time()))
        await asyncio.sleep(1.0)
        assert cpu.speed == pytest.approx(0.5) and cpu.jobs() == 4
        late = await cpu.run(0.25)
        await asyncio.sleep(10)
        alone = await cpu.run(0.3)
        return ends, late, alone, cpu

    (ends, late, alone, cpu), _ = run_virtual(main)
    assert late == pytest.approx(0.625)
    assert all(t == pytest.approx(2.125) for t in ends.values()) and len(ends) == 4
    assert alone == pytest.approx(0.3) and cpu.jobs() == 0
    assert cpu.busy_s == pytest.approx(4 * 1.0 + 0.25 + 0.3)  # core-seconds used = work done


def test_processor_sharing_conserves_work_whatever_the_arrivals():
    """Seeded random arrivals of jobs on 2 cores: each job ends no sooner than its work alone,
    the cores are never over-used, and the core-seconds used equal the work of the jobs."""
    from orchestrator.planning.sim.machine import MachineSpec, SharedCpu

    rng = random.Random(7)
    jobs = [(rng.uniform(0, 20), rng.expovariate(1 / 0.3)) for _ in range(300)]  # (start s, work s)

    async def main():
        loop = asyncio.get_running_loop()
        cpu = SharedCpu(loop, MachineSpec(cores=2, engine_cores=1), [])
        got = {}
        for i, (t0, work) in enumerate(jobs):
            loop.schedule(t0, cpu.start, work, lambda i=i: got.setdefault(i, loop.time()))
        await asyncio.sleep(1000)
        return got, cpu

    (ends, cpu), _ = run_virtual(main)
    assert len(ends) == len(jobs)
    assert all(ends[i] >= t0 + work - 1e-9 for i, (t0, work) in enumerate(jobs))
    assert cpu.busy_s == pytest.approx(sum(w for _, w in jobs), rel=1e-9)
    assert cpu.busy_s <= 2 * max(ends.values()) + 1e-9


def test_a_trainer_update_and_decoding_slow_each_other_on_a_shared_machine():
    """2 cores, the engine wants 2 and the trainer 1: an update overlapping decoding runs at
    2/3 speed, and so does the engine; alone, each runs at full speed."""
    from orchestrator.planning.sim.machine import MachineSpec, SharedCpu

    spec = EngineSpec(kv_tokens=100_000, max_num_seqs=16, step_base_s=0.01, step_per_seq_s=0.0,
                      prefill_s_per_token=0.0, gpus=1)

    async def main():
        loop = asyncio.get_running_loop()
        r = SimReplica(loop, spec)
        cpu = SharedCpu(loop, MachineSpec(cores=2, engine_cores=2, trainer_cores=1), [r])
        r.on_busy_change = cpu.engines_changed
        alone = await cpu.run_trainer(1.0)
        done = []
        r.submit(Request(10, 300, CacheOwner(), lambda q: done.append(loop.time())))  # 3 s of decoding alone
        t0 = loop.time()
        overlapped = await cpu.run_trainer(1.0)
        while not done:
            await asyncio.sleep(0.01)
        return alone, overlapped, done[0] - t0

    (alone, overlapped, decode_s), _ = run_virtual(main)
    assert alone == pytest.approx(1.0)
    assert overlapped == pytest.approx(1.5)  # 1 s of work at 2/3 speed
    assert decode_s == pytest.approx(1.5 + (3.0 - 1.0), abs=0.02)  # 1 s of decoding done while slowed


def test_fit_update_keeps_a_per_token_part_only_where_the_data_show_one():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from workload_from_run import fit_env, fit_update

    xs = [100.0, 200.0, 300.0, 400.0, 500.0]
    assert fit_update(xs, [0.5 + 0.001 * x for x in xs]) == pytest.approx((0.5, 0.001))
    fixed, slope = fit_update(xs, [0.5, 0.4, 0.6, 0.45, 0.55])  # noise, no trend
    assert slope == 0.0 and fixed == pytest.approx(0.5)
    median, sigma = fit_env(p50=1.0, mx=0.5 + 0.5 * math.e, n=32, engine_s=0.2, const_s=0.3)
    z = statistics.NormalDist().inv_cdf((32 - 0.375) / (32 + 0.25))
    assert median == pytest.approx(0.5) and sigma == pytest.approx(1 / z)


def test_agent_durations_read_the_acr_task_records(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from workload_from_run import agent_durations

    (tmp_path / "logs").mkdir()
    rec = {"message": "Async task completed: letters_rollout (ID: 1, Duration: 0.42s)",
           "sessionId": "exp-sync_1-g7-s3-abc"}
    (tmp_path / "logs" / "emulator.log").write_text(
        "ACR emulator ready\n" + json.dumps(rec) + "\n2026-12-01 plain line Duration: 9s\n")
    assert agent_durations(tmp_path) == {"exp-sync_1-g7-s3-abc": (7, 0.42)}


def test_a_fixed_batch_per_step_is_split_into_sync_every_mini_batches_and_filtering_follows_the_fit():
    """`batch.prompts_per_step` (a fitted run's rollout.batch_size) keeps the groups per weight
    sync, as the product does; `constant_reward_fraction` sets the share of filtered groups."""
    from orchestrator.planning.sim.run import layout

    raw = json.loads(json.dumps(load_workload("gsm8k_tools").__dict__, default=lambda o: o.__dict__))
    raw["batch"] |= {"prompts_per_step": 8, "reference_gpus": 1}
    raw["agent"]["constant_reward_fraction"] = 0.25
    raw["machine"] = {"cores": 2, "engine_cores": 2, "trainer_cores": 1, "store_rpc_s": 0.01}
    w = parse_workload(raw)
    assert layout(w, Scenario("sync", 2, True, gpus=1)).groups_per_update == 4
    assert layout(w, Scenario("async", 1, True, gpus=1)).groups_per_update == 8
    f = simulate(w, Scenario("sync", 1, True, gpus=1, sleeps=False), hours=0.1)
    filtered, dispatched = f["rollout/filtered"], f["rollout/dispatched"]
    assert 0.15 < filtered / dispatched < 0.35
    # the rollouts finished per minute count the filtered ones too: trained / finished = 1 - filtered share
    assert 0.6 < f["trained_samples_per_min"] / f["finished_rollouts_per_min"] < 0.9
    raw["machine"]["cores"] = 0
    with pytest.raises(WorkloadError, match="machine.cores"):
        parse_workload(raw)


def test_the_sweep_says_why_it_recommends_a_configuration():
    from orchestrator.planning.simulate import feasible, recommendation_reasons

    def fig(rate, *, eta=1, st_max=1, st_mean=0.5, expired=0.0):
        return {"tokens_per_min_per_gpu": rate, "eta": eta, "staleness_max": st_max, "staleness_mean": st_mean,
                "expired_fraction": expired}

    rows = {"sync_1": fig(100, eta=0, st_max=0, st_mean=0), "async_t4_eta1_k2_fixed": fig(150),
            "async_t4_eta1_k2_adaptive": fig(210), "async_t4_eta2_k2_fixed": fig(300, eta=2, expired=0.03),
            "async_t5_eta1_k4_adaptive": fig(180), "async_t4_eta2_k4_adaptive": fig(250, st_mean=1.5, eta=2)}
    ok = {k: f for k, f in rows.items() if feasible(f, 1.0)}
    assert "async_t4_eta2_k2_fixed" not in ok  # 3 % of its rollouts expired: ruled out however fast
    why = recommendation_reasons(rows, ok, "async_t4_eta1_k2_adaptive", 1.0)
    assert why[0].startswith("4 of 6 configurations feasible; ruled out: 1 expired >= 1 %") and "1 mean staleness" in why[0]
    assert "1.17x the next feasible one (async_t5_eta1_k4_adaptive)" in why[1]
    assert "2.10x sync_1" in why[2]
    assert any(line.startswith("policy: adaptive 1.00, fixed 0.71") for line in why)
    assert any(line.startswith("sync_every: 2 1.00, 4 0.86") for line in why)


def test_the_public_check_caps_the_container_pool_in_every_configuration(monkeypatch):
    # The plumbing only (each simulation is seconds to minutes): the cap reaches all four
    # configurations' scenarios; the simulator's cap itself is tests/test_sim_lifecycle.py's.
    from orchestrator.planning.sim import public_check

    seen = []

    def simulate(w, sc, **kw):
        seen.append(sc)
        return {k: 1.0 for k in public_check.ROW_KEYS}

    monkeypatch.setattr(public_check, "simulate", simulate)
    out = public_check.check(load_workload("reference"), gpus=16, hours=1.0, trainer_tokens_per_min_per_gpu=None,
                             refit=False, container_slots=256, log=lambda *a: None)
    assert [(sc.mode, sc.sync_every, sc.container_slots) for sc in seen] == [
        (c.mode, c.sync_every, 256) for c in public_check.CONFIGS.values()]
    assert out["container_slots"] == 256 and set(out["rows"]) == set(public_check.REPORT)
