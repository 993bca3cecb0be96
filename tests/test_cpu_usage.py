"""perf/cpu_s/<part> (orchestrator/watch/cpu_usage.py): attribution of a process tree to parts, the
per-step ledger, and the probe on a real child process that burns CPU."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

from orchestrator.watch.cpu_usage import PARTS, CpuLedger, CpuProbe, attribute, part_of_name


def test_part_of_name_follows_the_run_files_names():
    assert [part_of_name(n) for n in ("inference-0", "trainer-rank-1", "rollout-0-2a7c3b", "gateway", "emulator",
                                      "moto", "agent-3", "something")] == [
        "inference", "trainer", "rollout", "gateway", "local_stack", "local_stack", "local_stack", "other"]


def test_a_process_belongs_to_its_nearest_named_ancestor():
    # driver 1 -> raylet 2 -> {inference actor 3 -> engine core 4, gateway 5, idle worker 6};
    # driver 1 -> emulator 7 -> agent 8; process 9 is not the run's (parent 100)
    parents = {2: 1, 3: 2, 4: 3, 5: 2, 6: 2, 7: 1, 8: 7, 9: 100}
    got = attribute(parents, {3: "inference", 5: "gateway", 7: "local_stack"}, driver=1)
    assert got == {1: "driver", 2: "other", 3: "inference", 4: "inference", 5: "gateway", 6: "other",
                   7: "local_stack", 8: "local_stack"}


def test_ledger_counts_each_interval_once_and_never_negative():
    led = CpuLedger()
    led.baseline({1: 10.0, 3: 5.0})
    parts = {1: "driver", 3: "inference", 4: "inference"}
    # driver +0.5; inference: actor +1.0, engine core 4 started since (all its 2.0 s count)
    first = led.on_sample({1: 10.5, 3: 6.0, 4: 2.0}, parts)
    assert first["driver"] == 0.5 and first["inference"] == 3.0 and first["total"] == 3.5
    assert set(first) == {*PARTS, "total"}
    # process 4 exited (its last interval is lost); PID 3 reused by a new process at 0.2 s: counts 0.2
    second = led.on_sample({1: 11.0, 3: 0.2}, {1: "driver", 3: "inference"})
    assert second["driver"] == 0.5 and abs(second["inference"] - 0.2) < 1e-12
    assert min(second.values()) >= 0.0
    assert "machine" not in second  # no machine reading given


def test_ledger_reports_the_machines_busy_seconds_beside_the_runs():
    led = CpuLedger()
    led.baseline({1: 1.0}, machine_s=100.0)
    got = led.on_sample({1: 1.5}, {1: "driver"}, machine_s=101.8)  # the run 0.5 s, other jobs 1.3 s
    assert got["total"] == 0.5 and abs(got["machine"] - 1.8) < 1e-9


def test_probe_measures_a_child_that_burns_cpu():
    """A real child of this process spins for 0.4 s of CPU: the probe puts ~0.4 s in its part."""
    child = subprocess.Popen([sys.executable, "-c", "import sys, time\nsys.stdin.readline()\n"
                              "t = time.process_time()\nwhile time.process_time() - t < 0.4: pass\nsys.stdin.read()"],
                             stdin=subprocess.PIPE, text=True)
    try:
        probe = CpuProbe(lambda: {"agent-0": child.pid}, driver=os.getpid())  # baseline: the child waits
        child.stdin.write("go\n")
        child.stdin.flush()
        deadline = 200  # bounded wait (x 0.05 s) for the spin to finish
        sums: dict[str, float] = {}
        for _ in range(deadline):
            for k, v in asyncio.run(probe()).items():
                sums[k] = sums.get(k, 0.0) + v
            if sums["perf/cpu_s/local_stack"] >= 0.39:
                break
            asyncio.run(asyncio.sleep(0.05))
        assert 0.39 <= sums["perf/cpu_s/local_stack"] < 1.0, sums
        assert sums["perf/cpu_s/total"] >= sums["perf/cpu_s/local_stack"]
        # the machine's includes the run's (up to the skew of reading /proc/stat after the processes)
        assert sums["perf/cpu_s/machine"] >= sums["perf/cpu_s/local_stack"] - 0.1, sums
    finally:
        child.stdin.close()
        child.wait(timeout=10)
