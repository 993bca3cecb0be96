"""End to end on every real part: Ray, vLLM (CPU), the ACR emulator + agent processes, moto S3,
the gateway, TransferQueue, the FSDP2 trainer. A short run of the real main job as a subprocess."""

import json
import os
import signal
import subprocess
import time
import sys
from pathlib import Path

import psutil
import pytest
from report_checks import check_report

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(900)
def test_main_job_runs_end_to_end_on_real_parts(tmp_path):
    """The embedded default's sync run, its report, its quiet console and its cleanup; the weights
    go by the bucketed gloo broadcast (trainer.weight_sync.backend=gloo, 1 MB buckets: several per
    push), the file sync being run end to end by the other e2e tests (gsm8k, own agent, rollout=aws)."""
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator.main", "trainer.total_steps=3", "rollout.batch_size=4",
         "rollout.n=4", "mode.sync_every=1", "trainer.weight_sync.backend=gloo", "trainer.weight_sync.bucket_mb=1",
         "logger=console", f"run_dir={run_dir}"],
        cwd=REPO, capture_output=True, text=True, timeout=840, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3
    steps = [json.loads(line) for line in lines]
    assert [s["step"] for s in steps] == [1, 2, 3]
    # the health alarms are logged on every step and stay silent on the healthy embedded default
    assert all(s[k] == 0.0 for s in steps for k in ("alarm/malformed_tool_calls", "alarm/masked_fraction",
                                                     "alarm/length_bias", "alarm/truncated_share")), steps
    # the version bumps on exactly the steps that trained (a step whose groups all tie has nothing to
    # train: sampling is seeded per rollout, so which steps those are is fixed by `seed`, not by luck)
    updated = [s["rollout/step_completed"] > 0 for s in steps]
    assert [s["policy_version"] for s in steps] == [sum(updated[:i + 1]) for i in range(len(steps))]
    assert sum(updated) >= 2  # at least two broadcasts, at two versions
    assert not list(run_dir.glob("weights/*.safetensors"))  # the broadcast path writes no file
    assert all(s["timing_s/update_weights"] > 0 for s, up in zip(steps, updated) if up)
    for s in steps:
        for key in ("reward/mean", "perf/throughput", "timing_s/gen", "timing_s/update_actor",
                    "timing_s/update_weights", "rollout/completed", "rollout/failed", "rollout_corr/is_mean"):
            assert key in s, key
        # verl's throughput count: every token of the trained samples, prompts too
        assert s["perf/total_num_tokens"] >= s["perf/trained_tokens"], s
        # where the CPU went (orchestrator/watch/cpu_usage.py): each part that works in a step used some
        assert all(s[f"perf/cpu_s/{p}"] > 0 for p in ("driver", "inference", "gateway", "rollout", "local_stack",
                                                       "total")), s
        parts = ("driver", "trainer", "inference", "gateway", "rollout", "local_stack", "other")
        assert s["perf/cpu_s/total"] == pytest.approx(sum(s[f"perf/cpu_s/{p}"] for p in parts)), s  # parts sum to total
    assert sum(s["perf/cpu_s/trainer"] for s in steps) > 0  # the trainer ranks did the updates
    # what the run holds (orchestrator/watch/resources.py): a sync step clears the groups it trained
    assert all(s["buffer/rows_held"] == 0 and s["ray/object_store_bytes"] >= 0 for s in steps), steps
    assert sum(s["perf/total_num_tokens"] for s in steps) > sum(s["perf/trained_tokens"] for s in steps) > 0
    # the data path (issue 24): the driver is a control plane; what it receives is metered at its Ray
    # and TransferQueue clients (the async e2e, tests/test_own_agent_e2e.py, bounds it per rollout);
    # every row the step's train orders named was read from TransferQueue by a rank, once (each rank
    # counts the rows it read; the order sharding gives each key to one rank: tests/test_trainer_group.py)
    for s in steps:
        assert s["driver/rollouts_returned"] == 4 * 4, s
        assert s["driver/bytes_from_ray"] > 0 and s["driver/bytes_per_rollout"] > 0, s
        assert s["trainer/rows_read"] == s["trainer/rows_ordered"], s
        assert (s["trainer/rows_read"] > 0) == (s["rollout/step_completed"] > 0), s
        assert s["trainer/rows_read"] >= s["rollout/step_completed"], s  # a trained rollout has a row or more
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rollout/dispatched"] == 3 * 4 * 4
    assert summary["rollout/dispatched"] == (summary["rollout/completed"] + summary["rollout/failed"]
                                             + summary["rollout/filtered"])
    assert summary["rollout/failed"] == 0, proc.stdout[-4000:]
    assert summary["acr/sessions_open_at_exit"] == 0
    assert summary["rollout/completed"] > 0  # some groups had reward variance and were trained
    # sync mode is on-policy: the gateway's recorded log-probs must match the trainer's recompute,
    # which only holds if tokens and log-probs were captured exactly and aligned, and if the engine
    # got exactly the trainer's weights of each version through the broadcast
    trained = [s for s in steps if s["rollout/step_completed"] > 0]
    assert trained and all(abs(s["rollout_corr/log_ppl_abs_diff"]) < 1e-3 for s in trained)
    assert all(abs(s["rollout_corr/is_mean"] - 1.0) < 1e-3 for s in trained)
    assert f"run_dir: {run_dir}" in proc.stdout
    # the report of a short real run: every plot a valid PNG with data, referenced files only; its
    # path is the last console line
    check_report(run_dir / "report" / "report.html")
    assert proc.stdout.rstrip().splitlines()[-1] == f"report: {run_dir / 'report' / 'report.html'}"
    # a quiet console: nothing from Ray, vLLM, Triton or TransferQueue before the first step
    before_step_1 = proc.stdout.split("[step 1/")[0] + proc.stderr
    for noise in ("Ray instance", "(InferenceWorker", "(TrainerWorker", "Triton", "TransferQueue", "NUMA",
                  "FutureWarning", "Loading"):
        assert noise not in before_step_1, (noise, before_step_1[-3000:])
    assert (run_dir / "logs" / "driver.log").is_file()
    # every server the run started (moto, emulator, agents) was stopped by PID
    started = json.loads((run_dir / "pids.json").read_text())
    assert len(started) >= 4  # moto, emulator, two agents
    alive = {name: pid for name, pid in started.items() if psutil.pid_exists(pid)
             and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE}
    assert not alive, alive


# The target is 10 s (issue 14; it was 36-56 s), measured by scripts/bench_stop.py: 5.7 s (async) and
# 5.5 s (sync) at load 51 on 2 cores; the test's bound leaves room for a machine loaded by other jobs.
STOP_BOUND_S = 30.0


def _snapshot(pid: int) -> tuple[list[tuple[int, float]], set[int]]:
    """The driver's descendants (PID, start time) and the inodes of the /dev/shm files they map."""
    from orchestrator.control.reaper import Record

    record = Record(pid)
    assert record.scan()
    return list(record.procs.items()), set(record.shm)


def _left_behind(tree: list[tuple[int, float]], shm: set[int], timeout_s: float) -> tuple[list[int], list[str]]:
    """Processes of `tree` still alive and /dev/shm entries with an inode of `shm` after `timeout_s`."""
    from orchestrator.control.reaper import still_running

    def alive() -> list[int]:
        return still_running(tree)

    deadline = time.monotonic() + timeout_s
    while alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive(), [e.name for e in os.scandir("/dev/shm") if e.inode() in shm]


def _start_job(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "orchestrator.main", *args], cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # a background shell ignores SIGINT


def _read_until(proc: subprocess.Popen, text: str, timeout_s: float) -> list[str]:
    """The console lines up to the first one containing `text`."""
    out: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        out.append(line)
        if text in line:
            return out
    raise AssertionError(f"no {text!r} line:\n" + "".join(out[-50:]))


STARTING = "inference replica(s) (vLLM) and the trainer"  # the console line of the parts' start (build.py)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode,sig,at", [("async", signal.SIGINT, "[step 1/"), ("sync", signal.SIGTERM, "[step 1/"),
                                         ("async", signal.SIGINT, STARTING)],
                         ids=["async-sigint-in-loop", "sync-sigterm-in-loop", "async-sigint-while-starting"])
def test_first_ctrl_c_stops_the_run_fast_and_leaves_nothing_behind(tmp_path, mode, sig, at):
    """Regression (issue 14): the first Ctrl-C took 36-56 s, printed ~185 lines of connection
    errors, was ignored in 3 of 5 async tries, and left a /dev/shm/sem.mp-*. Ctrl-C (SIGINT to the
    whole process group, as a terminal sends it) or SIGTERM mid-run: the run ends within 10 s with
    status 130, a few lines, summary.json saying `interrupted: true` and no ACR session open; then
    no process the run started and no /dev/shm file they mapped is left.
    Regression: a Ctrl-C while the engines, trainer, buffer and rollout actors were starting went
    unseen for 26-36 s (blocking Ray calls held the event loop); it now ends the run as fast, the
    same way (the last case)."""
    run_dir = tmp_path / "run"
    proc = _start_job([f"mode={mode}", "trainer.total_steps=50", "rollout.batch_size=2", "rollout.n=2",
                       "rollout.num_workers=1", "rollout.acr.num_agents=1", "logger=console", f"run_dir={run_dir}"])
    try:
        _read_until(proc, at, 480)
        tree, shm = _snapshot(proc.pid)
        assert len(tree) >= 6  # moto, emulator, two agents, Ray and its actors
        t0 = time.monotonic()
        os.killpg(proc.pid, sig) if sig == signal.SIGINT else proc.send_signal(sig)
        rest, _ = proc.communicate(timeout=120)
        stop_s = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, rest[-3000:]
    assert stop_s < STOP_BOUND_S, (stop_s, rest[-3000:])
    lines = [line for line in rest.splitlines() if line.strip() and not line.startswith("[step ")]
    assert len(lines) <= 4 and "Traceback" not in rest, rest[-3000:]
    assert "interrupted: stopped at step" in rest
    summary = json.loads((run_dir / "summary.json").read_text())
    if at == STARTING:  # stopped before step 1: no report to draw
        assert summary["interrupted"] is True and summary["steps"] == 0 and "[step 1/" not in rest, rest[-3000:]
    else:
        report = run_dir / "report" / "report.html"  # drawn while the parts stopped (issue 15: also when interrupted)
        assert f"report: {report}" in rest and report.is_file(), rest[-3000:]
        assert summary["interrupted"] is True and summary["steps"] >= 1
        terminal = sum(summary[f"rollout/{k}"] for k in ("completed", "failed", "filtered", "expired", "truncated"))
        assert summary["rollout/dispatched"] == terminal + summary["rollout/open"], summary  # nothing lost
    alive, shm_left = _left_behind(tree, shm, timeout_s=15)
    assert not alive and not shm_left, (alive, shm_left)
    assert summary["acr/sessions_open_at_exit"] == 0  # stopped before the emulator went


@pytest.mark.timeout(900)
def test_a_killed_trainer_rank_restarts_from_the_last_checkpoint_inside_the_run(tmp_path):
    """Issue 29: `trainer.max_restarts=1`: the trainer rank, SIGKILLed once step 3 is logged, is
    replaced inside the same run (same driver, local stack and run_dir) from the last checkpoint;
    the run finishes all 4 steps, each logged once, and trains each of its 8 prompts exactly once
    (consumed_prompts.jsonl: what an uninterrupted run consumes), with no ACR session left open."""
    from orchestrator.config.task import TaskConfig
    from orchestrator.tasks import TASKS

    run_dir = tmp_path / "run"
    proc = _start_job(["mode=sync", "trainer.total_steps=4", "trainer.save_freq=1", "trainer.max_restarts=1",
                       "rollout.batch_size=2", "rollout.n=4", "task.num_prompts=8", "logger=console",
                       f"run_dir={run_dir}"])
    try:
        seen = _read_until(proc, "[step 3/", 480)
        rank = json.loads((run_dir / "actors.json").read_text())["trainer-rank-0"]
        os.kill(rank, signal.SIGKILL)
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = "".join(seen) + out
    assert proc.returncode == 0, out[-4000:]
    assert "trainer rank 0 of 1 died" in out and "restarting the trainer group from" in out and "restart 1/1" in out
    assert json.loads((run_dir / "actors.json").read_text())["trainer-rank-0"] != rank  # a new rank trained on
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    consumed = [json.loads(x) for x in (run_dir / "consumed_prompts.jsonl").read_text().splitlines()]
    assert [c["step"] for c in consumed] == [1, 2, 3, 4]
    epoch = {r["input_id"] for r in TASKS["letters"].rows(TaskConfig(name="letters", num_prompts=8), "train")}
    assert sorted(i for c in consumed for i in c["input_ids"]) == sorted(epoch)  # each prompt once
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["interrupted"] is False and summary["trainer/restarts"] == 1
    assert summary["acr/sessions_open_at_exit"] == 0
    # the counters go on from the checkpoint: the dead attempt's step after it is not counted twice
    assert summary["rollout/dispatched"] == 4 * 2 * 4 == (summary["rollout/completed"] + summary["rollout/failed"]
                                                          + summary["rollout/filtered"] + summary["rollout/expired"])
