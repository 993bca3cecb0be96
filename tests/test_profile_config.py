"""The production profile's config: model presets, inference=vllm, rollout=aws (ARN, bucket, region),
the gateway's network keys and the addresses agents are given."""

from __future__ import annotations

import pytest

from orchestrator.config import ConfigError, gateway_config
from stand_ins import compose_config
from workers.core.netaddr import reach_warning, routable_address
from workers.gateway.server import advertised_url

ARN = "arn:aws:bedrock-agentcore:eu-central-1:123456789012:runtime/my_agent-Ab12"
AWS = ["rollout=aws", f"rollout.acr.agent_runtime_arn={ARN}", "rollout.acr.s3_bucket=my-rollouts",
       "inference.max_model_len=16384"]


def test_aws_region_comes_from_the_runtime_arn():
    from orchestrator.config.rollout import acr_client_config, acr_region

    cfg = compose_config(AWS)
    assert cfg.rollout.name == "aws" and cfg.rollout.acr.region is None  # validation writes nothing back
    assert acr_region(cfg.rollout.acr) == acr_client_config(cfg.rollout).region_name == "eu-central-1"
    assert cfg.rollout.result_host == "auto"


@pytest.mark.parametrize("override,message", [
    ("rollout.acr.agent_runtime_arn=", "rollout.acr.agent_runtime_arn must be set with rollout=aws"),
    ("rollout.acr.s3_bucket=", "rollout.acr.s3_bucket must be set with rollout=aws"),
    ("rollout.acr.agent_runtime_arn=arn:aws:bedrock:eu-central-1:123456789012:agent/x",
     "rollout.acr.agent_runtime_arn must be an AgentCore Runtime ARN"),
    ("rollout.acr.agent_runtime_arn=arn:aws:bedrock-agentcore:eu-central-1:1234:runtime/x",
     "rollout.acr.agent_runtime_arn must be an AgentCore Runtime ARN"),
    ("rollout.acr.agent_runtime_arn=arn:aws:bedrock-agentcore:us-east-9:123456789012:runtime/x",
     "rollout.acr.agent_runtime_arn names the region 'us-east-9', which is not a region of the aws partition "
     "in botocore's endpoint data; use a valid one such as us-east-2, us-east-1, us-west-2"),
    ("rollout.acr.agent_runtime_arn=arn:aws-cn:bedrock-agentcore:us-east-1:123456789012:runtime/x",
     "rollout.acr.agent_runtime_arn names the region 'us-east-1', which is not a region of the aws-cn partition"),
    ("rollout.acr.s3_bucket=My_Bucket", "rollout.acr.s3_bucket must be an S3 bucket name"),
    ("rollout.acr.region=us-east-1", "rollout.acr.region must be null or the runtime's region 'eu-central-1'"),
])
def test_aws_values_are_checked_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        compose_config([*AWS, override])


@pytest.mark.parametrize("contract", ["a2a", "http"])
def test_contracts_that_return_results_in_the_invocation_need_no_bucket_on_aws(contract):
    """rollout=aws with contract=a2a or http: nothing is written to S3, so no bucket is asked for
    (and pre-flight checks none); a bucket that is set must still be a bucket name."""
    no_bucket = [o for o in AWS if not o.startswith("rollout.acr.s3_bucket")] + ["rollout.acr.s3_bucket="]
    assert compose_config([*no_bucket, f"rollout.contract={contract}"]).rollout.acr.s3_bucket == ""
    with pytest.raises(ConfigError, match=r"rollout\.acr\.s3_bucket must be an S3 bucket name"):
        compose_config([*AWS, f"rollout.contract={contract}", "rollout.acr.s3_bucket=My_Bucket"])


def test_preflight_touches_no_bucket_for_the_a2a_contract(monkeypatch):
    """With S3 unreachable (a closed port) and no bucket, pre-flight of contract=a2a passes; with
    contract=s3 the same setup fails naming the bucket."""
    import socket

    from orchestrator.control.preflight_aws import check_aws

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y", "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}"}.items():
        monkeypatch.setenv(k, v)
    no_bucket = [o for o in AWS if not o.startswith("rollout.acr.s3_bucket")] + ["rollout.acr.s3_bucket="]
    assert isinstance(check_aws(compose_config([*no_bucket, "rollout.contract=a2a"]), "exp-x"), list)
    with pytest.raises(ConfigError, match=r"rollout\.acr\.s3_bucket='my-rollouts'"):
        check_aws(compose_config(AWS), "exp-x")


def test_arn_regions_come_from_botocore_and_the_emulators_arn_stays_valid():
    """Issue 29: `us-east-9` passed the ARN's form check. The known regions are botocore's endpoint data,
    per partition; the ARN the local emulator serves (and the config's default) still parses."""
    from orchestrator.config.rollout import AcrConfig
    from workers.acr.arn import parse_runtime_arn, partition_regions
    from workers.embedded.emulator_config import DEFAULT_RUNTIME_ARN

    aws = partition_regions("aws")
    assert {"us-east-1", "eu-central-1"} <= set(aws) and "us-east-9" not in aws
    assert "cn-north-1" in partition_regions("aws-cn") and partition_regions("nowhere") == ()
    assert parse_runtime_arn(DEFAULT_RUNTIME_ARN).region == "us-west-2"
    assert parse_runtime_arn(AcrConfig().agent_runtime_arn).region == "us-west-2"
    gov = "arn:aws-us-gov:bedrock-agentcore:us-gov-west-1:123456789012:runtime/a"
    assert parse_runtime_arn(gov).partition == "aws-us-gov"


def test_aws_without_values_names_the_first_missing_key():
    with pytest.raises(ConfigError, match=r"rollout\.acr\.agent_runtime_arn must be set"):
        compose_config(["rollout=aws", "inference.max_model_len=16384"])


@pytest.mark.parametrize("preset,parser", [("qwen2_5", "hermes"), ("qwen3", "hermes"), ("qwen3_coder", "qwen3_coder")])
def test_model_presets_require_a_path_and_set_bf16(preset, parser):
    with pytest.raises(ConfigError, match=rf"model\.path must be set for model={preset}"):
        compose_config([f"model={preset}"])
    cfg = compose_config([f"model={preset}", "model.path=/models/m"])
    assert (cfg.model.tool_call_parser, cfg.inference.dtype, cfg.trainer.mixed_precision) == (parser, "bfloat16", "bf16")
    # the command line still wins over the preset's precision
    assert compose_config([f"model={preset}", "model.path=/m", "inference.dtype=float32"]).inference.dtype == "float32"


def test_inference_vllm_is_the_cuda_profile_and_needs_gpus():
    with pytest.raises(ConfigError, match=r"inference\.name vllm runs on CUDA GPUs"):
        compose_config(["inference=vllm"])
    inf = compose_config(["inference=vllm", "cluster=disaggregated"]).inference
    assert (inf.dtype, inf.kv_cache_gib, inf.enable_prefix_caching, inf.enforce_eager) == ("bfloat16", None, True, False)
    assert 0 < inf.gpu_memory_utilization <= 1 and inf.max_num_batched_tokens >= inf.max_model_len
    with pytest.raises(ConfigError, match=r"inference\.kv_cache_gib must be set with inference=vllm_cpu"):
        compose_config(["inference.kv_cache_gib=null"])


def test_inference_settings_carry_the_gpu_knobs():
    from orchestrator.config import inference_settings

    cfg = compose_config(["inference=vllm", "cluster=disaggregated", "cluster.trainer.gpus_per_node=1"])
    s = inference_settings(cfg.inference, mode=cfg.mode, async_=cfg.async_, cluster=cfg.cluster, seed=0,
                           model_path="/m", replica=0, initial_policy_version=0)
    assert s.kv_cache_bytes is None and s.gpu_memory_utilization == cfg.inference.gpu_memory_utilization
    assert s.max_num_batched_tokens == cfg.inference.max_num_batched_tokens and s.enforce_eager is False


def test_gateway_listens_locally_by_default_and_on_every_interface_for_aws():
    local = compose_config([])
    g = gateway_config(local.model, rollout=local.rollout, model_path="/m", net=local.gateway)
    assert (g.host, g.port, g.advertise_url) == ("127.0.0.1", 0, None)
    aws = compose_config(AWS)
    g = gateway_config(aws.model, rollout=aws.rollout, model_path="/m", net=aws.gateway)
    assert (g.host, g.advertise_url) == ("0.0.0.0", "auto")
    proxied = compose_config([*AWS, "gateway.port=8000", "gateway.advertise_url=https://rl.example.com/v1"])
    g = gateway_config(proxied.model, rollout=proxied.rollout, model_path="/m", net=proxied.gateway)
    assert (g.host, g.port, g.advertise_url) == ("0.0.0.0", 8000, "https://rl.example.com/v1")
    with pytest.raises(ConfigError, match=r"gateway\.advertise_url must be null, auto or an http"):
        compose_config(["gateway.advertise_url=rl.example.com"])



def test_gateway_history_mode_reaches_the_gateway_and_bad_values_name_the_key():
    local = compose_config([])
    g = gateway_config(local.model, rollout=local.rollout, model_path="/m", net=local.gateway)
    assert (g.history_mode, g.on_nonlinear) == ("tree", "reset")
    swe = compose_config(["+experiment=swe_mini_local", "gateway.on_nonlinear=error"])
    g = gateway_config(swe.model, rollout=swe.rollout, model_path="/m", net=swe.gateway)
    assert (g.history_mode, g.on_nonlinear) == ("linear", "error")
    with pytest.raises(ConfigError, match=r"gateway\.history_mode must be one of tree, linear"):
        compose_config(["gateway.history_mode=flat"])
    with pytest.raises(ConfigError, match=r"gateway\.on_nonlinear must be one of reset, error, passthrough"):
        compose_config(["gateway.on_nonlinear=ignore"])

def test_advertised_url():
    assert advertised_url(None, "127.0.0.1", 5000) == "http://127.0.0.1:5000/v1"
    assert advertised_url("auto", "0.0.0.0", 5000) == f"http://{routable_address()}:5000/v1"
    assert advertised_url("https://rl.example.com/v1/", "0.0.0.0", 5000) == "https://rl.example.com/v1"


@pytest.mark.parametrize("addr,warns", [
    ("http://127.0.0.1:8000/v1", "this machine only"), ("0.0.0.0", "this machine only"),
    ("localhost", "this machine only"), ("http://10.1.2.3:8000/v1", "private address"),
    ("172.31.0.5", "private address"), ("http://54.1.2.3:8000/v1", None), ("https://rl.example.com/v1", None),
])
def test_reach_warning(addr, warns):
    w = reach_warning(addr, "gateway.advertise_url")
    assert (w is None) if warns is None else (warns in w)


def test_task_custom_needs_your_agent_locally_but_not_on_aws():
    with pytest.raises(ConfigError, match=r"rollout\.acr\.agent_cmd must name your agent's command with task=custom"):
        compose_config(["task=custom", "task.data_path=examples/data/arith/train.jsonl"])
    with pytest.raises(ConfigError, match=r"task\.data_path must be set for task=custom"):
        compose_config(["task=custom", "rollout.acr.agent_cmd=python a.py"])
    assert compose_config([*AWS, "task=custom", "task.data_path=d.parquet"]).task.prompt_key == "prompt"


def test_result_host_auto_listens_everywhere_and_advertises_the_nodes_address():
    from workers.core.netaddr import listen_and_advertise

    assert listen_and_advertise("auto") == ("0.0.0.0", routable_address())
    assert listen_and_advertise("0.0.0.0") == ("0.0.0.0", routable_address())
    assert listen_and_advertise("127.0.0.1") == ("127.0.0.1", None)
    assert routable_address() not in ("", "0.0.0.0")
