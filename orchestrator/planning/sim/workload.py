"""A workload as data: the distributions and sizes the simulator draws from (YAML).

A workload file (orchestrator/planning/sim/workloads/*.yaml, or any path) has the sections `engine`
(one replica's hardware), `agent` (episode shape: turns, tokens, environment time, ACR limits),
`trainer`, `weight_sync`, `batch` and `algorithm`, plus `calibration` (the fitted free
parameters and the row they were fitted to) and, for one shared CPU machine rather than a GPU
cluster, `machine` (`MACHINE_KEYS`: cores, the cores each part keeps busy, the rollouts' and the
store's CPU work: orchestrator/planning/sim/machine.py). Every distribution is a mapping with `dist`:

    {dist: const, value: X}
    {dist: lognormal, median: M, sigma: S, min: A, max: B}   # min/max optional clamps
    {dist: uniform, low: A, high: B}

Invariant: `load_workload` returns a fully validated `Workload` or raises `WorkloadError` naming
the dotted key; distributions draw from the `random.Random` they are handed (seeded by the caller),
so a run is reproducible. `agent.setup_s` (optional, default 0) is the A2A contract's container
setup before a rollout slot is taken; `agent.cold_start_s` counts as setup too. Calibrated scales (`calibration.engine_time_scale`,
`calibration.env_time_scale`) multiply the engine's step times and the environment times.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

WORKLOADS = Path(__file__).resolve().parent / "workloads"


class WorkloadError(ValueError):
    """A workload file with a missing or bad value; the message starts with the dotted key."""


@dataclass(frozen=True)
class Dist:
    """One distribution (see the module docstring). `draw(rng)` returns a float."""

    dist: str
    value: float = 0.0
    median: float = 1.0
    sigma: float = 0.0
    low: float = 0.0
    high: float = 0.0
    min: float = -math.inf
    max: float = math.inf

    def draw(self, rng: random.Random) -> float:
        if self.dist == "lognormal":
            x = self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0))
        elif self.dist == "const":
            x = self.value
        else:
            x = rng.uniform(self.low, self.high)
        if x > self.max:
            return self.max
        return self.min if x < self.min else x

    def mean(self) -> float:
        """The unclamped mean (for sizing and reports)."""
        if self.dist == "const":
            return self.value
        if self.dist == "lognormal":
            return self.median * math.exp(self.sigma ** 2 / 2)
        return (self.low + self.high) / 2


def _dist(key: str, d: Any) -> Dist:
    if isinstance(d, (int, float)):
        return Dist("const", value=float(d))
    if not isinstance(d, dict) or d.get("dist") not in ("const", "lognormal", "uniform"):
        raise WorkloadError(f"{key}: a distribution needs dist: const | lognormal | uniform, got {d!r}")
    extra = set(d) - {f.name for f in fields(Dist)}
    if extra:
        raise WorkloadError(f"{key}: unknown fields {sorted(extra)}")
    out = Dist(**{k: (v if k == "dist" else float(v)) for k, v in d.items()})
    if out.dist == "lognormal" and (out.median <= 0 or out.sigma < 0):
        raise WorkloadError(f"{key}: lognormal needs median > 0 and sigma >= 0, got {d}")
    return out


@dataclass(frozen=True)
class AgentSpec:
    """Episode shape. Tokens per turn; times in seconds; `session_rate_per_s`: ACR session
    creations per second (cluster-wide); `reward_beta`: a prompt's success probability ~ Beta."""

    prompt_tokens: Dist
    turns: Dist
    agent_tokens_per_turn: Dist
    env_tokens_per_turn: Dist
    env_time_s: Dist
    final_time_s: Dist
    cold_start_s: Dist
    overhead_s: Dist = Dist("const")  # the rollout's own time after its last turn (CPU work on a shared machine)
    # the A2A contract's container setup (image pull, repository checkout) after the cold start and
    # before the rollout slot is taken (orchestrator/planning/sim/agent.py); const 0: none
    setup_s: Dist = Dist("const")
    max_context_tokens: int = 65536
    session_rate_per_s: float = 25.0
    reward_beta: tuple[float, float] = (1.0, 1.0)
    constant_reward_fraction: float | None = None  # set: that share of prompts rewards every sample
    # alike (its groups are zero-variance), the others draw continuous rewards; None: Bernoulli(p)


@dataclass(frozen=True)
class Workload:
    """A parsed workload file (see the module docstring); sizes in tokens, times in seconds."""

    name: str
    engine: dict
    agent: AgentSpec
    trainer: dict
    weight_sync: dict
    batch: dict
    algorithm: dict
    calibration: dict = field(default_factory=dict)
    path: str = ""
    machine: dict | None = None  # None: a GPU cluster (trainer and engines never share hardware)

    @property
    def engine_time_scale(self) -> float:
        return float(self.calibration.get("engine_time_scale", 1.0))

    @property
    def env_time_scale(self) -> float:
        return float(self.calibration.get("env_time_scale", 1.0))

    def with_scales(self, engine_time_scale: float, env_time_scale: float) -> "Workload":
        return replace(self, calibration={**self.calibration, "engine_time_scale": engine_time_scale,
                                          "env_time_scale": env_time_scale})


_REQUIRED = {
    "engine": ("kv_tokens_per_replica", "gpus_per_replica", "max_num_seqs", "step_base_s", "step_per_seq_s",
               "prefill_s_per_token"),
    "trainer": ("fixed_s",),
    "weight_sync": ("model_bytes", "bandwidth_bytes_per_s", "reload_s", "sleep_s", "wake_s"),
    "batch": ("prompts_per_mini_batch", "n", "reference_gpus"),
    "algorithm": ("filter_zero_variance",),
}
MACHINE_KEYS = ("cores", "trainer_cores", "engine_cores",  # required: > 0, > 0, >= 0
                "background_cores", "rollout_start_cpu_s", "store_rpc_s", "store_sample_s")  # >= 0, default 0
_AGENT_DISTS = ("prompt_tokens", "turns", "agent_tokens_per_turn", "env_tokens_per_turn", "env_time_s",
                "final_time_s", "cold_start_s")


def parse_workload(raw: dict, path: str = "") -> Workload:
    """Validate a workload mapping; raises WorkloadError naming the dotted key."""
    if not isinstance(raw, dict):
        raise WorkloadError(f"workload: expected a mapping, got {type(raw).__name__}")
    for section, keys in _REQUIRED.items():
        sec = raw.get(section)
        if not isinstance(sec, dict):
            raise WorkloadError(f"{section}: missing section")
        for k in keys:
            if k not in sec:
                raise WorkloadError(f"{section}.{k}: missing")
            if k != "filter_zero_variance" and not (isinstance(sec[k], (int, float)) and sec[k] >= 0):
                raise WorkloadError(f"{section}.{k}: must be a number >= 0, got {sec[k]!r}")
    a = raw.get("agent")
    if not isinstance(a, dict):
        raise WorkloadError("agent: missing section")
    for k in _AGENT_DISTS:
        if k not in a:
            raise WorkloadError(f"agent.{k}: missing")
    beta = tuple(float(x) for x in a.get("reward_beta", (1.0, 1.0)))
    if len(beta) != 2 or min(beta) <= 0:
        raise WorkloadError(f"agent.reward_beta: two numbers > 0, got {a.get('reward_beta')!r}")
    crf = a.get("constant_reward_fraction")
    if crf is not None and not (isinstance(crf, (int, float)) and 0 <= crf <= 1):
        raise WorkloadError(f"agent.constant_reward_fraction: a number in [0, 1], got {crf!r}")
    setup = _dist("agent.setup_s", a.get("setup_s", 0.0))
    if (setup.value if setup.dist == "const" else setup.low if setup.dist == "uniform" else 0.0) < 0:
        raise WorkloadError(f"agent.setup_s: a setup time cannot be negative, got {a.get('setup_s')!r}")
    agent = AgentSpec(**{k: _dist(f"agent.{k}", a[k]) for k in _AGENT_DISTS},
                      overhead_s=_dist("agent.overhead_s", a.get("overhead_s", 0.0)), setup_s=setup,
                      max_context_tokens=int(a.get("max_context_tokens", 65536)),
                      session_rate_per_s=float(a.get("session_rate_per_s", 25.0)),
                      reward_beta=beta,  # type: ignore[arg-type]
                      constant_reward_fraction=None if crf is None else float(crf))
    if agent.session_rate_per_s <= 0 or agent.max_context_tokens < 2:
        raise WorkloadError("agent.session_rate_per_s must be > 0 and agent.max_context_tokens >= 2")
    if raw["engine"]["kv_tokens_per_replica"] < agent.max_context_tokens:
        raise WorkloadError("engine.kv_tokens_per_replica: must hold at least one agent.max_context_tokens episode")
    cal = raw.get("calibration") or {}
    for k in ("engine_time_scale", "env_time_scale"):
        if k in cal and not (isinstance(cal[k], (int, float)) and cal[k] > 0):
            raise WorkloadError(f"calibration.{k}: must be a number > 0, got {cal[k]!r}")
    machine = raw.get("machine")
    if machine is not None:
        if not isinstance(machine, dict) or set(machine) - set(MACHINE_KEYS):
            raise WorkloadError(f"machine: a mapping of {list(MACHINE_KEYS)}, got {machine!r}")
        for k in MACHINE_KEYS:
            v = machine.get(k, 0.0 if k in MACHINE_KEYS[3:] else None)
            if not (isinstance(v, (int, float)) and (v > 0 if k in MACHINE_KEYS[:2] else v >= 0)):
                raise WorkloadError(f"machine.{k}: must be a number {'> 0' if k in MACHINE_KEYS[:2] else '>= 0'}, "
                                    f"got {v!r}")
            if k in ("engine_cores", "trainer_cores") and v > machine["cores"]:
                raise WorkloadError(f"machine.{k}: at most machine.cores ({machine['cores']}), got {v!r}")
    return Workload(name=str(raw.get("name", Path(path).stem or "workload")), engine=dict(raw["engine"]), agent=agent,
                    trainer=dict(raw["trainer"]), weight_sync=dict(raw["weight_sync"]), batch=dict(raw["batch"]),
                    algorithm=dict(raw["algorithm"]), calibration=dict(cal), path=path,
                    machine=None if machine is None else dict(machine))


def load_workload(name_or_path: str) -> Workload:
    """A shipped workload by name (`reference`, `gsm8k_tools`) or a YAML file by path."""
    p = Path(name_or_path)
    if not p.suffix:
        p = WORKLOADS / f"{name_or_path}.yaml"
    if not p.is_file():
        shipped = sorted(x.stem for x in WORKLOADS.glob("*.yaml"))
        raise WorkloadError(f"workload: no file {p} (shipped: {shipped})")
    return parse_workload(yaml.safe_load(p.read_text()), str(p))
