"""Typed configuration of the rollout gateway (validated where declared).

The driver's Hydra config maps onto this dataclass; the gateway modules take it as their only
source of settings. Errors name the offending key as `gateway.<field>`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

HISTORY_MODES = ("tree", "linear")
ON_NONLINEAR = ("reset", "error", "passthrough")


@dataclass(frozen=True)
class GatewayConfig:
    """Settings of one gateway process.

    model_path: local directory (or hub id already in the local cache) of the HF tokenizer whose
        chat template renders prompts; must match the model the inference replicas serve.
    served_model_name: model id listed by GET /v1/models and echoed in answers (None: model_path).
    host / port: listen address; port 0 picks a free port. The default host is loopback; a public
        address (e.g. 0.0.0.0, for agents running elsewhere) must be configured explicitly.
    advertise_url: the base URL agents are given (None: `http://HOST:PORT/v1` as bound; "auto":
        `http://<this node's routable address>:PORT/v1`; else used as given, e.g. the https URL of
        a TLS-terminating reverse proxy in front of HOST:PORT).
    max_context_tokens: default per-request budget (prompt + generated tokens) of a session.
    max_body_bytes: largest accepted request body.
    temperature / top_p / max_tokens / enforce_sampling: the sessions' SamplingDefaults.
    extra_stop_token_ids: ids that end generation besides the tokenizer's eos token.
    chat_template: path of a Jinja chat template that replaces the tokenizer's (vLLM's
        `--chat-template`), e.g. one that renders tools for a model whose own template does not.
    tool_call_parser: "auto" (detect the format from the template), "hermes" (Qwen2.5 JSON
        `<tool_call>`), "qwen3_coder" (XML `<function=...>`), "llama3_json" (Llama 3.x), "harmony"
        (gpt-oss; only with a harmony template), or "none" (requests with tools get 400).
    max_turns: turns a session may run (429 past it).
    token_continuity: build a turn's prompt on the recorded tokens when the client's history
        matches the recorded turns (workers/gateway/continuity.py); False always re-renders.
    history_mode: "tree" (continuity.py: continue where the template re-renders history the same
        way; a turn it re-renders differently starts a new row) or "linear" (linear.py: when the
        messages extend the previous turn's, the prompt is the served ids plus the rendered new
        messages, so an append-only session is one row whatever the template does to history).
    on_nonlinear: with history_mode=linear, a request whose messages do not extend the previous
        turn's (an edit, a dropped or reordered message, other tools): "reset" (a new row from the
        plain render, healing goes on from it), "error" (400 `nonlinear_history`), or "passthrough"
        (tree mode for the rest of the session). The agentcore-rl-toolkit's names.
    replica_wait_s: when a replica died under a turn and no healthy one is left, how long the turn
        waits for a replacement (`set_engines`) before it fails (503 `engine_failed`, the session
        marked `engine_lost`); 0: fail at once. Seconds.
    """

    model_path: str
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    advertise_url: str | None = None
    max_context_tokens: int = 4096
    max_body_bytes: int = 16 * 1024 * 1024
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None
    enforce_sampling: bool = False
    extra_stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    chat_template: str | None = None
    tool_call_parser: str = "auto"
    max_turns: int = 256
    token_continuity: bool = True
    history_mode: str = "tree"
    on_nonlinear: str = "reset"
    replica_wait_s: float = 0.0

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
        if self.replica_wait_s < 0:
            raise ValueError(f"gateway.replica_wait_s must be >= 0, got {self.replica_wait_s}")
        if self.history_mode not in HISTORY_MODES:
            raise ValueError(f"gateway.history_mode must be one of {', '.join(HISTORY_MODES)}, got {self.history_mode!r}")
        if self.on_nonlinear not in ON_NONLINEAR:
            raise ValueError(f"gateway.on_nonlinear must be one of {', '.join(ON_NONLINEAR)}, got {self.on_nonlinear!r}")
        if self.max_turns < 1:
            raise ValueError(f"gateway.max_turns must be >= 1, got {self.max_turns}")
        from workers.gateway.tool_parsers import TOOL_CALL_PARSERS

        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"gateway.tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                             f"got {self.tool_call_parser!r}")

    @property
    def model_id(self) -> str:
        """The model id the gateway serves under."""
        return self.served_model_name or self.model_path
