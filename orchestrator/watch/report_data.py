"""A run directory read back for the report: its step records, config and summary, and the series
and headline figures the plots and the comparison table are drawn from.

Pure: reads files, returns numbers; no matplotlib, Ray or HTTP. Callers: orchestrator/watch/report.py
(plots, report.html) and scripts/bench_modes.py (headline figures of each configuration).

Invariant: a series holds only finite points (NaN and missing values are left out, never drawn
as zero), and every series of a run is indexed by the same step records, in step order; when a
resumed run logged a step twice, the later record of that step wins.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

# per-step keys of the terminal-state counters the ledger logs (cumulative over the run)
OUTCOMES = ("rollout/completed", "rollout/filtered", "rollout/failed", "rollout/expired", "rollout/truncated")
# the first present of these is the masked-token fraction of rollout correction (verl's names)
MASKED_KEYS = ("rollout_corr/rollout_rs_masked_fraction", "rollout_corr/rollout_is_masked_fraction")


@dataclass
class RunData:
    """One run dir: `steps` are the training step records (step >= 1, one per step, in order),
    `validations` the records holding `val/reward/mean` (step 0 included), `config` the resolved
    config.yaml (empty when missing), `summary` summary.json (empty when the run ended before it)."""

    name: str
    path: Path
    steps: list[dict[str, float]]
    validations: list[dict[str, float]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)

    def series(self, key: str, x: str = "step") -> tuple[list[float], list[float]]:
        """(xs, ys) of `key` over the steps where it is a finite number; `x`: "step", "wall_min"
        (loop time since the first step, minutes) or "gpu_h" (wall hours x GPUs)."""
        xs_all = self.axis(x)
        xs, ys = [], []
        for xv, rec in zip(xs_all, self.steps):
            v = rec.get(key)
            if isinstance(v, (int, float)) and math.isfinite(v):
                xs.append(xv)
                ys.append(float(v))
        return xs, ys

    def axis(self, x: str) -> list[float]:
        """One x value per step record (see `series`)."""
        if x == "step":
            return [float(r["step"]) for r in self.steps]
        elapsed, t = [], 0.0
        for r in self.steps:
            v = r.get("timing_s/step", 0.0)
            t += v if isinstance(v, (int, float)) and math.isfinite(v) else 0.0
            elapsed.append(t)
        if x == "wall_min":
            return [e / 60.0 for e in elapsed]
        if x == "gpu_h":
            return [e / 3600.0 * self.num_gpus() for e in elapsed]
        raise ValueError(f"unknown axis {x!r}; choose step, wall_min or gpu_h")

    def has(self, key: str) -> bool:
        return bool(self.series(key)[1])

    def num_gpus(self) -> int:
        """GPUs the run placed (cluster.trainer + cluster.inference; colocated shares them); 0 on CPU."""
        c = self.config.get("cluster") or {}
        if c.get("name", "local") == "local":
            return 0
        t = (c.get("trainer") or {})
        i = (c.get("inference") or {})
        trainer = int(t.get("nodes", 1)) * int(t.get("gpus_per_node", 0))
        inference = int(i.get("replicas", 1)) * int(i.get("tensor_parallel_size", 1))
        return trainer if c.get("name") == "colocated" else trainer + inference

    def masked_key(self) -> str | None:
        return next((k for k in MASKED_KEYS if self.has(k)), None)

    def staleness_hist(self) -> tuple[list[int], list[list[float]]]:
        """(bins, counts): `counts[i][j]` samples of staleness `bins[j]` trained at step record i."""
        bins = sorted({int(k.rsplit("/", 1)[1]) for r in self.steps for k in r if k.startswith("staleness/hist/")})
        return bins, [[float(r.get(f"staleness/hist/{b}", 0.0)) for b in bins] for r in self.steps]

    def failed_by_reason(self) -> dict[str, float]:
        """`rollout/failed/{reason}` counts of the summary (empty without one)."""
        return {k.split("/", 2)[2]: float(v) for k, v in sorted(self.summary.items())
                if k.startswith("rollout/failed/") and isinstance(v, (int, float))}


def load_run(run_dir: Path, name: str | None = None) -> RunData:
    """Read `run_dir`'s metrics.jsonl, config.yaml and summary.json.

    Raises FileNotFoundError when metrics.jsonl is missing, ValueError naming the file and line
    when a line is not a JSON object (a truncated LAST line, what a killed run writes, is skipped
    with a warning), and ValueError when no step was logged."""
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics.jsonl (is this a run dir?)")
    by_step: dict[int, dict[str, float]] = {}
    validations: list[dict[str, float]] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    last = max((i for i, line in enumerate(lines, 1) if line.strip()), default=0)
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            if n == last:  # a run killed mid-write leaves exactly this: the records before it stand
                warnings.warn(f"{path}:{n}: a truncated last line, left out ({exc.msg})", stacklevel=2)
                continue
            raise ValueError(f"{path}:{n}: not JSON ({exc.msg})") from None
        if not isinstance(rec, dict) or "step" not in rec:
            raise ValueError(f"{path}:{n}: a record must be a JSON object with a step")
        if "val/reward/mean" in rec:
            validations.append(rec)
        if int(rec["step"]) >= 1 and "timing_s/step" in rec:  # a training step (not a lone validation)
            by_step[int(rec["step"])] = rec
    config: dict[str, Any] = {}
    if (run_dir / "config.yaml").is_file():
        config = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    summary: dict[str, Any] = {}
    if (run_dir / "summary.json").is_file():
        summary = json.loads((run_dir / "summary.json").read_text())
    if not by_step and not validations:
        raise ValueError(f"{path}: no step was logged (the run ended before its first step): nothing to report")
    return RunData(name=name or run_dir.name, path=run_dir, steps=[by_step[s] for s in sorted(by_step)],
                   validations=validations, config=config, summary=summary)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def headline(run: RunData, warmup_steps: int = 0) -> dict[str, Any]:
    """The comparison table's figures of one run, over its steps after the first `warmup_steps`:
    trained tokens per minute of loop time (`perf/trained_tokens` / `timing_s/step`), steps per
    minute, mean inference concurrency and KV-cache usage, mean staleness, masked fraction, reward
    at the first and last tenth of the steps, and the ledger's final counts."""
    from orchestrator.watch.metrics import reward_initial_final

    steps = run.steps[warmup_steps:]
    loop_s = sum(float(r.get("timing_s/step", 0.0)) for r in steps)
    tokens = sum(float(r.get("perf/trained_tokens", 0.0)) for r in steps)

    def mean_of(key: str) -> float:
        return _mean([float(r[key]) for r in steps if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])])

    initial, final = reward_initial_final([float(r.get("reward/mean", math.nan)) for r in run.steps])
    last = run.steps[-1] if run.steps else {}
    masked = run.masked_key()
    return {
        "run": run.name,
        "mode": (run.config.get("mode") or {}).get("name", "?"),
        "steps": len(run.steps),
        "loop_min": loop_s / 60.0,
        "trained_tokens_per_min": 60.0 * tokens / loop_s if loop_s > 0 else math.nan,
        "steps_per_min": 60.0 * len(steps) / loop_s if loop_s > 0 else math.nan,
        "inference_concurrency": mean_of("perf/inference_concurrency"),
        "kv_cache_usage": mean_of("perf/kv_cache_usage"),
        "staleness_mean": mean_of("staleness/mean"),
        "masked_fraction": mean_of(masked) if masked else math.nan,
        "reward_initial": initial,
        "reward_final": final,
        **{k.split("/")[1]: int(last.get(k, 0)) for k in OUTCOMES},
    }
