"""The staleness bound holds on every trained sample (issue 26 item 2), as a property over seeds,
workloads, modes, `sync_every` 1 / 2 / 4 and η 0 / 1 / 2: the product's own loops, admission and
judge (orchestrator/loop/) on the simulator's virtual clock (orchestrator/planning/sim/run.py).

Checked per logged step (the step records the loop writes to `metrics.jsonl`), not on the
summary: `staleness/trained_max` <= η at every update, and every judged sample is accounted
for (trained + dropped as stale = judged)."""

import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

from orchestrator.planning.sim.run import Scenario, simulate
from orchestrator.planning.sim.workload import load_workload

WORKLOADS = {"gsm8k_tools": (4, 0.06), "reference": (32, 1.0)}  # name: (GPUs, simulated hours): 1-3 s each


def _hist_total(record: dict, prefix: str) -> float:
    return sum(v for k, v in record.items() if k.startswith(prefix))


@pytest.mark.parametrize("sync_every", [1, 2, 4])
@pytest.mark.parametrize("eta", [0, 1, 2])
# no shrinking: each example is a whole simulated run; a failure prints its arguments as drawn
@settings(max_examples=2, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), workload=st.sampled_from(sorted(WORKLOADS)),
       mode=st.sampled_from(["async", "async", "sync"]), on_stale=st.sampled_from(["drop", "train_masked"]),
       policy=st.sampled_from(["fixed", "adaptive"]))
def test_no_trained_sample_is_staler_than_eta(sync_every, eta, seed, workload, mode, on_stale, policy):
    gpus, hours = WORKLOADS[workload]
    if mode == "sync":
        sc = Scenario("sync", sync_every, True, gpus=gpus)
    else:
        sc = Scenario("async", sync_every, False, gpus=gpus, max_staleness=eta, on_stale=on_stale, policy=policy)
    with tempfile.TemporaryDirectory() as d:
        f = simulate(load_workload(workload), sc, hours=hours, seed=seed, out_dir=Path(d))
        records = [json.loads(line) for line in (Path(d) / "metrics.jsonl").read_text().splitlines()]
    bound = eta if mode == "async" else 0
    assert f["staleness_max"] <= bound
    steps = [r for r in records if "staleness/mean" in r]
    assert mode == "sync" or steps, "an async run must judge samples"
    for r in steps:
        assert r.get("staleness/trained_max", 0.0) <= bound, r
        judged, trained = _hist_total(r, "staleness/hist/"), _hist_total(r, "staleness/trained_hist/")
        assert trained + r["async/dropped_stale"] == judged
