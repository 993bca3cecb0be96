"""The AgentCore Runtime ARN and S3 bucket names: their form, and the region an ARN names.

Pure (no boto3). The region of a runtime is the ARN's fourth field, as agentcore-rl-toolkit
derives it (`arn.split(":")[3]`); every ACR call of a run goes to that region.

Form (AWS Bedrock AgentCore API reference, AgentRuntime ARN):
`arn:<partition>:bedrock-agentcore:<region>:<12-digit account>:runtime/<runtime id>`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

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
    """Parse `arn`; raises ValueError saying what form is expected."""
    m = _ARN.match(arn or "")
    if m is None:
        raise ValueError("must be an AgentCore Runtime ARN, arn:aws:bedrock-agentcore:<region>:<12-digit account>:"
                         "runtime/<runtime id>")
    return RuntimeArn(partition=m.group(1), region=m.group(2), account=m.group(3), runtime_id=m.group(4))


def check_bucket_name(bucket: str) -> None:
    """Raise ValueError unless `bucket` follows S3's general-purpose bucket naming rules."""
    if not _BUCKET.match(bucket or "") or ".." in bucket:
        raise ValueError("must be an S3 bucket name (3-63 lowercase letters, digits, dots or hyphens, starting and "
                         "ending with a letter or digit)")
