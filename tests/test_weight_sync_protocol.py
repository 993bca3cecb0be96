"""One weight-sync protocol (issue 44): every backend is a `WeightSync` (version, sync, lost,
metrics), the file backends also a `ReplaceableWeightSync`; the probe passes the inner sync
through; the loops read the policy version from the sync; one rule for the LoRA versions a
replica serves. Plain objects stand in for trainer and replicas (no Ray, no engine)."""

from __future__ import annotations

import asyncio

import pytest

from orchestrator.loop.common import LoopParts, LoopPosition, start_position, sync_weights
from orchestrator.planning.sim.parts import SimWeightSync
from workers.weight_sync.adapter import AdapterWeightSync
from workers.weight_sync.broadcast import BroadcastWeightSync
from workers.weight_sync.file import FileWeightSync
from workers.weight_sync.lora import directories_kept, versions_served
from workers.weight_sync.probe import METRIC, ProbedWeightSync
from workers.weight_sync.protocol import ReplaceableWeightSync, WeightSync


class RayActorError(Exception):
    """Stands for ray.exceptions.RayActorError (matched by class name)."""


class Replica:
    def __init__(self) -> None:
        self.version, self.dead = 0, False

    async def update_weights(self, path: str, version: int) -> None:
        if self.dead:
            raise RayActorError("The actor died unexpectedly")
        self.version = version

    async def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        return [-1.0] * len(token_ids)


class Trainer:
    async def export_weights(self, path: str) -> str:
        open(path, "wb").close()
        return path

    async def probe_logprobs(self, token_ids: list[int]) -> list[float]:
        return [-1.0] * len(token_ids)


def test_every_backend_is_one_weight_sync_and_only_the_file_backends_take_a_replacement():
    for cls in (FileWeightSync, AdapterWeightSync, BroadcastWeightSync, ProbedWeightSync, SimWeightSync):
        assert issubclass(cls, WeightSync), cls
    assert issubclass(FileWeightSync, ReplaceableWeightSync) and issubclass(AdapterWeightSync, ReplaceableWeightSync)
    assert not issubclass(BroadcastWeightSync, ReplaceableWeightSync)  # a broadcast group takes no new member


async def test_the_probe_passes_version_lost_and_metrics_of_the_inner_sync_through(tmp_path):
    a, b = Replica(), Replica()
    inner = FileWeightSync([a, b], trainer=Trainer(), weights_dir=tmp_path)
    probed = ProbedWeightSync(inner, Trainer(), [a, b], [1, 2, 3])
    assert await probed.metrics() == {} and probed.lost() == frozenset()
    b.dead = True
    report = await asyncio.wait_for(probed.sync(1), timeout=10)
    assert (report.version, probed.version(), inner.version()) == (1, 1, 1)
    assert probed.lost() == frozenset({1})  # the inner sync's, not probed for with hasattr
    assert await probed.metrics() == {METRIC: 0.0}


async def test_the_loops_read_the_version_from_the_weight_sync(tmp_path):
    sync = FileWeightSync([Replica()], initial_version=3, trainer=Trainer(), weights_dir=tmp_path)
    parts = LoopParts(prompts=None, rollouts=None, store=None, trainer=None, weights=sync, logger=None)  # type: ignore[arg-type]
    assert start_position(parts, None).policy_version == 3
    assert await asyncio.wait_for(sync_weights(parts), timeout=10) == 4 == sync.version()
    with pytest.raises(RuntimeError, match="starts at policy version 2 but the weight sync serves version 4"):
        start_position(parts, LoopPosition(step=2, policy_version=2, next_group_id=0, trained_groups=0))


@pytest.mark.parametrize("async_mode,eta,served", [(True, 0, 1), (True, 1, 2), (True, 4, 5), (False, 4, 1)])
def test_one_rule_for_the_lora_versions_a_replica_serves(async_mode, eta, served):
    # async: a version trains while requests begun on the eta versions before it still generate
    assert versions_served(async_mode=async_mode, max_staleness=eta) == served
    assert directories_kept(async_mode=async_mode, max_staleness=eta) == served + 1  # plus the one loading


def test_the_replica_settings_and_the_dry_run_use_that_rule():
    from stand_ins import compose_config
    from orchestrator.config import inference_settings

    cfg = compose_config(["mode=async", "async.max_staleness=3", "model.lora.rank=8", "inference.lora_sync=adapter"])
    s = inference_settings(cfg.inference, mode=cfg.mode, async_=cfg.async_, cluster=cfg.cluster, seed=0, model_path="m", replica=0,
                           initial_policy_version=0, lora_rank=8)
    assert s.max_loras == versions_served(async_mode=True, max_staleness=3) == 4
