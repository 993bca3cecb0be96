"""What happens to the rollouts of a rollout actor that died: pure decisions, no Ray or asyncio.

A rollout actor (workers/rollout/actor.py `RolloutActor`) runs many rollouts at once; when its
process dies (SIGKILL, OOM, node loss) the driver learns only that the call failed, not which of
its rollouts had already stored their sample. The pool assigns every attempt its ACR session id
before dispatch, so after a loss it can ask the buffer which of the lost attempts stored a sample
and hand the facts to `plan_lost`, which decides each attempt's fate:

- `settled`: the attempt stored its sample before the actor died; its outcome stands (it is read
  back from the buffer), nothing is run again;
- `redispatch`: nothing was stored and the request has re-dispatches left
  (`max_redispatch`, `rollout.redispatch_lost`): it runs again under a NEW session id (the old
  session may still exist at ACR and in the gateway);
- `failed`: nothing was stored and no re-dispatch is left: the pool stores a failed sample with
  reason `actor_lost` (no rows, no reward: never trained).

`to_stop` lists the ACR sessions of every lost attempt (a stored attempt too: the worker stores
its sample before it stops its session), which the pool stops through a live actor.

Invariant (tested): every lost attempt lands in exactly one of `settled`, `redispatch` (as its
successor, attempt number + 1, a fresh session id) or `failed`, so each request still ends with
exactly one stored sample and the ledger identity dispatched = completed + filtered + failed +
expired holds. Callers: workers/rollout/pool.py.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from workers.core.types import RolloutRequest

ACTOR_LOST = "actor_lost"  # the failure reason of a rollout whose actor died (rollout/failed/actor_lost)


@dataclass(frozen=True)
class Attempt:
    """One dispatch of a request: the session id the pool gave it and its number (0: first)."""

    req: RolloutRequest
    session_id: str
    number: int = 0


@dataclass(frozen=True)
class LostPlan:
    """The fate of each lost attempt (see the module docstring)."""

    settled: tuple[Attempt, ...]
    redispatch: tuple[Attempt, ...]
    failed: tuple[Attempt, ...]
    to_stop: tuple[str, ...]


def plan_lost(lost: Sequence[Attempt], stored: Collection[str], *, max_redispatch: int,
              new_session_id: Callable[[RolloutRequest], str]) -> LostPlan:
    """Decide the fate of the attempts of a dead actor.

    lost: the attempts the dead actor was running; stored: session ids that have a sample in the
    buffer; max_redispatch: how many times one request may be re-dispatched (0: fail at once);
    new_session_id: a fresh session id for a request. Raises ValueError on max_redispatch < 0 or
    an attempt listed twice (a double count is a bug).
    """
    if max_redispatch < 0:
        raise ValueError(f"rollout.redispatch_lost must be >= 0, got {max_redispatch}")
    seen: set[str] = set()
    settled, again, failed = [], [], []
    for a in lost:
        if a.session_id in seen:
            raise ValueError(f"attempt {a.session_id} listed twice among lost attempts")
        seen.add(a.session_id)
        if a.session_id in stored:
            settled.append(a)
        elif a.number < max_redispatch:
            again.append(Attempt(a.req, new_session_id(a.req), a.number + 1))
        else:
            failed.append(a)
    return LostPlan(tuple(settled), tuple(again), tuple(failed), tuple(a.session_id for a in lost))
