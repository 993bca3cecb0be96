"""The report of a `mode=eval` run: the reward distribution, pass@k over k, and the summary, in
`RUN_DIR/report/` (report.html beside its PNGs), and the one console line that ends the run.

Written by orchestrator/main.py at the end of every evaluation that has records. Invariant: as for
the training report (orchestrator/watch/report.py), a plot is written only when it has a data point
and report.html references exactly the files written beside it. Pure except for those files.
"""

from __future__ import annotations

import html
import math
from pathlib import Path
from typing import Any, Sequence

from orchestrator.watch.report import CSS, PLOT_DPI, _figure, _table

BINS = 20  # histogram bins over the rewards' range


def eval_summary_text(summary: dict[str, Any]) -> str:
    """One line: rollouts, reward mean ± sem over the completed ones, pass@1 and pass@n, failures."""
    n = summary["n"]
    failed = {k.split("/", 1)[1]: v for k, v in summary.items() if k.startswith("failed/")}
    reasons = f" ({', '.join(f'{k} {v}' for k, v in sorted(failed.items()))})" if failed else ""
    mean, sem = summary["reward/mean"], summary["reward/sem"]
    reward = "n/a (none completed)" if not _finite(mean) else f"{mean:.3f} ± {sem:.3f}" if _finite(sem) else f"{mean:.3f}"
    passes = ", ".join(f"pass@{k} {summary[f'pass@{k}']:.3f}" for k in sorted({1, n}) if _finite(summary.get(f"pass@{k}")))
    return (f"eval: {summary['num_prompts']} prompts x {n} = {summary['rollouts']} rollouts of the {summary['split']} "
            f"split in {summary['wall_s']:.0f}s: reward {reward} (mean ± sem over {summary['completed']} completed)"
            + (f", {passes}" if passes else "") + f"; {summary['failed']} failed{reasons}")


def write_eval_report(run_dir: Path, rewards: Sequence[float], summary: dict[str, Any]) -> Path:
    """`RUN_DIR/report/report.html` with the reward histogram of the completed rollouts, pass@k for
    k = 1..n and the summary table; returns its path."""
    out = Path(run_dir) / "report"
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.png"):
        old.unlink()
    plots: list[tuple[str, str]] = []
    if rewards:
        fig, (ax,) = _figure(1)
        ax.hist(list(rewards), bins=BINS)
        ax.set(title="reward distribution", xlabel="reward", ylabel="rollouts")
        fig.savefig(out / "reward_hist.png", dpi=PLOT_DPI)
        plots.append(("reward_hist.png", f"reward of the {len(rewards)} completed rollouts"))
    ks = [k for k in range(1, summary["n"] + 1) if _finite(summary.get(f"pass@{k}"))]
    if ks:
        fig, (ax,) = _figure(1)
        ax.plot(ks, [summary[f"pass@{k}"] for k in ks], marker="o")
        ax.set(title=f"pass@k (reward >= {summary['pass_threshold']})", xlabel="k", ylabel="pass@k", ylim=(0, 1.05))
        ax.set_xticks(ks)
        fig.savefig(out / "pass_at_k.png", dpi=PLOT_DPI)
        plots.append(("pass_at_k.png", "pass@k: the unbiased estimator over each prompt's n samples"))
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>eval report</title><style>{CSS}</style>"
             f"</head><body><h1>Evaluation: {html.escape(Path(run_dir).name)}</h1>",
             f"<p>{html.escape(eval_summary_text(summary))}</p>"]
    parts += [f"<h2>{html.escape(t)}</h2><img src='{f}' alt='{html.escape(t)}'>" for f, t in plots]
    parts.append("<h2>eval_summary.json</h2>" + _table([{"key": k, "value": v} for k, v in summary.items()]))
    parts.append("</body></html>")
    path = out / "report.html"
    path.write_text("\n".join(parts), encoding="utf-8")
    return path


def _finite(v: object) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)
