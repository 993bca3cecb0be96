"""One way to call a part (issue 24 item 5): a typed adapter per protocol calls a local object and
a Ray actor handle alike, and no product code names a part's method in a string.

The actor handle here is a stand-in with Ray's calling shape (`handle.method.remote(*args)`
returns an awaitable; `handle.__ray_call__.remote(fn)` runs `fn(instance)` in the actor), so the
test needs no Ray; tests/test_inference_ray.py and the e2e tests drive the real handles.
"""

import asyncio
import os
import re
from pathlib import Path

import pytest

from orchestrator.adapters.colocate import SleepingTrainer
from workers.core.calls import PartClient
from workers.inference.client import ReplicaClient
from workers.inference.settings import SleepReport
from workers.rollout.clients import RolloutActorClient

ROOT = Path(__file__).resolve().parents[1]


class Replica:
    """A local replica with a sync and an async method, as InferenceWorker has."""

    def __init__(self) -> None:
        self.version, self.asleep = 3, False

    def policy_version(self) -> int:
        return self.version

    async def sleep(self) -> SleepReport:
        self.asleep = True
        return SleepReport(level=0, released_memory=False, elapsed_s=0.0)

    async def wake_up(self) -> SleepReport:
        self.asleep = False
        return SleepReport(level=0, released_memory=False, elapsed_s=0.0)

    async def update_weights(self, path: str, version: int) -> None:
        self.version = version


class _RemoteMethod:
    def __init__(self, fn) -> None:
        self._fn = fn

    def remote(self, *args, **kwargs):
        async def run():
            out = self._fn(*args, **kwargs)
            return await out if asyncio.iscoroutine(out) else out
        return asyncio.ensure_future(run())


class Handle:
    """Ray's calling shape over an instance: every method only through `.remote`."""

    def __init__(self, instance) -> None:
        self._instance = instance
        self.__ray_call__ = _RemoteMethod(lambda fn, *a: fn(instance, *a))

    def __getattr__(self, name):
        return _RemoteMethod(getattr(self._instance, name))


def test_a_replica_adapter_calls_a_local_object_and_an_actor_handle_alike():
    async def main():
        local, remote = Replica(), Replica()
        for target in (local, Handle(remote)):
            client = ReplicaClient(target)
            assert await client.policy_version() == 3
            await client.update_weights("/w.safetensors", 4)
            assert await client.policy_version() == 4
            assert (await client.sleep()).level == 0
        assert local.asleep and remote.asleep
        await ReplicaClient(Handle(remote)).wake_up()
        assert not remote.asleep
    asyncio.run(asyncio.wait_for(main(), 10))


def test_ping_and_pid_reach_an_actor_and_leave_a_local_object_alone():
    async def main():
        assert await PartClient(Replica()).pid() is None  # no process of its own: never listed to be killed
        await PartClient(Replica()).ping()
        assert await PartClient(Handle(Replica())).pid() == os.getpid()
        assert await PartClient(Handle(Replica())).run_inside(lambda r: r.policy_version()) == 3
    asyncio.run(asyncio.wait_for(main(), 10))


def test_an_adapter_passes_a_parts_error_through_unchanged():
    class Broken:
        async def prepare(self):
            raise ValueError("boom")

    async def main():
        for target in (Broken(), Handle(Broken())):
            with pytest.raises(ValueError, match="boom"):
                await RolloutActorClient(target).prepare()
    asyncio.run(asyncio.wait_for(main(), 10))


def test_sleeping_trainer_offers_the_loop_trainer_protocol_only():
    """Regression: `SleepingTrainer.__getattr__` passed any attribute through to the wrapped trainer,
    so a call the loop's `Trainer` protocol does not name still worked by accident."""
    class Inner:
        async def update(self, groups):
            return {}

        def save_hf(self, directory):
            return directory

    trainer = SleepingTrainer(Inner(), [Replica()])
    assert not hasattr(trainer, "save_hf")
    assert asyncio.run(asyncio.wait_for(trainer.update(()), 10))["perf/inference_sleep_level"] == 0.0


# `call(part, "method", ...)`, `getattr(part, method).remote(...)`, a `_call_all(parts, "method")`
STRING_DISPATCH = re.compile(r"""\bcall\(\s*[\w.\[\]]+\s*,\s*["']|getattr\(\w+,\s*method\)\.remote|_call_all\(""")
ALLOWED = {"workers/core/calls.py"}  # the definition of `call` itself (kept for TrainerGroup's fan-out)


def test_no_product_code_calls_a_part_by_a_method_name_in_a_string():
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
            for pkg in ("orchestrator", "workers") for p in sorted((ROOT / pkg).rglob("*.py"))
            if str(p.relative_to(ROOT)) not in ALLOWED
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
            if STRING_DISPATCH.search(line)]
    assert hits == []
