"""Bucket planner of the broadcast weight sync (pure logic): sizes, order, dtype runs, round trips."""

from __future__ import annotations

import random

import pytest
import torch

from workers.weight_sync.plan import (
    TensorSpec,
    dtype_from_name,
    flatten_into,
    plan_buckets,
    specs_of,
    unflatten,
)


def spec(name: str, *shape: int, dtype: str = "float32") -> TensorSpec:
    return TensorSpec(name, tuple(shape), dtype)


def test_buckets_fill_up_to_the_byte_limit_in_order():
    # 4 tensors of 10 fp32 = 40 B each; limit 100 B -> [a, b] (80 B), [c, d] (80 B): a third wouldn't fit
    specs = [spec(n, 10) for n in "abcd"]
    plan = plan_buckets(specs, bucket_bytes=100, version=3)
    assert [b.names for b in plan.buckets] == [("a", "b"), ("c", "d")]
    assert [b.nbytes for b in plan.buckets] == [80, 80]
    assert [s.offset for s in plan.buckets[1].slots] == [0, 10]
    assert plan.version == 3 and plan.total_bytes == 160 and plan.num_tensors == 4 and plan.max_bucket_bytes == 80


def test_oversized_tensor_gets_its_own_bucket():
    # embedding 1000 fp32 = 4000 B > 100 B limit: alone; the small ones around it are not merged across it
    specs = [spec("norm", 5), spec("embed", 1000), spec("bias", 5)]
    plan = plan_buckets(specs, bucket_bytes=100, version=1)
    assert [b.names for b in plan.buckets] == [("norm",), ("embed",), ("bias",)]
    assert plan.max_bucket_bytes == 4000


def test_dtype_change_closes_a_bucket_and_buckets_are_single_dtype():
    specs = [spec("a", 4), spec("b", 4, dtype="bfloat16"), spec("c", 4, dtype="bfloat16"), spec("d", 4)]
    plan = plan_buckets(specs, bucket_bytes=1 << 20, version=1)
    assert [(b.dtype, b.names) for b in plan.buckets] == [
        ("float32", ("a",)), ("bfloat16", ("b", "c")), ("float32", ("d",))]
    assert plan.buckets[1].nbytes == 16  # 8 bf16 elements x 2 B


def test_plan_rejects_bad_input():
    with pytest.raises(ValueError, match="appears twice"):
        plan_buckets([spec("a", 1), spec("a", 1)], bucket_bytes=8, version=1)
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets([spec("a", 1)], bucket_bytes=0, version=1)
    with pytest.raises(ValueError, match="no tensors"):
        plan_buckets([], bucket_bytes=8, version=1)
    with pytest.raises(ValueError, match="not a torch dtype"):
        dtype_from_name("float33")


def test_randomized_plans_cover_every_tensor_once_within_the_limit():
    """Seeded random models: every tensor in exactly one bucket, in order, offsets contiguous, each
    bucket within the limit unless it holds one oversized tensor; flatten/unflatten is exact."""
    rng = random.Random(0)
    for trial in range(30):
        sd = {}
        for i in range(rng.randint(1, 20)):
            shape = tuple(rng.randint(1, 9) for _ in range(rng.randint(0, 3)))
            dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16])
            sd[f"layer{i}.w"] = torch.randn(shape).to(dtype)
        limit = rng.randint(1, 600)
        plan = plan_buckets(specs_of(sd), bucket_bytes=limit, version=trial + 1)
        names = [n for b in plan.buckets for n in b.names]
        assert names == list(sd)
        for b in plan.buckets:
            assert len(b.slots) == 1 or b.nbytes <= limit
            assert {s.spec.dtype for s in b.slots} == {b.dtype}
            offsets = [s.offset for s in b.slots]
            assert offsets[0] == 0 and all(
                offsets[k + 1] == offsets[k] + b.slots[k].spec.numel for k in range(len(offsets) - 1))
            assert b.numel == sum(s.spec.numel for s in b.slots)
            buf = torch.empty(b.numel + 3, dtype=dtype_from_name(b.dtype))  # larger buffers are fine
            flat = flatten_into(b, sd, buf)
            for name, t in unflatten(b, flat.clone()):
                assert torch.equal(t, sd[name])


def test_flatten_converts_dtype_and_checks_shapes():
    sd = {"w": torch.randn(3, 2, dtype=torch.float32)}
    plan = plan_buckets([spec("w", 3, 2, dtype="bfloat16")], bucket_bytes=64, version=1)
    flat = flatten_into(plan.buckets[0], sd, torch.empty(6, dtype=torch.bfloat16))
    assert torch.equal(unflatten(plan.buckets[0], flat)[0][1], sd["w"].to(torch.bfloat16))
    with pytest.raises(ValueError, match="planned"):
        flatten_into(plan.buckets[0], {"w": torch.zeros(2, 3)}, torch.empty(6, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="missing"):
        flatten_into(plan.buckets[0], {}, torch.empty(6, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="buffer"):
        flatten_into(plan.buckets[0], sd, torch.empty(6, dtype=torch.float32))
    with pytest.raises(ValueError, match="expects"):
        unflatten(plan.buckets[0], torch.empty(5, dtype=torch.bfloat16))
