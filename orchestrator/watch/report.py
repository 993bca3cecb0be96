"""The run report: PNG plots (matplotlib) and one report.html showing them with each run's
headline figures, summary and config. Several run dirs overlay in one set of plots, one color
per run, with a table of their headline figures.

    python -m orchestrator.watch.report RUN_DIR [RUN_DIR ...] [--out DIR] [--warmup-steps K]

Written at the end of every training run (orchestrator/main.py, also after an interrupt or a
failure once a step was logged) to `RUN_DIR/report/`; scripts/bench_modes.py writes one for its
four configurations.

Invariant: a plot has only the panels that can have data (no GPU-hours panel on CPU), is written
only when at least one of its panels has a data point, and report.html references exactly the PNG
files written beside it (no external resource: CSS inline, images by relative path). Pure except
for the files it writes; no Ray or HTTP.
"""

from __future__ import annotations

import argparse
import html
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from orchestrator.watch.alarms import ALARMS
from orchestrator.watch.report_data import OUTCOMES, RunData, headline, load_run

PLOT_DPI = 90  # small files (docs/img) that stay legible in a browser
KV_HEADROOM = 1.15  # the KV-cache axis ends 15 % above the peak usage
KV_SCILIMITS = (-1, 3)  # KV-cache ticks below 0.1 % get a power-of-ten offset (labels stay 3-4 characters)


@dataclass(frozen=True)
class Plot:
    """One written PNG: `file` (name beside report.html), a caption, points drawn in all panels."""

    file: str
    title: str
    points: int


# Fixed margins (inches) instead of tight_layout, which draws every figure twice: half the CPU of a
# report, which an interrupted run draws while its engines and Ray shut down (orchestrator/main.py).
PANEL_W, PANEL_H = 4.6, 3.4  # one panel's share of the figure
LEFT, RIGHT, GAP, BOTTOM, TOP = 0.75, 0.15, 0.8, 0.5, 0.3  # room for tick labels, axis labels, titles


def _figure(k: int):
    """A figure of `k` panels in one row (matplotlib's object API: no pyplot state, safe off the main
    thread) with the fixed margins above; returns (figure, its k axes)."""
    from matplotlib.figure import Figure

    w = PANEL_W * k
    fig = Figure(figsize=(w, PANEL_H))
    axes = fig.subplots(1, k, squeeze=False)
    panel = (w - LEFT - RIGHT - GAP * (k - 1)) / k
    fig.subplots_adjust(left=LEFT / w, right=1 - RIGHT / w, bottom=BOTTOM / PANEL_H, top=1 - TOP / PANEL_H,
                        wspace=GAP / panel)
    return fig, list(axes[0])


def _x_label(x: str, runs: list[RunData]) -> str:
    return {"step": "step", "wall_min": "loop wall time (min)", "gpu_h": "GPU-hours"}[x]


def _lines(ax, runs: list[RunData], key: str, x: str = "step", label_suffix: str = "", **kw) -> int:
    """Draw `key` of every run on `ax` in the run's color; returns the number of points drawn."""
    n = 0
    for i, run in enumerate(runs):
        xs, ys = run.series(key, x)
        if xs:
            ax.plot(xs, ys, color=f"C{i}", marker="." if len(xs) < 30 else None,
                    label=f"{run.name}{label_suffix}", **kw)
            n += len(xs)
    return n


def _finish(ax, title: str, xlabel: str, ylabel: str, legend: bool) -> None:
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if legend and ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def _reward_axes(runs: list[RunData]) -> list[str]:
    """The reward plot's x axes, one panel each: GPU-hours only when a run placed GPUs."""
    return ["step", "wall_min"] + (["gpu_h"] if any(r.num_gpus() for r in runs) else [])


def _reward(axes, runs: list[RunData]) -> int:
    n = 0
    for ax, x in zip(axes, _reward_axes(runs)):
        n += _lines(ax, runs, "reward/mean", x, " train")
        for i, run in enumerate(runs):  # validation: its own records (step 0 included)
            if x == "step" and run.validations:
                ax.plot([v["step"] for v in run.validations], [v["val/reward/mean"] for v in run.validations],
                        color=f"C{i}", linestyle="--", marker="o", label=f"{run.name} val")
                n += len(run.validations)
        _finish(ax, f"reward vs {_x_label(x, runs)}", _x_label(x, runs), "mean reward", True)
    return n


def _throughput(axes, runs: list[RunData]) -> int:
    gpus = [r.num_gpus() for r in runs]
    unit = "per GPU" if all(gpus) else "whole machine (CPU)"
    n = 0
    for i, run in enumerate(runs):
        xs, ys = run.series("perf/throughput", "wall_min")
        per = gpus[i] or 1
        if xs:
            axes[0].plot(xs, [60.0 * y / per for y in ys], color=f"C{i}", label=run.name,
                         marker="." if len(xs) < 30 else None)
            n += len(xs)
        steps = [r for r in run.steps if isinstance(r.get("perf/inference_concurrency"), (int, float))]
        if steps:
            axes[2].scatter([r["perf/inference_concurrency"] for r in steps],
                            [60.0 * r.get("perf/throughput", 0.0) / per for r in steps], color=f"C{i}", s=12,
                            label=run.name)
            n += len(steps)
    _finish(axes[0], f"trained tokens/min, {unit}", "loop wall time (min)", "tokens/min", True)
    n += _lines(axes[1], runs, "perf/inference_concurrency", "wall_min")
    _finish(axes[1], "inference concurrency (gateway, time average)", "loop wall time (min)", "requests in flight", True)
    _finish(axes[2], "throughput vs concurrency", "inference concurrency", "tokens/min", True)
    return n


def _kv_cache(axes, runs: list[RunData]) -> int:
    """KV-cache usage in percent, on an axis from 0 to just above the peak, so that a usage of 0.03 %
    (a tiny model) is a visible line, not an empty chart; the peak is also in the title. Short tick
    labels (a power-of-ten offset below 0.1 %) keep the y label inside the figure."""
    ax, n, peak = axes[0], 0, 0.0
    for i, run in enumerate(runs):
        xs, ys = run.series("perf/kv_cache_usage", "wall_min")
        if xs:
            pct = [100.0 * y for y in ys]
            ax.plot(xs, pct, color=f"C{i}", marker="." if len(xs) < 30 else None, label=run.name)
            n, peak = n + len(xs), max(peak, *pct)
    ax.set_ylim(0.0, peak * KV_HEADROOM if peak > 0 else 1.0)  # usage 0 throughout: 0-1 %
    ax.ticklabel_format(axis="y", style="sci", scilimits=KV_SCILIMITS, useOffset=False)
    _finish(ax, f"KV-cache usage (peak {peak:.3g} %)", "loop wall time (min)", "KV blocks used (%)", True)
    return n


def _with_staleness(runs: list[RunData]) -> list[RunData]:
    return [r for r in runs if r.staleness_hist()[0]]


def _staleness(axes, runs: list[RunData]) -> int:
    n = 0
    for ax, run in zip(axes, _with_staleness(runs)):
        bins, counts = run.staleness_hist()
        bottom = [0.0] * len(counts)
        steps = [r["step"] for r in run.steps]
        for j, b in enumerate(bins):
            col = [c[j] for c in counts]
            ax.bar(steps, col, bottom=bottom, width=1.0, color=f"C{j}", label=f"staleness {b}")
            bottom = [a + c for a, c in zip(bottom, col)]
            n += sum(1 for c in col if c > 0)
        _finish(ax, f"staleness of completed samples: {run.name}", "step", "samples", True)
    return n


def _rollout_corr(axes, runs: list[RunData]) -> int:
    n = 0
    for i, run in enumerate(runs):
        key = run.masked_key()
        if key:
            n += _lines(axes[0], [run], key)
        xs, mean = run.series("rollout_corr/rollout_is_mean")
        if xs:
            axes[1].plot(xs, mean, color=f"C{i}", label=f"{run.name} mean")
            n += len(xs)
            for stat, style in (("rollout_corr/rollout_is_min", ":"), ("rollout_corr/rollout_is_max", "--")):
                sx, sy = run.series(stat)
                axes[1].plot(sx, sy, color=f"C{i}", linestyle=style, linewidth=0.8,
                             label=f"{run.name} {stat.rsplit('_', 1)[1]}")
    for line in axes[0].get_lines():  # _lines used C0 for each single-run call: recolor per run
        idx = [r.name for r in runs].index(line.get_label())
        line.set_color(f"C{idx}")
    if not axes[0].get_lines():
        axes[0].text(0.5, 0.5, "not logged: no rejection rule\n(algorithm.rollout_correction.rs)", ha="center",
                     va="center", transform=axes[0].transAxes, color="gray")
    _finish(axes[0], "rollout correction: masked-token fraction", "step", "fraction of tokens", True)
    _finish(axes[1], "IS weight (token level)", "step", "weight", True)
    return n


# key, label, color (the same color in every run's panel)
TIMING = (("timing_s/wait_for_batch", "waiting for a batch", "C0"), ("timing_s/gen", "generation", "C0"),
          ("timing_s/update_actor", "update", "C1"), ("timing_s/update_weights", "weight sync", "C3"))


def _timing(axes, runs: list[RunData]) -> int:
    n = 0
    for ax, run in zip(axes, runs):
        steps = [r["step"] for r in run.steps]
        bottom = [0.0] * len(steps)
        # async logs both wait_for_batch and gen (the same wait): draw the first present only
        parts = [t for t in TIMING if t[0] != "timing_s/gen" or not run.has("timing_s/wait_for_batch")]
        for key, label, color in parts:
            vals = [float(r.get(key, 0.0) or 0.0) for r in run.steps]
            if not any(vals):
                continue
            ax.bar(steps, vals, bottom=bottom, width=0.9, color=color, label=label)
            bottom = [a + v for a, v in zip(bottom, vals)]
            n += len(vals)
        other = [max(0.0, float(r.get("timing_s/step", 0.0)) - b) for r, b in zip(run.steps, bottom)]
        if any(other):
            ax.bar(steps, other, bottom=bottom, width=0.9, color="C7", label="other")
        _finish(ax, f"time per step: {run.name}", "step", "seconds", True)
    return n


def _outcomes(axes, runs: list[RunData]) -> int:
    n = 0
    for ax, key in zip(axes, OUTCOMES):
        n += _lines(ax, runs, key)
        _finish(ax, f"{key.split('/')[1]} rollouts (cumulative)", "step", "rollouts", True)
    reasons = {(run.name, r): c for run in runs for r, c in run.failed_by_reason().items()}
    if reasons:
        axes[2].set_title("failed rollouts (cumulative); by reason: " +
                          ", ".join(f"{r}={int(c)}" for (_, r), c in list(reasons.items())[:4]), fontsize=8)
    return n


PanelFn = Callable[[list, list[RunData]], int]
PanelCount = Callable[[list[RunData]], int]


def _fixed(k: int) -> PanelCount:
    return lambda runs: k


# file, title, number of panels (only those that can have data), draw
PLOTS: tuple[tuple[str, str, PanelCount, PanelFn], ...] = (
    ("reward.png", "Reward against step, loop wall time (and GPU-hours on GPUs)",
     lambda runs: len(_reward_axes(runs)), _reward),
    ("throughput.png", "Throughput, inference concurrency, throughput against concurrency", _fixed(3), _throughput),
    ("kv_cache.png", "KV-cache usage over time", _fixed(1), _kv_cache),
    ("staleness.png", "Staleness of the completed samples judged per step (async; those staler than "
     "async.max_staleness are dropped or loss-masked, async/dropped_stale)",
     lambda runs: max(1, len(_with_staleness(runs))), _staleness),
    ("rollout_correction.png", "Rollout correction: masked fraction and IS-weight statistics", _fixed(2),
     _rollout_corr),
    ("timing.png", "Time per step: waiting for a batch / generation, update, weight sync",
     lambda runs: max(1, len(runs)), _timing),
    ("outcomes.png", "Rollout outcomes over time", _fixed(len(OUTCOMES)), _outcomes),
)


def draw_plot(file: str, runs: list[RunData]):
    """The matplotlib Figure of the plot named `file` (one of PLOTS) over `runs`, with one panel per
    axis that can have data, and the number of points drawn. Raises KeyError for an unknown name."""
    panels, draw = {f: (k, d) for f, _, k, d in PLOTS}[file]
    fig, axes = _figure(panels(runs))
    return fig, draw(axes, runs)


def write_plots(runs: list[RunData], out: Path) -> list[Plot]:
    """Draw every plot that has data into `out`; returns the plots written (see the invariant)."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for file, title, _, _ in PLOTS:
        fig, points = draw_plot(file, runs)
        path = out / file
        if points > 0:
            fig.savefig(path, dpi=PLOT_DPI)
            written.append(Plot(file, title, points))
        else:
            path.unlink(missing_ok=True)  # a stale plot of an earlier report must not stay referenced
    return written


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return "–" if math.isnan(v) else f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return html.escape(str(v))


def _table(rows: list[dict]) -> str:
    if not rows:
        return "<p>no figures</p>"
    head = "".join(f"<th>{html.escape(k)}</th>" for k in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{_fmt(v)}</td>" for v in r.values()) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


CSS = ("body{font-family:system-ui,sans-serif;margin:1.5em;max-width:1500px}table{border-collapse:collapse;"
       "font-size:13px}td,th{border:1px solid #ccc;padding:3px 7px;text-align:right}th{background:#f3f3f3}"
       "img{max-width:100%;border:1px solid #eee;margin:.4em 0}pre{background:#f7f7f7;padding:.6em;"
       "font-size:12px;overflow:auto}")


def write_html(runs: list[RunData], plots: list[Plot], out: Path, warmup_steps: int = 0) -> Path:
    """report.html in `out`: headline table, the plots (by relative path), each run's summary and config."""
    import yaml

    rows = [headline(r, warmup_steps) for r in runs]
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>run report</title><style>{CSS}</style>"
             "</head><body>", f"<h1>Run report: {html.escape(', '.join(r.name for r in runs))}</h1>",
             f"<h2>Headline figures</h2><p>per run; rates over the steps after the first {warmup_steps}"
             "</p>", _table(rows)]
    parts += ["<h2>Health alarms</h2><p>steps on which each alarm held (orchestrator/watch/alarms.py)</p>",
              _table([{"run": r.name, **alarm_steps(r)} for r in runs])]
    hacking = [{"run": r.name, **h} for r in runs if (h := hacking_rows(r))]
    if hacking:
        parts += ["<h2>Reward hacking</h2><p>per run, the mean over steps of each share the clean-sandbox grader "
                  "flags (examples/agents/agent_common/grading.py) and the steps that had any</p>", _table(hacking)]
    for p in plots:
        parts.append(f"<h2>{html.escape(p.title)}</h2><img src='{html.escape(p.file)}' alt='{html.escape(p.title)}'>")
    for r in runs:
        parts.append(f"<h2>{html.escape(r.name)}</h2><p>{html.escape(str(r.path))}</p>")
        if r.summary:
            parts.append("<details open><summary>summary.json</summary>" +
                         _table([{"key": k, "value": v} for k, v in r.summary.items()]) + "</details>")
        else:
            parts.append("<p>no summary.json: the run ended before writing it</p>")
        if r.config:
            parts.append("<details><summary>config</summary><pre>" +
                         html.escape(yaml.safe_dump(r.config, sort_keys=False)) + "</pre></details>")
    parts.append("</body></html>")
    path = out / "report.html"
    path.write_text("\n".join(parts), encoding="utf-8")
    return path


def alarm_steps(run: RunData) -> dict[str, str]:
    """Per alarm, the steps of `run` on which it held ("none"; "-" for a run that logged none)."""
    out = {}
    for key in ALARMS:
        logged = [r for r in run.steps if key in r]
        held = [str(int(r["step"])) for r in logged if r[key] == 1.0]
        out[key.split("/", 1)[1]] = ", ".join(held) if held else "none" if logged else "-"
    return out


HACKING_SHARES = ("agent/hacking/protected_paths", "agent/hacking/outside_scope", "agent/hacking/episode_vs_graded")


def hacking_rows(run: RunData) -> dict[str, str | float]:
    """Per reward-hacking share `run` logged (`batching.agent_metric_means`): its mean over the
    steps that logged it and the steps where it was above 0 ("none"); {} when it logged none."""
    out: dict[str, str | float] = {}
    for key in HACKING_SHARES:
        logged = [r for r in run.steps if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        if logged:
            name = key.rsplit("/", 1)[1]
            out[f"{name} (mean share)"] = sum(r[key] for r in logged) / len(logged)
            out[f"{name} (steps)"] = ", ".join(str(int(r["step"])) for r in logged if r[key] > 0) or "none"
    return out


def distinct_labels(run_dirs: list[Path]) -> list[str]:
    """One label per run: its folder name, with as many parent folders as it takes to tell two runs
    of the same name apart (`a/run`, `b/run`)."""
    paths = [Path(d).resolve() for d in run_dirs]
    depth = 1
    while True:
        labels = ["/".join(p.parts[-depth:]) for p in paths]
        if len(set(labels)) == len(labels) or depth >= max(len(p.parts) for p in paths):
            return labels
        depth += 1


def build_report(run_dirs: list[Path], out: Path, *, names: list[str] | None = None,
                 warmup_steps: int = 0) -> tuple[Path, list[Plot]]:
    """Load `run_dirs`, write the plots and report.html into `out`; returns (report.html, plots).
    Raises FileNotFoundError / ValueError from `load_run` for a dir that is not a run."""
    labels = names or distinct_labels([Path(d) for d in run_dirs])
    runs = [load_run(Path(d), label) for d, label in zip(run_dirs, labels)]
    plots = write_plots(runs, out)
    return write_html(runs, plots, out, warmup_steps), plots


def write_run_report(run_dir: Path) -> Path | None:
    """The end-of-run report in `RUN_DIR/report/`; None when no step was logged (nothing to draw)."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file() or not metrics.stat().st_size:
        return None
    path, _ = build_report([run_dir], run_dir / "report")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m orchestrator.watch.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dirs", nargs="+", type=Path, help="run dirs (each with metrics.jsonl)")
    ap.add_argument("--out", type=Path, help="output dir (default: RUN_DIR/report for one run)")
    ap.add_argument("--warmup-steps", type=int, default=0, help="first steps left out of the rates in the table")
    args = ap.parse_args(argv)
    if args.out is None:
        if len(args.run_dirs) > 1:
            ap.error("--out is required with several run dirs")
        args.out = args.run_dirs[0] / "report"
    if args.out.exists() and not args.out.is_dir():
        ap.error(f"--out {args.out} is a file; give a directory (created if missing)")
    try:
        path, plots = build_report(args.run_dirs, args.out, warmup_steps=args.warmup_steps)
    except (FileNotFoundError, ValueError) as exc:
        print(f"report error: {exc}", file=sys.stderr)
        return 2
    print(f"{len(plots)} plots; report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
