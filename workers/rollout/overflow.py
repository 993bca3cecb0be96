"""Context overflow is a result, not a crash: the `rollout.overflow` policy for a truncated rollout.

A rollout is truncated when its gateway session ran out of context (`SessionCapture.context_exceeded`):
a request whose prompt left no room to generate was answered in the API's own error shape (OpenAI
400 `context_length_exceeded`, Anthropic 400 `invalid_request_error` "prompt is too long"), or a
generation was cut at the context's end (workers/gateway/turns.py). Such a rollout ends with status
`truncated` (its own terminal state in the driver's `RolloutLedger`), whatever the agent did with
the 400, and `rollout.overflow` decides what its tokens train on:

- `train_zero` (default): trained at reward 0, whatever the agent reported (tinker-cookbook PR
  #506's neutral overflow reward): running out of context earns no credit, and the group's baseline
  still counts it;
- `drop`: not trained (reward None), and left out of its group's baseline (DAPO's overlong
  filtering, applied to whole rollouts);
- `train_reward`: trained with the agent's own reward; a truncated rollout whose agent reported no
  usable reward is not trained (reward None), as `drop`.

Pure: no I/O. Callers: workers/rollout/worker.py; orchestrator/config/rollout.py validates the name
through RolloutSettings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

OverflowPolicy = Literal["train_zero", "drop", "train_reward"]
OVERFLOW_POLICIES: tuple[OverflowPolicy, ...] = ("train_zero", "drop", "train_reward")
TRUNCATED = "context_length_exceeded"  # the error prefix of a truncated rollout (the APIs' own code)


@dataclass(frozen=True)
class Truncation:
    """What a truncated rollout is stored with: `reward` (None: not trained) and the `error` line
    that says why and what the policy did with the agent's reward."""

    reward: float | None
    error: str


def truncation(policy: OverflowPolicy, agent_reward: float | None, agent_error: str | None) -> Truncation:
    """The reward and error of a rollout that ran out of context under `policy`.

    agent_reward: the reward the agent reported (None: none usable, `agent_error` says why).
    Raises ValueError for an unknown policy.
    """
    if policy not in OVERFLOW_POLICIES:
        raise ValueError(f"rollout.overflow must be one of {list(OVERFLOW_POLICIES)}, got {policy!r}")
    reported = f"agent reward {agent_reward}" if agent_reward is not None else f"no agent reward ({agent_error})"
    reward = {"train_zero": 0.0, "drop": None, "train_reward": agent_reward}[policy]
    fate = "not trained" if reward is None else f"trained at reward {reward}"
    return Truncation(reward, f"{TRUNCATED}: the session ran out of context; {reported}; {fate} "
                              f"(rollout.overflow={policy})")
