"""The trainer and the inference replicas as the weight sync calls them: one typed adapter each.

`WeightSenderClient` is the trainer side (a rank, a `TrainerGroup` or an actor handle of a rank:
`export_weights` / `export_adapter` for the file backends, `open_weight_group` /
`broadcast_weights` / `close` for the broadcast, `probe_logprobs` for the post-sync probe).
`WeightReceiverClient` is a replica's side (`update_weights` / `load_adapter`, `join_weight_group`
/ `receive_weights`, `prompt_logprobs`). Each method awaits the part's method of that name, on a
local object or through `.remote` on an actor (workers/core/calls.py), so tests hand the sync plain
objects and the run hands it actor handles. Every call is bounded by `bounds.WEIGHT_SYNC_S` and raises
`PartTimeout` naming the part past it (workers/core/bounds.py). The driver holds the trainer as a
`TrainerGroup` (workers/trainer/group.py), whose methods are coroutines; the replica's adapter
for the driver (workers/inference/client.py) extends `WeightReceiverClient`; the weight sync
imports neither package (both import it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from workers.core import bounds
from workers.core.calls import PartClient

if TYPE_CHECKING:
    from workers.weight_sync.transport import WeightGroupInfo


class WeightSenderClient(PartClient):
    """The trainer (rank 0, or a TrainerGroup) as the weight sync sees it."""

    async def export_weights(self, path: str) -> str:
        """The full weights as one safetensors file at `path`; returns the path written."""
        return await self.call_within(bounds.WEIGHT_SYNC_S, self.target.export_weights, path)

    async def export_adapter(self, directory: str) -> str:
        """The LoRA adapter as a PEFT directory; returns the directory written."""
        return await self.call_within(bounds.WEIGHT_SYNC_S, self.target.export_adapter, directory)

    async def probe_logprobs(self, token_ids: list[int]) -> list[float]:
        """The trainer's log-probs of the probe's tokens (workers/weight_sync/probe.py)."""
        return await self.call_within(bounds.WEIGHT_SYNC_S, self.target.probe_logprobs, token_ids)

    async def open_weight_group(self, info: WeightGroupInfo) -> None:
        await self.call_within(bounds.WEIGHT_SYNC_S, self.target.open_weight_group, info)

    async def broadcast_weights(self, version: int) -> Any:
        """Send the current weights as `version`; rank 0's `broadcast.SendReport` (None elsewhere)."""
        return await self.call_within(bounds.WEIGHT_SYNC_S, self.target.broadcast_weights, version)

    async def close(self) -> None:
        """Release the weight-sync group (and the rank's process group)."""
        await self.call_within(bounds.WEIGHT_SYNC_S, self.target.close)


class WeightReceiverClient(PartClient):
    """An inference replica (InferenceWorker, a test receiver, or an actor handle of one) as the
    weight sync sees it."""

    async def update_weights(self, path: str, version: int) -> None:
        """Load the safetensors file at `path` as policy version `version`."""
        await self.call_within(bounds.WEIGHT_SYNC_S, self.target.update_weights, path, version)

    async def load_adapter(self, path: str, version: int, *, initial: bool = False) -> None:
        """Serve the LoRA adapter directory `path` as policy version `version`."""
        await self.call_within(bounds.WEIGHT_SYNC_S, self.target.load_adapter, path, version, initial=initial)

    async def join_weight_group(self, info: WeightGroupInfo, rank: int) -> Any:
        return await self.call_within(bounds.WEIGHT_SYNC_S, self.target.join_weight_group, info, rank)

    async def receive_weights(self, version: int) -> Any:
        return await self.call_within(bounds.WEIGHT_SYNC_S, self.target.receive_weights, version)

    async def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """The engine's log-probs of `token_ids` (the probe)."""
        return await self.call_within(bounds.WEIGHT_SYNC_S, self.target.prompt_logprobs, token_ids)
