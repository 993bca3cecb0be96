"""Metric sinks (console progress, JSONL, TensorBoard, wandb) and the end-of-run summary.

Invariant: every sink receives the same step records in step order (non-decreasing);
`RUN_DIR/metrics.jsonl` holds one JSON object per training step, flushed when the step is logged,
so a crashed run keeps every step it finished, plus the validation records that have no step of
their own (step 0 before training; in async mode the final weights' validation, at the last step). Metric names follow verl where verl has one.

Resume: a run continued from the checkpoint of step k first drops the records of steps after k
(`keep_steps_upto`: the dead run logged them, the resumed run logs them again), so metrics.jsonl
holds each step once, and the logger's reward history starts from the kept records (the summary
covers the whole run). The wandb sink resumes the same wandb run (its id is kept in
`RUN_DIR/wandb_run_id`) instead of starting a second one.
"""

from __future__ import annotations

import json
import math
import os
import uuid
from pathlib import Path
from typing import Any, Protocol, TextIO


METRICS_FILENAME = "metrics.jsonl"
WANDB_ID_FILENAME = "wandb_run_id"  # RUN_DIR/wandb_run_id: the wandb run a resumed run continues


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

        id_file = run_dir / WANDB_ID_FILENAME
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:8]
        id_file.write_text(run_id + "\n")
        self._run = wandb.init(project=project, mode=mode, dir=str(run_dir), config=config, id=run_id,
                               resume="allow", settings=wandb.Settings(silent=True, console="off"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(metrics, step=step)

    def close(self) -> None:
        self._run.finish()


class MetricLogger:
    """Fans step records out to the selected sinks and keeps the reward history for the summary."""

    def __init__(self, sinks: list[MetricSink], history: list[dict] = ()) -> None:
        """history: the records of the run before a resume (`keep_steps_upto`), for the summary."""
        self._sinks = sinks
        self.rewards: list[float] = [float(r["reward/mean"]) for r in history if "reward/mean" in r]
        self.last: dict[str, float] = next((r for r in reversed(history) if "reward/mean" in r), {})

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if "reward/mean" in metrics:  # a training step (validation-only records have none)
            self.rewards.append(float(metrics["reward/mean"]))
            self.last = {"step": step, **metrics}
        for s in self._sinks:
            s.log(step, metrics)

    def close(self) -> None:
        for s in self._sinks:
            s.close()


def finite_json(value: Any) -> Any:
    """`value` with every NaN or infinite float (in dicts and lists, at any depth) replaced by None,
    so `json.dumps` writes standard JSON (`null`, not the bare `NaN` that other parsers reject)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


def write_summary(path: Path, summary: dict) -> None:
    """Write a run's summary (summary.json, eval_summary.json) as standard JSON: null where a value
    could not be measured (NaN)."""
    path.write_text(json.dumps(finite_json(summary), indent=2, allow_nan=False) + "\n")


def read_summary(path: Path) -> dict:
    """A summary written by `write_summary`, with its nulls read back as NaN (a figure that was not
    measured), so arithmetic on it gives NaN rather than a TypeError."""
    return {k: math.nan if v is None else v for k, v in json.loads(Path(path).read_text()).items()}


def reward_initial_final(rewards: list[float], fraction: float = 0.1) -> tuple[float, float]:
    """Mean reward over the first and last `fraction` of steps (at least one step each).

    NaN steps (no trainable sample) are skipped; returns (nan, nan) when nothing is left.
    """
    vals = [r for r in rewards if not math.isnan(r)]
    if not vals:
        return math.nan, math.nan
    k = max(1, int(len(vals) * fraction))
    return sum(vals[:k]) / k, sum(vals[-k:]) / k


def keep_steps_upto(path: Path, step: int) -> list[dict]:
    """Drop the records of `path` (JSON lines with a "step") after `step`, atomically; return those
    kept. A missing file keeps nothing; a torn last line (a crash mid-write) is dropped."""
    if not path.is_file():
        return []
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and int(record.get("step", -1)) <= step:
            kept.append(record)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(r, allow_nan=True) + "\n" for r in kept), encoding="utf-8")
    os.replace(tmp, path)
    return kept


def build_sinks(names: list[str], run_dir: Path, total_steps: int, wandb_project: str,
                wandb_mode: str, config: dict[str, Any]) -> list[MetricSink]:
    """Create the sinks named in `logger.sinks` (`wandb_mode` resolved by `resolve_wandb_mode`)."""
    from orchestrator.watch.progress import ProgressSink

    sinks: list[MetricSink] = []
    for name in names:
        if name == "console":
            sinks.append(ProgressSink(total_steps))
        elif name == "jsonl":
            sinks.append(JsonlSink(run_dir / METRICS_FILENAME))
        elif name == "tensorboard":
            sinks.append(TensorBoardSink(run_dir / "tensorboard"))
        elif name == "wandb" and (mode := resolve_wandb_mode(wandb_mode, os.environ)) != "disabled":
            sinks.append(WandbSink(run_dir, wandb_project, mode, config))
    return sinks
