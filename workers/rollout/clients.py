"""The rollout package's typed adapters: each calls one kind of part the same way whether it is a
Ray actor handle or a local object (workers/core/calls.py).

- `RolloutActorClient`: a `RolloutActor` (workers/rollout/actor.py) as the pool calls it.
- `GatewaySessionsClient`: the gateway as a rollout worker's `GatewaySessions` (open and close a
  session); the driver's own calls to the gateway are workers/gateway/client.py's.
- `SampleStoreClient`: the trajectory buffer (or any store with `put` / `sample_infos`) as a
  worker's `SampleSink` and the pool's recovery read it.
Callers: workers/rollout/pool.py, workers/rollout/actor.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from workers.core.calls import PartClient, invoke

if TYPE_CHECKING:
    from workers.core.types import RolloutRequest, RolloutResult, Sample, SessionCapture
    from workers.rollout.stops import LostStop


class RolloutActorClient(PartClient):
    """One rollout actor (see `RolloutActor` for what each method does)."""

    async def prepare(self) -> None:
        await invoke(self.target.prepare)

    async def run_many(self, reqs: list[RolloutRequest], partition: str) -> list[RolloutResult]:
        return await invoke(self.target.run_many, reqs, partition)

    async def stop_lost_sessions(self, session_ids: list[str]) -> list[LostStop]:
        return await invoke(self.target.stop_lost_sessions, session_ids)

    async def acr_stats(self) -> dict[str, int]:
        return await invoke(self.target.acr_stats)

    async def rollout_counts(self) -> dict[str, int]:
        return await invoke(self.target.rollout_counts)

    async def shutdown(self) -> list[str]:
        """The ACR sessions it still holds open after its stops."""
        return await invoke(self.target.shutdown)


class GatewaySessionsClient(PartClient):
    """GatewaySessions over the gateway: its Ray actor handle or a local GatewayServer."""

    async def open_session(self, session_id: str, max_context_tokens: int | None = None,
                           sampling: dict | None = None) -> str:
        return await invoke(self.target.open_session, session_id, max_context_tokens, sampling)

    async def close_session(self, session_id: str) -> SessionCapture:
        return await invoke(self.target.close_session, session_id)


class SampleStoreClient(PartClient):
    """SampleSink (and the recovery's read) over a store with `put(samples, partition)` and
    `sample_infos(partition)`."""

    async def put(self, samples: list[Sample], partition: str) -> None:
        await invoke(self.target.put, samples, partition)

    async def sample_infos(self, partition: str) -> list:
        return await invoke(self.target.sample_infos, partition)
