"""The gateway as the driver calls it: `GatewayClient`, the one typed adapter over a
`GatewayServer` or a Ray actor handle of one (workers/core/calls.py).

The rollout workers open and close sessions through their own adapter of the `GatewaySessions`
protocol (workers/rollout/clients.py `GatewaySessionsClient`); this one is the driver's: start and stop
the server, hand it the replicas, read its metrics. Callers: orchestrator/wiring/,
orchestrator/control/supervise.py, orchestrator/adapters/clients.py (`GatewayProbe`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from workers.core import bounds
from workers.core.calls import PartClient, invoke

if TYPE_CHECKING:
    from workers.gateway.metrics import GatewayMetrics


class GatewayClient(PartClient):
    """One GatewayServer (see workers/gateway/server.py)."""

    async def start(self) -> str:
        """Serve; returns the base URL agents reach it at."""
        return await self.call_within(bounds.ENGINE_START_S, self.target.start)

    async def stop(self) -> None:
        await invoke(self.target.stop)

    async def set_engines(self, engines: Sequence[Any]) -> None:
        """Route turns to `engines` (replica handles) from now on."""
        await self.call_within(bounds.STATUS_S, self.target.set_engines, list(engines))

    async def metrics(self) -> GatewayMetrics:
        return await self.call_within(bounds.STATUS_S, self.target.metrics)
