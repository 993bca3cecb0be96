"""What a long run holds: trajectory-buffer rows and Ray object-store bytes, logged at every step.

A step probe (orchestrator/wiring/training.py wires it beside the CPU probe) returns
`buffer/rows_held` (TransferQueue rows over every partition, puts in flight included: rows a run
keeps after training on them are a leak), `buffer/partitions`, and `ray/object_store_bytes` (bytes
in the plasma stores of every live node, from each raylet's node stats). scripts/soak.py reads them
from metrics.jsonl beside the processes' RSS and file descriptors and fails a run whose figures grow
without bound.

Invariant: the probe never fails a step. A figure that cannot be read (the buffer's controller
busy past `READ_WAIT_S`, a Ray without the node-stats call) is left out of that step's record, and
the first such miss is logged once per figure.
Cost: one controller request per partition plus one gRPC per node, in a worker thread for the latter.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger(__name__)

READ_WAIT_S = 5.0  # bound on one step's buffer or object-store read (seconds)


class ResourceProbe:
    """`await probe()` -> {"buffer/rows_held", "buffer/partitions", "ray/object_store_bytes"} (counts,
    bytes). `buffer`: a started `TrajectoryBuffer` (its `partitions()` and `row_count(p)`)."""

    def __init__(self, buffer: Any) -> None:
        self._buffer = buffer
        self._warned: set[str] = set()

    async def __call__(self) -> dict[str, float]:
        out: dict[str, float] = {}
        try:
            async with asyncio.timeout(READ_WAIT_S):
                parts = await self._buffer.partitions()
                rows = [await self._buffer.row_count(p) for p in parts]
            out["buffer/rows_held"] = float(sum(rows))
            out["buffer/partitions"] = float(len(parts))
        except Exception as exc:  # noqa: BLE001 - a probe never fails a step
            self._warn_once("buffer", exc)
        try:
            async with asyncio.timeout(READ_WAIT_S):
                out["ray/object_store_bytes"] = float(await asyncio.to_thread(object_store_bytes))
        except Exception as exc:  # noqa: BLE001
            self._warn_once("object store", exc)
        return out

    def _warn_once(self, what: str, exc: BaseException) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning("resource probe: %s usage not read (%s: %s); left out of the metrics", what,
                        type(exc).__name__, exc)


def object_store_bytes() -> int:
    """Bytes held in the plasma object stores of every live Ray node (primary copies, spilled-back
    and pinned objects alike), summed. Needs `ray.init` first. Uses Ray's node-stats RPC
    (`ray._private.internal_api.node_stats`, the call behind `ray memory --stats-only`)."""
    import ray
    from ray._private.internal_api import node_stats

    total = 0
    for node in ray.nodes():
        if node.get("Alive"):
            reply = node_stats(node["NodeManagerAddress"], node["NodeManagerPort"], include_memory_info=False)
            total += int(reply.store_stats.object_store_bytes_used)
    return total
