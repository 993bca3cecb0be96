"""The LoRA adapter sync (`model.lora` with `inference.lora_sync=adapter`): each `sync(v)` sends
only the adapter, as a PEFT directory, and every replica serves it as a vLLM LoRA adapter.

`AdapterWeightSync` is the file backend (`FileWeightSync`, workers/weight_sync/file.py) with two
changes: the trainer writes `adapter-v{v}/` (adapter_config.json + adapter_model.safetensors,
`TrainerWorker.export_adapter`) instead of a full safetensors file, and replicas load it with
`InferenceWorker.load_adapter(path, v)`, which pins every request to the adapter of the version
it started on (workers/inference/adapters.py). The rest (versions only increase, a failed replica
fails the push naming it, a dead one is marked lost, `admit` loads the current adapter into a
replacement) is the file backend's.

Invariant: the directories of the last `keep` versions stay on disk (a replica's vLLM may reload
an adapter evicted from its host cache while a request still uses it); older ones are removed
after a successful push. `open_adapter(dir, v)` serves a resumed run's adapter as version v on
every replica before the first push.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from workers.weight_sync.file import FileWeightSync
from workers.weight_sync.parts import WeightReceiverClient, WeightSenderClient
from workers.weight_sync.protocol import WeightSyncReport


class AdapterWeightSync(FileWeightSync):
    """Adapter-only pushes to replicas with LoRA; see the module docstring."""

    def __init__(self, replicas: Sequence[Any], *, initial_version: int = 0, trainer: Any = None,
                 weights_dir: Path | None = None, keep: int = 2) -> None:
        """keep: adapter directories kept on disk (>= 1; workers/weight_sync/lora.py
        `directories_kept` keeps every version a request may still use)."""
        super().__init__(replicas, initial_version=initial_version, trainer=trainer, weights_dir=weights_dir)
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self._keep = keep
        self._dirs: list[Path] = []

    async def open_adapter(self, directory: str) -> None:
        """Serve the adapter at `directory` as the current version on every replica (a resumed
        run's checkpointed adapter, before the loop starts). Raises what a replica raised."""
        await asyncio.gather(*(WeightReceiverClient(r).load_adapter(directory, self._version, initial=True)
                               for r in self._replicas))
        self._source = directory

    async def admit(self, index: int, replica: Any, *, loaded_version: int) -> None:
        """Replace replica `index` by `replica` (started on the base, labelled `loaded_version`): it
        first serves the current adapter, also when that is `loaded_version`'s own (a resumed
        run's checkpointed adapter); then as the file backend's `admit`."""
        if self._source is not None and self._version == loaded_version:
            await WeightReceiverClient(replica).load_adapter(self._source, self._version, initial=True)
        await super().admit(index, replica, loaded_version=loaded_version)

    async def sync(self, version: int) -> WeightSyncReport:
        """Export the trainer's adapter as `version` into `weights_dir/adapter-v{version}`, push it
        to every live replica, then remove directories older than the last `keep`. Raises
        RuntimeError without a trainer and weights_dir, and what `push` raises."""
        weights_dir = self._export_dir(version)
        path = str(await WeightSenderClient(self._trainer).export_adapter(str(weights_dir / f"adapter-v{version}")))
        report = await self.push(path, version)
        self._dirs.append(Path(path))
        while len(self._dirs) > self._keep:
            shutil.rmtree(self._dirs.pop(0), ignore_errors=True)
        return report

    async def _load(self, replica: Any, source: str, version: int) -> None:
        """Make one replica serve the adapter directory `source` as `version`."""
        await WeightReceiverClient(replica).load_adapter(source, version)
