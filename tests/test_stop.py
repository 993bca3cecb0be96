"""Surviving the driver's death and stopping fast: the reaper, the interrupt guard, resume
bookkeeping (metrics.jsonl, consumed prompts, cumulative counters, checkpoint staging) and the
choice of Ray cluster. Pure logic and small real processes; the end-to-end checks are in
tests/test_e2e.py (Ctrl-C) and tests/test_driver_kill.py (SIGKILL + resume)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from orchestrator.loop.batching import RolloutLedger
from orchestrator.control.checkpoint import RunState, load_latest, remove_staging, stage_checkpoint
from orchestrator.config import ConfigError
from orchestrator.watch.metrics import MetricLogger, keep_steps_upto
from orchestrator.loop.prompts import PromptCycle
from orchestrator.control.run_checkpoint import CONSUMED_FILENAME, LoopPosition, ResumablePrompts, RunCheckpointer, trim_after
from orchestrator.loop.staleness import AdmissionState
from orchestrator.control.stopping import CANCEL_GRACE_S, Interrupts, RunInterrupted
from stand_ins import FileTrainer, wait_until

REPO = Path(__file__).resolve().parent.parent
ROWS = [{"input_id": f"p{i}", "prompt": "x"} for i in range(10)]


@pytest.fixture(autouse=True)
def _signal_handlers_restored():
    """A fired `Interrupts` leaves `exit_at_once` for later signals: not for the next test."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)

# A stand-in driver: starts a server in its own session (as LocalStack does) whose child holds a
# named semaphore (spawn-context multiprocessing leaves /dev/shm/sem.mp-* until finalized), leaves
# a checkpoint staging folder, starts the real reaper, reports, then waits to be killed.
FAKE_DRIVER = textwrap.dedent("""
    import json, os, subprocess, sys, time
    from pathlib import Path
    from orchestrator.control.reaper import start_reaper
    run_dir = Path(sys.argv[1])
    (run_dir / "checkpoints" / ".step-00000002-staging-abc" / "model").mkdir(parents=True)
    reaper = start_reaper(run_dir)
    holder = ("import multiprocessing as mp, subprocess, sys, time; lock = mp.get_context('spawn').Lock(); "
              "sub = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
              "print(lock._semlock.name, sub.pid, flush=True); time.sleep(600)")
    server = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    sem, grandchild = server.stdout.readline().split()
    print(json.dumps({"reaper": reaper.pid, "server": server.pid, "grandchild": int(grandchild), "sem": sem}),
          flush=True)
    time.sleep(600)
""")


def test_driver_killed_with_sigkill_takes_everything_it_started_with_it(tmp_path):
    """Regression (issue 14): after `kill -9` of the driver, moto, the emulator and its agents kept
    running and a /dev/shm/sem.mp-* stayed. The reaper kills every descendant it saw (a server in
    its own session and that server's child included), unlinks the semaphore they mapped and
    removes the checkpoint staging folder."""
    driver = subprocess.Popen([sys.executable, "-c", FAKE_DRIVER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        info = json.loads(driver.stdout.readline())
        sem_path = Path("/dev/shm") / f"sem.{info['sem'].lstrip('/')}"
        assert sem_path.exists()
        time.sleep(1.5)  # let the reaper see the tree at least once (it scans every 0.5 s)
        driver.kill()
        driver.wait()
        reaper = psutil.Process(info["reaper"])
        reaper.wait(timeout=15)
    finally:
        if driver.poll() is None:
            driver.kill()
    for name in ("server", "grandchild"):
        assert wait_until(lambda: not _alive(info[name]), timeout_s=5), name
    assert not sem_path.exists()
    assert not list((tmp_path / "checkpoints").glob(".step-*"))


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def test_interrupt_stops_a_task_that_swallows_its_cancellation():
    """Regression (issue 14): in async mode Ctrl-C was ignored in 3 of 5 tries: `asyncio.wait_for`
    on Python 3.11 swallows a cancellation when the awaited future completes in the same turn, and
    the loop ran to its last step. The guard cancels again when the first one did not end the task."""
    interrupts = Interrupts()
    interrupts.install()
    swallowed = []

    async def stubborn_loop():
        while True:
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed.append(True)  # what wait_for did: the loop goes on

    guarded = asyncio.ensure_future(interrupts.guard(stubborn_loop()))
    await asyncio.sleep(0.05)
    t0 = time.monotonic()
    os.kill(os.getpid(), signal.SIGINT)
    with pytest.raises(RunInterrupted, match="SIGINT"):
        await asyncio.wait_for(guarded, 3 * CANCEL_GRACE_S)
    assert swallowed and time.monotonic() - t0 < 2 * CANCEL_GRACE_S
    assert interrupts.interrupted


# A stand-in driver for the handlers outside the event loop: `before` (nothing started yet) or
# `unwinding` (the first signal raises KeyboardInterrupt; the driver then takes its time to clean up).
HANDLED = textwrap.dedent("""
    import sys, time
    from orchestrator.control import stopping
    getattr(stopping, "install_" + sys.argv[1])()
    try:
        print("ready", flush=True)
        time.sleep(60)
    except KeyboardInterrupt as exc:
        print(f"unwinding {exc}", flush=True)
        time.sleep(60)  # a slow cleanup: a second signal must not wait for it
""")


def _handled(window: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HANDLED, window], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline() == "ready\n"
    return proc


def test_a_signal_before_the_run_started_anything_exits_130_with_one_line():
    """Regression: a Ctrl-C while the driver imported its libraries printed a KeyboardInterrupt
    traceback. Before anything is started a signal ends the process at once: one line, status 130."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        proc = _handled("before_start")
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=10)
        assert proc.returncode == 130 and out == ""
        assert err == f"interrupted: {signal.Signals(sig).name} before the run started anything\n"


def test_first_signal_unwinds_and_a_second_exits_at_once():
    """The first SIGTERM raises KeyboardInterrupt where the driver is (so its ExitStack stops what
    it started, as a Ctrl-C does); a second signal during that cleanup exits at once with status
    130 and one line (README: a second Ctrl-C exits at once), leaving the rest to the reaper."""
    proc = _handled("unwinding")
    proc.send_signal(signal.SIGTERM)
    assert proc.stdout.readline() == "unwinding SIGTERM\n"
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=10)
    assert proc.returncode == 130 and time.monotonic() - t0 < 5
    assert err.startswith("interrupted again (SIGINT): exiting now") and "Traceback" not in err


# A stand-in driver past pre-flight: the real `orchestrator.main` owns its run dir (which registers
# the second signal's last words) with two steps logged; the first signal raises KeyboardInterrupt
# and the driver then takes its time to stop its parts, before it wrote summary.json.
DOUBLE_CTRL_C = textwrap.dedent("""
    import json, sys, time, types
    from pathlib import Path
    from orchestrator import main as driver
    from orchestrator.control import stopping
    from orchestrator.control.preflight import Preflight
    run_dir = Path(sys.argv[1])
    with (run_dir / "metrics.jsonl").open("w") as f:
        for step in (1, 2):
            f.write(json.dumps({"step": step, "policy_version": step, "reward/mean": 0.25 * step,
                                "timing_s/step": 2.0}) + "\\n")
    driver._own_run_dir(types.SimpleNamespace(mode=types.SimpleNamespace(name="async")),
                        Preflight(run_dir=run_dir, checkpoint=None), time.monotonic())
    stopping.install_unwinding()
    try:
        print("ready", flush=True)
        time.sleep(60)
    except KeyboardInterrupt as exc:
        print(f"unwinding {exc}", flush=True)
        time.sleep(60)  # stopping the parts: the summary is written after this
""")


def test_a_double_ctrl_c_still_leaves_the_summary_and_the_report(tmp_path):
    """Issue 47 (item 8): a second Ctrl-C while the run stopped its parts exited at once and left no
    summary.json and no report. It still exits without unwinding, status 130, but first writes
    summary.json (`interrupted: true`, the last logged step) and the report, and says where."""
    from orchestrator.control.stopping import LAST_WORDS_S

    proc = subprocess.Popen([sys.executable, "-c", DOUBLE_CTRL_C, str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert proc.stdout.readline() == "ready\n", proc.stderr.read() if proc.poll() is not None else ""
        proc.send_signal(signal.SIGINT)
        assert proc.stdout.readline() == "unwinding SIGINT\n"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=LAST_WORDS_S + 10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130 and time.monotonic() - t0 < LAST_WORDS_S, err
    assert err.startswith("interrupted again (SIGINT): writing summary.json and the report") and "Traceback" not in err
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["exited_at_once"] is True
    assert (summary["steps"], summary["policy_version"]) == (2, 2)
    report = tmp_path / "report" / "report.html"
    assert report.is_file() and f"report: {report}" in err


def test_a_second_signal_keeps_the_summary_the_interrupted_run_wrote(tmp_path, monkeypatch):
    """Once the interrupted run wrote its own summary.json (its totals), the last words keep it and
    only see to the report."""
    from orchestrator import main as driver
    from orchestrator.control.preflight import Preflight

    for name in ("_SUMMARY_WRITTEN", "_INTERRUPTED_REPORT", "_REPORT_DRAWN"):
        monkeypatch.setattr(driver, name, [])
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 3, "policy_version": 3, "timing_s/step": 2.0}) + "\n")
    pre = Preflight(run_dir=tmp_path, checkpoint=None)
    driver._write_summary(tmp_path, {"steps": 3, "interrupted": True, "rollout/dispatched": 24}, pre, time.monotonic())
    written = (tmp_path / "summary.json").read_text()
    driver._last_words(pre, time.monotonic())
    assert (tmp_path / "summary.json").read_text() == written
    assert (tmp_path / "report" / "report.html").is_file()


def test_ray_inits_own_sigterm_exit_counts_as_the_first_signal():
    """While ray.init runs, its own SIGTERM handler raises SystemExit(15): the driver takes it for
    the first SIGTERM (KeyboardInterrupt: unwind, summary.json) and a later signal exits at once."""
    from orchestrator.control.stopping import exit_at_once, interrupt_from

    with pytest.raises(SystemExit):
        interrupt_from(SystemExit(2))
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        interrupt_from(SystemExit(signal.SIGTERM))
    assert signal.getsignal(signal.SIGTERM) is exit_at_once and signal.getsignal(signal.SIGINT) is exit_at_once


async def test_a_second_signal_after_the_guard_fired_exits_at_once():
    """In the event loop the first signal cancels the guarded work; a later one no longer reaches
    the loop but `exit_at_once` (README: a second Ctrl-C exits at once)."""
    from orchestrator.control.stopping import exit_at_once

    interrupts = Interrupts()
    interrupts.install()
    guarded = asyncio.ensure_future(interrupts.guard(asyncio.sleep(60)))
    await asyncio.sleep(0.05)
    os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(RunInterrupted, match="SIGTERM"):
        await asyncio.wait_for(guarded, CANCEL_GRACE_S)
    assert all(signal.getsignal(s) is exit_at_once for s in (signal.SIGINT, signal.SIGTERM))


async def test_guard_returns_the_result_or_the_error_without_a_signal():
    interrupts = Interrupts()
    interrupts.install()
    assert await interrupts.guard(asyncio.sleep(0, result=7)) == 7

    async def boom():
        raise ValueError("x")

    with pytest.raises(ValueError):
        await interrupts.guard(boom())
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().remove_signal_handler(sig)


def test_metrics_after_a_resume_hold_each_step_once(tmp_path):
    """Regression (issue 14): after a resume metrics.jsonl had duplicate step lines and the
    summary's rewards restarted. The records after the checkpoint's step are dropped (a torn last
    line too) and the kept ones seed the logger's reward history."""
    path = tmp_path / "metrics.jsonl"
    lines = [{"step": 0, "val/reward/mean": 0.1}] + [{"step": s, "reward/mean": s / 10} for s in (1, 2, 3, 4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 5, "rew')
    kept = keep_steps_upto(path, 2)
    assert [r["step"] for r in kept] == [0, 1, 2]
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [0, 1, 2]
    logger = MetricLogger([], kept)
    logger.log(3, {"reward/mean": 0.9, "policy_version": 3.0})
    assert logger.rewards == [0.1, 0.2, 0.9] and logger.last["step"] == 3


def test_cumulative_counters_continue_after_a_resume():
    """The ledger's counters at a checkpoint exclude rollouts still open (their rows are dispatched
    again on resume); a restored ledger continues from them."""
    ledger = RolloutLedger()
    for k in ("g0/s0", "g0/s1", "g1/s0"):
        ledger.on_dispatched(k)
    ledger.on_terminal("g0/s0", "completed")
    ledger.on_terminal("g0/s1", "failed")
    saved = ledger.settled_counts()
    assert saved["rollout/dispatched"] == 2
    resumed = RolloutLedger()
    resumed.restore(saved)
    resumed.on_dispatched("g5/s0")
    resumed.on_terminal("g5/s0", "completed")
    assert resumed.counts()["rollout/dispatched"] == 3 and resumed.counts()["rollout/completed"] == 2
    with pytest.raises(ValueError, match="do not add up"):
        RolloutLedger().restore({**saved, "rollout/dispatched": 3})


async def test_checkpointer_records_consumed_prompts_and_counters(tmp_path):
    prompts = ResumablePrompts(PromptCycle(ROWS, seed=1))
    ledger = RolloutLedger()
    ckpt = RunCheckpointer(tmp_path, FileTrainer(), prompts, save_freq=2, keep_last=2, counters=ledger.settled_counts)
    for step in (1, 2, 3):
        for row in prompts.next_rows(2):
            prompts.on_group_rewards(row["input_id"], [1.0, 0.0])
        await ckpt(LoopPosition(step, step, 2 * step, 2 * step))
    records = [json.loads(x) for x in (tmp_path / CONSUMED_FILENAME).read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and all(len(r["input_ids"]) == 2 for r in records)
    assert load_latest(tmp_path).state.counters == ledger.settled_counts()
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)))
    assert [r["step"] for r in trim_after(tmp_path, 2)] == [1, 2]
    assert [json.loads(x)["step"] for x in (tmp_path / CONSUMED_FILENAME).read_text().splitlines()] == [1, 2]


def test_run_state_counters_round_trip_and_old_states_read():
    state = RunState(step=1, policy_version=1, next_group_id=2, prompts=PromptCycle(ROWS, seed=0).state(),
                     admission=AdmissionState(1, 2), counters={"rollout/dispatched": 8})
    d = state.to_json()
    assert RunState.from_json(d).counters == {"rollout/dispatched": 8}
    assert RunState.from_json({k: v for k, v in d.items() if k != "counters"}).counters == {}


def test_interrupted_checkpoint_writes_leave_no_staging_folder(tmp_path):
    """Regression (issue 14): an interrupted checkpoint left a hidden staging folder with a full
    model copy. `remove_staging` (reaper, next start's pre-flight) removes it; committed ones stay."""
    with stage_checkpoint(tmp_path, 1) as stage:
        stage.model_dir.mkdir()
        (stage.model_dir / "config.json").write_text("{}")
        stage.optimizer_path.write_bytes(b"x")
        stage.commit(RunState(step=1, policy_version=1, next_group_id=0, prompts=PromptCycle(ROWS, seed=0).state(),
                              admission=AdmissionState(1, 0)))
    orphan = stage_checkpoint(tmp_path, 2)  # a driver killed mid-write never leaves the block
    (orphan.model_dir).mkdir()
    assert [p.name for p in remove_staging(tmp_path)] == [orphan.staging_dir.name]
    assert not orphan.staging_dir.exists() and load_latest(tmp_path).state.step == 1


def test_a_run_starts_its_own_ray_unless_told_to_join(monkeypatch):
    """Regression (issue 14): with a `ray start` cluster on the machine, `make run` joined it
    silently (and its rollouts failed). Only `cluster.address` or RAY_ADDRESS make a run join."""
    from orchestrator.control.ray_cluster import ray_address
    from stand_ins import compose_config

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert ray_address(compose_config()) == "local"
    assert ray_address(compose_config(["cluster.address=10.0.0.1:6379"])) == "10.0.0.1:6379"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:6379")
    assert ray_address(compose_config()) == "10.0.0.2:6379"


def test_a_cluster_the_run_starts_caps_the_task_events_its_gcs_keeps():
    """Soak finding: Ray's GCS kept 100,000 task events (~3 KB per actor call) and grew 56 -> 385 MB
    over 500 async steps. A cluster the driver starts gets the cap; 0 leaves Ray's default."""
    from orchestrator.config import ConfigError
    from orchestrator.control.ray_cluster import ray_system_config
    from stand_ins import compose_config

    assert ray_system_config(compose_config()) == {"task_events_max_num_task_in_gcs": 10_000}
    assert ray_system_config(compose_config(["cluster.task_events_max=500"])) == {"task_events_max_num_task_in_gcs": 500}
    assert ray_system_config(compose_config(["cluster.task_events_max=0"])) == {}
    with pytest.raises(ConfigError, match="cluster.task_events_max"):
        compose_config(["cluster.task_events_max=-1"])


def test_a_dead_cluster_is_a_clear_error_not_a_hang():
    """Regression (issue 14): a cluster that died without `ray stop` made ray.init hang for 10
    minutes without a word. Nothing answering at the address is a config error naming the key."""
    from orchestrator.control.ray_cluster import check_cluster_reachable

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"cluster.address: no Ray cluster answers at '127.0.0.1:\d+'"):
        check_cluster_reachable(f"127.0.0.1:{port}", "cluster.address", timeout_s=2)
    assert time.monotonic() - t0 < 3


def test_a_resumed_run_continues_its_wandb_run(tmp_path, monkeypatch):
    """Regression (issue 14): a resume created a second wandb run. The sink keeps the run id in
    run_dir/wandb_run_id and resumes it; offline, both parts are files of the same run id."""
    from orchestrator.watch.metrics import WANDB_ID_FILENAME, WandbSink

    monkeypatch.setenv("WANDB_SILENT", "true")
    for step in (1, 2):  # the first run, then the resumed one
        sink = WandbSink(tmp_path, "p", "offline", {})
        sink.log(step, {"reward/mean": 0.5})
        sink.close()
    run_id = (tmp_path / WANDB_ID_FILENAME).read_text().strip()
    runs = sorted(p.name for p in (tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.endswith(f"-{run_id}") for r in runs)
