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

from orchestrator.planning.sim.run import CONFIGS, Scenario, simulate
from orchestrator.planning.sim.workload import Workload


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


SCALE_BOUNDS = (0.02, 5.0)  # the engine and environment time scales a fitted run's calibration may reach


def calibrate_fitted(scaled: Callable[[float, float], Workload], sc: Scenario, *, step_s: float, concurrency: float,
                     hours: float, seed: int = 0, warmup_steps: int = 2, rounds: int = 4, tol: float = 0.01) -> dict:
    """A workload fitted from a real run on one shared machine (scripts/workload_from_run.py): the
    scales of its engine time and its environment time (`scaled(ke, kv)`: the workload with every
    engine step and every environment time so scaled) for which simulating `sc`, the run's own
    configuration, gives the run's mean step time `step_s` (seconds) and its inference
    concurrency `concurrency` (requests at the engine, time average).

    Why these two: the fit measures each rollout's latency, its time at the gateway and its CPU
    work, and gives the environment what is left; but on a shared machine part of both times was
    waiting for the cores, which the simulator's machine model (orchestrator/planning/sim/machine.py) adds
    by itself, so the engine's and the environment's own times are what the fit cannot separate.
    The concurrency pins the engine (a turn's time at the engine), the step time the rest.
    Procedure: per round, secant steps on the environment scale for the step time, then a
    proportional step on the engine scale for the concurrency; clamped to `SCALE_BOUNDS`; stops
    when both are within `tol` or after `rounds`. Returns the record: the scales reached
    (`engine_scale`, `env_scale`; `at_bound`: those stopped at a bound), targets and simulated
    figures, simulations run."""
    runs = [0]

    def sim(ke: float, kv: float) -> dict:
        runs[0] += 1
        return simulate(scaled(ke, kv), sc, hours=hours, seed=seed, warmup_steps=warmup_steps)

    ke, kv = 1.0, 1.0
    for _ in range(rounds):
        kv, f = _secant(lambda k: sim(ke, k), "step_s_mean", step_s, kv, tol)
        c_err = f["inference_concurrency"] / concurrency - 1
        if abs(c_err) <= 3 * tol:
            break
        ke = _clamp(ke / (1 + c_err), *SCALE_BOUNDS)
    return {"target_step_s": step_s, "simulated_step_s": f["step_s_mean"], "target_concurrency": concurrency,
            "simulated_concurrency": f["inference_concurrency"], "engine_scale": ke, "env_scale": kv,
            # a scale stopped at a bound of SCALE_BOUNDS: the run's figures did not determine it (e.g.
            # the environment of a run whose steps the cores' speed set, not the rollouts' latency)
            "at_bound": [name for name, x in (("engine_scale", ke), ("env_scale", kv)) if x in SCALE_BOUNDS],
            "runs": runs[0], "scenario": sc.overrides()}


def _secant(run: Callable[[float], dict], key: str, target: float, x0: float, tol: float,
            steps: int = 5) -> tuple[float, dict]:
    """The x (within SCALE_BOUNDS) whose `run(x)[key]` is closest to `target` after at most
    `steps` secant steps from x0 (the figure grows with x); returns it and its figures."""
    lo, hi = SCALE_BOUNDS
    f0 = run(x0)
    best = (abs(f0[key] / target - 1), x0, f0)
    e0 = f0[key] / target - 1
    x1 = _clamp(x0 / (1 + e0), lo, hi) if e0 > -1 else hi
    e_prev, x_prev = e0, x0
    for _ in range(steps):
        if best[0] <= tol or x1 == x_prev:
            break
        f1 = run(x1)
        e1 = f1[key] / target - 1
        best = min(best, (abs(e1), x1, f1), key=lambda b: b[0])
        if e1 == e_prev:
            break
        x_prev, e_prev, x1 = x1, e1, _clamp(x1 - e1 * (x1 - x_prev) / (e1 - e_prev), lo, hi)
    return best[1], best[2]
