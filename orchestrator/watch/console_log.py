"""A quiet console: library output (Ray, vLLM, Triton, TransferQueue, NUMA notices, loading bars,
Python warnings) goes to `RUN_DIR/logs/`, the console shows only our own lines (phases, progress,
warnings that matter, errors) and library records at or above `logger.console_level`.

Where each source goes:
- driver-side Python logging (root logger, and Ray's own `ray` logger, which does not propagate)
  and `warnings.warn` (FutureWarning, ...): `RUN_DIR/logs/driver.log`, all levels; console from
  `console_level` up;
- Ray actors' stdout/stderr (vLLM, Triton, NUMA, the trainer's loading bars): Ray's session logs,
  linked as `RUN_DIR/logs/ray`; forwarded to the console only with `console_level` debug or info;
- progress bars of libraries (tqdm, Hugging Face Hub): off in every process started after
  `quiet_console` (the environment is inherited).

Callers: orchestrator/main.py (`quiet_console`, before anything starts) and orchestrator/wiring/runtime.py
(`ray_init_options`, `link_ray_logs`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
# environment of every process started from here on: no library progress bars, quiet libraries
QUIET_ENV = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error",
             "TQ_LOGGING_LEVEL": "ERROR"}
DRIVER_LOG = "driver.log"


def _not_printed(record: logging.LogRecord) -> bool:
    """Console filter: the progress lines are printed already (orchestrator/watch/progress.py logs
    them for the driver log only)."""
    from orchestrator.watch.progress import CONSOLE_LOGGER

    return not record.name.startswith(CONSOLE_LOGGER)


def quiet_console(run_dir: Path, console_level: str) -> Path:
    """Send driver-side logging and warnings to `RUN_DIR/logs/driver.log`; keep on the console only
    records at `console_level` or above. Returns the log file's path."""
    level = LEVELS[console_level]
    logs = Path(run_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    path = logs / DRIVER_LOG
    to_file = logging.FileHandler(path, encoding="utf-8")
    to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for h in root.handlers:  # Hydra's stdout handler: the console
        if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
            h.setLevel(level)
            h.addFilter(_not_printed)
    root.addHandler(to_file)
    root.setLevel(min(root.level or logging.INFO, logging.INFO))
    logging.captureWarnings(True)  # warnings.warn -> the py.warnings logger -> the file
    quiet_library_loggers(level, to_file)
    if level > logging.INFO:
        for k, v in QUIET_ENV.items():
            os.environ.setdefault(k, v)
    return path


def quiet_library_loggers(level: int, to_file: logging.Handler | None = None) -> None:
    """Loggers that keep their own console handlers and levels (Ray's, vLLM's once imported):
    console from `level`, everything from INFO to the file."""
    for name in ("ray", "vllm"):
        lib = logging.getLogger(name)
        lib.setLevel(min(lib.level or logging.INFO, logging.INFO))
        for h in lib.handlers:
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
                h.setLevel(level)
        if to_file is not None and to_file not in lib.handlers:
            lib.addHandler(to_file)


def ray_init_options(console_level: str) -> dict:
    """`ray.init` keywords: actor output and Ray's startup notices reach the console only at
    debug/info."""
    loud = LEVELS[console_level] <= logging.INFO
    return {"log_to_driver": loud, "logging_level": logging.INFO if loud else logging.ERROR}


def link_ray_logs(run_dir: Path) -> None:
    """`RUN_DIR/logs/ray` -> this node's Ray session logs (actors' stdout/stderr); best effort."""
    with contextlib.suppress(Exception):
        import ray

        session = Path(ray._private.worker._global_node.get_session_dir_path())  # no public accessor
        link = Path(run_dir) / "logs" / "ray"
        if link.is_symlink():  # an earlier attempt in this run_dir: point at this session
            link.unlink()
        if not link.exists():
            link.symlink_to(session / "logs", target_is_directory=True)
