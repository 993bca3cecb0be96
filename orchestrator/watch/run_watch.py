"""What the console must tell a person about a run beyond its numbers: warnings from consecutive
step records (a mostly filtered run, a burst of failed rollouts, a slow step, a throttled ACR) and
the verdict on a run that trained nothing.

Pure: step records (the dicts the loops log; ledger counts are cumulative) in, messages out; no
clock, no I/O. Callers: orchestrator/watch/progress.py (warnings, printed however quiet the console) and
orchestrator/main.py (`nothing_trained`, exit status 1).

Invariant: each kind of warning is given at most once per `REPEAT_STEPS` steps, so a run that stays
mostly filtered warns again now and then but never floods the console.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MOSTLY_FILTERED = 0.8  # fraction of the rollouts finished in a step that were filtered (zero reward variance)
FAILURE_BURST = 0.25  # fraction of the rollouts finished in a step that failed
SLOW_STEP = 3.0  # a step this many times the median of the earlier steps (after the first) is slow
MIN_STEPS_FOR_SLOW = 3  # earlier steps needed before "slow" means anything
REPEAT_STEPS = 10  # a warning of one kind at most once per this many steps
FINISHED = ("rollout/completed", "rollout/filtered", "rollout/failed", "rollout/expired", "rollout/truncated")


def _num(rec: dict, key: str) -> float:
    v = rec.get(key, 0.0)
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else 0.0


@dataclass
class StepWatch:
    """Feed every step record to `on_step`; it returns the warnings that step raised."""

    _prev: dict[str, float] = field(default_factory=dict)
    _step_s: list[float] = field(default_factory=list)
    _last_warned: dict[str, int] = field(default_factory=dict)

    def on_step(self, step: int, rec: dict[str, float]) -> list[str]:
        delta = {k: _num(rec, k) - self._prev.get(k, 0.0) for k in (*FINISHED, "acr/throttled")}
        self._prev = {k: _num(rec, k) for k in (*FINISHED, "acr/throttled")}
        finished = sum(delta[k] for k in FINISHED)
        out: list[tuple[str, str]] = []
        if finished > 0 and delta["rollout/filtered"] / finished >= MOSTLY_FILTERED:
            reward = rec.get("reward/mean")
            mean = f", mean reward {reward:.2f}" if isinstance(reward, (int, float)) and math.isfinite(reward) else ""
            out.append(("filtered", f"step {step}: {int(delta['rollout/filtered'])} of {int(finished)} rollouts "
                        f"were filtered (every sample of their group got the same reward: nothing to learn{mean}); "
                        "the prompts may be too easy or too hard for the policy, or the reward or the sampling "
                        "temperature may not vary"))
        if finished > 0 and delta["rollout/failed"] / finished >= FAILURE_BURST:
            out.append(("failed", f"step {step}: {int(delta['rollout/failed'])} of {int(finished)} rollouts failed "
                        "(reasons in RUN_DIR/logs/ and summary.json rollout/failed/*)"))
        if delta["acr/throttled"] > 0:
            out.append(("throttled", f"step {step}: ACR throttled {int(delta['acr/throttled'])} requests "
                        "(rollout.acr.limits paces below the quota; ask AWS for a higher one to go faster)"))
        step_s = _num(rec, "timing_s/step")
        earlier = sorted(self._step_s[1:])  # the first step holds warm-up
        if len(earlier) >= MIN_STEPS_FOR_SLOW and step_s > SLOW_STEP * earlier[len(earlier) // 2]:
            out.append(("slow", f"step {step} took {step_s:.1f} s, {step_s / earlier[len(earlier) // 2]:.1f}x the "
                        "median step (timing_s/* in metrics.jsonl show where the time went)"))
        self._step_s.append(step_s)
        warnings = []
        for kind, msg in out:
            if step - self._last_warned.get(kind, -REPEAT_STEPS) >= REPEAT_STEPS:
                self._last_warned[kind] = step
                warnings.append(msg)
        return warnings


def nothing_trained(summary: dict) -> str | None:
    """The exit message of a run that trained no group (None when one was trained), naming what
    happened to its rollouts: none completed, or they completed and were all filtered."""
    if summary.get("rollout/trained_groups", 0) > 0 or summary.get("steps", 0) == 0:
        return None
    n = {k.split("/")[1]: int(summary.get(k, 0)) for k in ("rollout/dispatched", *FINISHED)}
    if n["filtered"] == 0 and n["expired"] == 0:
        cut = (f", {n['truncated']} ran out of context (rollout.max_context_tokens; rollout.overflow)"
               if n["truncated"] else "")
        return f"no rollout completed ({n['failed']} of {n['dispatched']} failed{cut}; see summary.json and logs/)"
    return (f"nothing was trained: of {n['dispatched']} rollouts, {n['filtered']} completed and were filtered "
            f"(every group's rewards were equal: no learning signal; algorithm.filter_zero_variance), "
            f"{n['failed']} failed, {n['expired']} expired; the policy did not change (see summary.json)")


FAILURE_HINTS = {  # rollout/failed/{reason} (workers/rollout/failures.py) -> what to check first
    "agent_error": "the agent raised or could not finish (its log in RUN_DIR/logs/); an agent that cannot reach "
                   "the gateway fails this way: gateway.advertise_url must be reachable from where the agent runs",
    "timeout": "rollouts ran past rollout.timeout_s",
    "bad_result": "the agent's results broke the rollout contract (rollout.contract, docs/agents.md)",
    "throttled": "ACR throttled the calls: lower rollout.acr.limits.requests_per_s or raise the account's quota",
    "acr_error": "ACR refused the calls: check rollout.acr.agent_runtime_arn, its qualifier and the credentials",
    "acr_unavailable": "the ACR endpoint could not be reached",
    "s3_unavailable": "S3, the result store (rollout.acr.s3_bucket), could not be reached, by this run or by the agents "
                      "writing their results: with rollout=local moto was down or restarting (local/server_restarts), "
                      "on AWS check the bucket's region and the network; not the agent's fault",
    "transport": "the connection to the agent dropped",
    "engine_lost": "no inference replica answered the agent's model calls",
    "nonlinear_history": "the agents edited their message history under gateway.history_mode=linear with "
                         "gateway.on_nonlinear=error: use reset or passthrough for agents that compact or edit",
    "actor_lost": "the rollout actors died (RUN_DIR/logs/)",
    "setup_timeout": "the agents' setup (rollout.contract=a2a) ran past rollout.setup_timeout_s: raise it, or make "
                     "the container start faster",
    "setup_failed": "the agents' setup raised (rollout.contract=a2a): the task's FAILED status text names why",
}


def stopped_early(summary: dict) -> str:
    """The exit message of a run its loop stopped early (`summary["stopped"]`): why, the most common
    failure reason with its count, and what to check for it."""
    reasons = {k.split("/", 2)[2]: int(v) for k, v in summary.items()
               if k.startswith("rollout/failed/") and isinstance(v, (int, float)) and v}
    text = str(summary["stopped"])
    if reasons:
        top = max(reasons, key=reasons.get)
        text += (f"; most common reason: {top} ({reasons[top]} of {int(summary.get('rollout/failed', 0))} failed)"
                 + (f": {FAILURE_HINTS[top]}" if top in FAILURE_HINTS else ""))
    return text + " (summary.json, report/)"
