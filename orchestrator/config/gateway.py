"""`gateway` group: where the agents' model endpoint listens and the URL agents are given.

Agents running in AgentCore Runtime call the gateway over the network, so with `rollout=aws` the
defaults listen on every interface and advertise this node's routable address; pre-flight
(orchestrator/control/preflight_aws.py) warns when that address is one ACR cannot reach. Maps onto the
worker's GatewayConfig fields `host`, `port`, `advertise_url` (workers/gateway/config.py) through
`gateway_net` and orchestrator/config/model.py's `gateway_config` (and `max_body_bytes` there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from orchestrator.config.defaults import default_of
from orchestrator.config.errors import check
from workers.core.netaddr import AUTO
from workers.gateway.config import HISTORY_MODES, ON_NONLINEAR, GatewayConfig

LOOPBACK = "127.0.0.1"
ALL_INTERFACES = "0.0.0.0"


@dataclass
class GatewayGroupConfig:
    """host: interface to listen on (null: 127.0.0.1 with rollout=local, 0.0.0.0 with rollout=aws).
    port: TCP port (0: a free one; fix it when a firewall or reverse proxy must name it).
    advertise_url: the base URL agents are given as `base_url` (null: "auto" when listening on
    every interface (0.0.0.0), else the listen URL; "auto": http://<this node's routable address>:<port>/v1;
    or e.g. https://rl.example.com/v1 behind a TLS-terminating reverse proxy).
    history_mode: "tree" or "linear" (an append-only agent session stays one row whatever the
    template does to earlier turns); on_nonlinear: reset | error | passthrough, what linear mode
    does with a request that edits the history (workers/gateway/config.py says each).
    max_body_bytes: the largest request body an agent may send (bytes); a larger one is answered 413
    naming this key before anything is rendered."""

    host: Optional[str] = None
    port: int = default_of(GatewayConfig, "port")
    advertise_url: Optional[str] = default_of(GatewayConfig, "advertise_url")
    history_mode: str = default_of(GatewayConfig, "history_mode")
    on_nonlinear: str = default_of(GatewayConfig, "on_nonlinear")
    max_body_bytes: int = default_of(GatewayConfig, "max_body_bytes")

    def __post_init__(self) -> None:
        check(0 <= self.port <= 65535, "gateway.port", "must be in [0, 65535]", self.port)
        check(self.max_body_bytes >= 1024, "gateway.max_body_bytes", "must be >= 1024", self.max_body_bytes)
        url = self.advertise_url
        check(url is None or url == AUTO or url.startswith(("http://", "https://")), "gateway.advertise_url",
              "must be null, auto or an http(s):// base URL", url)
        check(self.history_mode in HISTORY_MODES, "gateway.history_mode", f"must be one of {', '.join(HISTORY_MODES)}",
              self.history_mode)
        check(self.on_nonlinear in ON_NONLINEAR, "gateway.on_nonlinear", f"must be one of {', '.join(ON_NONLINEAR)}",
              self.on_nonlinear)


def gateway_net(g: GatewayGroupConfig, *, rollout_name: str) -> tuple[str, int, Optional[str]]:
    """(host, port, advertise_url) of the gateway for a run whose rollouts are `rollout_name`."""
    host = g.host or (ALL_INTERFACES if rollout_name == "aws" else LOOPBACK)
    advertise = g.advertise_url or (AUTO if host == ALL_INTERFACES else None)  # a bound address is its own URL
    return host, g.port, advertise
