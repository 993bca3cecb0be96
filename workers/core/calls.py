"""Calling a part the same way whether it is a Ray actor handle or a plain local object.

Parts are handed either actor handles (production) or plain objects (tests, benchmarks, one
process). Each kind of part has one typed adapter (a `PartClient` subclass beside the Protocol it
implements: `workers.inference.client.ReplicaClient`, `workers.rollout.clients.RolloutActorClient`,
`workers.weight_sync.parts.WeightSenderClient`, ...; the trainer's is `TrainerGroup`), whose methods name the part's methods as
attributes, so a reader and a type checker can follow every call. Inside an adapter,
`invoke(target.method, *args)` awaits `target.method.remote(*args)` for an actor (a Ray ObjectRef is
awaitable, so no Ray import is needed here) and `target.method(*args)` otherwise, awaiting the
result when it is awaitable. `is_actor_method` tells the two apart; `actor_died` tells a dead
actor from an error its method raised. `PartClient.call_within(timeout_s, target.method, *args)` is
`invoke` under a bound (workers/core/bounds.py): past it, `PartTimeout` names the part and the call.

Invariant: the method is called exactly once, and its result (or exception) is returned as is; a
bounded call returns within its bound or raises `PartTimeout` (the remote call itself is not stopped:
the caller stops the run or drops the part).

What a process receives through Ray: with `meter_ray_results(meter)` (the driver does it once at
start), every result of an actor call made here (`invoke`, `__ray_call__`) adds its pickled size to
`meter`, a `ByteMeter`; the trajectory buffer's client meters what TransferQueue answers the same
way (workers/buffer/store.py), so the driver's `driver/bytes_per_rollout` counts all it receives.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import pickle
from typing import Any, Awaitable, TypeVar

from workers.core import bounds

T = TypeVar("T")


class PartTimeout(TimeoutError):
    """A control call to a part did not return within its bound (workers/core/bounds.py): the part is
    stalled (a blocked event loop, a hung collective, a lost node). `part`, `call` and `timeout_s` say
    which."""

    def __init__(self, part: str, call: str, timeout_s: float) -> None:
        self.part, self.call, self.timeout_s = part, call, timeout_s
        super().__init__(f"{part}: {call} did not return within {timeout_s:g} s; the part is stalled (see its log "
                         f"for the call); the bound is in workers/core/bounds.py")

    def __reduce__(self) -> tuple:  # pickled through Ray with its three fields, not the message
        return PartTimeout, (self.part, self.call, self.timeout_s)


async def within(timeout_s: float, aw: Awaitable[T], *, part: str, call: str) -> T:
    """Await `aw` for at most `timeout_s` seconds. Raises PartTimeout(part, call, timeout_s) when the
    bound passes (a TimeoutError raised by `aw` itself propagates unchanged)."""
    cm = asyncio.timeout(timeout_s)
    try:
        async with cm:
            return await aw
    except TimeoutError:
        if cm.expired():
            raise PartTimeout(part, call, timeout_s) from None
        raise


class ByteMeter:
    """Counts the bytes of what a process received: each message's pickled size (protocol 5; the
    few objects plain pickle refuses are measured with cloudpickle, as Ray sends them). `take()`
    returns (bytes, messages) since the last take and starts again from 0."""

    def __init__(self) -> None:
        self._bytes = self._messages = 0

    def add(self, message: Any) -> None:
        try:
            size = len(pickle.dumps(message, protocol=5))
        except Exception:  # noqa: BLE001 - a local class or closure: Ray pickles those with cloudpickle
            import cloudpickle

            size = len(cloudpickle.dumps(message, protocol=5))
        self._bytes += size
        self._messages += 1

    def take(self) -> tuple[int, int]:
        out = (self._bytes, self._messages)
        self._bytes = self._messages = 0
        return out


_ray_results: ByteMeter | None = None  # this process's meter of Ray call results (meter_ray_results)


def meter_ray_results(meter: ByteMeter | None) -> None:
    """From now on count every actor-call result this process receives here in `meter` (None: stop)."""
    global _ray_results
    _ray_results = meter


def count_received(out: T) -> T:
    """`out`, a result this process received through Ray, counted by the `meter_ray_results` meter if any."""
    if _ray_results is not None:
        _ray_results.add(out)
    return out


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
        return count_received(await method.remote(*args, **kwargs))
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
    definition and has no process of its own (`pid` is None). `name` is how errors name the part
    (default: the actor handle's repr, `Actor(InferenceWorker, <id>)`, or the object's class)."""

    def __init__(self, target: Any, name: str | None = None) -> None:
        self.target = target
        self._name = name

    @property
    def name(self) -> str:
        """The part as errors name it."""
        name = getattr(self, "_name", None)  # a subclass with an __init__ of its own may not set it
        if name is not None:
            return name
        return repr(self.target) if self.is_actor else type(self.target).__name__

    async def call_within(self, timeout_s: float, method: Any, *args: Any, **kwargs: Any) -> Any:
        """`invoke(method, *args, **kwargs)` bounded by `timeout_s` seconds (a bound of
        workers/core/bounds.py, read by the caller at call time). Raises PartTimeout naming this part and
        the method; whatever the method raises otherwise."""
        call = getattr(method, "__name__", None) or getattr(method, "_method_name", "call")
        return await within(timeout_s, invoke(method, *args, **kwargs), part=self.name, call=call)

    @property
    def is_actor(self) -> bool:
        """True when the target is a Ray actor handle."""
        return is_actor_method(getattr(self.target, "__ray_call__", None))

    async def ping(self) -> None:
        """A no-op round trip; raises the actor's death (`actor_died`) when it is gone."""
        if self.is_actor:
            count_received(await within(bounds.STATUS_S, self.target.__ray_call__.remote(_noop), part=self.name, call="ping"))

    async def pid(self) -> int | None:
        """The actor's process id; None for a local object. Raises PartTimeout past bounds.STATUS_S."""
        if not self.is_actor:
            return None
        return count_received(await within(bounds.STATUS_S, self.target.__ray_call__.remote(_pid), part=self.name,
                                      call="pid"))

    async def run_inside(self, fn: Any, *args: Any) -> Any:
        """`fn(instance, *args)` inside the actor's process (`__ray_call__`), or on the local
        object itself."""
        if self.is_actor:
            return count_received(await self.target.__ray_call__.remote(fn, *args))
        out = fn(self.target, *args)
        return await out if inspect.isawaitable(out) else out


def _noop(_: Any) -> None:
    return None


def _pid(_: Any) -> int:
    return os.getpid()
