"""The run's prompt source: an endless, seeded, resumable cycle over the task's dataset rows.

Invariant: `PromptCycle.from_state(rows, c.state())` draws exactly the rows `c` would draw next, and
a state taken on other rows is refused (the dataset's digest is part of the state).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class PromptCycleState:
    """PromptCycle's resumable state (JSON-safe). `order`: row indices left in this epoch (drawn
    from the end); `rng_state`: `random.Random.getstate()` as nested lists; `rows_digest`: sha256
    of the dataset rows, so a resume on different rows is refused."""

    epoch: int
    order: tuple[int, ...]
    rng_state: list
    num_rows: int
    rows_digest: str

    def to_json(self) -> dict:
        return {"epoch": self.epoch, "order": list(self.order), "rng_state": self.rng_state,
                "num_rows": self.num_rows, "rows_digest": self.rows_digest}

    @classmethod
    def from_json(cls, d: dict) -> "PromptCycleState":
        return cls(epoch=int(d["epoch"]), order=tuple(int(i) for i in d["order"]), rng_state=d["rng_state"],
                   num_rows=int(d["num_rows"]), rows_digest=str(d["rows_digest"]))


def rows_digest(rows: list[dict]) -> str:
    """sha256 over the rows' canonical JSON (keys sorted; non-JSON values by str())."""
    return hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()


class PromptCycle:
    """Endless prompt source over `rows`: reshuffled each epoch with a seeded RNG (reproducible).

    Invariant: `PromptCycle.from_state(rows, c.state())` draws exactly the rows `c` would draw next.
    """

    def __init__(self, rows: list[dict], seed: int) -> None:
        if not rows:
            raise ValueError("the task produced no dataset rows")
        self._rows = list(rows)
        self._rng = random.Random(seed)
        self._order: list[int] = []
        self.epoch = 0

    def state(self) -> PromptCycleState:
        """The cursor (epoch, indices left in this epoch) and RNG state, JSON-safe."""
        version, internal, gauss = self._rng.getstate()
        return PromptCycleState(self.epoch, tuple(self._order), [version, list(internal), gauss],
                                len(self._rows), rows_digest(self._rows))

    @classmethod
    def from_state(cls, rows: list[dict], state: PromptCycleState) -> "PromptCycle":
        """A cycle over `rows` that continues where `state` was taken.

        Raises ValueError when `rows` are not the rows the state was taken on, or the state is corrupt.
        """
        if len(rows) != state.num_rows or rows_digest(list(rows)) != state.rows_digest:
            raise ValueError(
                f"prompt state was saved for {state.num_rows} rows (digest {state.rows_digest[:12]}), "
                f"got {len(rows)} different rows: the dataset changed since the checkpoint"
            )
        if any(not 0 <= i < len(rows) for i in state.order):
            raise ValueError(f"prompt state holds row indices outside [0, {len(rows)})")
        cycle = cls(rows, seed=0)
        version, internal, gauss = state.rng_state
        cycle._rng.setstate((int(version), tuple(int(x) for x in internal), gauss))
        cycle._order = list(state.order)
        cycle.epoch = state.epoch
        return cycle

    def on_group_rewards(self, input_id: str, rewards: list[float]) -> None:
        """Uniform cycling ignores feedback (the difficulty sampler's hook, orchestrator/loop/sampler.py)."""

    def take_metrics(self) -> dict[str, float]:
        """No `sampler/*` metrics: every prompt of an epoch is drawn exactly once."""
        return {}

    def next_rows(self, num: int) -> list[dict]:
        out = []
        while len(out) < num:
            if not self._order:
                self._order = list(range(len(self._rows)))
                self._rng.shuffle(self._order)
                self.epoch += 1
            out.append(self._rows[self._order.pop()])
        return out
