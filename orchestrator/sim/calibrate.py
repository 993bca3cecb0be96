"""Fit a workload's two free parameters to one measured row (sync, 1 mini-batch per step).

Free parameters and why these two: the engine's time scale (`calibration.engine_time_scale`,
multiplying every step time: how fast this model decodes on this hardware, which the report does
not give) and the environment's time scale (`calibration.env_time_scale`, multiplying every tool /
environment time: how long SWE-Gym's tools take, which it does not give either). Everything else
is a size the report states (KV capacity, context cap, agent share of tokens, batch) or a
hardware constant written in the workload file. The two targets pin them: inference concurrency
depends on the ratio of environment time to decode time (a rollout at the engine vs in its tools),
throughput on their common scale (the trainer is tied to the engine's peak, so it scales too).

Procedure: a damped step on the ratio (for concurrency) and on the common scale (for throughput)
per round, until both are within `tol` or `rounds` run out. Invariant: only the two scales
change; the result records the row it was fitted to and what the simulator measured there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from orchestrator.sim.run import CONFIGS, Scenario, simulate
from orchestrator.sim.workload import Workload


@dataclass(frozen=True)
class Target:
    """The measured row: trained tokens per minute per GPU and inference concurrency per replica."""

    tokens_per_min_per_gpu: float = 27820.0
    inference_concurrency: float = 11.03
    kv_usage_below: float = 0.25


def calibrate(w: Workload, target: Target, *, gpus: int = 64, hours: float = 4.0, seed: int = 0, rounds: int = 6,
              tol: float = 0.02, log: Callable[[str], None] = print) -> tuple[Workload, dict]:
    """Return the workload with fitted scales and the fit's record (the measured figures)."""
    sc: Scenario = CONFIGS["sync_1"]
    sc = Scenario(sc.mode, sc.sync_every, sc.colocated, gpus=gpus)
    eng, env = w.engine_time_scale, w.env_time_scale
    hist: list[tuple[float, float, dict]] = []  # (engine scale, env scale, figures)

    def run(e: float, v: float) -> dict:
        f = simulate(w.with_scales(e, v), sc, hours=hours, seed=seed)
        hist.append((e, v, f))
        log(f"engine_time_scale={e:.4f} env_time_scale={v:.4f}: {f['tokens_per_min_per_gpu']:.0f} tok/min/GPU, "
            f"concurrency {f['inference_concurrency']:.2f}, KV {f['kv_usage_mean']:.3f} ({f['wall_s']:.0f} s)")
        return f

    f = run(eng, env)
    for _ in range(rounds):
        c_err = f["inference_concurrency"] / target.inference_concurrency - 1
        p_err = f["tokens_per_min_per_gpu"] / target.tokens_per_min_per_gpu - 1
        if abs(c_err) <= tol and abs(p_err) <= tol:
            break
        # damped fixed-slope steps: the figures are noisy (the slowest of ~1000 rollouts ends a
        # sync step), so a secant would chase the noise. d log c / d log(env/engine) ~ -1,
        # d log throughput / d log scale ~ -1 (measured on the reference workload).
        env *= _clamp((1 + c_err) ** (1.0 / 1.0))
        k = _clamp((1 + p_err) ** 1.0)
        eng, env = eng * k, env * k
        f = run(eng, env)
    record = {"fitted_to": "sync_1", "target": vars(target), "gpus": gpus, "hours": hours, "seed": seed,
              "engine_time_scale": eng, "env_time_scale": env,
              "measured": {k: f[k] for k in ("tokens_per_min_per_gpu", "inference_concurrency", "kv_usage_mean")},
              "runs": len(hist)}
    return w.with_scales(eng, env), record


def _clamp(factor: float, lo: float = 0.5, hi: float = 2.0) -> float:
    return min(hi, max(lo, factor))


ENV_SCALE_BOUNDS = (0.02, 5.0)  # the environment-time scale a fitted run's calibration may reach


def calibrate_step_time(scaled: Callable[[float], Workload], sc: Scenario, step_s: float, *, hours: float,
                        seed: int = 0, warmup_steps: int = 2, rounds: int = 8, tol: float = 0.01) -> dict:
    """A workload fitted from a real run on one shared machine (scripts/workload_from_run.py): the
    scale of its environment time (`scaled(k)`: the workload with every environment time times k)
    for which simulating `sc`, the run's own configuration, gives the run's mean step time
    `step_s` (seconds). Why this one: the fit measures each rollout's latency, its model time and
    its CPU work, and gives the environment what is left; but on a shared machine part of that
    latency was waiting for the cores, which the simulator's machine model
    (orchestrator/sim/machine.py) adds by itself, so the environment alone is what the fit cannot
    separate. Secant steps on k (the step time grows with it), clamped to `ENV_SCALE_BOUNDS`; stops
    within `tol` or after `rounds`. Returns the record: the k closest to the target (`env_scale`),
    target and simulated step time, simulations run."""
    lo, hi = ENV_SCALE_BOUNDS
    pts: list[tuple[float, float]] = []

    def err(k: float) -> float:
        f = simulate(scaled(k), sc, hours=hours, seed=seed, warmup_steps=warmup_steps)
        pts.append((k, f["step_s_mean"]))
        return f["step_s_mean"] / step_s - 1

    x0, e0 = 1.0, err(1.0)
    x1 = _clamp(1.0 / (1 + e0), lo, hi)
    e1 = err(x1) if abs(e0) > tol and x1 != x0 else e0
    for _ in range(rounds - 2):
        if abs(e1) <= tol or e1 == e0:
            break
        x2 = _clamp(x1 - e1 * (x1 - x0) / (e1 - e0), lo, hi)
        if x2 == x1:
            break
        x0, e0, x1, e1 = x1, e1, x2, err(x2)
    k, sim = min(pts, key=lambda p: abs(p[1] / step_s - 1))
    return {"target_step_s": step_s, "simulated_step_s": sim, "env_scale": k, "runs": len(pts),
            "scenario": sc.overrides()}
