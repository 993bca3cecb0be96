"""Fault handling without Ray (issue 14): `run_watched`, the replica supervisor and the file weight
sync's lost / admit rules, the session cap's per-owner release. Dead actors are stood in for by
an error class named like Ray's (`workers.core.calls.actor_died` recognises the name); the Ray
tests (tests/test_faults_*.py) kill real actor processes."""

from __future__ import annotations

import asyncio

import pytest

from orchestrator.control.supervise import ReplicasExhausted, ReplicaSupervisor, run_watched
from workers.acr.limits import SessionCapService
from workers.weight_sync.file import FileWeightSync


class RayActorError(Exception):
    """Stands for ray.exceptions.RayActorError (matched by class name)."""


class Replica:
    def __init__(self, version: int = 0) -> None:
        self.version, self.loads, self.dead, self.started = version, [], False, False

    async def start(self) -> None:
        self.started = True

    def policy_version(self) -> int:
        if self.dead:
            raise RayActorError("The actor died unexpectedly")
        return self.version

    async def update_weights(self, path: str, version: int) -> None:
        if self.dead:
            raise RayActorError("The actor died unexpectedly")
        self.loads.append((path, version))
        self.version = version


class Gateway:
    def __init__(self) -> None:
        self.lists: list[list] = []

    def set_engines(self, engines: list) -> None:
        self.lists.append(list(engines))


async def test_a_push_skips_a_dead_replica_and_the_replacement_loads_the_current_file_first():
    a, b = Replica(), Replica()
    sync = FileWeightSync([a, b])
    await sync.push("v1.st", 1)
    b.dead = True
    report = await sync.push("v2.st", 2)  # not an error: b is lost, a confirmed
    assert (report.num_replicas, sync.version(), sync.lost()) == (1, 2, frozenset({1}))
    c = Replica(version=0)  # a replacement starts from the run's initial weights
    await sync.admit(1, c, loaded_version=0)
    assert c.loads == [("v2.st", 2)] and sync.lost() == frozenset()
    await sync.push("v3.st", 3)
    assert (a.version, c.version) == (3, 3)


async def test_a_live_replica_that_fails_to_load_still_breaks_the_push():
    class Broken(Replica):
        async def update_weights(self, path: str, version: int) -> None:
            raise OSError("disk full")

    sync = FileWeightSync([Replica(), Broken()])
    with pytest.raises(RuntimeError, match="replica 1: OSError"):
        await sync.push("v1.st", 1)
    assert sync.version() == 0


async def test_supervisor_replaces_the_dead_one_then_stops_past_max_restarts():
    replicas = [Replica(), Replica()]
    gateway, sync = Gateway(), FileWeightSync(replicas)
    await sync.push("v1.st", 1)
    made = []
    sup = ReplicaSupervisor(replicas, spawn=lambda i: made.append(Replica()) or made[-1], weights=sync,
                            gateway=gateway, loaded_version=0, max_restarts=1, check_every_s=0.01)
    assert await sup.check() == []
    replicas[1].dead = True
    assert await sup.check() == [1]
    assert replicas[1] is made[0] and made[0].started and made[0].loads == [("v1.st", 1)]
    assert gateway.lists == [replicas] and await sup.metrics() == {"inference/restarts": 1.0}
    replicas[0].dead = True
    with pytest.raises(ReplicasExhausted, match="replica 0 died and inference.max_restarts=1"):
        await sup.check()


async def test_run_watched_returns_the_loop_result_or_stops_it_when_a_watcher_raises():
    async def watcher_ok() -> None:
        return None

    assert await run_watched(asyncio.sleep(0.01, result=7), [watcher_ok]) == 7
    cancelled = asyncio.Event()

    async def loop() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            cancelled.set()

    async def failing() -> None:
        await asyncio.sleep(0.01)
        raise ReplicasExhausted("gone")

    with pytest.raises(ReplicasExhausted):
        await asyncio.wait_for(run_watched(loop(), [failing]), 5)
    assert cancelled.is_set()  # the loop was cancelled, not left running


async def test_session_cap_gives_back_the_slots_of_a_dead_owner_once():
    cap = SessionCapService(4)
    assert await cap.acquire(3, owner="rollout-0-aa") == 3
    assert await cap.acquire(1, owner="rollout-1-bb") == 1
    assert await cap.release_owner("rollout-0-aa") == 3  # its process died holding them
    await cap.release(2, owner="rollout-0-aa")  # a late release of the dead owner gives back nothing
    assert cap.stats().in_use == 1
    await cap.release(1, owner="rollout-1-bb")
    assert cap.stats().in_use == 0


class Exporter:
    """The trainer seam of the file sync: writes a file per export and records the paths."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    async def export_weights(self, path: str) -> str:
        from pathlib import Path

        Path(path).write_bytes(b"weights")
        self.paths.append(path)
        return path


async def test_one_sync_call_exports_pushes_and_removes_the_superseded_file(tmp_path):
    """`sync(v)` is the loop's only weight call (issue 24 item 4): the file backend exports
    `policy-v{v}.safetensors`, every replica loads it, and the previous version's file goes only
    after the new one was confirmed; a replacement admitted later still finds the current file."""
    a, b, trainer = Replica(), Replica(), Exporter()
    sync = FileWeightSync([a, b], trainer=trainer, weights_dir=tmp_path / "weights")
    await sync.sync(1)
    v1 = str(tmp_path / "weights" / "policy-v1.safetensors")
    assert a.loads == b.loads == [(v1, 1)] and trainer.paths == [v1]
    await sync.sync(2)
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["policy-v2.safetensors"]
    c = Replica()
    await sync.admit(1, c, loaded_version=0)
    assert c.loads == [(str(tmp_path / "weights" / "policy-v2.safetensors"), 2)]
    with pytest.raises(ValueError, match="must increase"):
        await sync.sync(2)
    assert trainer.paths[-1].endswith("policy-v2.safetensors")  # a refused version exports nothing


async def test_a_failed_push_keeps_both_files_and_the_version(tmp_path):
    a, trainer = Replica(), Exporter()
    sync = FileWeightSync([a], trainer=trainer, weights_dir=tmp_path)
    await sync.sync(1)

    async def broken(path: str, version: int) -> None:
        raise OSError("disk full")

    a.update_weights = broken
    with pytest.raises(RuntimeError, match="version 2 failed"):
        await sync.sync(2)
    assert sync.version() == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy-v1.safetensors", "policy-v2.safetensors"]


@pytest.mark.parametrize("form", ["symlink", "text file"])
async def test_a_lost_trainer_names_the_checkpoint_latest_points_at(tmp_path, form):
    """The "trainer lost" message names the checkpoint to continue from, whichever form `latest`
    has (the symlink runs write now, the text file of earlier versions; issue 47 item 8)."""
    from orchestrator.control.supervise import explain_trainer_loss
    from workers.trainer.group import TrainerRankLost

    (tmp_path / "checkpoints" / "step-00000003").mkdir(parents=True)
    latest = tmp_path / "checkpoints" / "latest"
    latest.symlink_to("step-00000003") if form == "symlink" else latest.write_text("step-00000003\n")
    lost = await explain_trainer_loss(TrainerRankLost(0, RuntimeError("gone")), [object()], tmp_path)
    assert f"last checkpoint: {tmp_path / 'checkpoints' / 'step-00000003'}; rerun with trainer.resume_mode=auto" in str(lost)
    latest.unlink()
    lost = await explain_trainer_loss(TrainerRankLost(0, RuntimeError("gone")), [object()], tmp_path)
    assert "no checkpoint was written yet" in str(lost)
