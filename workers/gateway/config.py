"""Typed configuration of the rollout gateway (validated where declared).

The driver's Hydra config maps onto this dataclass; the gateway modules take it as their only
source of settings. Errors name the offending key as `gateway.<field>`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class GatewayConfig:
    """Settings of one gateway process.

    model_path: local directory (or hub id already in the local cache) of the HF tokenizer whose
        chat template renders prompts; must match the model the inference replicas serve.
    served_model_name: model id listed by GET /v1/models and echoed in answers (None: model_path).
    host / port: listen address; port 0 picks a free port.
    max_context_tokens: default per-request budget (prompt + generated tokens) of a session.
    max_body_bytes: largest accepted request body.
    temperature / top_p / max_tokens / enforce_sampling: the sessions' SamplingDefaults.
    extra_stop_token_ids: ids that end generation besides the tokenizer's eos token.
    """

    model_path: str
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    max_context_tokens: int = 4096
    max_body_bytes: int = 16 * 1024 * 1024
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None
    enforce_sampling: bool = False
    extra_stop_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("gateway.model_path must name a tokenizer directory")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"gateway.port must be in [0, 65535], got {self.port}")
        if self.max_context_tokens < 2:
            raise ValueError(f"gateway.max_context_tokens must be >= 2, got {self.max_context_tokens}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"gateway.max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.temperature < 0:
            raise ValueError(f"gateway.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"gateway.top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"gateway.max_tokens must be >= 1, got {self.max_tokens}")

    @property
    def model_id(self) -> str:
        """The model id the gateway serves under."""
        return self.served_model_name or self.model_path
