"""Bucket planner of the broadcast weight sync: which tensors travel together, flattened how.

Pure logic over names, shapes and dtypes (torch is used only to flatten / view tensors); no
process group, no I/O. Both ends of a sync use it: the trainer plans and flattens, the receiver
gets the plan (a small picklable dataclass) and cuts each received flat buffer back into tensors.

Rules (the receiver relies on them):
- Buckets hold tensors of ONE dtype, so a bucket is one flat 1-D tensor of that dtype and each
  tensor is a view `flat[offset : offset + numel].view(shape)`.
- Tensors keep the order they were given in (the state-dict order). A bucket closes when the next
  tensor has another dtype or would push it past `bucket_bytes`; so the receiver sees the tensors
  in the same order as the sender's state dict (vLLM's layer-wise reload finishes a layer as soon
  as its last tensor arrives, instead of buffering the whole model). With a mixed-dtype model
  this makes more, smaller buckets than grouping by dtype would; our trainer sends one dtype.
- A tensor larger than `bucket_bytes` gets a bucket of its own (never split).
- Every tensor is in exactly one bucket; offsets inside a bucket are contiguous and start at 0.
The version travels in the plan, so a receiver can refuse an old version before any byte moves.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

MIB = 2**20


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32 (the plan stores names: they pickle without torch internals)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of `dtype_name`; raises ValueError for a name that is not a torch dtype."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype (name, e.g. 'bfloat16') of one weight."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_from_name(self.dtype).itemsize


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor lives in its bucket: elements [offset, offset + spec.numel)."""

    spec: TensorSpec
    offset: int


@dataclass(frozen=True)
class Bucket:
    """One flat buffer of `numel` elements of `dtype`, holding `slots` back to back."""

    index: int
    dtype: str
    slots: tuple[TensorSlot, ...]
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_from_name(self.dtype).itemsize

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.spec.name for s in self.slots)


@dataclass(frozen=True)
class BucketPlan:
    """All buckets of one push of policy version `version`."""

    version: int
    buckets: tuple[Bucket, ...]

    @property
    def total_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def max_bucket_bytes(self) -> int:
        return max((b.nbytes for b in self.buckets), default=0)

    @property
    def num_tensors(self) -> int:
        return sum(len(b.slots) for b in self.buckets)


def specs_of(tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> list[TensorSpec]:
    """TensorSpecs of a state dict (or (name, tensor) pairs), in order."""
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    return [TensorSpec(name, tuple(int(d) for d in t.shape), dtype_name(t.dtype)) for name, t in items]


def plan_buckets(specs: Sequence[TensorSpec], *, bucket_bytes: int, version: int) -> BucketPlan:
    """Cut `specs` (in order) into buckets of at most `bucket_bytes` bytes each; see the module rules.

    Raises ValueError when bucket_bytes < 1, when a name repeats, or when there is no tensor.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    if not specs:
        raise ValueError("plan_buckets got no tensors")
    seen: set[str] = set()
    buckets: list[Bucket] = []
    slots: list[TensorSlot] = []
    numel = 0
    dtype = specs[0].dtype

    def close() -> None:
        nonlocal slots, numel
        if slots:
            buckets.append(Bucket(index=len(buckets), dtype=dtype, slots=tuple(slots), numel=numel))
        slots, numel = [], 0

    for spec in specs:
        if spec.name in seen:
            raise ValueError(f"tensor {spec.name!r} appears twice")
        seen.add(spec.name)
        itemsize = dtype_from_name(spec.dtype).itemsize
        if spec.dtype != dtype or (slots and (numel + spec.numel) * itemsize > bucket_bytes):
            close()
            dtype = spec.dtype
        slots.append(TensorSlot(spec, numel))
        numel += spec.numel
    close()
    return BucketPlan(version=version, buckets=tuple(buckets))


def flatten_into(bucket: Bucket, tensors: Mapping[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Copy the bucket's tensors into `out[:bucket.numel]` (1-D, the bucket's dtype); return that view.

    Tensors may live on another device or hold another dtype: `copy_` converts. Raises ValueError
    when a tensor is missing, has another shape than planned, or `out` is too small / wrong dtype.
    """
    want = dtype_from_name(bucket.dtype)
    if out.dtype != want or out.dim() != 1 or out.numel() < bucket.numel:
        raise ValueError(
            f"bucket {bucket.index} needs a 1-D {bucket.dtype} buffer of >= {bucket.numel} elements, "
            f"got {out.dtype} shape {tuple(out.shape)}"
        )
    for slot in bucket.slots:
        t = tensors.get(slot.spec.name)
        if t is None:
            raise ValueError(f"bucket {bucket.index}: tensor {slot.spec.name!r} is missing")
        if tuple(t.shape) != slot.spec.shape:
            raise ValueError(f"tensor {slot.spec.name!r} has shape {tuple(t.shape)}, planned {slot.spec.shape}")
        out[slot.offset : slot.offset + slot.spec.numel].view(slot.spec.shape).copy_(t)
    return out[: bucket.numel]


def unflatten(bucket: Bucket, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """(name, view) pairs cut from `flat` (no copy: the views keep `flat` alive).

    Raises ValueError when `flat` is not the bucket's 1-D dtype or holds too few elements.
    """
    if flat.dtype != dtype_from_name(bucket.dtype) or flat.dim() != 1 or flat.numel() < bucket.numel:
        raise ValueError(
            f"bucket {bucket.index} expects a 1-D {bucket.dtype} tensor of {bucket.numel} elements, "
            f"got {flat.dtype} shape {tuple(flat.shape)}"
        )
    return [(s.spec.name, flat[s.offset : s.offset + s.spec.numel].view(s.spec.shape)) for s in bucket.slots]
