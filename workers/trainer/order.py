"""Split one train order across data-parallel trainer ranks, on metadata alone (no torch, no Ray),
and merge the ranks' metrics (`merge_rank_metrics`, what `TrainerGroup.update` returns).

`TrainerGroup.update` (workers/trainer/group.py) sends each rank its shard of a `TrainOrder`
(workers/core/types.py); each rank then reads its own rows from the trajectory buffer
(workers/trainer/rows.py) and builds its own padded batch (workers/trainer/train_batch.py). The
driver never holds a token: the order carries each row's key and token count, which is all the
split needs.

Invariants of `shard_order(order, world_size, ...)`:
- Every row key of `order` is in exactly one shard (read once, by one rank), in its sample's order.
- Whole groups: when the order has at least `world_size` groups with a row, all rows of a group go
  to the same rank, so rejection (workers/core/algorithms/rejection.py) recomputes a group's
  advantages from all of its samples on one rank, exactly as one rank would on the whole order.
  Groups are assigned longest-processing-time first by token count. With fewer groups than ranks,
  groups are split by sample (then by row) so that no rank is idle; a shard then still lists every
  sample of each group it touches (those whose rows another rank reads with no key: they count in
  the group statistics only).
- Each shard lists the samples of the groups it touches in the order's order, its `masked` the
  masked ones among them, and `pad_rows` so that every rank runs as many micro-batches
  (`plan_micro_batches` counted exactly as TrainerWorker counts them).

Raises ValueError when the order has fewer rows than ranks (a rank without a trained token cannot
take part in the update).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from workers.core.types import TrainOrder

# metrics every rank computes globally (all-reduced or identical): rank 0's value is the group's
GLOBAL_METRICS = ("actor/pg_loss", "actor/grad_norm", "actor/num_tokens", "actor/lr", "actor/step_skipped")
# counts of each rank's own rows: the group's is the sum
SUMMED_METRICS = ("rollout_corr/rs_recomputed_groups", "perf/total_num_tokens", "trainer/rows_read")


def plan_micro_batches(lengths: Sequence[int], *, micro_batch_size: int, max_tokens: int | None) -> list[list[int]]:
    """Row indices of each micro-batch.

    lengths: real (unpadded) token count of each row. max_tokens None: consecutive chunks of
    `micro_batch_size` rows. Otherwise rows are sorted longest first (stable) and packed greedily:
    a micro-batch takes the next rows while (rows + 1) x its longest row <= max_tokens;
    `micro_batch_size` is then ignored (the budget decides, as verl's use_dynamic_bsz).

    Raises ValueError when micro_batch_size < 1, max_tokens < 1, or there is no row.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if not lengths:
        raise ValueError("plan_micro_batches got no rows")
    n = len(lengths)
    if max_tokens is None:
        return [list(range(s, min(s + micro_batch_size, n))) for s in range(0, n, micro_batch_size)]
    if max_tokens < 1:
        raise ValueError(f"trainer.max_tokens_per_micro_batch must be >= 1, got {max_tokens}")
    order = sorted(range(n), key=lambda i: -int(lengths[i]))
    plan: list[list[int]] = []
    for i in order:
        if plan and (len(plan[-1]) + 1) * int(lengths[plan[-1][0]]) <= max_tokens:
            plan[-1].append(i)
        else:
            plan.append([i])
    return plan


@dataclasses.dataclass(frozen=True)
class _Row:
    sample: int  # index into order.samples
    key: int  # index into that sample's row_keys
    length: int


def _rows(order: TrainOrder) -> list[_Row]:
    return [_Row(i, j, n) for i, s in enumerate(order.samples) for j, n in enumerate(s.row_lens)]


def _units(order: TrainOrder, rows: list[_Row], world_size: int) -> list[list[int]]:
    """Indices into `rows` of the units assigned whole: groups, else samples, else rows."""
    for unit_of in (lambda r: order.samples[r.sample].group_id, lambda r: r.sample):
        units: dict[int, list[int]] = {}
        for i, r in enumerate(rows):
            units.setdefault(unit_of(r), []).append(i)
        if len(units) >= world_size:
            return list(units.values())
    return [[i] for i in range(len(rows))]


def assign(order: TrainOrder, world_size: int) -> list[list[tuple[int, int]]]:
    """(sample index, key index) of each rank's rows, in order: whole units (see the module
    docstring), balanced by token count (greedy, largest unit first, to the rank with the fewest
    tokens so far; ties: fewest rows, then lowest rank). Raises ValueError as `shard_order`."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    rows = _rows(order)
    if len(rows) < world_size:
        raise ValueError(f"the mini-batch has {len(rows)} rows with a trained token, fewer than the "
                         f"{world_size} trainer ranks: every rank needs at least one")
    units = _units(order, rows, world_size)
    tokens, counts = [0] * world_size, [0] * world_size
    out: list[list[int]] = [[] for _ in range(world_size)]
    for u in sorted(units, key=lambda u: -sum(rows[i].length for i in u)):
        r = min(range(world_size), key=lambda k: (tokens[k], counts[k], k))
        out[r].extend(u)
        tokens[r] += sum(rows[i].length for i in u)
        counts[r] += len(u)
    return [[(rows[i].sample, rows[i].key) for i in sorted(rs)] for rs in out]


def _shard(order: TrainOrder, mine: list[tuple[int, int]], pad_rows: int) -> TrainOrder:
    keys: dict[int, list[int]] = {}
    for s, k in mine:
        keys.setdefault(s, []).append(k)
    groups = {order.samples[s].group_id for s in keys}
    samples = tuple(dataclasses.replace(s, row_keys=tuple(s.row_keys[k] for k in keys.get(i, ())),
                                        row_lens=tuple(s.row_lens[k] for k in keys.get(i, ())))
                    for i, s in enumerate(order.samples) if s.group_id in groups)
    sessions = {s.session_id for s in samples}
    return dataclasses.replace(order, samples=samples, masked=tuple(m for m in order.masked if m in sessions),
                               pad_rows=pad_rows)


def shard_order(order: TrainOrder, world_size: int, *, micro_batch_size: int,
                max_tokens_per_micro_batch: int | None = None) -> list[TrainOrder]:
    """One TrainOrder per rank (see the module docstring for the invariants).

    micro_batch_size / max_tokens_per_micro_batch: the trainer's (TrainerSettings), to count each
    shard's micro-batches as TrainerWorker.micro_batches does; a shard with fewer rows than the
    largest count gets `pad_rows`. world_size 1 returns `[order]` unchanged.
    """
    if world_size == 1:
        return [order]
    mine = assign(order, world_size)
    lengths = [[order.samples[s].row_lens[k] for s, k in rows] for rows in mine]
    target = max(len(plan_micro_batches(ls, micro_batch_size=micro_batch_size, max_tokens=max_tokens_per_micro_batch))
                 for ls in lengths)
    return [_shard(order, rows, max(0, target - len(rows))) for rows in mine]


def merge_rank_metrics(per_rank: Sequence[dict[str, float]], weights: Sequence[float]) -> dict[str, float]:
    """One metrics dict for the group from each rank's `TrainerWorker.update` metrics.

    `GLOBAL_METRICS` are already global on every rank (rank 0's value is taken); names ending in
    `_max` / `_min` (or containing `_max_` / `_min_`, e.g. `seq_max_deviation`) take the max / min
    over ranks; `SUMMED_METRICS` (counts) are summed; every other metric is a per-rank mean and is
    averaged with `weights` (the ranks' trained-token counts): exact for token means, a
    token-weighted approximation for per-sequence statistics.

    Raises ValueError when the lists differ in length or are empty.
    """
    if not per_rank or len(per_rank) != len(weights):
        raise ValueError(f"got metrics of {len(per_rank)} ranks and {len(weights)} weights")
    out: dict[str, float] = {}
    for name in dict.fromkeys(k for m in per_rank for k in m):
        pairs = [(m[name], w) for m, w in zip(per_rank, weights) if name in m]
        values = [v for v, _ in pairs]
        if name in GLOBAL_METRICS:
            out[name] = float(per_rank[0].get(name, values[0]))
        elif name in SUMMED_METRICS:
            out[name] = float(sum(values))
        elif name.endswith("_max") or "_max_" in name:
            out[name] = float(max(values))
        elif name.endswith("_min") or "_min_" in name:
            out[name] = float(min(values))
        else:
            w = sum(wt for _, wt in pairs)
            out[name] = float(sum(v * wt for v, wt in pairs) / w) if w > 0 else float(sum(values) / len(values))
    return out
