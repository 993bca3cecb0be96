"""Failures blamed on the right part (issue 47, item 6): a typo in `model.lora.target_modules` and a
`gateway.host` that is not on this machine are config errors naming the key, before any part starts,
instead of a "trainer lost" (exit 3, a minute in) or a bind traceback inside the gateway actor; an
agent that could not write its result because S3 was down is S3's failure (`s3_unavailable`), not
the agent's (the rule here; the rollout through the real emulator, moto and an agent:
tests/test_rollout_worker.py). (The emulator restarting a crashed agent process is
tests/test_acr_emulator.py's.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.config import ConfigError
from orchestrator.control.lora_targets import check_lora_targets, unmatched_targets
from orchestrator.control.preflight import preflight
from orchestrator.watch.run_watch import FAILURE_HINTS
from workers.rollout.failures import agent_could_not_store
from stand_ins import compose_config, random_qwen2

REPO = Path(__file__).resolve().parent.parent


def test_unmatched_targets_follow_peft_list_matching():
    names = ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj", "lm_head"]
    assert unmatched_targets(["q_proj", "down_proj", "all-linear"], names) == []
    assert unmatched_targets(["q_prj", "self_attn.q_proj", "proj"], names) == ["q_prj", "proj"]


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    return random_qwen2(tmp_path_factory.mktemp("qwen2"))


def test_a_typo_in_target_modules_is_a_config_error_naming_the_key(small_model):
    cfg = compose_config(["model.lora.rank=4", "model.lora.target_modules=[q_proj,v_prj]"])
    with pytest.raises(ConfigError, match=r"^model.lora.target_modules: \['v_prj'\] match no Linear layer.*'v_proj'"):
        check_lora_targets(cfg, small_model)
    check_lora_targets(compose_config(["model.lora.rank=4", "model.lora.target_modules=[q_proj,v_proj]"]), small_model)
    check_lora_targets(compose_config(["model.lora.rank=4"]), small_model)  # all-linear


def test_a_gateway_host_not_on_this_machine_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"^gateway.host '8.8.8.8' is not an address of this machine"):
        preflight(compose_config(["gateway.host=8.8.8.8"], run_dir=tmp_path / "a"))
    with pytest.raises(ConfigError, match=r"^gateway.host 'no-such-host.invalid' does not resolve"):
        preflight(compose_config(["gateway.host=no-such-host.invalid"], run_dir=tmp_path / "b"))
    preflight(compose_config(["gateway.host=0.0.0.0"], run_dir=tmp_path / "c"))
    assert not (tmp_path / "a").exists()  # refused before run_dir was created


def test_the_entry_point_exits_2_on_a_foreign_gateway_host_at_once(tmp_path):
    out = subprocess.run([sys.executable, "-m", "orchestrator.main", "gateway.host=8.8.8.8", f"run_dir={tmp_path / 'r'}"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("config error: gateway.host '8.8.8.8' is not an address of this machine")
    assert "Traceback" not in out.stderr and "Error executing job" not in out.stderr


KEY = "exp-1/letters-0/exp-1-g3-s1-0123abcd.json"  # result_key(exp_id, input_id, session_id)


def _stop_reason(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"  # what the example agents write (letters_agent/app.py)


def _put_into_a_closed_port() -> Exception:
    """botocore's own exception for a put while the store is down (connection refused at once)."""
    import socket

    import boto3
    from botocore.config import Config

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1",
                          aws_access_key_id="x", aws_secret_access_key="y", config=Config(retries={"max_attempts": 1}))
    try:
        client.put_object(Bucket="results", Key=KEY, Body=b"{}")
    except Exception as exc:  # noqa: BLE001
        return exc
    raise AssertionError("a put into a closed port succeeded")


def test_an_agent_that_could_not_reach_s3_for_its_result_blames_s3():
    """The object store's outage, met by the agent writing this rollout's result: botocore's
    could-not-connect (from a real put), connect/read timeouts and dropped connections, path-style
    (moto) or virtual-hosted (AWS) URLs, a URL-quoted key. The line names S3 and the object."""
    from botocore.exceptions import ConnectionClosedError, ConnectTimeoutError, ReadTimeoutError

    aws = f"https://results.s3.us-east-1.amazonaws.com/{KEY}"
    for exc in (_put_into_a_closed_port(), ConnectTimeoutError(endpoint_url=aws), ReadTimeoutError(endpoint_url=aws),
                ConnectionClosedError(endpoint_url=aws.replace("/", "%2F").replace("https:%2F%2F", "https://"))):
        line = agent_could_not_store(_stop_reason(exc), "results", KEY)
        assert line is not None, _stop_reason(exc)
        assert line.startswith(f"S3 (the result store) could not be reached: the agent could not write its result to "
                               f"s3://results/{KEY} (") and "not the agent at fault" in line
    assert "not the agent's fault" in FAILURE_HINTS["s3_unavailable"] and "moto" in FAILURE_HINTS["s3_unavailable"]


def _client_error(code: str, operation: str, retries: int = 0) -> Exception:
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code, "Message": f"the store says {code}"},
                        "ResponseMetadata": {"RetryAttempts": retries, "MaxAttemptsReached": retries > 0}}, operation)


def test_an_agent_whose_put_s3_refused_for_a_store_fault_blames_s3():
    """Seen killing moto mid-run: the restarted moto answered before it had its bucket back, the
    agent's PutObject got NoSuchBucket and its error object failed the rollout `agent_error`. S3's
    answers that are the store's fault (STORE_FAULT_CODES) to the agent's PutObject blame S3; the
    agent's own (access denied, a read of another object) stay the agent's."""
    from workers.rollout.failures import STORE_FAULT_CODES

    for code in STORE_FAULT_CODES:
        for retries in (0, 4):
            line = agent_could_not_store(_stop_reason(_client_error(code, "PutObject", retries)), "results", KEY)
            assert line is not None and line.startswith(f"S3 (the result store) refused the agent's write of its "
                                                        f"result to s3://results/{KEY} ({code}: the store says"), line
    as_boto3_names_it = ("NoSuchBucket: An error occurred (NoSuchBucket) when calling the PutObject operation: "
                         "The specified bucket does not exist")  # the modeled class, from the real run
    assert agent_could_not_store(as_boto3_names_it, "results", KEY) is not None
    for code, operation in (("AccessDenied", "PutObject"), ("NoSuchKey", "GetObject"), ("NoSuchBucket", "GetObject")):
        assert agent_could_not_store(_stop_reason(_client_error(code, operation)), "results", KEY) is None


def test_the_agents_own_failures_stay_the_agents():
    """A connection error to another endpoint (the gateway, another object), or any other reason, is
    the agent's own: None (the rollout stays `agent_error`)."""
    from botocore.exceptions import EndpointConnectionError

    for stop_reason in (None, "", "ValueError: no answer in the reply",
                        "APIConnectionError: Connection error. (http://127.0.0.1:8000/v1/chat/completions)",
                        _stop_reason(EndpointConnectionError(endpoint_url="http://127.0.0.1:8000/v1/chat/completions")),
                        _stop_reason(EndpointConnectionError(endpoint_url="http://127.0.0.1:9/data/exp-1/other.json")),
                        f"S3 key {KEY} was written twice"):
        assert agent_could_not_store(stop_reason, "results", KEY) is None, stop_reason
