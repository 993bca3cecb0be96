"""`model` group: the policy and how the gateway renders it; maps to the gateway's GatewayConfig.

Values only: whether `path` and `chat_template` exist is checked by orchestrator/control/preflight.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from orchestrator.config.errors import check
from orchestrator.config.gateway import GatewayGroupConfig, gateway_net
from orchestrator.config.rollout import RolloutConfig
from workers.gateway.tool_parsers import TOOL_CALL_PARSERS

if TYPE_CHECKING:
    from workers.gateway.config import GatewayConfig



@dataclass
class ModelConfig:
    """The policy. `path`: a Hugging Face model dir; None builds (once) and uses the tiny default
    (only with `name=tiny`: every other preset, e.g. `model=qwen3`, requires it).

    chat_template: a Jinja file replacing the tokenizer's chat template in the gateway (vLLM's
    `--chat-template`), e.g. for a model whose own template renders no tools.
    tool_call_parser: the gateway's tool-call format: "auto" (from the template), "hermes",
    "qwen3_coder", "llama3_json", "harmony" (gpt-oss) or "none" (requests offering tools are then
    refused with a 400).
    """

    name: str = "tiny"
    path: str | None = None
    served_name: str = "policy"
    chat_template: str | None = None
    tool_call_parser: str = "auto"

    def __post_init__(self) -> None:
        from workers.embedded.qwen3_random import EMBEDDED_MODELS  # torch-free: names only

        check(self.name in EMBEDDED_MODELS or bool(self.path), "model.path",
              f"must be set for model={self.name} (a local Hugging Face model directory, e.g. "
              f"model.path=/models/Qwen3-8B); only {', '.join(EMBEDDED_MODELS)} are built without one", self.path)
        check(self.tool_call_parser in TOOL_CALL_PARSERS, "model.tool_call_parser",
              f"must be one of {', '.join(TOOL_CALL_PARSERS)}", self.tool_call_parser)


def gateway_config(model: ModelConfig, *, rollout: RolloutConfig, model_path: str,
                   net: GatewayGroupConfig | None = None, replica_wait_s: float = 0.0) -> GatewayConfig:
    """The gateway's settings: the model it renders for, the rollouts' sampling and budgets, where
    it listens / what URL agents get (the `gateway` group, defaults by `rollout.name`), and how long
    a turn waits for a replacement replica (`inference.replica_wait_s`)."""
    from workers.gateway.config import GatewayConfig

    net = net or GatewayGroupConfig()
    host, port, advertise_url = gateway_net(net, rollout_name=rollout.name)
    return GatewayConfig(model_path=model_path, host=host, port=port, advertise_url=advertise_url,
                         history_mode=net.history_mode, on_nonlinear=net.on_nonlinear, served_model_name=model.served_name,
                         chat_template=model.chat_template, tool_call_parser=model.tool_call_parser,
                         max_context_tokens=rollout.max_context_tokens, max_tokens=rollout.max_tokens,
                         temperature=rollout.temperature, top_p=rollout.top_p, replica_wait_s=replica_wait_s)
