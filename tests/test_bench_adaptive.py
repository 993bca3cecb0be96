"""scripts/bench_adaptive.py: the figures it prints from a run's step records, and its verdict of
the policy against the best fixed cap (issue 45 item 2), on records built by hand."""

import importlib.util

import pytest

from stand_ins import REPO


def _bench():
    spec = importlib.util.spec_from_file_location("bench_adaptive", REPO / "scripts" / "bench_adaptive.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _steps(tokens_per_step, step_s, finished_per_step, best_cap=None):
    out, done = [], 0.0
    for i in range(5):
        done += finished_per_step
        rec = {"timing_s/step": step_s, "perf/total_num_tokens": tokens_per_step, "rollout/completed": done,
               "rollout/dispatched": done + 8, "perf/kv_cache_usage": 0.5}
        if best_cap is not None:
            rec |= {"rollout/concurrency_limit": best_cap + i % 2, "rollout/concurrency_best_cap": best_cap}
        out.append(rec)
    return out


def test_figures_count_throughput_per_minute_of_loop_time_after_the_warmup():
    b = _bench()
    f = b.figures(_steps(600.0, 2.0, 4.0, best_cap=12), {}, warmup_steps=1, in_flight_budget=40)
    # 4 steps after the warm-up: 2 400 tokens and 16 rollouts in 8 s of loop time
    assert f["tokens_per_min"] == pytest.approx(18_000.0) and f["rollouts_per_min"] == pytest.approx(120.0)
    assert f["settled_cap"] == 12 and f["limit"]["max"] == 13


def test_verdict_compares_each_policy_with_the_best_fixed_cap_of_its_eta():
    b = _bench()
    rows = [{"name": "cap8", "eta": 4, "tokens_per_min": 10_000.0, "rollouts_per_min": 100.0},
            {"name": "cap16", "eta": 4, "tokens_per_min": 12_000.0, "rollouts_per_min": 120.0},
            {"name": "adaptive", "eta": 4, "tokens_per_min": 11_000.0, "rollouts_per_min": 111.0, "settled_cap": 14.0},
            {"name": "cap8", "eta": 0, "tokens_per_min": 9_000.0, "rollouts_per_min": 90.0},
            {"name": "adaptive", "eta": 0, "tokens_per_min": 7_000.0, "rollouts_per_min": 70.0, "settled_cap": 8.0}]
    lines = b.verdicts(rows)
    assert lines[0].startswith("eta 0: adaptive settled at cap 8 groups, 0.78x the best fixed cap (cap8)")
    assert "NOT within 10%" in lines[0]
    assert lines[1].startswith("eta 4: adaptive settled at cap 14 groups, 0.92x the best fixed cap (cap16)")
    assert lines[1].endswith("within 10%")
