"""Stopping what a run left open (workers/acr/sweep.py, orchestrator/control/reaper.py) against the
ACR emulator as a separate process, reached only through the standard AWS variables: real sessions
opened with the product's ACR client, journaled, then stopped through StopRuntimeSession by a sweep
and by the reaper of a driver that was SIGKILLed."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest

from stand_ins import REPO, BlockingAcr, new_session_id
from workers.acr.client import AcrClientConfig
from workers.acr.journal import JournalEntry, SessionJournal
from workers.acr.sweep import sweep_run_dir


def _open_sessions(stack, n: int) -> list[JournalEntry]:
    acr = BlockingAcr()
    entries = [JournalEntry(new_session_id("dead-run"), stack.agent_runtime_arn, None) for _ in range(n)]
    for e in entries:
        acr.invoke(e.arn, e.session_id, {})
    return entries


def test_a_sweep_stops_every_journaled_session_and_keeps_what_it_could_not(echo_env, tmp_path, monkeypatch):
    before = echo_env.stats()
    opened = _open_sessions(echo_env, 3)
    assert echo_env.stats().sessions_open == before.sessions_open + 3
    journal = SessionJournal(tmp_path)
    gone = JournalEntry(new_session_id("stopped-before"), echo_env.agent_runtime_arn, None)
    on_dead_emulator = JournalEntry(new_session_id("local"), echo_env.agent_runtime_arn, None, local=True)
    journal.add([*opened, gone, on_dead_emulator])

    cfg = AcrClientConfig(region_name=echo_env.region, max_attempts=1)
    got = asyncio.run(sweep_run_dir(tmp_path, cfg, rate_per_s=25.0, deadline_s=30.0))
    assert (got.stopped, got.not_open, got.local, got.kept) == (3, 1, 1, 0)
    assert journal.entries() == []
    after = echo_env.stats()
    assert after.sessions_open == before.sessions_open
    assert after.sessions_stopped == before.sessions_stopped + 3

    # an endpoint that is down: every stop fails, every entry stays for the next sweep
    more = _open_sessions(echo_env, 2)
    journal.add(more)
    monkeypatch.setenv("AWS_ENDPOINT_URL_BEDROCK_AGENTCORE", "http://127.0.0.1:9")
    got = asyncio.run(sweep_run_dir(tmp_path, cfg, rate_per_s=25.0, deadline_s=30.0))
    assert (got.stopped, got.failed, got.kept) == (0, 2, 2)
    assert journal.entries() == sorted(more, key=lambda e: e.session_id)
    monkeypatch.setenv("AWS_ENDPOINT_URL_BEDROCK_AGENTCORE", echo_env.env["AWS_ENDPOINT_URL_BEDROCK_AGENTCORE"])
    got = asyncio.run(sweep_run_dir(tmp_path, cfg, rate_per_s=25.0, deadline_s=30.0))
    assert (got.stopped, got.kept) == (2, 0) and echo_env.stats().sessions_open == before.sessions_open


@pytest.mark.timeout(120)
def test_the_reaper_of_a_sigkilled_driver_stops_the_sessions_it_left(echo_env, tmp_path):
    before = echo_env.stats()
    opened = _open_sessions(echo_env, 4)
    SessionJournal(tmp_path).add(opened)
    driver = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    reaper = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.control.reaper", "--parent", str(driver.pid), "--run-dir", str(tmp_path),
         "--acr-requests-per-s", "25"],
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)
    try:
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        out, _ = reaper.communicate(timeout=90)
    finally:
        for p in (driver, reaper):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert reaper.returncode == 0, out
    assert "ACR sessions left open" in out and "stopped=4" in out, out
    assert SessionJournal(tmp_path).entries() == []
    assert echo_env.stats().sessions_open == before.sessions_open
