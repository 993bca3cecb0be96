"""Calling a part the same way whether it is a Ray actor handle or a plain local object.

Parts are handed either actor handles (production) or plain objects (tests, benchmarks, one
process). Each kind of part has one typed adapter (a `PartClient` subclass beside the Protocol it
implements: `workers.inference.client.ReplicaClient`, `workers.rollout.clients.RolloutActorClient`,
`workers.weight_sync.parts.WeightSenderClient`, ...; the trainer's is `TrainerGroup`), whose methods name the part's methods as
attributes, so a reader and a type checker can follow every call. Inside an adapter,
`invoke(target.method, *args)` awaits `target.method.remote(*args)` for an actor (a Ray ObjectRef is
awaitable, so no Ray import is needed here) and `target.method(*args)` otherwise, awaiting the
result when it is awaitable. `is_actor_method` tells the two apart; `actor_died` tells a dead
actor from an error its method raised.

Invariant: the method is called exactly once, and its result (or exception) is returned as is.
"""

from __future__ import annotations

import inspect
import os
from typing import Any


def actor_died(exc: BaseException) -> bool:
    """True when `exc` says the Ray actor behind a call is gone: its process died (SIGKILL, OOM,
    node loss). Ray raises `ray.exceptions.RayActorError` (or a subclass: ActorDiedError,
    ActorUnavailableError); recognised by class name, so no Ray import is needed here."""
    return any(c.__name__ == "RayActorError" for c in type(exc).__mro__)


def is_actor_method(fn: Any) -> bool:
    """True when `fn` is a Ray actor method (it has `.remote`), False for a plain callable."""
    return callable(getattr(fn, "remote", None))


async def invoke(method: Any, *args: Any, **kwargs: Any) -> Any:
    """Await one call of `method`, an attribute of a part: an actor method (`handle.m`) or a
    plain or async method (`obj.m`). Whatever the method raises propagates."""
    if is_actor_method(method):
        return await method.remote(*args, **kwargs)
    out = method(*args, **kwargs)
    return await out if inspect.isawaitable(out) else out


async def call(obj: Any, method: str, *args: Any, **kwargs: Any) -> Any:
    """Await `obj.<method>(*args, **kwargs)` with the method named at run time. Only for a
    dispatcher that forwards a method its own caller chose (`TrainerGroup`'s fan-out to its ranks,
    workers/trainer/group.py); every other call goes through a typed adapter. Raises
    AttributeError when `obj` has no such method."""
    return await invoke(getattr(obj, method), *args, **kwargs)


class PartClient:
    """Base of the typed adapters: one part (`target`: a Ray actor handle or a local object).

    `ping` and `pid` run inside an actor's process (`__ray_call__`); a local object is alive by
    definition and has no process of its own (`pid` is None)."""

    def __init__(self, target: Any) -> None:
        self.target = target

    @property
    def is_actor(self) -> bool:
        """True when the target is a Ray actor handle."""
        return is_actor_method(getattr(self.target, "__ray_call__", None))

    async def ping(self) -> None:
        """A no-op round trip; raises the actor's death (`actor_died`) when it is gone."""
        if self.is_actor:
            await self.target.__ray_call__.remote(_noop)

    async def pid(self) -> int | None:
        """The actor's process id; None for a local object."""
        return await self.target.__ray_call__.remote(_pid) if self.is_actor else None

    async def run_inside(self, fn: Any, *args: Any) -> Any:
        """`fn(instance, *args)` inside the actor's process (`__ray_call__`), or on the local
        object itself."""
        if self.is_actor:
            return await self.target.__ray_call__.remote(fn, *args)
        out = fn(self.target, *args)
        return await out if inspect.isawaitable(out) else out


def _noop(_: Any) -> None:
    return None


def _pid(_: Any) -> int:
    return os.getpid()
