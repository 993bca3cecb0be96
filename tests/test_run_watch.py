"""The console's warnings and the nothing-trained verdict (orchestrator/watch/run_watch.py), from step
records built here; counts are cumulative, as the ledger logs them."""

from orchestrator.watch.run_watch import REPEAT_STEPS, StepWatch, nothing_trained


def rec(completed=0, filtered=0, failed=0, expired=0, step_s=1.0):
    return {"rollout/completed": completed, "rollout/filtered": filtered, "rollout/failed": failed,
            "rollout/expired": expired, "timing_s/step": step_s}


def test_a_mostly_filtered_run_warns_once_per_window():
    """Regression (new-user report): temperature near 0 filtered 95 % of rollouts and the run said nothing."""
    w = StepWatch()
    warned = [w.on_step(s, rec(completed=2 * s, filtered=38 * s)) for s in range(1, 2 * REPEAT_STEPS + 1)]
    assert "step 1: 38 of 40 rollouts were filtered" in warned[0][0]
    assert [s for s, ws in enumerate(warned, 1) if ws] == [1, 1 + REPEAT_STEPS]


def test_a_healthy_step_does_not_warn_and_the_window_is_per_step_not_cumulative():
    w = StepWatch()
    assert w.on_step(1, rec(completed=4, filtered=36)) != []  # 90 % filtered in step 1
    # step 2: 36 more trained, 4 more filtered -> 10 % of this step, although 40 of 80 overall
    assert w.on_step(2, rec(completed=40, filtered=40)) == []


def test_failure_burst_and_slow_step():
    w = StepWatch()
    for s in range(1, 5):
        assert w.on_step(s, rec(completed=16 * s, step_s=10.0 if s == 1 else 2.0)) == []  # step 1: warm-up
    [burst] = w.on_step(5, rec(completed=72, failed=8))  # 8 of 16 finished in step 5 failed
    assert "8 of 16 rollouts failed" in burst
    [slow] = w.on_step(6, rec(completed=88, failed=8, step_s=7.0))  # median of steps 2..5 is 2 s
    assert "step 6 took 7.0 s, 3.5x the median step" in slow


def test_nothing_trained_names_what_happened():
    """Regression: 28 of 32 rollouts completed and were all filtered, and the run said
    'no rollout completed' (or exited 0)."""
    msg = nothing_trained({"steps": 2, "rollout/dispatched": 32, "rollout/completed": 0, "rollout/filtered": 28,
                           "rollout/failed": 4, "rollout/expired": 0, "rollout/trained_groups": 0})
    assert msg.startswith("nothing was trained: of 32 rollouts, 28 completed and were filtered")
    assert "4 failed" in msg and "no rollout completed" not in msg
    assert nothing_trained({"steps": 1, "rollout/dispatched": 8, "rollout/failed": 8}).startswith(
        "no rollout completed (8 of 8 failed")
    assert nothing_trained({"steps": 1, "rollout/dispatched": 8, "rollout/completed": 4,
                            "rollout/trained_groups": 1}) is None


def test_a_run_stopped_by_failures_names_the_most_common_reason_and_what_to_check():
    from orchestrator.watch.run_watch import stopped_early

    summary = {"stopped": "step 1: all 4 rollouts failed (1 distinct error(s); e.g. x)", "rollout/failed": 4,
               "rollout/failed/agent_error": 3, "rollout/failed/timeout": 1}
    text = stopped_early(summary)
    assert text.startswith("step 1: all 4 rollouts failed")
    assert "most common reason: agent_error (3 of 4 failed)" in text and "gateway.advertise_url" in text


async def test_the_throttle_warning_fires_from_the_per_step_acr_count():
    """Issue 29: the throttled-ACR warning never fired: the step records had no `acr/throttled`
    (only summary.json did). The step probe now adds the pool's running count."""
    from orchestrator.wiring.training import _pool_recovery_metrics

    class Pool:  # the two things the probe reads of workers/rollout/pool.py RolloutPool
        counts = {"rollout/actors_lost": 0, "rollout/redispatched": 0}
        throttled = 0

        async def acr_stats(self):
            return {"throttled": self.throttled, "invocations": 10}

    pool, w = Pool(), StepWatch()
    assert w.on_step(1, {**rec(completed=16), **await _pool_recovery_metrics(pool)}) == []
    pool.throttled = 5
    [warning] = w.on_step(2, {**rec(completed=32), **await _pool_recovery_metrics(pool)})
    assert "step 2: ACR throttled 5 requests" in warning
