"""A trainer rank's reader of its own rows: the rows of its shard of a train order, straight from
the trajectory buffer (TransferQueue), so no token passes through the driver.

The rank connects its own TransferQueue client (`TrajectoryBuffer.connect`) on the first order,
with the picklable `BufferHandle` it was given once at start (`open`, from the rank's `open_data`),
and keeps it (and a private event loop: a trainer rank's methods are synchronous) for the run. Invariant: each call reads exactly the keys of the order, once;
`rows_read` counts them (the rank's `trainer/rows_read` metric, summed over ranks by
workers/trainer/order.py `merge_rank_metrics`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from workers.core.types import TrainOrder, TrajectoryRow


class RowReader:
    """Reads a rank's rows from the trajectory buffer it was opened on."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._buffer: Any = None
        self._handle: Any = None
        self.rows_read = 0

    def open(self, handle: Any) -> None:
        """Read from the buffer named by `handle` (a `BufferHandle`; None: none) from now on; a client
        connected to another buffer is closed."""
        if handle != self._handle:
            self.close()
        self._handle = handle

    def read(self, order: TrainOrder) -> list[TrajectoryRow]:
        """The rows of `order` (one per key of its samples, in order). Raises ValueError when the
        rank was given no buffer but the order has rows to read; the buffer's errors (a missing key)
        propagate."""
        keys = [k for s in order.samples for k in s.row_keys]
        if not keys:
            return []
        if self._handle is None:
            raise ValueError(f"train order of {order.partition!r} lists {len(keys)} rows but this rank has no "
                             "buffer: call open_data with the trajectory buffer's handle first")
        buffer = self._connect()
        rows = self._loop.run_until_complete(buffer.read_rows(order.partition, keys))  # type: ignore[union-attr]
        self.rows_read += len(rows)
        return rows

    def _connect(self) -> Any:
        if self._buffer is None:
            from workers.buffer.store import TrajectoryBuffer

            self._loop = asyncio.new_event_loop()
            self._buffer = TrajectoryBuffer.connect(self._handle)
        return self._buffer

    def close(self) -> None:
        """Release the client and the loop (the buffer's actors keep running)."""
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None
        if self._loop is not None:
            self._loop.close()
            self._loop = None
