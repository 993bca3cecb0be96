"""Pre-flight: the file-system checks of a validated config, in one step before anything starts.

Schema validation (orchestrator/config/) reads values only; `preflight` then checks what the
values point at, in this order: `model.path` is a Hugging Face model directory, `model.chat_template`
a file, the task's data file exists (the registry's `check_data`, orchestrator/tasks.py), `run_dir`
is not a file and holds no earlier run unless resuming, the staging folders of interrupted checkpoint
writes are removed, the checkpoint to resume from is complete
and leaves steps to train, and `run_dir` can be created (it is created here).

Raises ConfigError (orchestrator/config/errors.py) or CheckpointError (orchestrator/checkpoint.py),
each message naming the config key or the file. Callers: orchestrator/main.py after `to_run_config`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from orchestrator.checkpoint import Checkpoint, CheckpointError, remove_staging
from orchestrator.config import ConfigError, RunConfig
from orchestrator.config.errors import check
from orchestrator.run_checkpoint import find_resume_checkpoint
from orchestrator.tasks import TASKS


@dataclass(frozen=True)
class Preflight:
    """What pre-flight found: the absolute run_dir (now existing) and the checkpoint to resume
    from (None: a fresh run)."""

    run_dir: Path
    checkpoint: Checkpoint | None


def check_model(cfg: RunConfig) -> None:
    """`model.path` (when set) is a local HF model directory; `model.chat_template` (when set) a file."""
    m = cfg.model
    if m.chat_template is not None:
        check(Path(m.chat_template).is_file(), "model.chat_template", "must be a Jinja file", m.chat_template)
    if m.path is not None:
        check(Path(m.path).is_dir() and (Path(m.path) / "config.json").is_file(), "model.path",
              "must be a local Hugging Face model directory (with config.json)", m.path)


def check_task_data(cfg: RunConfig) -> None:
    """The task's data files (e.g. gsm8k's `task.data_path`, and `task.val_data_path` when set) are
    there; the message names the key."""
    check_data = TASKS[cfg.task.name].check_data
    if check_data is None:
        return
    try:
        check_data(cfg.task.data_path)
    except (FileNotFoundError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
    if cfg.task.val_data_path:
        try:
            check_data(cfg.task.val_data_path)
        except (FileNotFoundError, ValueError) as exc:
            raise ConfigError(str(exc).replace("task.data_path", "task.val_data_path")) from None


def check_run_dir(cfg: RunConfig) -> None:
    """`run_dir` is a directory or absent, and holds no earlier run (metrics.jsonl) unless
    `trainer.resume_mode=auto` finds a checkpoint there to continue."""
    run_dir = Path(cfg.run_dir)
    check(not run_dir.exists() or run_dir.is_dir(), "run_dir", "exists and is not a directory", cfg.run_dir)
    resuming = cfg.trainer.resume_mode == "auto" and (run_dir / "checkpoints" / "latest").is_file()
    check(resuming or not (run_dir / "metrics.jsonl").exists(), "run_dir",
          "already holds a run (metrics.jsonl) and no checkpoint to resume from; choose a new run_dir "
          "(or resume one saved with trainer.save_freq > 0 using trainer.resume_mode=auto)", cfg.run_dir)


def find_checkpoint(cfg: RunConfig, run_dir: Path) -> Checkpoint | None:
    """The verified checkpoint to resume from, or None. Raises CheckpointError when it is missing,
    partial or corrupt, or when it is already at `trainer.total_steps` (nothing left to train)."""
    t = cfg.trainer
    ckpt = find_resume_checkpoint(run_dir, t.resume_mode, t.resume_from_path)
    if ckpt is not None and ckpt.state.step >= t.total_steps:
        raise CheckpointError(f"{ckpt.path} is at step {ckpt.state.step}; trainer.total_steps={t.total_steps} "
                              f"leaves nothing to train (total_steps counts the steps before the resume too)")
    return ckpt


def preflight(cfg: RunConfig) -> Preflight:
    """Run every file-system check of `cfg` (see the module docstring) and create run_dir."""
    check_model(cfg)
    check_task_data(cfg)
    check_run_dir(cfg)
    run_dir = Path(cfg.run_dir).resolve()
    remove_staging(run_dir)  # half-written checkpoints of a run that died are never used
    ckpt = find_checkpoint(cfg, run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"run_dir: cannot create {run_dir}: {exc}") from None
    return Preflight(run_dir=run_dir, checkpoint=ckpt)
