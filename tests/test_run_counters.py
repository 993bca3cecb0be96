"""The run's carried counters: a resumed run's summary counts ACR calls and failure reasons for the
whole run (the checkpoint's plus this process's), never the ledger's own totals twice."""

from __future__ import annotations

import asyncio

from orchestrator.wiring.training import _acr_totals


class Pool:
    def __init__(self, now: dict[str, int] | None, stuck: bool = False) -> None:
        self.now, self.stuck = now, stuck

    async def acr_counts(self) -> dict[str, int]:
        if self.stuck:
            await asyncio.sleep(3600)
        return dict(self.now or {})


def test_failure_reasons_and_acr_calls_add_the_checkpoints_to_this_processs():
    restored = {"acr/requests": 30, "rollout/failed/timeout": 2, "rollout/failed": 9, "rollout/dispatched": 40}
    now = {"acr/requests": 12, "rollout/failed/timeout": 1, "rollout/failed/agent_error": 4}
    got = asyncio.run(_acr_totals(Pool(now), restored)())
    assert got == {"acr/requests": 42, "rollout/failed/agent_error": 4, "rollout/failed/timeout": 3}


def test_a_stuck_pool_leaves_the_checkpoints_counts(monkeypatch):
    import orchestrator.wiring.training as training

    monkeypatch.setattr(training, "ACR_STATS_WAIT_S", 0.05)
    got = asyncio.run(_acr_totals(Pool(None, stuck=True), {"rollout/failed/timeout": 2})())
    assert got == {"rollout/failed/timeout": 2}
