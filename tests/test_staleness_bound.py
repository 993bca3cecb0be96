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


# (sync_every, eta) -> (workload, mode, on_stale, policy): over the 9 cells every value of each comes
# up, each policy at every eta (drawing them per cell left the simplest everywhere); the reference
# workload where its hour holds more than the warm-up step (at eta = 2, sync_every = 2 it does not,
# nor at eta = 1, sync_every = 1 with 2B groups in flight from the start, fixed or adaptive)
CELLS = {(1, 0): ("reference", "async", "drop", "adaptive"), (1, 1): ("gsm8k_tools", "async", "drop", "adaptive"),
         (1, 2): ("gsm8k_tools", "sync", "drop", "fixed"), (2, 0): ("reference", "async", "train_masked", "fixed"),
         (2, 1): ("gsm8k_tools", "async", "train_masked", "fixed"), (2, 2): ("gsm8k_tools", "async", "drop", "adaptive"),
         (4, 0): ("gsm8k_tools", "sync", "train_masked", "fixed"), (4, 1): ("reference", "async", "train_masked", "adaptive"),
         (4, 2): ("gsm8k_tools", "async", "train_masked", "fixed")}


@pytest.mark.parametrize("sync_every", [1, 2, 4])
@pytest.mark.parametrize("eta", [0, 1, 2])
# no shrinking: each example is a whole simulated run (1-9 s); a failure prints its seed. One seed
# per (sync_every, eta) cell, the other dimensions from CELLS: 9 runs (two drawn per cell took
# 40-60 s of make test-fast)
@settings(max_examples=1, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000))
def test_no_trained_sample_is_staler_than_eta(sync_every, eta, seed):
    workload, mode, on_stale, policy = CELLS[(sync_every, eta)]
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


def test_the_cells_cover_every_workload_mode_on_stale_and_policy():
    cells = list(CELLS.values())
    assert set(CELLS) == {(k, eta) for k in (1, 2, 4) for eta in (0, 1, 2)}
    for dim, values in enumerate((set(WORKLOADS), {"async", "sync"}, {"drop", "train_masked"}, {"fixed", "adaptive"})):
        assert {c[dim] for c in cells} == values
    for policy in ("fixed", "adaptive"):  # each policy in async mode at every eta
        assert {eta for (_, eta), c in CELLS.items() if c[1] == "async" and c[3] == policy} == {0, 1, 2}
    assert any(c[0] == "reference" and c[1] == "async" for c in cells)
