"""mode=eval: batch evaluation of the current weights (`model.path`, or the checkpoint resumed) on
`task.split`, through the real rollout pool under the same cluster-wide ACR limits, no trainer.

Every prompt of the split (the first `eval.max_prompts`) x `eval.n` samples; outputs in run_dir:
`eval.jsonl` (one line per rollout, orchestrator/loop/validation.py EvalRecord) and
`eval_summary.json` (orchestrator/loop/validation.py `summarize`, plus the ACR session count left
open). Progress: a tqdm bar on a terminal (done / failed / remaining, ETA), else a plain line per
tenth of the rollouts.

Invariant: eval.jsonl has exactly `rollouts` lines and `completed + failed == rollouts ==
prompts x n` (a failed rollout is counted by reason, never scored 0). Callers: orchestrator/main.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from orchestrator.config import RunConfig
from orchestrator.config.eval import eval_settings
from orchestrator.config.task import eval_split
from orchestrator.tasks import TASKS
from orchestrator.loop.validation import EvalRecord, evaluate_rows, summarize
from orchestrator.watch.progress import phase
from workers.inference.client import ReplicaClient

PARTITION = "eval"
LINES_EVERY = 10  # plain progress: a line per this many percent of the rollouts
ETA_AFTER = 0.1  # the ETA is shown once this fraction of the rollouts is done


class Progress:
    """Counts done / failed / in flight; draws a tqdm bar (`bar`) or prints plain lines (`lines`)."""

    def __init__(self, total: int, style: str, stream: TextIO = sys.stderr) -> None:
        if style == "auto":
            style = "bar" if stream.isatty() else "lines"
        self._style, self._total, self._stream = style, total, stream
        self.done = self.failed = 0
        self._t0 = time.monotonic()
        self._next_line = 0
        self._bar = None
        if style == "bar":
            from tqdm import tqdm

            self._bar = tqdm(total=total, file=stream, unit="rollout", dynamic_ncols=True)

    def on_record(self, r: EvalRecord) -> None:
        self.done += 1
        self.failed += r.status != "completed"
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(failed=self.failed, remaining=self._total - self.done, refresh=False)
        elif self._style == "lines" and (self.done * 100 >= self._next_line * self._total or self.done == self._total):
            elapsed = time.monotonic() - self._t0
            print(f"[eval] {self.done}/{self._total} done, {self.failed} failed, {self._total - self.done} remaining, "
                  f"{elapsed:.0f}s elapsed, ETA {self.eta(elapsed)}", file=self._stream, flush=True)
            self._next_line = self.done * 100 // self._total + LINES_EVERY

    def eta(self, elapsed_s: float) -> str:
        """Seconds left at the pace so far, once ETA_AFTER of the rollouts are done (the first ones
        finish together, their pace says nothing); "n/a" before."""
        if self.done < max(1, ETA_AFTER * self._total):
            return "n/a"
        return f"{elapsed_s / self.done * (self._total - self.done):.0f}s"

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def split_rows(cfg: RunConfig) -> list[dict]:
    """The rows of the evaluated split (`eval_split`) that are evaluated (the first `eval.max_prompts`)."""
    rows = TASKS[cfg.task.name].rows(cfg.task, eval_split(cfg.task))
    return rows[:cfg.eval.max_prompts] if cfg.eval.max_prompts else rows


async def run_eval(cfg: RunConfig, rt: Any, stack: contextlib.ExitStack) -> dict[str, Any]:
    """Build the evaluation parts, evaluate the split, write eval.jsonl and eval_summary.json;
    return the summary. Raises what the pool raises (ContractError stops the evaluation)."""
    from orchestrator.wiring.eval import build_eval

    rows = split_rows(cfg)
    settings = eval_settings(cfg.eval, step_rollouts=cfg.samples_per_step)
    built = await build_eval(cfg, rt, stack)
    phase(f"evaluating {len(rows)} prompt(s) of the {eval_split(cfg.task)} split x {settings.n} samples, "
          f"{settings.max_concurrent_rollouts} rollouts at once (eval.max_concurrent_rollouts)")
    progress = Progress(len(rows) * settings.n, cfg.eval.progress)
    async with built.closing:
        try:
            records, wall_s = await evaluate_rows(built.pool, built.store, rows, settings, PARTITION, time.monotonic,
                                                  progress.on_record)
        finally:
            progress.close()
        acr = await built.pool.acr_stats()
        counts = await built.pool.rollout_counts()
        with contextlib.suppress(Exception):
            await asyncio.gather(*(ReplicaClient(r).shutdown() for r in built.replicas))
    summary = {"task": cfg.task.name, "split": eval_split(cfg.task), "model_path": rt.model_path,
               "serve_model": cfg.eval.serve_model, "temperature": cfg.eval.temperature,
               **summarize(records, n=settings.n, pass_threshold=settings.pass_threshold, wall_s=wall_s),
               "acr/sessions_open_at_exit": rt.local.stats().sessions_open if rt.local else acr.get("sessions_open", 0),
               "acr/requests": acr.get("requests", 0), "acr/retries": acr.get("retries", 0),
               "acr/stop_failed": counts.get("acr/stop_failed", 0)}
    write_outputs(rt.run_dir, records, summary)
    with contextlib.suppress(Exception):  # the report is best effort; eval_summary.json is the record
        from orchestrator.watch.eval_report import write_eval_report

        write_eval_report(rt.run_dir, [r.reward for r in records if r.status == "completed"], summary)
    return summary


def write_outputs(run_dir: Path, records: list[EvalRecord], summary: dict[str, Any]) -> None:
    """`run_dir/eval.jsonl` (a line per record) and `run_dir/eval_summary.json`."""
    with (run_dir / "eval.jsonl").open("w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r.to_json(), allow_nan=True) + "\n")
    from orchestrator.watch.metrics import write_summary

    write_summary(run_dir / "eval_summary.json", summary)
