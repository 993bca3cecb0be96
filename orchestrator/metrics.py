"""Metric sinks (console progress, JSONL, TensorBoard, wandb) and the end-of-run summary.

Invariant: every sink receives the same step records in step order (non-decreasing);
`RUN_DIR/metrics.jsonl` holds one JSON object per training step, flushed when the step is logged,
so a crashed run keeps every step it finished, plus the validation records that have no step of
their own (step 0 before training; in async mode the final weights' validation, at the last step). Metric names follow verl where verl has one.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Protocol, TextIO


class MetricSink(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...
    def close(self) -> None: ...


class JsonlSink:
    """Appends `{"step": s, **metrics}` per step to `path`, flushed at once. The file is created by
    the first record, so a run that fails before logging anything leaves no metrics.jsonl and its
    run_dir can be reused by a rerun."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._f: TextIO | None = None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self._f is None:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            self._f = self._path.open("a", encoding="utf-8")
        self._f.write(json.dumps({"step": step, **metrics}, allow_nan=True) + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()


class TensorBoardSink:
    """TensorBoard event files under RUN_DIR/tensorboard (`tensorboard --logdir RUN_DIR/tensorboard`);
    one scalar per finite metric per step."""

    def __init__(self, log_dir: Path) -> None:
        from tensorboardX import SummaryWriter  # only when the sink is selected

        self._w = SummaryWriter(logdir=str(log_dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and math.isfinite(v):
                self._w.add_scalar(k, v, step)
        self._w.flush()

    def close(self) -> None:
        self._w.close()


def resolve_wandb_mode(mode: str, environ: dict[str, str]) -> str:
    """`logger.wandb_mode`, with `auto` resolved: online when WANDB_API_KEY is set, else offline."""
    if mode != "auto":
        return mode
    return "online" if environ.get("WANDB_API_KEY") else "offline"


class WandbSink:
    """wandb run (offline without WANDB_API_KEY: files under RUN_DIR/wandb, sync later with `wandb sync`)."""

    def __init__(self, run_dir: Path, project: str, mode: str, config: dict[str, Any]) -> None:
        import wandb  # heavy; only when the sink is selected

        self._run = wandb.init(project=project, mode=mode, dir=str(run_dir), config=config,
                               settings=wandb.Settings(silent=True, console="off"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(metrics, step=step)

    def close(self) -> None:
        self._run.finish()


class MetricLogger:
    """Fans step records out to the selected sinks and keeps the reward history for the summary."""

    def __init__(self, sinks: list[MetricSink]) -> None:
        self._sinks = sinks
        self.rewards: list[float] = []

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if "reward/mean" in metrics:
            self.rewards.append(float(metrics["reward/mean"]))
        for s in self._sinks:
            s.log(step, metrics)

    def close(self) -> None:
        for s in self._sinks:
            s.close()


def reward_initial_final(rewards: list[float], fraction: float = 0.1) -> tuple[float, float]:
    """Mean reward over the first and last `fraction` of steps (at least one step each).

    NaN steps (no trainable sample) are skipped; returns (nan, nan) when nothing is left.
    """
    vals = [r for r in rewards if not math.isnan(r)]
    if not vals:
        return math.nan, math.nan
    k = max(1, int(len(vals) * fraction))
    return sum(vals[:k]) / k, sum(vals[-k:]) / k


def build_sinks(names: list[str], run_dir: Path, total_steps: int, wandb_project: str,
                wandb_mode: str, config: dict[str, Any]) -> list[MetricSink]:
    """Create the sinks named in `logger.sinks` (`wandb_mode` resolved by `resolve_wandb_mode`)."""
    from orchestrator.progress import ProgressSink

    sinks: list[MetricSink] = []
    for name in names:
        if name == "console":
            sinks.append(ProgressSink(total_steps))
        elif name == "jsonl":
            sinks.append(JsonlSink(run_dir / "metrics.jsonl"))
        elif name == "tensorboard":
            sinks.append(TensorBoardSink(run_dir / "tensorboard"))
        elif name == "wandb" and (mode := resolve_wandb_mode(wandb_mode, os.environ)) != "disabled":
            sinks.append(WandbSink(run_dir, wandb_project, mode, config))
    return sinks
