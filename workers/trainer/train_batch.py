"""A rank's padded train batch: from its rows (read from the trajectory buffer) and its train order.

`order_batch` is what `TrainerShell.update` (workers/trainer/shell.py) trains on: the rows of its
shard of a `TrainOrder` (workers/core/types.py), each row carrying its sample's GRPO advantage
computed over every sample of the order (its groups are whole: workers/trainer/order.py), plus the
order's padding rows. `build_train_batch` is the same over whole `Sample`s (tests, tools).

Invariants: the batch holds exactly the rows asked, in order, each with its sample's advantage
(`grpo_outcome_advantages` over the order's rewards and groups); a loss-masked sample (its session
in `order.masked`) has no row and counts in its group's statistics only; padding rows carry one
attended token and no trained one, in a group of their own with reward 0 (so they add nothing to the
loss, its normaliser, the gradient or any statistic: workers/trainer/order.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from workers.core.algorithms.advantages import grpo_outcome_advantages
from workers.core.algorithms.batch import SampleTable, TrainBatch
from workers.core.types import OrderData, OrderSample, Sample, TrainOrder, TrajectoryRow


def order_batch(order: TrainOrder, rows: Sequence[TrajectoryRow], data: OrderData) -> TrainBatch:
    """[rows + pad_rows, seq] tensors of `rows` (one per key of `order.samples`, in order) and the
    order's padding rows, with the run's pad id and advantage setting (`data`). Raises ValueError when a row's length or trained tokens contradict the
    order (the buffer returned another row than the one listed), or when a masked sample has rows."""
    keys = [(i, k) for i, s in enumerate(order.samples) for k in range(len(s.row_keys))]
    if len(keys) != len(rows):
        raise ValueError(f"order lists {len(keys)} rows, got {len(rows)}")
    masked = set(order.masked)
    for (i, k), row in zip(keys, rows):
        s = order.samples[i]
        if s.session_id in masked:
            raise ValueError(f"masked sample {s.session_id} has rows in its order: a masked sample trains nothing")
        if len(row.token_ids) != s.row_lens[k] or row.num_generated == 0:
            raise ValueError(f"row {s.row_keys[k]}: {len(row.token_ids)} tokens ({row.num_generated} generated), "
                             f"the order says {s.row_lens[k]} with a generated token")
    rewards = torch.tensor([float(s.reward) for s in order.samples], dtype=torch.float32)
    group_ids = [s.group_id for s in order.samples]
    adv = grpo_outcome_advantages(rewards, group_ids, norm_adv_by_std=data.norm_adv_by_std).tolist()
    row_adv = [adv[i] for i, _ in keys]
    row_sample = [i for i, _ in keys]
    all_rows = list(rows)
    if order.pad_rows:
        first = rows[0].token_ids[0] if rows else data.pad_id
        all_rows += [TrajectoryRow((first,), (0,), (0.0,), (-1,))] * order.pad_rows
        row_adv += [0.0] * order.pad_rows
        row_sample += [len(order.samples)] * order.pad_rows  # one extra sample in a fresh group
        group_ids = [*group_ids, max(group_ids, default=-1) + 1]
        rewards = torch.cat([rewards, torch.zeros(1)])
    table = SampleTable(group_index=torch.tensor(group_ids, dtype=torch.long), rewards=rewards,
                        row_sample=torch.tensor(row_sample, dtype=torch.long), norm_adv_by_std=data.norm_adv_by_std)
    return TrainBatch.from_rows(all_rows, row_adv, pad_id=data.pad_id, samples=table)


def sample_order(samples: Sequence[Sample], *, masked: Sequence[str] = (),
                 partition: str = "") -> tuple[TrainOrder, list[TrajectoryRow]]:
    """The train order of whole `samples` (every sample of their groups) and the rows it reads: the
    rows with a generated token of each sample not in `masked`."""
    masked_set = set(masked)
    order_samples, rows = [], []
    for s in samples:
        info = s.info()
        read = [] if s.session_id in masked_set else [j for j, n in enumerate(info.row_generated) if n > 0]
        order_samples.append(OrderSample(s.session_id, s.group_id, float(s.reward),  # type: ignore[arg-type]
                                         tuple(info.row_keys[j] for j in read), tuple(info.row_lens[j] for j in read)))
        rows += [s.rows[j] for j in read]
    sessions = {s.session_id for s in samples}
    order = TrainOrder(partition, tuple(order_samples), tuple(m for m in masked if m in sessions))
    return order, rows


def build_train_batch(samples: Sequence[Sample], *, pad_id: int, norm_adv_by_std: bool,
                      masked: Sequence[str] = ()) -> TrainBatch:
    """Rows of every sample in `samples` (all samples of their groups, group by group), each with its
    sample's GRPO advantage ([rows, seq] tensors); the samples in `masked` (session ids) count in
    their groups' statistics with no row. The batch carries a SampleTable (group and reward of every
    sample, row -> sample) so the trainer can recompute group advantages when rejection masks
    exclude a sample (algorithms/rejection.py)."""
    order, rows = sample_order(samples, masked=masked)
    return order_batch(order, rows, OrderData(pad_id=pad_id, norm_adv_by_std=norm_adv_by_std))
