"""An inference replica as the driver calls it: `ReplicaClient`, the one typed adapter over an
`InferenceWorker` or a Ray actor handle of one.

The weight sync's side of a replica (`update_weights`, `load_adapter`, the broadcast group,
`prompt_logprobs`) is `workers.weight_sync.parts.WeightReceiverClient`, which this extends with
what the driver asks of a replica: start it, read its policy version and scheduler load, put it
to sleep and wake it (colocated training), shut it down. The gateway's generate path has its own
adapter (workers/gateway/server.py `as_engine`: a cancelled turn cancels the actor task).
Callers: orchestrator/control/supervise.py, orchestrator/adapters/ (colocate, engine loads),
orchestrator/wiring/, orchestrator/main.py. Every call but `shutdown` (which has its own wait) is
bounded (workers/core/bounds.py: readiness, pause/resume, status reads) and raises `PartTimeout`
naming the replica past its bound.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from workers.core import bounds
from workers.core.calls import invoke
from workers.weight_sync.parts import WeightReceiverClient

if TYPE_CHECKING:
    from workers.core.types import EngineLoad
    from workers.inference.settings import EngineInfo, SleepReport


class ReplicaClient(WeightReceiverClient):
    """One inference replica (`InferenceWorker`'s methods; see workers/inference/worker.py)."""

    async def start(self) -> EngineInfo:
        """Build the engine (model load, KV cache); once per replica."""
        return await self.call_within(bounds.ENGINE_START_S, self.target.start)

    async def policy_version(self) -> int:
        """The version of the weights it serves now (also the supervisor's health check)."""
        return await self.call_within(bounds.STATUS_S, self.target.policy_version)

    async def kv_cache_usage(self) -> float:
        """Time-averaged KV-cache usage (0..1) since the last call."""
        return await self.call_within(bounds.STATUS_S, self.target.kv_cache_usage)

    async def engine_load(self) -> EngineLoad:
        """vLLM's scheduler stats at its last step (`rollout.concurrency=adaptive`)."""
        return await self.call_within(bounds.STATUS_S, self.target.engine_load)

    async def sleep(self) -> SleepReport:
        return await self.call_within(bounds.PAUSE_RESUME_S, self.target.sleep)

    async def wake_up(self) -> SleepReport:
        return await self.call_within(bounds.PAUSE_RESUME_S, self.target.wake_up)

    async def shutdown(self, timeout_s: float | None = None) -> None:
        """Stop the engine (waits up to `timeout_s` for requests in flight; None: the worker's own)."""
        if timeout_s is None:
            await invoke(self.target.shutdown)
        else:
            await invoke(self.target.shutdown, timeout_s)
