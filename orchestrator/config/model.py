"""`model` group: the policy, its LoRA adapter (`model.lora`), and how the gateway renders it;
maps to the gateway's GatewayConfig and (`lora_settings`) to the trainer's LoraSettings.

Values only: whether `path` and `chat_template` exist is checked by orchestrator/control/preflight.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from orchestrator.config.errors import check
from orchestrator.config.gateway import GatewayGroupConfig, gateway_net
from orchestrator.config.rollout import RolloutConfig
from workers.gateway.tool_parsers import TOOL_CALL_PARSERS

if TYPE_CHECKING:
    from workers.gateway.config import GatewayConfig
    from workers.trainer.settings import LoraSettings

LORA_INITS = ("default", "gaussian")  # PEFT init_lora_weights True / "gaussian": B = 0, the adapter starts as the identity
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's `max_lora_rank` choices (config/lora.py)


@dataclass
class LoraConfig:
    """LoRA (PEFT) on the policy; `rank` 0 or null trains every weight (no adapter).

    rank: r of W + (alpha / r) B A; at most 512 (vLLM's largest `max_lora_rank`).
    alpha: the scale numerator (`lora_alpha`), > 0. dropout: PEFT's `lora_dropout` in [0, 1),
    applied in the training forward only (π_old and the probes score without it).
    target_modules: module names the adapter wraps (PEFT `target_modules`), or ["all-linear"]:
    every linear layer except the output head.
    init: "default" (PEFT's Kaiming A, B = 0) or "gaussian" (A ~ N(0, 1/r), B = 0); both start as
    the base model, so version 0 is the base the engines already serve. Inits that rewrite the base
    weights (PiSSA, OLoRA, LoftQ) are refused: the engines serve the unmodified base.
    """

    rank: Optional[int] = 0
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    init: str = "default"

    def __post_init__(self) -> None:
        r = self.rank or 0
        check(0 <= r <= VLLM_MAX_LORA_RANKS[-1], "model.lora.rank",
              f"must be 0 / null (LoRA off) or in 1..{VLLM_MAX_LORA_RANKS[-1]} (vLLM's largest max_lora_rank)", self.rank)
        check(self.alpha > 0, "model.lora.alpha", "must be > 0", self.alpha)
        check(0 <= self.dropout < 1, "model.lora.dropout", "must be in [0, 1)", self.dropout)
        check(bool(self.target_modules) and all(isinstance(m, str) and m for m in self.target_modules),
              "model.lora.target_modules", "must be a non-empty list of module names (or [all-linear])",
              self.target_modules)
        check(self.init in LORA_INITS, "model.lora.init",
              f"must be one of {list(LORA_INITS)} (inits that rewrite the base weights, e.g. pissa or olora, "
              "cannot run: the engines serve the unmodified base)", self.init)

    @property
    def enabled(self) -> bool:
        return bool(self.rank)

    def max_lora_rank(self) -> int:
        """The smallest vLLM `max_lora_rank` choice that holds `rank`."""
        return next(r for r in VLLM_MAX_LORA_RANKS if r >= (self.rank or 0))



@dataclass
class ModelConfig:
    """The policy. `path`: a Hugging Face model dir; None builds (once) and uses the tiny default
    (only with `name=tiny`: every other preset, e.g. `model=qwen3`, requires it).

    chat_template: a Jinja file replacing the tokenizer's chat template in the gateway (vLLM's
    `--chat-template`), e.g. for a model whose own template renders no tools.
    tool_call_parser: the gateway's tool-call format: "auto" (from the template), "hermes",
    "qwen3_coder", "llama3_json", "harmony" (gpt-oss) or "none" (requests offering tools are then
    refused with a 400).
    lora: train a LoRA adapter instead of every weight (`LoraConfig`; rank 0 / null: off).
    """

    name: str = "tiny"
    path: str | None = None
    served_name: str = "policy"
    chat_template: str | None = None
    tool_call_parser: str = "auto"
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        from workers.embedded.models import EMBEDDED_MODELS  # torch-free: names only

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
                         temperature=rollout.temperature, top_p=rollout.top_p, replica_wait_s=replica_wait_s,
                         max_body_bytes=net.max_body_bytes)


def lora_settings(lora: LoraConfig) -> LoraSettings | None:
    """`model.lora` as the trainer's LoraSettings (workers/trainer/settings.py), None when off."""
    from workers.trainer.settings import LoraSettings

    if not lora.enabled:
        return None
    return LoraSettings(rank=int(lora.rank or 0), alpha=lora.alpha, dropout=lora.dropout,
                        target_modules=tuple(lora.target_modules), init=lora.init)
