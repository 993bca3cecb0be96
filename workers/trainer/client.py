"""The trainer as the driver calls it outside the training step: `TrainerRankClient`, the one
typed adapter over a trainer rank, a `TrainerGroup` or a Ray actor handle of a rank.

It extends the weight sync's side of the trainer (workers/weight_sync/parts.py
`WeightSenderClient`: export, broadcast group, probe) with the checkpoint calls. The training
step itself goes through the loop's trainer client (orchestrator/adapters/clients.py).
Callers: orchestrator/control/run_checkpoint.py, orchestrator/build/training.py.
"""

from __future__ import annotations

from workers.core.calls import invoke
from workers.weight_sync.parts import WeightSenderClient


class TrainerRankClient(WeightSenderClient):
    """One trainer (see workers/trainer/protocol.py `Trainer` for each method's contract)."""

    async def save_hf(self, directory: str) -> str:
        """An HF model directory `from_pretrained` loads; returns the directory."""
        return await invoke(self.target.save_hf, directory)

    async def save_optimizer(self, path: str) -> str:
        return await invoke(self.target.save_optimizer, path)

    async def load_optimizer(self, path: str) -> None:
        await invoke(self.target.load_optimizer, path)
