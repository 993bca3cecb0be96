"""The run report (orchestrator/watch/report.py) from synthetic metrics files: every plot is written,
is a PNG with data drawn, report.html references only files that exist; several runs overlay with
a headline table; plots without data are not written. The report of a real run is checked in
tests/test_e2e.py (test_main_job_runs_end_to_end_on_real_parts)."""

from __future__ import annotations

import json
import math
import random

import pytest
import yaml
from report_checks import MIN_COLORED_PIXELS, check_report, colored_pixels

from orchestrator.watch.report import PLOTS, build_report, draw_plot, main
from orchestrator.watch.report_data import headline, load_run

ALL_PLOTS = {p[0] for p in PLOTS}


def make_run(path, *, mode="async", steps=12, gpus=0, seed=0, masked=True, val=True, step_s=2.0, kv_usage=None):
    """A run dir with every metric the loops log, values drawn from a seeded generator (the KV-cache
    usage `kv_usage` x (1, 1.1, 1.2) by step when given)."""
    rng = random.Random(seed)
    path.mkdir(parents=True)
    cluster = ({"name": "local"} if not gpus else
               {"name": "disaggregated", "trainer": {"nodes": 1, "gpus_per_node": gpus // 2},
                "inference": {"replicas": gpus // 2, "tensor_parallel_size": 1}})
    (path / "config.yaml").write_text(yaml.safe_dump({"mode": {"name": mode}, "cluster": cluster}))
    recs = [{"step": 0, "val/reward/mean": 0.1, "val/policy_version": 0}] if val else []
    done = filt = 0
    for s in range(1, steps + 1):
        done, filt = done + 16, filt + rng.randint(0, 8)
        r = {"step": s, "reward/mean": min(1.0, 0.1 * s + rng.random() * 0.1), "timing_s/step": step_s,
             "timing_s/gen": 1.2, "timing_s/update_actor": 0.5, "timing_s/update_weights": 0.1,
             "perf/throughput": 100.0 + 10 * rng.random(), "perf/trained_tokens": 400.0,
             "perf/inference_concurrency": 4 + rng.random() * 4, "perf/kv_cache_usage": 0.05 * rng.random(),
             "rollout/completed": done, "rollout/filtered": filt, "rollout/failed": s // 4, "rollout/expired": s // 3,
             "rollout/truncated": s // 5,
             "rollout_corr/rollout_is_mean": 1 + 0.01 * rng.random(), "rollout_corr/rollout_is_min": 0.8,
             "rollout_corr/rollout_is_max": 1.3, "policy_version": s}
        if mode == "async":
            r.update({"timing_s/wait_for_batch": 1.2, "staleness/mean": 0.5, "staleness/hist/0": 10,
                      "staleness/hist/1": 5, "staleness/hist/2": rng.randint(0, 2)})
        if masked:
            r["rollout_corr/rollout_rs_masked_fraction"] = 0.02 * rng.random()
        if kv_usage is not None:
            r["perf/kv_cache_usage"] = kv_usage * (1 + 0.1 * (s % 3))
        if s == 3:
            r["perf/kv_cache_usage"] = math.nan  # a step without the engine's figure is left out
        recs.append(r)
        if val and s % 4 == 0:
            recs.append({"step": s, "val/reward/mean": 0.1 + 0.05 * s, "val/policy_version": s})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (path / "summary.json").write_text(json.dumps({"steps": steps, "rollout/failed/timeout": 2}))
    return path


def test_every_plot_of_a_full_run_is_a_png_with_data(tmp_path):
    run = make_run(tmp_path / "run", gpus=4)
    html, plots = build_report([run], tmp_path / "out")
    assert {p.file for p in plots} == ALL_PLOTS
    check_report(html, expect=ALL_PLOTS)
    assert all(p.points > 0 for p in plots)


def test_an_empty_axis_does_not_pass_the_data_check(tmp_path):
    """Negative control of check_report: a PNG of axes with no data has no colored pixel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.set_title("empty")
    fig.savefig(tmp_path / "empty.png")
    plt.close(fig)
    assert colored_pixels(tmp_path / "empty.png") < MIN_COLORED_PIXELS


def test_runs_overlay_with_a_headline_table(tmp_path):
    sync = make_run(tmp_path / "sync_1", mode="sync", step_s=4.0, masked=False, val=False)
    asyn = make_run(tmp_path / "async_1", mode="async", seed=1)
    assert main([str(sync), str(asyn), "--out", str(tmp_path / "cmp")]) == 0
    text = (tmp_path / "cmp" / "report.html").read_text()
    assert "sync_1" in text and "async_1" in text and "trained_tokens_per_min" in text
    check_report(tmp_path / "cmp" / "report.html", expect=ALL_PLOTS)
    # async's steps take half as long for the same tokens: twice the trained tokens per minute
    h_sync, h_async = headline(load_run(sync)), headline(load_run(asyn))
    assert h_async["trained_tokens_per_min"] == pytest.approx(2 * h_sync["trained_tokens_per_min"])
    assert (h_sync["mode"], h_sync["steps"], h_sync["completed"]) == ("sync", 12, 12 * 16)


def test_a_plot_without_data_is_not_written_nor_referenced(tmp_path):
    """A sync CPU run without engine figures: no KV-cache or staleness plot, and a stale
    kv_cache.png left by an earlier report is removed rather than shown."""
    run = make_run(tmp_path / "run", mode="sync", masked=False)
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    (run / "metrics.jsonl").write_text("".join(json.dumps({k: v for k, v in r.items() if "kv_cache" not in k}) + "\n"
                                               for r in lines))
    out = tmp_path / "out"
    out.mkdir()
    (out / "kv_cache.png").write_bytes(b"old")
    html, plots = build_report([run], out)
    assert {p.file for p in plots} == ALL_PLOTS - {"kv_cache.png", "staleness.png"}
    assert not (out / "kv_cache.png").exists()
    check_report(html, expect=ALL_PLOTS - {"kv_cache.png", "staleness.png"})


def test_a_resumed_run_keeps_the_last_record_of_a_repeated_step(tmp_path):
    run = make_run(tmp_path / "run", steps=4, val=False)
    with (run / "metrics.jsonl").open("a") as f:  # the resume re-ran step 4
        f.write(json.dumps({"step": 4, "reward/mean": 0.9, "timing_s/step": 1.0}) + "\n")
    data = load_run(run)
    assert [r["step"] for r in data.steps] == [1, 2, 3, 4]
    assert data.series("reward/mean")[1][-1] == 0.9


def test_not_a_run_dir_is_a_clear_error(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{not json\n{"step": 1, "timing_s/step": 1.0}\n')
    assert main([str(tmp_path)]) == 2  # a bad line in the middle is corruption, not a torn write
    assert "metrics.jsonl:1: not JSON" in capsys.readouterr().err


def test_the_report_cli_papercuts_a_new_user_hit(tmp_path, capsys):
    """Issue 29: an empty metrics.jsonl exited 0 with an empty report; a truncated last line (what a
    killed run writes) failed the whole report; two runs named `run` were both labelled "run";
    `--out <a file>` gave a traceback."""
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")
    assert main([str(empty)]) == 2
    assert "no step was logged" in capsys.readouterr().err

    killed = make_run(tmp_path / "killed", steps=4, val=False)
    with (killed / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "reward/me')
    with pytest.warns(UserWarning, match="truncated last line"):
        assert [r["step"] for r in load_run(killed).steps] == [1, 2, 3, 4]

    a, b = make_run(tmp_path / "a" / "run", steps=3), make_run(tmp_path / "b" / "run", steps=3, seed=1)
    html, _ = build_report([a, b], tmp_path / "cmp")
    text = html.read_text()
    assert "a/run" in text and "b/run" in text

    a_file = tmp_path / "out.txt"
    a_file.write_text("x")
    with pytest.raises(SystemExit) as exc:
        main([str(a), "--out", str(a_file)])
    assert exc.value.code == 2 and f"--out {a_file} is a file" in capsys.readouterr().err


def _drawn(fig):
    """`fig` laid out by the Agg canvas (what savefig does), so text extents are known."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig).draw()
    return fig


def test_reward_plot_has_no_blank_gpu_hours_panel_on_cpu(tmp_path):
    """Issue 29: a CPU run's reward plot had a blank third panel (no GPU-hours); only panels with
    data are drawn, and a GPU run keeps its GPU-hours panel."""
    cpu, _ = draw_plot("reward.png", [load_run(make_run(tmp_path / "cpu"))])
    assert [ax.get_xlabel() for ax in cpu.axes] == ["step", "loop wall time (min)"]
    assert all(ax.get_visible() and ax.get_lines() for ax in cpu.axes)
    gpu, _ = draw_plot("reward.png", [load_run(make_run(tmp_path / "gpu", gpus=4))])
    assert [ax.get_xlabel() for ax in gpu.axes] == ["step", "loop wall time (min)", "GPU-hours"]
    assert all(ax.get_lines() for ax in gpu.axes)


@pytest.mark.parametrize("usage", [0.0003, 0.05, 0.7])
def test_kv_cache_plot_shows_small_usages_and_keeps_its_y_label(tmp_path, usage):
    """Issue 29: usages near 0.0003 (the tiny model) looked like an empty chart and the y label was
    cut off by the long tick labels (0.000300). Now percent on an axis from 0 to 15 % above the
    peak (the line fills the top of the panel), the peak in the title, and short tick labels."""
    fig, points = draw_plot("kv_cache.png", [load_run(make_run(tmp_path / "run", kv_usage=usage))])
    ax = _drawn(fig).axes[0]
    assert points == 11  # 12 steps, step 3 NaN
    peak = 100 * usage * 1.2  # percent; the steps' factors are 1, 1.1, 1.2
    assert max(ax.get_lines()[0].get_ydata()) == pytest.approx(peak)
    assert ax.get_ylim() == pytest.approx((0.0, peak * 1.15))
    assert f"(peak {peak:.3g} %)" in ax.get_title() and ax.get_ylabel() == "KV blocks used (%)"
    assert ax.yaxis.label.get_window_extent().x0 >= 0  # inside the figure, not cut off
    assert all(len(t.get_text()) <= 4 for t in ax.get_yticklabels())
