"""Bounded control calls through Ray: a replica actor that stalls in `update_weights` during a weight sync
fails the sync within the bound, and the error names the actor (its handle's repr: class and actor id) and
the call. The unit tests (tests/test_control_bounds.py) cover the same on plain objects; this one shows the
bound holds on a real ObjectRef wait. One small Ray instance, no engine."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest

from stand_ins import own_ray
from workers.core import bounds
from workers.core.calls import PartTimeout
from workers.weight_sync.file import FileWeightSync

BOUND_S = 2.0  # the shrunk weight-sync bound (s)
SLACK_S = 5.0  # a loaded 2-core machine's scheduling slack (s)
T_TEST_S = 60.0  # bounds every await here (s)


class LoadingReplica:
    def __init__(self) -> None:
        self.version = 0

    async def update_weights(self, path: str, version: int) -> None:
        self.version = version

    async def policy_version(self) -> int:
        return self.version


class StallingReplica(LoadingReplica):
    async def update_weights(self, path: str, version: int) -> None:
        await asyncio.Event().wait()  # never returns: a hung load


@pytest.fixture(scope="module")
def ray_mod():
    with own_ray(num_cpus=2, ship=[sys.modules[__name__]]) as ray:
        yield ray


async def test_an_actor_stalled_in_a_weight_sync_fails_it_within_the_bound_naming_the_actor(ray_mod, monkeypatch):
    monkeypatch.setattr(bounds, "WEIGHT_SYNC_S", BOUND_S)
    good = ray_mod.remote(num_cpus=0)(LoadingReplica).remote()
    stalled = ray_mod.remote(num_cpus=0)(StallingReplica).remote()
    sync = FileWeightSync([good, stalled])
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="failed on 1/2 replicas") as err:
        await asyncio.wait_for(sync.push("/weights/policy-v1.safetensors", 1), T_TEST_S)
    elapsed = time.monotonic() - t0
    assert BOUND_S <= elapsed < BOUND_S + SLACK_S, elapsed
    cause = err.value.__cause__
    assert isinstance(cause, PartTimeout) and cause.call == "update_weights"
    assert cause.part.startswith("Actor(StallingReplica, ") and cause.part in str(err.value)
    assert await good.policy_version.remote() == 1 and sync.version() == 0
    ray_mod.kill(stalled)
