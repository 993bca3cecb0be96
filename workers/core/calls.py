"""Calling a method on a Ray actor handle or on a plain local object, the same way.

Parts are handed either actor handles (production) or plain objects (tests, benchmarks, one
process). `call(obj, "method", *args)` awaits `obj.method.remote(*args)` for an actor (a Ray
ObjectRef is awaitable, so no Ray import is needed here) and `obj.method(*args)` otherwise,
awaiting the result when the method is a coroutine function. `is_actor_method` tells the two apart;
`actor_died` tells a dead actor from an error its method raised.

Invariant: the method is called exactly once, and its result (or exception) is returned as is.
"""

from __future__ import annotations

import inspect
from typing import Any


def actor_died(exc: BaseException) -> bool:
    """True when `exc` says the Ray actor behind a call is gone: its process died (SIGKILL, OOM,
    node loss). Ray raises `ray.exceptions.RayActorError` (or a subclass: ActorDiedError,
    ActorUnavailableError); recognised by class name, so no Ray import is needed here."""
    return any(c.__name__ == "RayActorError" for c in type(exc).__mro__)


def is_actor_method(fn: Any) -> bool:
    """True when `fn` is a Ray actor method (it has `.remote`), False for a plain callable."""
    return callable(getattr(fn, "remote", None))


async def call(obj: Any, method: str, *args: Any, **kwargs: Any) -> Any:
    """Await `obj.<method>(*args, **kwargs)` on an actor handle or a local object.

    Raises AttributeError when `obj` has no such method; whatever the method raises propagates.
    """
    fn = getattr(obj, method)
    if is_actor_method(fn):
        return await fn.remote(*args, **kwargs)
    out = fn(*args, **kwargs)
    return await out if inspect.isawaitable(out) else out
