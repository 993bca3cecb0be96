"""scripts/soak.py's growth test (issue 29 item 4): a series is bounded when its last quarter's mean
is within the tolerance of its second quarter's (the first is warm-up), or its rise is noise."""

import importlib.util

import pytest

from stand_ins import REPO


def _soak():
    spec = importlib.util.spec_from_file_location("soak_script", REPO / "scripts" / "soak.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


MIB = 1 << 20
STEPS = list(range(10, 510, 10))  # 50 samples, every 10 steps


@pytest.mark.parametrize("values, kind, bounded", [
    ([600 * MIB + (200 * MIB if i < 5 else 0) for i in range(50)], "rss", True),  # warm-up, then flat
    ([600 * MIB + i * 4 * MIB for i in range(50)], "rss", False),  # a 4 MiB-per-sample leak: +100 MiB
    ([600 * MIB + (i % 3) * 8 * MIB for i in range(50)], "rss", True),  # allocator noise
    ([40 + i // 5 for i in range(50)], "fds", True),  # +5 descriptors over the run: under the floor
    ([40 + i for i in range(50)], "fds", False),  # one descriptor leaked per sample
    ([(i % 2) * 8 for i in range(50)], "rows", True),  # the buffer fills and drains
    ([i * 4 for i in range(50)], "rows", False),  # rows never cleared
])
def test_growth_test_tells_a_leak_from_warm_up_and_noise(values, kind, bounded):
    verdict = _soak().judge(STEPS, [float(v) for v in values], kind, 0.10)
    assert verdict["bounded"] is bounded, verdict
    if not bounded:
        assert verdict["slope_per_100_steps"] > 0, verdict


def test_every_sampled_series_is_judged():
    soak = _soak()
    samples = [{"step": s, "shm_used_bytes": 10 * MIB, "probes": {"buffer/rows_held": 4.0},
                "parts": {"driver": {"rss": 600 * MIB + s * MIB, "fds": 40, "procs": 1}}} for s in STEPS]
    series = soak.series_of(samples, 0.10)
    assert set(series) == {"rss/driver", "fds/driver", "buffer/rows_held", "shm/used_bytes"}
    assert [k for k, v in series.items() if not v["bounded"]] == ["rss/driver"]
    assert series["rss/driver"]["slope_per_100_steps"] == pytest.approx(100 * MIB, rel=1e-6)  # 1 MiB a step
