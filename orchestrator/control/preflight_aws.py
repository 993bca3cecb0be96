"""Pre-flight of `rollout=aws`: before Ray starts, what the rollout actors' boto3 will need.

1. Credentials, resolved the way boto3 resolves them in the actors (botocore's chain: the
   environment, `AWS_PROFILE` in the shared config / credentials files (`AWS_CONFIG_FILE`,
   `AWS_SHARED_CREDENTIALS_FILE`), SSO, web identity, container and instance-metadata roles).
2. With `rollout.contract=s3`, the results bucket exists (`HeadBucket`) and is writable (a
   `PutObject` + `DeleteObject` of one small object under the run's prefix), through
   `AWS_ENDPOINT_URL_S3` when set (the http and a2a contracts return results in the invocation).
3. The runtime ARN's form and region are checked by config validation already
   (orchestrator/config/rollout.py); the S3 and ACR clients use that region.

A failure raises ConfigError naming what is missing (key, profile, bucket, and the AWS error code).
Warnings (returned, printed by the caller) name addresses that agents running in AgentCore Runtime
could not reach: the gateway's advertised URL and the rollout actors' result host
(workers/core/netaddr.py). `forwarded_aws_env` is the AWS configuration the driver hands to actors
on a joined cluster. Callers: orchestrator/control/preflight.py, orchestrator/wiring/runtime.py.
"""

from __future__ import annotations

import uuid
from typing import Mapping

from orchestrator.config import ConfigError, RunConfig, gateway_net
from orchestrator.config.rollout import acr_region
from workers.core.netaddr import AUTO, reach_warning, routable_address

PREFLIGHT_TIMEOUT_S = 10  # per S3 call: a wrong endpoint or a blocked network fails in seconds, not minutes
AWS_ENV_PREFIX = "AWS_"  # every AWS_* variable (profile, config files, session token, endpoints, region, ...)


def forwarded_aws_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The driver's AWS configuration for actors on a joined Ray cluster: every `AWS_*` variable
    (`AWS_PROFILE`, `AWS_CONFIG_FILE`, `AWS_SHARED_CREDENTIALS_FILE`, `AWS_SESSION_TOKEN`,
    `AWS_ENDPOINT_URL_*`, ...). Empty when none is set: the actors then use their node's own chain
    (the instance role). Files named by a path must exist at that path on every node."""
    return {k: v for k, v in environ.items() if k.startswith(AWS_ENV_PREFIX)}


def check_aws(cfg: RunConfig, exp_id: str) -> list[str]:
    """Run the checks of the module docstring; return the warnings. Raises ConfigError."""
    import boto3
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError, ProfileNotFound

    acr = cfg.rollout.acr
    region = acr_region(acr)
    try:
        session = boto3.Session(region_name=region)
        credentials = session.get_credentials()
    except ProfileNotFound as exc:
        raise ConfigError(f"rollout=aws: {exc} (AWS_PROFILE names a profile missing from the AWS config files)") from None
    except BotoCoreError as exc:
        raise ConfigError(f"rollout=aws: resolving AWS credentials failed: {exc}") from None
    if credentials is None:
        raise ConfigError("rollout=aws: no AWS credentials found (looked where boto3 looks: AWS_ACCESS_KEY_ID / "
                          "AWS_SECRET_ACCESS_KEY, AWS_PROFILE in AWS_CONFIG_FILE / AWS_SHARED_CREDENTIALS_FILE, SSO, "
                          "web identity, the instance role); set AWS_PROFILE or run `aws configure`")
    if cfg.rollout.contract != "s3":
        return reach_warnings(cfg)
    s3 = session.client("s3", config=Config(connect_timeout=PREFLIGHT_TIMEOUT_S, read_timeout=PREFLIGHT_TIMEOUT_S,
                                            retries={"max_attempts": 2, "mode": "standard"}))
    bucket = acr.s3_bucket
    key = f"{exp_id}/.preflight-{uuid.uuid4().hex}"
    step = "HeadBucket"
    try:
        s3.head_bucket(Bucket=bucket)
        step = "PutObject"
        s3.put_object(Bucket=bucket, Key=key, Body=b"preflight")
        step = "DeleteObject"
        s3.delete_object(Bucket=bucket, Key=key)
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "?")
        what = {"404": "does not exist", "NoSuchBucket": "does not exist", "403": "is not accessible (access denied)",
                "AccessDenied": "is not writable (access denied)"}.get(str(code), f"failed {step} ({code})")
        raise ConfigError(f"rollout.acr.s3_bucket={bucket!r} {what} in {region} with the resolved credentials "
                          f"({credentials.method}); agents write their results there") from None
    except BotoCoreError as exc:
        raise ConfigError(f"rollout.acr.s3_bucket={bucket!r}: S3 {step} failed: {exc}") from None
    return reach_warnings(cfg)


def reach_warnings(cfg: RunConfig) -> list[str]:
    """Addresses agents in ACR are given that they may not reach (the gateway's, the result host's)."""
    host, port, advertise = gateway_net(cfg.gateway, rollout_name=cfg.rollout.name)
    url = routable_address() if advertise == AUTO else (advertise or host)
    warnings = [reach_warning(url, "gateway.advertise_url")]
    result = cfg.rollout.result_host
    if result:
        warnings.append(reach_warning(routable_address() if result == AUTO else result, "rollout.result_host"))
    return [w for w in warnings if w]
