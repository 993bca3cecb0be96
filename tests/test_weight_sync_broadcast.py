"""Bucketed weight broadcast between real processes (shared memory and gloo), and
BroadcastWeightSync driving a real TrainerWorker into receivers."""

from __future__ import annotations

import asyncio
import multiprocessing as mp

import pytest
import torch

from stand_ins import InThread
from workers.weight_sync.broadcast import BroadcastWeightSync, new_group_info, send_weights
from workers.weight_sync.plan import specs_of
from workers.weight_sync.receiver import PushOutcome, TensorReceiver, run_receiver_process
from workers.weight_sync.transport import open_transport

T_TIMEOUT_S = 60.0
NUM_RECEIVERS = 2


def model_state(version: int) -> dict[str, torch.Tensor]:
    """A small mixed-dtype 'model' whose values encode the version (small integers: sums are exact)."""
    g = torch.Generator().manual_seed(version)
    sd = {}
    for i in range(6):
        sd[f"layers.{i}.w"] = torch.randint(-8, 8, (32, 16), generator=g).float()
        sd[f"layers.{i}.norm"] = torch.randint(-8, 8, (16,), generator=g).to(torch.bfloat16)
    sd["lm_head.weight"] = torch.randint(-8, 8, (300, 16), generator=g).float()  # > bucket: alone
    return sd


@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_broadcast_reaches_every_receiver_exactly_and_refuses_old_versions(backend):
    """Two pushes (v1, v2) then a repeated v2: every receiver process holds exactly the sender's
    tensors after each push; the repeat is refused by both receivers (after draining, so the
    sender returns instead of hanging). 1 KiB buckets: the fp32 / bf16 alternation and the 2 KiB weights put every one of the
    13 tensors in its own bucket, so the 2 shm
    slots are reused many times."""
    specs = specs_of(model_state(1))
    info = new_group_info(backend, NUM_RECEIVERS, timeout_s=T_TIMEOUT_S)
    ctx = mp.get_context("fork")  # children need no fresh torch import; they create their groups after the fork
    results = ctx.Queue()
    versions = [1, 2, 2]
    procs = [ctx.Process(target=run_receiver_process, args=(info, r + 1, specs, versions, results), daemon=True)
             for r in range(NUM_RECEIVERS)]
    for p in procs:
        p.start()
    sender = open_transport(info, 0)
    try:
        reports = [send_weights(sender, specs, model_state(v).items(), version=v, bucket_bytes=1024) for v in versions]
        outcomes: list[PushOutcome] = [results.get(timeout=T_TIMEOUT_S) for _ in range(NUM_RECEIVERS * len(versions))]
    finally:
        for p in procs:
            p.join(timeout=T_TIMEOUT_S)
            if p.is_alive():
                p.kill()
        sender.close()
    assert reports[0].num_buckets == 13 and reports[0].num_tensors == 13
    assert reports[0].total_bytes == 6 * (32 * 16 * 4 + 16 * 2) + 300 * 16 * 4
    by_version: dict[int, list[PushOutcome]] = {}
    for o in outcomes:
        by_version.setdefault(o.version, []).append(o)
    for v in (1, 2):
        ok = [o for o in by_version[v] if o.error is None]
        assert len(ok) == NUM_RECEIVERS, [o.error for o in by_version[v]]
        want = {n: float(t.double().sum()) for n, t in model_state(v).items()}
        for o in ok:
            assert o.sums == want
            assert o.report.version == v and o.report.num_tensors == 13
    refused = [o for o in by_version[2] if o.error is not None]
    assert len(refused) == NUM_RECEIVERS and all("must increase" in o.error for o in refused)
    assert all(p.exitcode == 0 for p in procs)


@pytest.mark.parametrize("backend", ["shm", "gloo"])
async def test_broadcast_sync_copies_trainer_weights_into_receivers(backend, random_qwen2_dir):
    """A real TrainerWorker (FSDP2, its own gloo world) sends through a separate weight group;
    after a push both receivers hold the trainer's full state dict; a failing receiver makes the
    push raise and leaves the version where it was."""
    from workers.trainer.worker import TrainerSettings, TrainerWorker

    trainer = TrainerWorker(TrainerSettings(model_path=random_qwen2_dir, weight_sync_bucket_mb=0.01))
    try:
        full = trainer.full_state_dict()
        assert [s.name for s in trainer.weight_specs()] == list(full)
        targets = [{n: torch.zeros_like(t) for n, t in full.items()} for _ in range(NUM_RECEIVERS)]
        receivers = [TensorReceiver(t) for t in targets]
        info = new_group_info(backend, NUM_RECEIVERS, timeout_s=T_TIMEOUT_S)
        sync = BroadcastWeightSync([InThread(trainer)], [InThread(r) for r in receivers], info)
        report = await asyncio.wait_for(sync.sync(1), T_TIMEOUT_S)
        assert report.version == 1 and sync.version() == 1 and report.num_replicas == NUM_RECEIVERS
        assert sync.last_send.num_buckets > 2  # 10 KiB buckets on a ~150 KiB model
        for t in targets:
            for name, want in full.items():
                assert torch.equal(t[name], want), name
        assert all(r.version() == 1 for r in receivers)

        with pytest.raises(ValueError, match="must increase"):
            await sync.sync(1)
        del targets[0][next(iter(full))]  # receiver 0 no longer knows the first tensor
        receivers[0]._targets = targets[0]
        with pytest.raises(RuntimeError, match="receiver 0: KeyError"):
            await asyncio.wait_for(sync.sync(2), T_TIMEOUT_S)
        assert sync.version() == 1
        for r in receivers:
            r.close()
    finally:
        trainer.close()
