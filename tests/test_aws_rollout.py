"""rollout=aws exercised as on AWS: the test starts the ACR emulator and moto S3 as separate
processes; the main job reaches them only through AWS_ENDPOINT_URL_BEDROCK_AGENTCORE /
AWS_ENDPOINT_URL_S3 and a profile in a temporary AWS_CONFIG_FILE (no AWS_ACCESS_KEY_ID in its
environment). Pre-flight stops a run without credentials, with an unknown profile or with a missing
bucket before Ray starts, with `config error:` naming what is missing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from orchestrator.control.preflight_aws import forwarded_aws_env
from stand_ins import LETTERS_AGENT, REPO

PROFILE = "rl-test"


@pytest.fixture(scope="module")
def stack(local_stack):
    return local_stack(LETTERS_AGENT, num_agents=2)


def aws_env(tmp_path, stack, *, profile: str | None = PROFILE) -> dict[str, str]:
    """The job's environment: no AWS_* of this process; endpoints and a profile in a temporary config file."""
    config = tmp_path / "aws_config"
    config.write_text(f"[profile {PROFILE}]\nregion = {stack.region}\naws_access_key_id = testing\n"
                      "aws_secret_access_key = testing\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update({"AWS_CONFIG_FILE": str(config), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
                "AWS_EC2_METADATA_DISABLED": "true", "PYTHONUNBUFFERED": "1",
                "AWS_ENDPOINT_URL_BEDROCK_AGENTCORE": stack.env["AWS_ENDPOINT_URL_BEDROCK_AGENTCORE"],
                "AWS_ENDPOINT_URL_S3": stack.env["AWS_ENDPOINT_URL_S3"]})
    if profile:
        env["AWS_PROFILE"] = profile
    return env


def main(stack, run_dir, env, *overrides: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.main", "rollout=aws", f"rollout.acr.agent_runtime_arn={stack.agent_runtime_arn}",
         f"rollout.acr.s3_bucket={stack.bucket}", "rollout.max_tokens=16", "rollout.max_context_tokens=512",
         "rollout.n=2", "rollout.batch_size=2", "rollout.num_workers=1", "rollout.timeout_s=60",
         "rollout.poll_initial_s=0.02", "rollout.poll_max_s=0.5", "gateway.host=127.0.0.1", "rollout.result_host=127.0.0.1",
         "trainer.total_steps=1", "logger=console", f"run_dir={run_dir}", *overrides],
        cwd=REPO, capture_output=True, text=True, timeout=timeout_s, env=env)


@pytest.mark.parametrize("case,needle", [
    ("no_credentials", "config error: rollout=aws: no AWS credentials found"),
    ("unknown_profile", "config error: rollout=aws: The config profile (nobody) could not be found"),
    ("missing_bucket", "config error: rollout.acr.s3_bucket='no-such-bucket-7' does not exist"),
])
def test_preflight_stops_before_ray_naming_what_is_missing(tmp_path, stack, case, needle):
    env = aws_env(tmp_path, stack, profile=None if case == "no_credentials" else PROFILE)
    overrides = ["rollout.acr.s3_bucket=no-such-bucket-7"] if case == "missing_bucket" else []
    if case == "unknown_profile":
        env["AWS_PROFILE"] = "nobody"
    out = main(stack, tmp_path / "run", env, *overrides)
    assert out.returncode == 2, out.stderr[-3000:]
    assert needle in out.stderr
    assert "Traceback" not in out.stderr and "ray" not in out.stdout.lower()
    assert not (tmp_path / "run" / "config.yaml").exists()  # the job never started


@pytest.mark.timeout(600)
def test_main_job_runs_with_rollout_aws_through_a_profile_and_endpoints(tmp_path, stack):
    """One sync step of the letters task: 2 groups x 2 rollouts invoked through boto3's ACR client,
    results written by the agents to (moto) S3 and read back, trained."""
    import boto3

    run_dir = tmp_path / "run"
    # zero-variance groups kept: with 2 groups of 2 a tied group would be filtered (and a run that
    # trains nothing exits 1), which made this test depend on the sampled rewards
    out = main(stack, run_dir, aws_env(tmp_path, stack), "algorithm.filter_zero_variance=false", timeout_s=570)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rollout/completed"] == 4 and summary["rollout/failed"] == 0
    assert summary["acr/requests"] >= 4  # invocations (and stops) went to the emulator through its endpoint
    assert not (run_dir / "pids.json").exists()  # rollout=aws started no local stack of its own
    assert "warning: gateway.advertise_url='127.0.0.1' is reachable from this machine only" in out.stderr
    s3 = boto3.client("s3", region_name=stack.region, **{k: stack.env[v] for k, v in (
        ("endpoint_url", "AWS_ENDPOINT_URL_S3"), ("aws_access_key_id", "AWS_ACCESS_KEY_ID"),
        ("aws_secret_access_key", "AWS_SECRET_ACCESS_KEY"))})
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=stack.bucket, Prefix="exp-run/").get("Contents", [])]
    assert len([k for k in keys if k.endswith(".json")]) == 4, keys  # one result per rollout; preflight's probe gone


def test_actors_on_a_joined_cluster_get_the_users_aws_configuration():
    env = {"AWS_PROFILE": "sso-dev", "AWS_CONFIG_FILE": "/home/u/.aws/config", "AWS_SESSION_TOKEN": "t",
           "AWS_SHARED_CREDENTIALS_FILE": "/home/u/.aws/credentials", "AWS_ENDPOINT_URL_S3": "http://s3.local",
           "HOME": "/home/u", "PATH": "/bin"}
    assert forwarded_aws_env(env) == {k: v for k, v in env.items() if k.startswith("AWS_")}
    assert forwarded_aws_env({"HOME": "/home/u"}) == {}  # nothing set: actors use their node's instance role


def _popen_main(stack, run_dir, env, *overrides: str) -> tuple[subprocess.Popen, list[str]]:
    """`main`'s job started in the background; its console lines collect in the returned list."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.main", "rollout=aws", f"rollout.acr.agent_runtime_arn={stack.agent_runtime_arn}",
         f"rollout.acr.s3_bucket={stack.bucket}", "rollout.max_tokens=16", "rollout.max_context_tokens=512",
         "rollout.n=2", "rollout.batch_size=2", "rollout.num_workers=1", "gateway.host=127.0.0.1",
         "rollout.result_host=127.0.0.1", "logger=console", f"run_dir={run_dir}", *overrides],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    return proc, lines


def _wait_for(pred, what: str, timeout_s: float, lines: list[str]) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s}s:\n" + "".join(lines[-40:])
        time.sleep(0.01)


@pytest.mark.timeout(600)
def test_sessions_of_a_driver_killed_with_its_reaper_are_stopped_by_the_next_start(tmp_path, stack, stack_env):
    """Issue 29: a driver SIGKILLed with ACR sessions open, its reaper with it (the node was lost):
    the open-session journal in run_dir names them, and the next start of the same run_dir stops
    every one of them through StopRuntimeSession before it opens any of its own."""
    from orchestrator.control.reaper import Record, reap
    from stand_ins import BlockingAcr
    from workers.acr.journal import SessionJournal

    import psutil

    run_dir, env = tmp_path / "run", aws_env(tmp_path, stack)
    baseline = stack.stats().sessions_open
    proc, lines = _popen_main(stack, run_dir, env, "trainer.total_steps=50", "rollout.timeout_s=60")
    tree = Record(proc.pid)
    try:
        _wait_for(lambda: stack.stats().sessions_open > baseline, "ACR session opened", 480, lines)
        assert tree.scan()  # everything the driver started, to clean up by PID once the test is done
        reaper = next(c for c in psutil.Process(proc.pid).children()
                      if "orchestrator.control.reaper" in " ".join(c.cmdline()))
        reaper.kill()  # first: a lost node takes the reaper with the driver
        proc.kill()
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reap(tree, None)  # its rollout actors, Ray and the engines too (by PID and start time): the node is gone
    left_open = stack.stats().sessions_open - baseline
    journaled = [e for e in SessionJournal(run_dir).entries() if not e.local]
    assert left_open >= 1 and len(journaled) >= left_open, (left_open, journaled)  # every open one is journaled

    again, lines = _popen_main(stack, run_dir, env, "trainer.total_steps=1")
    try:
        _wait_for(lambda: any("ACR session(s) in its journal" in line for line in lines), "sweep line", 120, lines)
        again.send_signal(signal.SIGTERM)  # the rest of the run is not what this test is about
        again.wait(timeout=120)
    finally:
        if again.poll() is None:
            again.kill()
            again.wait()
    said = next(line for line in lines if "ACR session(s) in its journal" in line)
    assert f"left {len(journaled)} ACR session(s)" in said and f"{left_open} stopped now" in said, said
    assert not {e.session_id for e in journaled} & {e.session_id for e in SessionJournal(run_dir).entries()}
    stack_env(stack)
    acr = BlockingAcr()  # every session the killed run left is gone: a stop now finds none of them
    assert [acr.stop_session(e.arn, e.session_id, e.qualifier) for e in journaled] == [False] * len(journaled)
    assert stack.stats().sessions_open == baseline
