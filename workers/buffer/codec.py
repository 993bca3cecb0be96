"""Layout of samples in the trajectory buffer: pure encode/decode between `Sample` and TQ rows.

No torch, Ray or TransferQueue here: `workers.buffer.store` turns `StoredRow` columns into tensors and
talks to TQ. The layout (one TQ row per trajectory row, key `{session_id}/{row_index}`, sample
scalars repeated as tags on each row, a placeholder row `{session_id}/empty` for a sample without
rows) is described in `workers.buffer.store`'s docstring.

Invariant: `decode_samples(encode_sample(s) for s in samples)` equals `samples` sorted by
(group_id, sample_index, session_id), for any order of the rows; `complete_sessions` admits a
session only when its tagged rows are exactly 0..num_rows-1 (or the one placeholder), and raises
`BufferCorruptError` on rows that contradict their sample.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from workers.core.types import RolloutStatus, Sample, SampleInfo, TrajectoryRow, row_key

FIELDS: tuple[str, ...] = ("token_ids", "loss_mask", "rollout_logprobs", "versions")
EMPTY_ROW_INDEX = -1  # row_index tag of the placeholder row that stands for a sample without rows
ROW_TAGS = ("row_index", "seq_len", "row_generated")  # tags of one row; the others are its sample's


class BufferCorruptError(RuntimeError):
    """Rows in the buffer contradict each other (e.g. one session put twice with different rows)."""


@dataclass(frozen=True)
class StoredRow:
    """One TQ row as the codec sees it: its key, its tags, and its four per-token columns."""

    key: str
    tags: dict[str, Any]
    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    rollout_logprobs: tuple[float, ...]
    versions: tuple[int, ...]


def sample_tags(sample: Sample) -> dict[str, Any]:
    """The sample-level tags repeated on each of its TQ rows (layout: `workers.buffer.store` docstring)."""
    vr = sample.version_range()
    return {
        "session_id": sample.session_id,
        "group_id": sample.group_id,
        "input_id": sample.input_id,
        "sample_index": sample.sample_index,
        "reward": sample.reward,
        "status": sample.status,
        "latency_s": sample.latency_s,
        "error": sample.error,
        "setup_s": sample.setup_s,
        "rollout_slot_wait_s": sample.rollout_slot_wait_s,
        "num_turns": sample.num_turns,
        "min_version": None if vr is None else vr[0],
        "max_version": None if vr is None else vr[1],
        "num_generated_tokens": sample.num_generated_tokens,
        "num_rows": len(sample.rows),
        "agent_metrics": json.dumps(dict(sample.agent_metrics)) if sample.agent_metrics else None,
    }


def _agent_metrics(tag: str | None) -> tuple[tuple[str, float], ...]:
    """The `agent_metrics` tag (a JSON object, or None for none) as Sample.agent_metrics."""
    return tuple(sorted((str(k), float(v)) for k, v in json.loads(tag).items())) if tag else ()


def empty_key(session_id: str) -> str:
    """The key of the placeholder row of a sample stored without rows."""
    return f"{session_id}/empty"


def stored_keys(info: SampleInfo) -> tuple[str, ...]:
    """Every TQ key a stored sample occupies: its row keys, or its placeholder's when it has none
    (what clearing the sample deletes, with no listing)."""
    return info.row_keys or (empty_key(info.session_id),)


def encode_sample(sample: Sample) -> list[StoredRow]:
    """Split a sample into its TQ rows: one per trajectory row, or one placeholder if it has none."""
    base = sample_tags(sample)
    if not sample.rows:
        return [
            StoredRow(
                key=empty_key(sample.session_id),
                tags={**base, "row_index": EMPTY_ROW_INDEX, "seq_len": 0, "row_generated": 0},
                token_ids=(),
                loss_mask=(),
                rollout_logprobs=(),
                versions=(),
            )
        ]
    return [
        StoredRow(
            key=row_key(sample.session_id, i),
            tags={**base, "row_index": i, "seq_len": len(row.token_ids), "row_generated": row.num_generated},
            token_ids=row.token_ids,
            loss_mask=row.loss_mask,
            rollout_logprobs=row.rollout_logprobs,
            versions=row.versions,
        )
        for i, row in enumerate(sample.rows)
    ]


def sample_info(listing: dict[str, dict[str, Any]], keys: list[str]) -> SampleInfo:
    """The metadata of one complete sample from its rows' tags (`keys`: its TQ keys in row order,
    as `complete_sessions` gives them); the placeholder row of a sample without rows is no row."""
    t = listing[keys[0]]
    rows = [k for k in keys if listing[k]["row_index"] != EMPTY_ROW_INDEX]
    return SampleInfo(
        session_id=t["session_id"], group_id=t["group_id"], input_id=t["input_id"], sample_index=t["sample_index"],
        status=t["status"], reward=t["reward"], latency_s=t["latency_s"], error=t["error"], setup_s=t.get("setup_s"),
        rollout_slot_wait_s=t.get("rollout_slot_wait_s"), num_turns=t.get("num_turns", 0),
        num_generated_tokens=t["num_generated_tokens"], min_version=t["min_version"], max_version=t["max_version"],
        row_keys=tuple(rows), row_lens=tuple(listing[k]["seq_len"] for k in rows),
        row_generated=tuple(listing[k]["row_generated"] for k in rows),
        agent_metrics=_agent_metrics(t.get("agent_metrics")))


def complete_sessions(listing: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    """Session id -> keys of its TQ rows, for the sessions whose rows are all tagged.

    listing: key -> tags, as TQ's kv_list returns for one partition. Keys without tags (created
    by a put still in flight) and sessions missing a row are left out.
    Raises BufferCorruptError when a session carries a row index outside 0..num_rows-1.
    """
    by_session: dict[str, list[tuple[int, str, int]]] = defaultdict(list)
    for key, tags in listing.items():
        if not tags or "session_id" not in tags:
            continue
        by_session[tags["session_id"]].append((tags["row_index"], key, tags["num_rows"]))
    out: dict[str, list[str]] = {}
    for sid, rows in by_session.items():
        rows.sort()
        num_rows = {n for _, _, n in rows}
        if len(num_rows) != 1:
            raise BufferCorruptError(f"session {sid} rows disagree on num_rows: {sorted(num_rows)}")
        n = num_rows.pop()
        indexes = [i for i, _, _ in rows]
        expected = [EMPTY_ROW_INDEX] if n == 0 else list(range(n))
        if any(i not in expected for i in indexes):
            raise BufferCorruptError(f"session {sid} has row indexes {indexes}, expected a subset of {expected}")
        if indexes == expected:
            out[sid] = [k for _, k, _ in rows]
    return out


def decode_samples(rows: Iterable[StoredRow]) -> list[Sample]:
    """Rebuild Samples from their TQ rows (any order), sorted by (group_id, sample_index, session_id).

    Raises BufferCorruptError when a session's rows are incomplete or their tags disagree.
    """
    by_session: dict[str, list[StoredRow]] = defaultdict(list)
    for r in rows:
        by_session[r.tags["session_id"]].append(r)
    samples = []
    for sid, srows in by_session.items():
        srows.sort(key=lambda r: r.tags["row_index"])
        t = srows[0].tags
        base = {k: v for k, v in t.items() if k not in ROW_TAGS}
        for r in srows[1:]:
            other = {k: v for k, v in r.tags.items() if k not in ROW_TAGS}
            if other != base:
                raise BufferCorruptError(f"session {sid} rows disagree on their sample tags: {base} vs {other}")
        if t["num_rows"] == 0:
            traj: tuple[TrajectoryRow, ...] = ()
        else:
            if [r.tags["row_index"] for r in srows] != list(range(t["num_rows"])):
                raise BufferCorruptError(f"session {sid} is missing rows of its {t['num_rows']}")
            traj = tuple(
                TrajectoryRow(
                    token_ids=r.token_ids,
                    loss_mask=r.loss_mask,
                    rollout_logprobs=r.rollout_logprobs,
                    versions=r.versions,
                )
                for r in srows
            )
        status: RolloutStatus = t["status"]
        samples.append(
            Sample(
                session_id=sid,
                group_id=t["group_id"],
                input_id=t["input_id"],
                sample_index=t["sample_index"],
                rows=traj,
                reward=t["reward"],
                status=status,
                latency_s=t["latency_s"],
                error=t["error"],
                setup_s=t.get("setup_s"),
                rollout_slot_wait_s=t.get("rollout_slot_wait_s"),
                num_turns=t.get("num_turns", 0),
                agent_metrics=_agent_metrics(t.get("agent_metrics")),
            )
        )
    samples.sort(key=lambda s: (s.group_id, s.sample_index, s.session_id))
    return samples
