"""A trainer rank SIGKILLed mid-run (issue 14, item 2): the run stops in bounded time, naming the
rank and the checkpoint to resume from.

Real parts: two TrainerWorker ranks as Ray actors in one gloo process group (`start_trainer_ranks`,
`TrainerGroup`) on the tiny model, with a short `collective_timeout_s`; rank 1's process is killed
with SIGKILL by its PID. The driver-side call fails at once with `TrainerRankLost(rank=1)`, without
waiting for rank 0 (which may sit in a collective), and `explain_trainer_loss` turns it into the
run's error with the `checkpoints/latest` path and the `trainer.resume_mode=auto` hint. A single
rank (world size 1, a plain actor) killed the same way is named by the ping of every rank.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from stand_ins import own_ray
from test_trainer_group import grouped_samples
from orchestrator.control.supervise import explain_trainer_loss
from workers.trainer.group import TrainerRankLost, start_trainer_ranks

BOUND_S = 30.0  # from the kill to the named error (seconds), well below the collective timeout's 600 default


@pytest.fixture(scope="module")
def ray_local():
    with own_ray() as ray:
        yield ray


def _settings():
    from workers.embedded.tiny_model import ensure_tiny_model
    from workers.trainer.worker import TrainerSettings

    return TrainerSettings(model_path=str(ensure_tiny_model()), lr=1e-3, weight_decay=0.0, micro_batch_size=2,
                           seed=0, device="cpu", collective_timeout_s=20.0)


def _run_dir(tmp_path):
    ckpts = tmp_path / "checkpoints"
    (ckpts / "step-00000003").mkdir(parents=True)
    (ckpts / "latest").write_text("step-00000003\n")
    return tmp_path


def test_a_dead_rank_stops_the_update_at_once_and_is_named_with_the_last_checkpoint(ray_local, tmp_path):
    from workers.trainer.worker import TrainerWorker

    from workers.buffer.store import BufferConfig, TrajectoryBuffer
    from workers.core.types import OrderData
    from workers.trainer.train_batch import sample_order

    cls = ray_local.remote(num_cpus=0)(TrainerWorker)
    samples = grouped_samples([[[5], [9]], [[12], [3, 4]], [[7], [2]]], vocab=200, seed=1)
    buffer = TrajectoryBuffer.start(BufferConfig())
    buffer.put_sync(samples, "step-1")  # each rank reads its rows from it
    order = sample_order(samples, partition="step-1")[0]
    threads = {"runtime_env": {"env_vars": {"OMP_NUM_THREADS": "1"}}}

    async def scenario():
        group = await start_trainer_ranks(cls, _settings(), world_size=2, rank_options=lambda r: threads)
        try:
            await group.open_data(OrderData(buffer.handle))
            await group.update(order)  # both ranks up and in the group
            os.kill(await group.ranks[1].__ray_call__.remote(lambda w: os.getpid()), signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(TrainerRankLost) as info:
                await asyncio.wait_for(group.update(order), BOUND_S)
            lost = await explain_trainer_loss(info.value, group.ranks, _run_dir(tmp_path))
            return info.value, lost, time.monotonic() - t0
        finally:
            for r in group.ranks:
                ray_local.kill(r)

    try:
        exc, lost, took_s = asyncio.run(scenario())
    finally:
        buffer.stop()
    assert exc.rank == 1 and took_s < BOUND_S
    assert "trainer rank 1 of 2 died" in str(lost)
    assert str(tmp_path / "checkpoints" / "step-00000003") in str(lost) and "trainer.resume_mode=auto" in str(lost)


def test_a_dead_single_rank_is_found_by_its_ping(ray_local, tmp_path):
    from workers.trainer.worker import TrainerWorker

    async def scenario():
        rank0 = ray_local.remote(num_cpus=0)(TrainerWorker).remote(_settings())
        await rank0.__ray_call__.remote(lambda w: None)
        os.kill(await rank0.__ray_call__.remote(lambda w: os.getpid()), signal.SIGKILL)
        try:
            await asyncio.wait_for(rank0.export_weights.remote(str(tmp_path / "w.safetensors")), BOUND_S)
        except Exception as e:  # noqa: BLE001 - Ray's own dead-actor error, as the loop would see it
            return await explain_trainer_loss(e, [rank0], tmp_path)  # no checkpoint written
        raise AssertionError("a call on a killed actor returned")

    lost = asyncio.run(scenario())
    assert "trainer rank 0 of 1 died" in str(lost) and "no checkpoint was written yet" in str(lost)
