"""A stopped run stops every ACR session it opened before the emulator goes (issue 14, item 6).

Pure asyncio, no Ray, no HTTP: a `RolloutActor` in this process runs its `RolloutWorker` over an
in-memory ACR whose StopRuntimeSession takes a while, as the real one does under load. The driver
stops a run by shutting the actor down while its rollouts are in flight (`RolloutPool.shutdown`);
the moment `shutdown` returns, the emulator may be stopped, so every session must be stopped by then.
"""

from __future__ import annotations

import asyncio
from collections import Counter

from workers.core.types import RolloutRequest
from workers.rollout.actor import RolloutActor
from workers.rollout.stops import SessionStops
from workers.rollout.worker import NoGateway, RolloutSettings, RolloutWorker

ARN = "arn:aws:bedrock-agentcore:us-east-1:000000000000:runtime/fake"
TIMEOUT_S = 10.0  # bound on every await of the test itself


class SlowStopAcr:
    """AcrCalls in memory: `invoke` opens a session whose agent never answers; `stop_session` takes
    `stop_s[i]` seconds for the i-th stop (so a sibling's stop is still in flight when one ends)."""

    def __init__(self, stop_s: list[float]) -> None:
        self.open: set[str] = set()
        self.invoked = asyncio.Event()
        self._stop_s = list(stop_s)

    async def invoke(self, arn: str, session_id: str, payload: dict, qualifier: str | None = None) -> dict:
        self.open.add(session_id)
        self.invoked.set()
        return {}

    async def stop_session(self, arn: str, session_id: str, qualifier: str | None = None) -> bool:
        await asyncio.sleep(self._stop_s.pop(0) if self._stop_s else 0.0)
        was_open = session_id in self.open
        self.open.discard(session_id)
        return was_open

    async def wait_for_result(self, bucket: str, key: str, timeout_s: float) -> dict | None:
        await asyncio.sleep(3600)  # the agent never answers: the rollout is in flight until cancelled
        return None


class NullSink:
    async def put(self, samples, partition: str) -> None:
        pass


def settings() -> RolloutSettings:
    return RolloutSettings(exp_id="exp-stop", agent_runtime_arn=ARN, qualifier=None, s3_bucket="b",
                           gateway_base_url="", model_id="m", max_tokens=8, temperature=1.0, top_p=1.0,
                           timeout_s=600.0, max_context_tokens=64)


def requests(n: int) -> list[RolloutRequest]:
    return [RolloutRequest(group_id=0, sample_index=i, input_id=f"p{i}", row={"prompt": "x"}) for i in range(n)]


async def until_open(acr: SlowStopAcr, n: int) -> None:
    async with asyncio.timeout(TIMEOUT_S):
        while len(acr.open) < n:
            await asyncio.sleep(0.005)


async def test_shutdown_mid_batch_stops_every_session_before_it_returns():
    """Regression (issue 14): a sync run stopped by SIGTERM left 1-2 ACR sessions open. A rollout
    actor runs a shard of several rollouts; `shutdown` cancels them; the first to finish its stop
    ends `run_many`'s gather, which cancelled its siblings a second time while their shielded stops
    were in flight: they gave up waiting, the actor closed, and the emulator stopped before them."""
    acr = SlowStopAcr(stop_s=[0.01, 0.3, 0.2, 0.25])
    actor = RolloutActor(settings(), None, None)
    worker = RolloutWorker(settings(), NoGateway(), acr, NullSink())
    actor._worker = worker  # the actor's own build needs the ACR client and limit actors
    run = asyncio.ensure_future(actor.run_many(requests(4), "step-1"))
    await until_open(acr, 4)
    async with asyncio.timeout(TIMEOUT_S):
        await actor.shutdown()
    assert acr.open == set()  # every session stopped before shutdown returned
    assert worker.sessions_open == 0
    async with asyncio.timeout(TIMEOUT_S):
        await asyncio.gather(run, return_exceptions=True)


class FlakyStopAcr:
    """StopCalls whose first `fail` stops raise (the endpoint is restarting), later ones succeed."""

    def __init__(self, fail: int) -> None:
        self.fail = fail
        self.stopped: list[str] = []

    async def stop_session(self, arn: str, session_id: str, qualifier: str | None = None) -> bool:
        if self.fail > 0:
            self.fail -= 1
            raise ConnectionError("emulator restarting")
        self.stopped.append(session_id)
        return True


async def test_a_failed_stop_keeps_its_slot_until_close_stops_it():
    """A stop that fails keeps the session counted open and its slot held (never over the cap);
    `close` (the actor's shutdown) does not leave its background retry behind: it tries once more
    at once, gives the slot back once, and leaves no task running."""
    acr, released, counts = FlakyStopAcr(fail=1), [], Counter()
    stops = SessionStops(acr, ARN, None, on_stopped=lambda: released.append(1), counts=counts)
    stops.opened("s-fails")
    stops.opened("s-ok")
    await stops.stop("s-fails")
    await stops.stop("s-ok")
    assert (stops.open, len(released), counts["acr/stop_failed"]) == (1, 1, 1)
    assert stops.open_ids() == {"s-fails"} and stops.is_open("s-fails")  # what the run's journal keeps
    async with asyncio.timeout(TIMEOUT_S):  # well before the retry's STOP_RETRY_EVERY_S
        await stops.close()
    assert (stops.open, len(released), counts["acr/stop_recovered"]) == (0, 2, 1)
    assert sorted(acr.stopped) == ["s-fails", "s-ok"]
    assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []


async def test_a_stop_survives_its_rollout_being_cancelled_twice():
    """The stop is a task of its own: the rollout stops waiting when cancelled again, the session
    still gets stopped, and `close` returns only after that."""
    acr = SlowStopAcr(stop_s=[0.2])
    acr.open.add("s1")
    released: list[int] = []
    stops = SessionStops(acr, ARN, None, on_stopped=lambda: released.append(1), counts=Counter())
    stops.opened("s1")
    waiting = asyncio.ensure_future(stops.stop("s1"))
    await asyncio.sleep(0.01)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert waiting.cancelled() and acr.open == {"s1"}  # the rollout gave up waiting; the stop is in flight
    async with asyncio.timeout(TIMEOUT_S):
        await stops.close()
    assert acr.open == set() and stops.open == 0 and released == [1]
