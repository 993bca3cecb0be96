"""The A2A rollout lifecycle in the simulator (orchestrator/planning/sim/{slots,agent,lifecycle}.py):
container slots, setup, rollout slots; the warm pool's effect, its absence without setup, the caps
inside the product's loop, the planner's container sizing and scripts/bench_swe.py."""

import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from orchestrator.planning.sim.lifecycle import simulate_lifecycle
from orchestrator.planning.sim.run import CONFIGS, Scenario, simulate
from orchestrator.planning.sim.slots import SlotQueue
from orchestrator.planning.sim.workload import Dist, Workload, WorkloadError, load_workload, parse_workload
from orchestrator.planning.simulate import main as planner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_swe  # noqa: E402

SETUP = Dist("lognormal", median=2.0, sigma=0.5)  # about the run's own ~2 s: a setup-heavy workload


def _gsm8k(setup: Dist) -> Workload:
    """gsm8k_tools (two ~1 s turns) with no cold start and `setup` as its container setup."""
    w = load_workload("gsm8k_tools")
    return replace(w, agent=replace(w.agent, cold_start_s=Dist("const"), setup_s=setup))


def _raw(setup: dict | float) -> dict:
    raw = json.loads(json.dumps(load_workload("gsm8k_tools").__dict__, default=lambda o: o.__dict__))
    raw["agent"] |= {"setup_s": setup, "cold_start_s": 0.0}
    return raw


def test_slot_queue_grants_in_request_order_and_never_beyond_its_capacity():
    q: SlotQueue[str] = SlotQueue(2)
    assert [q.request(x, 0.0) for x in "abcd"] == [True, True, False, False]
    assert (q.held, q.waiting) == (2, 2)
    assert q.release(1.0) == "c" and q.held == 2  # the freed slot goes straight to the head waiter
    assert q.release(2.0) == "d" and q.release(3.0) is None and q.held == 1
    assert q.request("e", 4.0) is True and q.peak == 2
    assert q.held_s(5.0) == pytest.approx(2 * 3.0 + 1 * 1.0 + 2 * 1.0)  # slot-seconds
    q.release(5.0), q.release(5.0)
    with pytest.raises(ValueError, match="no slot held"):
        q.release(6.0)
    assert SlotQueue(None).request("x", 0.0) is True  # no cap


def test_a_warm_pool_fills_the_rollout_slots_while_containers_set_up():
    """Setup ~ the run: with as many containers as rollout slots the slots idle while each new
    container sets up (utilisation ~ run / (setup + run)); twice the containers set up ahead, the
    slots stay full and inference requests per minute rise in proportion."""
    w = _gsm8k(SETUP)
    cold, warm = (simulate_lifecycle(w, rollout_slots=16, container_slots=c, replicas=1, hours=0.5) for c in (16, 32))
    assert cold["rollout_slot_utilisation"] < 0.6 and warm["rollout_slot_utilisation"] > 0.95
    assert warm["inference_requests_per_min"] / cold["inference_requests_per_min"] > 1.6
    assert warm["rollouts_finished_per_min"] / cold["rollouts_finished_per_min"] > 1.6
    assert cold["rollout_slot_wait_s_mean"] == 0.0 < warm["rollout_slot_wait_s_mean"]  # warm containers queue
    for f in (cold, warm):  # setup spans are the drawn lognormal: p50 = median, p90 = median * e^(1.2816 sigma)
        assert f["setup_s_p50"] == pytest.approx(2.0, rel=0.05)
        assert f["setup_s_p90"] == pytest.approx(2.0 * math.exp(1.2816 * 0.5), rel=0.05)
        assert f["rollout_slots_peak"] <= 16 and f["container_slots_peak"] <= f["container_slots"]
    assert warm["rollout_slots_peak"] == 16 and warm["container_slots_peak"] == 32


def test_without_setup_a_warm_pool_changes_nothing():
    w = _gsm8k(Dist("const"))
    cold, warm = (simulate_lifecycle(w, rollout_slots=16, container_slots=c, replicas=1, hours=0.5) for c in (16, 32))
    assert cold["setup_s_p90"] == warm["setup_s_p90"] == 0.0
    assert cold["rollout_slot_utilisation"] > 0.99 and warm["rollout_slot_utilisation"] > 0.99
    assert warm["inference_requests_per_min"] / cold["inference_requests_per_min"] == pytest.approx(1.0, abs=0.025)


LIFECYCLE_KEYS = {"inference_requests_per_min", "rollout_slots", "container_slots", "rollout_slot_utilisation",
                  "rollout_slots_held_mean", "container_slots_held_mean", "rollout_slot_wait_s_mean", "setup_s_p50",
                  "setup_s_p90", "rollout_slots_peak", "container_slots_peak"}


def test_caps_that_never_bind_leave_a_simulated_run_as_it_was():
    """The lifecycle adds no draw and no event of its own until a cap binds: every figure of the
    product's loop is the same as without caps (so a run without them is today's run)."""
    w, sc = load_workload("gsm8k_tools"), replace(CONFIGS["async_1"], gpus=4)
    free = simulate(w, sc, hours=0.05)
    capped = simulate(w, replace(sc, container_slots=10 ** 6, rollout_slots=10 ** 6), hours=0.05)
    same = set(free) - LIFECYCLE_KEYS - {"scenario", "overrides", "wall_s", "cpu_s"}
    assert {k: free[k] for k in same} == {k: capped[k] for k in same}
    assert free["events"] == capped["events"] > 0
    assert math.isnan(free["rollout_slot_utilisation"]) and capped["rollout_slot_utilisation"] < 0.01


def test_the_products_loop_runs_under_both_caps(tmp_path):
    """Inside run_async: the caps bind (peaks at the caps, never over), the overrides name the
    product's keys, and the loop's own step metrics report the simulated samples' setup spans."""
    sc = replace(CONFIGS["async_1"], gpus=4, rollout_slots=8, container_slots=16)
    f = simulate(_gsm8k(SETUP), sc, hours=0.05, out_dir=tmp_path)
    assert (f["rollout_slots_peak"], f["container_slots_peak"]) == (8, 16)
    assert 0.5 < f["rollout_slot_utilisation"] <= 1.0 and f["rollout_slot_wait_s_mean"] > 0
    assert {"rollout.contract=a2a", "rollout.rollout_slots=8", "rollout.acr.limits.max_open_sessions=16"} <= set(
        f["overrides"])
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any(s.get("rollout/setup_s_p50", 0) > 0 for s in steps)
    assert any("rollout/rollout_slot_wait_s_mean" in s for s in steps)


def test_lifecycle_settings_errors_name_the_bad_value(tmp_path, capsys):
    with pytest.raises(ValueError, match="scenario.rollout_slots must be an integer >= 1"):
        Scenario(rollout_slots=0)
    with pytest.raises(ValueError, match="scenario.rollout_slots=8 > container_slots=4"):
        Scenario(rollout_slots=8, container_slots=4)
    with pytest.raises(WorkloadError, match="agent.setup_s: a setup time cannot be negative"):
        parse_workload(_raw(-1.0))
    for argv, message in ((["--rollout-slots", "8", "--container-slots", "4"], "--rollout-slots 8 > --container-slots 4"),
                          (["--container-slots", "0"], "--container-slots must be >= 1, got 0"),
                          (["--container-factors", "1,2"], "--container-factors needs --rollout-slots")):
        assert planner(["workload=gsm8k_tools", "gpus=4", "hours=0.05", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("config error: ") and message in err, err
    with pytest.raises(SystemExit):
        planner(["workload=gsm8k_tools", "--rollout-slots", "8", "--container-factors", "0.5,2"])
    assert "each factor must be >= 1" in capsys.readouterr().err
    assert bench_swe.main(["--container-slots-factor", "0.5"]) == 2
    assert "--container-slots-factor must be >= 1" in capsys.readouterr().err


def test_the_planner_sizes_containers_by_the_fewest_that_fill_the_rollout_slots(tmp_path, capsys):
    """The loop keeps 512 rollouts in flight against 32 rollout slots: 2x containers already fill
    the slots, 4x only adds containers waiting warm, 1x leaves the slots idle during setup."""
    path, out = tmp_path / "setup.yaml", tmp_path / "f.json"
    path.write_text(yaml.safe_dump(_raw({"dist": "lognormal", "median": 2.0, "sigma": 0.5})))
    assert planner([f"workload={path}", "gpus=4", "hours=0.1", "--config", "async_1", "--rollout-slots", "32",
                    "--container-factors", "1,2,4", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    util = {k: f["rollout_slot_utilisation"] for k, f in r["results"].items()}
    assert util["1"] < 0.6 and util["2"] > 0.98 and util["4"] > 0.98
    assert r["best"] == "2" and "rollout.acr.limits.max_open_sessions=64" in r["best_overrides"]
    assert "best: container factor 2 (64 containers for 32 rollout slots" in capsys.readouterr().out


def test_bench_swe_writes_both_runs_and_warm_over_cold(tmp_path):
    w = load_workload("swe_gym")
    assert w.agent.setup_s == Dist("lognormal", median=30.0, sigma=1.0, max=900.0)
    out = tmp_path / "b.json"
    assert bench_swe.main(["--rollout-slots", "16", "--hours", "1", "--replicas", "1", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    cold, warm = r["cold"], r["warm"]
    assert (cold["container_slots"], warm["container_slots"]) == (16, 32)
    assert cold["rollout_slot_utilisation"] < warm["rollout_slot_utilisation"]
    ratio = r["warm_over_cold"]["inference_requests_per_min"]
    assert ratio == pytest.approx(warm["inference_requests_per_min"] / cold["inference_requests_per_min"]) and ratio > 1
    assert 20 < cold["setup_s_p50"] < 50 and cold["setup_s_p90"] > 2 * cold["setup_s_p50"]


def test_adaptive_concurrency_steers_the_simulated_rollout_slots_as_the_product_does(tmp_path):
    """policy=adaptive with rollout slots: the product's RolloutSlotSteering (not a dispatch gate)
    sets the simulated rollout-slot cap, through `SlotQueue.resize`: a larger cap admits the
    waiting warm containers in order, a smaller one takes no slot back."""
    sc = replace(CONFIGS["async_1"], gpus=4, policy="adaptive", rollout_slots=16, container_slots=32)
    f = simulate(_gsm8k(SETUP), sc, hours=0.05, out_dir=tmp_path)
    n = int(load_workload("gsm8k_tools").batch["n"])
    assert n <= f["rollout_slots_peak"] <= 16 and f["rollout_slot_wait_s_mean"] > 0
    q: SlotQueue[str] = SlotQueue(2)  # the resize the steering calls: grows admit waiters in order
    assert [q.request(x, 0.0) for x in "abcd"] == [True, True, False, False]
    assert q.resize(3, 1.0) == ["c"] and q.held == 3
    q.resize(1, 2.0)  # shrinks take nothing back; releases go to nobody until under the cap
    assert q.release(3.0) is None and q.release(3.0) is None and q.held == 1 and q.waiting == 1
    assert q.release(4.0) == "d"
