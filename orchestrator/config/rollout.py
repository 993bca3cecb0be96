"""`rollout` group: the rollout pool and its ACR endpoint; maps to the rollout workers'
RolloutSettings (workers/rollout/worker.py), the ACR client's AcrClientConfig
(workers/acr/client.py), the cluster-wide AcrLimitsConfig (workers/acr/limits/, which also
validates `rollout.acr.limits.*`) and the trajectory buffer's BufferConfig.

One source per setting: a field these settings take has its default in the settings dataclass
(`default_of`) and its check in that dataclass's `__post_init__`, reached here by building the
settings once; validation returns values and writes nothing into the config. The contract names
are workers/rollout/contract.py's `Contract`."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Optional

from orchestrator.loop.concurrency import CONCURRENCY_CHOICES, AimdConcurrency, GroupLimit
from orchestrator.loop.throughput_concurrency import ProbeSettings, ThroughputConcurrency
from orchestrator.config.errors import ConfigError, check, one_of
from workers.acr.arn import check_bucket_name, parse_runtime_arn
from orchestrator.config.defaults import default_of
from workers.acr.limits import AcrLimitsConfig
from workers.acr.client import AcrClientConfig
from workers.rollout.settings import RolloutSettings

if TYPE_CHECKING:
    from workers.buffer.store import BufferConfig

ROLLOUT_BACKENDS = ("local", "aws")  # local: the ACR emulator + moto S3 on loopback; aws: real AWS


@dataclass
class AcrLimitsSchema:
    """Cluster-wide ACR limits (workers/acr/limits/), each held by one named Ray actor.

    requests_per_s: cap on EVERY ACR request (invoke, get, stop, command, botocore retries
    included) in any 1 s window; headroom: fraction of it the token bucket holds back for the
    delay between a grant and its request (see AcrLimitsConfig).
    max_open_sessions: ACR sessions open at once (invoked, not yet stopped), whole cluster: the
    container slots. sessions_per_s: new sessions created per second, whole cluster (null: only
    requests_per_s bounds them).
    """

    requests_per_s: float = default_of(AcrLimitsConfig, "requests_per_s")
    headroom: float = default_of(AcrLimitsConfig, "headroom")
    max_open_sessions: int = default_of(AcrLimitsConfig, "max_open_sessions")
    sessions_per_s: Optional[float] = default_of(AcrLimitsConfig, "sessions_per_s")

    def __post_init__(self) -> None:
        self.typed()  # AcrLimitsConfig checks the values, naming rollout.acr.limits.<key>

    def typed(self) -> AcrLimitsConfig:
        """The limit actors' settings; raises ConfigError naming the key."""
        try:
            return AcrLimitsConfig(requests_per_s=self.requests_per_s, headroom=self.headroom,
                                   max_open_sessions=self.max_open_sessions, sessions_per_s=self.sessions_per_s)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


@dataclass
class AcrConfig:
    """ACR endpoint. With `rollout=local` the emulator and moto S3 are started on loopback and
    `agent_runtime_arn` / `s3_bucket` point at them; with `rollout=aws` they name real AWS resources
    (both required, their form checked here, the bucket's existence by pre-flight) and `region`
    null takes the ARN's region (as agentcore-rl-toolkit does; a different explicit region is refused)."""

    agent_runtime_arn: str = "arn:aws:bedrock-agentcore:us-west-2:000000000000:runtime/letters-agent"
    qualifier: str = "DEFAULT"
    s3_bucket: str = "rollouts"
    region: Optional[str] = "us-west-2"
    num_agents: int = 2
    session_rate_per_s: float = 25.0
    agent_cmd: str | None = None  # null: the built-in letters agent, run with this Python
    agent_env: dict[str, str] = field(default_factory=dict)  # extra env vars of the agent processes
    limits: AcrLimitsSchema = field(default_factory=lambda: AcrLimitsSchema())
    retry_mode: str = default_of(AcrClientConfig, "retry_mode")  # botocore retry mode for throttling / 5xx
    max_attempts: int = default_of(AcrClientConfig, "max_attempts")  # botocore total attempts per call
    runtime_error_attempts: int = default_of(AcrClientConfig, "runtime_error_attempts")  # invocations of one session on RuntimeClientError (424)
    # rollout=local only: fault injection rates of the emulator (workers/embedded/faults.py FaultRates
    # fields, e.g. {crash: 0.05, throttle: 0.05, seed: 1}); empty: none
    faults: dict[str, float] = field(default_factory=dict)
    # DeleteObject on each result once read (S3 contract): rollout=local's moto keeps every object
    # in memory (+~22 MB per 100 steps of the default run, scripts/soak.py); on AWS the bucket is
    # the durable record, bounded by the bucket's lifecycle rule
    delete_results: bool = default_of(RolloutSettings, "delete_results")


@dataclass
class AdaptiveConcurrencyConfig:
    """The concurrency policies' knobs (orchestrator/loop/concurrency.py).

    `rollout.concurrency=adaptive` (orchestrator/loop/throughput_concurrency.py): probe a cap
    `probe_step` above and below the current one, keep the largest within `tolerance` of the best
    measured throughput (groups finished per second); KV usage (0..1) only trims: an up probe
    starts only below `grow_below`, the cap is cut when usage stands at or above `trim_at` for
    `kv_persist_s` seconds, and above `cancel_above` the groups over the cut cap are to be
    cancelled; a queue of more than `max_waiting` requests standing `waiting_persist_s` seconds
    cuts; a window measures at least `min_window_s` seconds.

    `rollout.concurrency=aimd` (the earlier policy, kept for comparison): admit groups while the
    engines' mean KV-cache usage (time-averaged over >= `interval_s`) is below `kv_target` (0..1),
    no more than `max_waiting` requests wait on any engine (time-averaged too) and none was
    preempted; the group limit moves at most once per `interval_s`
    seconds (one group up, or down to `decrease` x the limit). Both sit under the staleness
    budget (`async.max_staleness`): if that binds first the cache cannot fill (configs/rollout/)."""

    kv_target: float = 0.8
    interval_s: float = 2.0
    decrease: float = 0.9
    max_waiting: float = 0.5
    probe_step: float = default_of(ProbeSettings, "probe_step")
    tolerance: float = default_of(ProbeSettings, "tolerance")
    grow_below: float = default_of(ProbeSettings, "grow_below")
    trim_at: float = default_of(ProbeSettings, "trim_at")
    cancel_above: float = default_of(ProbeSettings, "cancel_above")
    waiting_persist_s: float = default_of(ProbeSettings, "waiting_persist_s")
    kv_persist_s: float = default_of(ProbeSettings, "kv_persist_s")
    min_window_s: float = default_of(ProbeSettings, "min_window_s")


@dataclass
class RolloutConfig:
    """Rollout pool. `n`: samples per prompt (group size); `batch_size`: prompts per step;
    `timeout_s`: per-rollout deadline (seconds) after which the rollout ends `failed` (reason `timeout`)."""

    name: str = "local"
    n: int = 4
    batch_size: int = 8
    num_workers: int = 2
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    timeout_s: float = 120.0
    acr: AcrConfig = field(default_factory=AcrConfig)  # the endpoint, its agents, limits and retries
    # S3 result, A2A GetTask and HTTP `get` polling backoff (first wait, cap; AcrClientConfig owns the values)
    poll_initial_s: float = default_of(AcrClientConfig, "poll_initial_s")
    poll_max_s: float = default_of(AcrClientConfig, "poll_max_s")
    max_context_tokens: int = 512
    contract: str = default_of(RolloutSettings, "contract")  # s3: `_rollout` + result in S3 | http: `_config` + `_agentcore_runtime` records | a2a: one A2A task (setup, rollout)
    http_background: bool = default_of(RolloutSettings, "http_background")  # http: start in the background and poll `get` (else the start answers)
    push_grace_s: float = default_of(RolloutSettings, "push_grace_s")  # s3: once agents POST results, S3 polling starts this long after the invoke
    # where rollout actors take posted results: an interface address, "auto" (listen on every
    # interface, tell agents this node's routable address; rollout=aws) or "" (S3 polling only)
    result_host: str = "127.0.0.1"
    max_consecutive_bad_results: int = default_of(RolloutSettings, "max_consecutive_bad_results")  # agent results in a row without a usable reward: stop the run
    redispatch_lost: int = 1  # times a rollout whose actor died runs again (new session id), then failed actor_lost
    # a rollout that ran out of context ends `truncated` (workers/rollout/overflow.py); its tokens train
    # at reward 0 (train_zero), not at all (drop) or with the agent's reward (train_reward)
    overflow: str = default_of(RolloutSettings, "overflow")
    # contract=a2a: the two phases' own bounds (null: timeout_s) and the cluster-wide cap on rollouts
    # running past their setup (null: none). Containers are the open-session cap
    # (acr.limits.max_open_sessions): more of them than rollout_slots set up ahead (a warm pool)
    setup_timeout_s: float | None = default_of(RolloutSettings, "setup_timeout_s")
    run_timeout_s: float | None = default_of(RolloutSettings, "run_timeout_s")
    rollout_slots: int | None = None
    concurrency: str = "fixed"  # fixed: (η + 1)·B groups in flight | adaptive: probe for the best throughput | aimd: an AIMD window on the engines' KV cache
    adaptive: AdaptiveConcurrencyConfig = field(default_factory=AdaptiveConcurrencyConfig)

    def __post_init__(self) -> None:
        """Checks of this group's own values; the values the rollout workers and the ACR client take
        are checked by their settings' own `__post_init__` (one check per value), reached here by
        building them once with placeholders for what only the run knows."""
        one_of(self.name, "rollout.name", ROLLOUT_BACKENDS)
        check(self.n >= 1, "rollout.n", "must be >= 1", self.n)
        check(self.batch_size >= 1, "rollout.batch_size", "must be >= 1", self.batch_size)
        check(self.num_workers >= 1, "rollout.num_workers", "must be >= 1", self.num_workers)
        check(self.redispatch_lost >= 0, "rollout.redispatch_lost", "must be >= 0", self.redispatch_lost)
        if self.name == "aws":
            _check_aws(self.acr, self.contract)
        check(bool(acr_region(self.acr)), "rollout.acr.region", "must not be empty", self.acr.region)
        try:
            rollout_settings(self, exp_id="exp-check", agent_runtime_arn=self.acr.agent_runtime_arn,
                             gateway_base_url="", model_id="check")
            acr_client_config(self)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.acr.faults:
            check(self.name == "local", "rollout.acr.faults", "needs rollout=local (the emulator injects them)",
                  dict(self.acr.faults))
            try:
                local_fault_rates(self.acr)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"rollout.acr.faults: {exc}") from None
        one_of(self.concurrency, "rollout.concurrency", CONCURRENCY_CHOICES)
        try:
            concurrency_policy(self)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        check(self.acr.agent_cmd not in ("True", "False"), "rollout.acr.agent_cmd",  # OmegaConf's str of a bool
              "must be a command line: YAML read a bare true/false as a boolean (quote it, "
              "rollout.acr.agent_cmd=\"'true'\", to run the command of that name)", self.acr.agent_cmd)
        check(self.acr.num_agents >= 1, "rollout.acr.num_agents", "must be >= 1", self.acr.num_agents)
        if self.rollout_slots is not None:
            check(self.contract == "a2a", "rollout.rollout_slots", "applies to rollout.contract=a2a only (a rollout "
                  "slot is taken after the agent's setup)", self.rollout_slots)
            try:
                pool_limits(self)  # AcrLimitsConfig checks the value, naming rollout.rollout_slots
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        check(self.acr.session_rate_per_s > 0, "rollout.acr.session_rate_per_s", "must be > 0",
              self.acr.session_rate_per_s)


def acr_region(acr: AcrConfig) -> str | None:
    """The region the ACR and S3 clients use: `rollout.acr.region`, or (null) the runtime ARN's."""
    if acr.region:
        return acr.region
    try:
        return parse_runtime_arn(acr.agent_runtime_arn).region
    except ValueError:
        return None


def _check_aws(acr: AcrConfig, contract: str) -> None:
    """rollout=aws: the runtime ARN's form, the bucket name's form (required with contract=s3 only:
    the http and a2a contracts return results in the invocation), and the region (from the ARN)."""
    required = [("agent_runtime_arn", acr.agent_runtime_arn)] + ([("s3_bucket", acr.s3_bucket)] if contract == "s3" else [])
    for key, value in required:
        check(bool(value), f"rollout.acr.{key}", f"must be set with rollout=aws (add rollout.acr.{key}=...)", value)
    try:
        arn = parse_runtime_arn(acr.agent_runtime_arn)
    except ValueError as exc:
        raise ConfigError(f"rollout.acr.agent_runtime_arn {exc}, got {acr.agent_runtime_arn!r}") from None
    try:
        if acr.s3_bucket or contract == "s3":
            check_bucket_name(acr.s3_bucket)
    except ValueError as exc:
        raise ConfigError(f"rollout.acr.s3_bucket {exc}, got {acr.s3_bucket!r}") from None
    check(acr.region in (None, arn.region), "rollout.acr.region",
          f"must be null or the runtime's region {arn.region!r} (from rollout.acr.agent_runtime_arn)", acr.region)


def concurrency_policy(r: RolloutConfig, min_groups: int = 1, max_groups: int | None = None,
                       start_groups: int | None = None) -> GroupLimit:
    """The policy `rollout.concurrency` names from `rollout.adaptive` (`aimd`, else the
    throughput-seeking `adaptive`), its cap in [min_groups, max_groups] (the adaptive one's: the
    staleness budget's groups, None: unbounded; its cold start `start_groups`, the fixed policy's
    cap in the product; AIMD starts at min_groups). Validates every knob of both; ValueError names the key."""
    a = r.adaptive
    aimd = AimdConcurrency(kv_target=a.kv_target, min_groups=min_groups, interval_s=a.interval_s,
                           decrease=a.decrease, max_waiting=a.max_waiting)
    probe = ProbeSettings(probe_step=a.probe_step, tolerance=a.tolerance, grow_below=a.grow_below,
                          trim_at=a.trim_at, cancel_above=a.cancel_above, max_waiting=a.max_waiting,
                          waiting_persist_s=a.waiting_persist_s, kv_persist_s=a.kv_persist_s,
                          min_window_s=a.min_window_s)
    if r.concurrency == "aimd":
        return aimd
    return ThroughputConcurrency(probe, min_groups=min_groups, max_groups=max_groups, start_groups=start_groups)


def rollout_settings(r: RolloutConfig, *, exp_id: str, agent_runtime_arn: str, gateway_base_url: str,
                     model_id: str, seed: int | None = None) -> RolloutSettings:
    """What every rollout of the run shares (workers/rollout/worker.py); the agents reach the
    policy through the gateway at `gateway_base_url` as `model_id` (`model.served_name`); `seed`
    (the run's) seeds each rollout's sampling (workers/core/seeds.py)."""
    return RolloutSettings(
        exp_id=exp_id, agent_runtime_arn=agent_runtime_arn, qualifier=r.acr.qualifier, s3_bucket=r.acr.s3_bucket,
        gateway_base_url=gateway_base_url, model_id=model_id, max_tokens=r.max_tokens,
        temperature=r.temperature, top_p=r.top_p, timeout_s=r.timeout_s, max_context_tokens=r.max_context_tokens,
        contract=r.contract, http_background=r.http_background, push_grace_s=r.push_grace_s,  # type: ignore[arg-type]
        max_consecutive_bad_results=r.max_consecutive_bad_results, seed=seed,
        poll_initial_s=r.poll_initial_s, poll_max_s=r.poll_max_s,
        setup_timeout_s=r.setup_timeout_s, run_timeout_s=r.run_timeout_s,
        delete_results=r.acr.delete_results, overflow=r.overflow)  # type: ignore[arg-type]


def pool_limits(r: RolloutConfig) -> AcrLimitsConfig:
    """The cluster-wide limits the rollout pool starts (workers/acr/limits/): ACR's, and the
    rollout-slot cap."""
    return replace(r.acr.limits.typed(), rollout_slots=r.rollout_slots)


def local_fault_rates(acr: AcrConfig) -> Any:
    """`rollout.acr.faults` as the emulator's FaultRates (workers/embedded/faults.py); None when empty.
    Raises TypeError / ValueError on an unknown kind or a bad rate."""
    if not acr.faults:
        return None
    from workers.embedded.faults import FaultRates

    f = dict(acr.faults)
    known = [fl.name for fl in fields(FaultRates)]
    unknown = sorted(set(f) - set(known))
    if unknown:
        raise ValueError(f"unknown fault kind(s) {unknown}; known: {known}")
    return FaultRates(**{k: (int(v) if k in ("seed", "repeats") else float(v)) for k, v in f.items()})


def acr_client_config(r: RolloutConfig) -> AcrClientConfig:
    """botocore, retry and S3-polling settings of each rollout actor's ACR client; an A2A runtime
    gets the `A2A-Version` header on every invocation."""
    from workers.rollout.a2a import A2A_VERSION

    acr = r.acr
    return AcrClientConfig(region_name=acr_region(acr), retry_mode=acr.retry_mode,  # type: ignore[arg-type]
                           max_attempts=acr.max_attempts, runtime_error_attempts=acr.runtime_error_attempts,
                           poll_initial_s=r.poll_initial_s, poll_max_s=r.poll_max_s,
                           invoke_headers=(("A2A-Version", A2A_VERSION),) if r.contract == "a2a" else ())


def buffer_config() -> BufferConfig:
    """The trajectory buffer's TQ actors: one storage unit (samples of one run fit one node)."""
    from workers.buffer.store import BufferConfig

    return BufferConfig(num_storage_units=1)
