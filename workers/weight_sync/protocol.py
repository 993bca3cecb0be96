"""The one weight-sync protocol: what the loops, the wiring and the supervisor call, any backend.

`WeightSync` owns the policy version: `version()` is the version every live replica confirmed
last, and it changes only inside `sync(v)`, which exports the trainer's weights as `v` and pushes
them (backends: file.py, adapter.py, broadcast.py; probe.py wraps any of them). The loops read the
version from it (orchestrator/loop/common.py `sync_weights`), nothing else holds it.
`lost()` names the replicas found dead since, `metrics()` the backend's per-step figures.
The file backends can also take a replacement replica (`ReplaceableWeightSync.admit`): the
broadcast group cannot, so that method is typed apart rather than probed for.

Invariant: `version()` never decreases; `sync(v)` with v <= version() raises ValueError and a
failed sync leaves `version()` unchanged. No torch, Ray or HTTP import: the loops import this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class WeightSyncReport:
    """One completed push: the version now served by all live replicas and how long it took (s)."""

    version: int
    num_replicas: int
    elapsed_s: float


@runtime_checkable
class WeightSync(Protocol):
    """Trainer -> replicas, versioned; see the module docstring."""

    def version(self) -> int:
        """The version every live replica confirmed last (the initial version before any sync)."""
        ...

    async def sync(self, version: int) -> WeightSyncReport:
        """Export the trainer's weights as `version` and make every live replica serve them."""
        ...

    def lost(self) -> frozenset[int]:
        """Indices of replicas found dead and not replaced (empty for a backend that cannot lose one)."""
        ...

    async def metrics(self) -> dict[str, float]:
        """The backend's figures of the last sync, as step metrics (may be empty)."""
        ...


@runtime_checkable
class ReplaceableWeightSync(WeightSync, Protocol):
    """A weight sync whose replicas can be replaced while the run goes on (the file backends)."""

    async def admit(self, index: int, replica: Any, *, loaded_version: int) -> None:
        """Put `replica` (started on the weights of `loaded_version`) in slot `index`, loading the
        current version into it first when that is newer."""
        ...
