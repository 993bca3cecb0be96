"""Split one mini-batch across data-parallel trainer ranks, and merge the ranks' metrics.

Pure torch, no Ray. `shard_batch` is what `TrainerGroup.update` (workers/trainer/group.py)
sends to each rank; `merge_rank_metrics` is what it returns.

Invariants of `shard_batch(batch, world_size, ...)`:
- Every row of `batch` goes to exactly one rank, unchanged (tensors, advantage, rollout log-probs).
- Whole groups: when the batch has at least `world_size` groups, all rows of a group go to the same
  rank, so rejection (workers/core/algorithms/rejection.py) recomputes a group's advantages from all
  of its samples on one rank, exactly as one rank would on the whole batch. Groups are assigned
  longest-processing-time first by real token count (attention tokens), which balances the ranks'
  forward cost. With fewer groups than ranks, groups are split by sample (then by row) so that no
  rank is idle; each rank's SampleTable then still holds every sample of each group it touches
  (those without a row here stay in the group statistics, as rejection.py specifies), which is
  exact unless a rejection rule excludes a sample of a split group.
- Each shard carries its own consistent SampleTable (samples re-indexed, rows of a sample
  consecutive, in the batch's order).
- Equal micro-batch counts are possible: TrainerWorker runs on every rank as many micro-batches as
  the rank with the most (`split_to_count`) and raises when a rank has fewer rows than that. A shard
  with too few rows is padded with rows that carry no trained token (attention on one token, loss
  mask 0); they add nothing to the loss, its normaliser, the gradient or any `rollout_corr/*`
  statistic (all are taken over loss-mask tokens and rows that have one), and their sample sits in
  a group of its own, which rejection never touches.

Raises ValueError when the batch has fewer rows with a trained token than ranks (a rank without a
trained token cannot take part in the update).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from workers.core.algorithms.batch import SampleTable, TrainBatch
from workers.trainer.scale import plan_micro_batches

# metrics every rank computes globally (all-reduced or identical): rank 0's value is the group's
GLOBAL_METRICS = ("actor/pg_loss", "actor/grad_norm", "actor/num_tokens", "actor/lr", "actor/step_skipped")
SUMMED_METRICS = ("rollout_corr/rs_recomputed_groups",)


def _units(batch: TrainBatch, world_size: int) -> list[list[int]]:
    """Row indices of the units that are assigned whole: groups, else samples, else rows."""
    table = batch.samples
    trained = batch.loss_mask.sum(dim=-1) > 0
    if table is None:
        return [[i] for i in range(batch.batch_size)]
    row_sample = table.row_sample.tolist()
    group_of_row = [int(table.group_index[s]) for s in row_sample]
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(group_of_row):
        groups.setdefault(g, []).append(i)
    units = list(groups.values())
    if sum(any(bool(trained[i]) for i in u) for u in units) >= world_size:
        return units
    samples: dict[int, list[int]] = {}
    for i, s in enumerate(row_sample):
        samples.setdefault(s, []).append(i)
    units = list(samples.values())
    if sum(any(bool(trained[i]) for i in u) for u in units) >= world_size:
        return units
    return [[i] for i in range(batch.batch_size)]


def assign_rows(batch: TrainBatch, world_size: int) -> list[list[int]]:
    """Row indices (ascending) of each rank's shard: whole groups when there are at least
    `world_size` of them (see the module docstring), balanced by real token count (greedy, largest
    unit first, to the rank with the fewest tokens so far; ties: fewest rows, then lowest rank).
    Every rank gets at least one row with a trained token.

    Raises ValueError when world_size < 1 or fewer rows than ranks hold a trained token.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    trained = (batch.loss_mask.sum(dim=-1) > 0).tolist()
    if sum(trained) < world_size:
        raise ValueError(f"the mini-batch has {sum(trained)} rows with a trained token, fewer than the "
                         f"{world_size} trainer ranks: every rank needs at least one")
    lengths = batch.attention_mask.sum(dim=-1).tolist()
    units = _units(batch, world_size)
    # units with a trained token first (so every rank gets one), each class largest first
    order = sorted(range(len(units)), key=lambda u: (not any(trained[i] for i in units[u]),
                                                     -sum(lengths[i] for i in units[u])))
    tokens, rows = [0] * world_size, [0] * world_size
    out: list[list[int]] = [[] for _ in range(world_size)]
    has_trained = [False] * world_size
    for u in order:
        unit_trained = any(trained[i] for i in units[u])
        idle = [r for r in range(world_size) if not has_trained[r]]
        pool = idle if unit_trained and idle else range(world_size)
        r = min(pool, key=lambda k: (tokens[k], rows[k], k))
        out[r].extend(units[u])
        tokens[r] += sum(lengths[i] for i in units[u])
        rows[r] += len(units[u])
        has_trained[r] = has_trained[r] or unit_trained
    return [sorted(rs) for rs in out]


def _sub_table(table: SampleTable, rows: list[int], pad_rows: int) -> SampleTable:
    """The SampleTable of `rows` (+ `pad_rows` padding rows): every sample of each group those rows
    touch, re-indexed in table order; padding rows belong to one extra sample in a fresh group."""
    row_sample = table.row_sample[rows]
    groups = torch.unique(table.group_index[row_sample])
    keep = torch.isin(table.group_index, groups).nonzero(as_tuple=True)[0]  # ascending sample indices
    new_index = torch.full((table.num_samples,), -1, dtype=torch.long)
    new_index[keep] = torch.arange(keep.numel())
    group_index, rewards = table.group_index[keep], table.rewards[keep]
    new_rows = new_index[row_sample]
    if pad_rows:
        fresh = int(table.group_index.max()) + 1 if table.num_samples else 0
        group_index = torch.cat([group_index, torch.tensor([fresh], dtype=torch.long)])
        rewards = torch.cat([rewards, torch.zeros(1, dtype=rewards.dtype)])
        new_rows = torch.cat([new_rows, torch.full((pad_rows,), keep.numel(), dtype=torch.long)])
    return SampleTable(group_index=group_index, rewards=rewards, row_sample=new_rows,
                       norm_adv_by_std=table.norm_adv_by_std)


def _with_padding(batch: TrainBatch, rows: list[int], pad_rows: int, table: SampleTable | None) -> TrainBatch:
    idx = torch.tensor(rows, dtype=torch.long)
    parts = {f: getattr(batch, f)[idx] for f in ("input_ids", "attention_mask", "loss_mask", "rollout_logprobs",
                                                  "advantages")}
    if pad_rows:
        t = batch.seq_len
        pad_ids = torch.full((pad_rows, t), int(batch.input_ids[rows[0], 0]), dtype=torch.long)
        attn = torch.zeros((pad_rows, t), dtype=batch.attention_mask.dtype)
        attn[:, 0] = 1  # one real token: a cheap, well-defined forward, nothing to train
        zeros = torch.zeros((pad_rows, t), dtype=batch.loss_mask.dtype)
        parts = {"input_ids": torch.cat([parts["input_ids"], pad_ids]),
                 "attention_mask": torch.cat([parts["attention_mask"], attn]),
                 "loss_mask": torch.cat([parts["loss_mask"], zeros]),
                 "rollout_logprobs": torch.cat([parts["rollout_logprobs"], zeros.to(batch.rollout_logprobs.dtype)]),
                 "advantages": torch.cat([parts["advantages"], zeros.to(batch.advantages.dtype)])}
    return TrainBatch(**parts, samples=table)


def shard_batch(batch: TrainBatch, world_size: int, *, micro_batch_size: int,
                max_tokens_per_micro_batch: int | None = None) -> list[TrainBatch]:
    """One TrainBatch per rank (see the module docstring for the invariants).

    micro_batch_size / max_tokens_per_micro_batch: the trainer's (TrainerSettings), used to count
    each shard's micro-batches exactly as TrainerWorker.micro_batches does; a shard with fewer rows
    than the largest count gets padding rows. world_size 1 returns `[batch]` unchanged.

    Raises ValueError as `assign_rows`.
    """
    if world_size == 1:
        return [batch]
    assignment = assign_rows(batch, world_size)
    lengths = batch.attention_mask.sum(dim=-1).tolist()
    counts = [len(plan_micro_batches([lengths[i] for i in rows], micro_batch_size=micro_batch_size,
                                     max_tokens=max_tokens_per_micro_batch)) for rows in assignment]
    target = max(counts)
    shards = []
    for rows in assignment:
        pad_rows = max(0, target - len(rows))
        table = None if batch.samples is None else _sub_table(batch.samples, rows, pad_rows)
        shards.append(_with_padding(batch, rows, pad_rows, table))
    return shards


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
