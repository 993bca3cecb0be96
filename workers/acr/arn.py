"""The AgentCore Runtime ARN and S3 bucket names: their form, and the region an ARN names.

No boto3 client: the region of a runtime is the ARN's fourth field, as agentcore-rl-toolkit
derives it (`arn.split(":")[3]`); every ACR call of a run goes to that region, so it must be a
region of the ARN's partition in botocore's own endpoint data (`endpoints.json`, the partitions'
`regions`), read from the installed botocore: a region AWS opens arrives with a botocore upgrade.

Form (AWS Bedrock AgentCore API reference, AgentRuntime ARN):
`arn:<partition>:bedrock-agentcore:<region>:<12-digit account>:runtime/<runtime id>`.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from functools import cache

_ARN = re.compile(r"^arn:(aws|aws-cn|aws-us-gov):bedrock-agentcore:([a-z]{2}(?:-[a-z]+)+-\d+):(\d{12}):"
                  r"runtime/([A-Za-z][A-Za-z0-9_-]{0,99})$")
# S3 bucket naming rules (general purpose buckets): 3-63 chars, lowercase letters, digits, dots, hyphens,
# starting and ending with a letter or digit
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


@dataclass(frozen=True)
class RuntimeArn:
    """A parsed AgentCore Runtime ARN."""

    partition: str
    region: str
    account: str
    runtime_id: str


def parse_runtime_arn(arn: str) -> RuntimeArn:
    """Parse `arn`; raises ValueError saying what form is expected, or that its region is not one of
    its partition's regions (naming a few that are)."""
    m = _ARN.match(arn or "")
    if m is None:
        raise ValueError("must be an AgentCore Runtime ARN, arn:aws:bedrock-agentcore:<region>:<12-digit account>:"
                         "runtime/<runtime id>")
    partition, region = m.group(1), m.group(2)
    known = partition_regions(partition)
    if region not in known:
        near = difflib.get_close_matches(region, known, n=3, cutoff=0.6) or sorted(known)[:3]
        raise ValueError(f"names the region {region!r}, which is not a region of the {partition} partition in "
                         f"botocore's endpoint data; use a valid one such as {', '.join(near)}")
    return RuntimeArn(partition=partition, region=region, account=m.group(3), runtime_id=m.group(4))


@cache
def partition_regions(partition: str) -> tuple[str, ...]:
    """The region names of `partition` ("aws", "aws-cn", ...) in the installed botocore's endpoints.json;
    empty for a partition botocore does not know."""
    from botocore.loaders import Loader

    for p in Loader().load_data("endpoints")["partitions"]:
        if p["partition"] == partition:
            return tuple(sorted(p["regions"]))
    return ()


def check_bucket_name(bucket: str) -> None:
    """Raise ValueError unless `bucket` follows S3's general-purpose bucket naming rules."""
    if not _BUCKET.match(bucket or "") or ".." in bucket:
        raise ValueError("must be an S3 bucket name (3-63 lowercase letters, digits, dots or hyphens, starting and "
                         "ending with a letter or digit)")
