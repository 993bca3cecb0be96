"""RolloutSettings: what every rollout of a run shares, with the one default and the one check of
each value.

Invariant: a setting the `rollout` config group maps onto these fields has its default here and
nowhere else; orchestrator/config/rollout.py takes its field defaults from here
(`orchestrator.config.defaults.default_of`) and builds these settings once to validate (tests/test_rollout_settings_source.py fails when the two
drift). The ACR client's own settings (S3 polling, retries) are `workers.acr.client.AcrClientConfig`,
whose polling backoff these settings share for the A2A GetTask and HTTP `get` polls.

Callers: workers/rollout/worker.py (RolloutWorker), orchestrator/config/rollout.py, tests and
scripts/bench_rollout.py. Light: no Ray, no aiohttp.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

from workers.acr.client import POLL_INITIAL_S, POLL_MAX_S
from workers.rollout.contract import Contract
from workers.rollout.overflow import OVERFLOW_POLICIES, OverflowPolicy

__all__ = ["RolloutSettings"]


@dataclass(frozen=True)
class RolloutSettings:
    """What every rollout of a run shares. Times in seconds.

    contract: "s3" (`_rollout`, result in S3), "http" (`_config` + `_agentcore_runtime`) or "a2a".
    http_background: HTTP contract: start in the background and poll `get`; False: the start
        answers the result.
    poll_initial_s, poll_max_s: the backoff (first wait, cap) of the A2A GetTask and the HTTP
        `get` polls, the same as the S3 result poll's (rollout.poll_initial_s / poll_max_s; the
        values are AcrClientConfig's). Every poll is one ACR request under the rate limit.
    push_grace_s: with a result board, once this worker has received one posted result (its
        agents POST to `result_url`), S3 polling of later rollouts starts this long after the
        invoke: a posted result wins without any S3 request, and S3 stays the durable fallback.
        Until then (agents that only write S3) polling starts at once.
    max_consecutive_bad_results: bad agent results in a row that stop the run (ContractError).
    overflow: what a rollout that ran out of context trains on (workers/rollout/overflow.py):
        train_zero (reward 0), drop (not trained) or train_reward (the agent's reward).
    seed: the run seed; each session samples with `session_seed(seed, input_id, group_id,
        sample_index)` (workers/core/seeds.py), so a resumed run or a re-dispatched rollout samples
        what the uninterrupted run would have; None: unseeded.
    """

    exp_id: str
    agent_runtime_arn: str
    qualifier: str | None
    s3_bucket: str
    gateway_base_url: str
    model_id: str
    max_tokens: int
    temperature: float
    top_p: float
    timeout_s: float
    max_context_tokens: int
    contract: Contract = "s3"
    http_background: bool = False
    poll_initial_s: float = POLL_INITIAL_S
    poll_max_s: float = POLL_MAX_S
    push_grace_s: float = 5.0
    max_consecutive_bad_results: int = 32
    seed: int | None = None
    delete_results: bool = False
    setup_timeout_s: float | None = None  # a2a: the setup phase's bound (None: timeout_s)
    run_timeout_s: float | None = None  # a2a: the run phase's bound (None: timeout_s)
    overflow: OverflowPolicy = "train_zero"

    def __post_init__(self) -> None:
        """The one check of these values; each message starts with the config key that sets it
        (orchestrator/config/rollout.py turns the ValueError into a ConfigError)."""
        if self.overflow not in OVERFLOW_POLICIES:
            raise ValueError(f"rollout.overflow must be one of {list(OVERFLOW_POLICIES)} (what a rollout that ran out "
                             f"of context trains on), got {self.overflow!r}")
        if self.contract not in get_args(Contract):
            raise ValueError(f"rollout.contract must be one of {list(get_args(Contract))}, got {self.contract!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"rollout.timeout_s must be > 0, got {self.timeout_s}")
        for key in ("setup_timeout_s", "run_timeout_s"):
            value = getattr(self, key)
            if value is not None and (self.contract != "a2a" or value <= 0):
                raise ValueError(f"rollout.{key} must be > 0 or null, and applies to rollout.contract=a2a only "
                                 f"(the setup/run split), got {value} with contract {self.contract!r}")
        if self.push_grace_s < 0:
            raise ValueError(f"rollout.push_grace_s must be >= 0, got {self.push_grace_s}")
        if self.max_consecutive_bad_results < 1:
            raise ValueError(f"rollout.max_consecutive_bad_results must be >= 1, got {self.max_consecutive_bad_results}")
        if not 0 < self.poll_initial_s <= self.poll_max_s:
            raise ValueError(f"rollout.poll_initial_s and rollout.poll_max_s: need 0 < poll_initial_s <= poll_max_s, "
                             f"got {self.poll_initial_s}, {self.poll_max_s}")
        if self.temperature <= 0:
            raise ValueError(f"rollout.temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"rollout.max_tokens must be >= 1, got {self.max_tokens}")
        if self.max_context_tokens <= self.max_tokens:
            raise ValueError(f"rollout.max_context_tokens must be > rollout.max_tokens={self.max_tokens} "
                             f"(prompt + answer must fit), got {self.max_context_tokens}")

