"""The console a person watches (orchestrator/watch/progress.py) and the metric sinks beside it
(orchestrator/watch/metrics.py): plain lines off a terminal, a rich bar on one, warnings always shown,
TensorBoard event files, wandb online only with an API key, no metrics.jsonl before a first record."""

from __future__ import annotations

import io
import math

from orchestrator.watch.metrics import JsonlSink, TensorBoardSink, resolve_wandb_mode
from orchestrator.watch.progress import ProgressSink


def step_rec(step, *, filtered=0, is_mean=1.0):
    return {"reward/mean": 0.25 * step, "perf/throughput": 120.0, "timing_s/step": 2.0, "timing_s/gen": 1.5,
            "timing_s/update_actor": 0.4, "timing_s/update_weights": 0.05, "rollout/dispatched": 20.0 * step,
            "rollout/completed": 16.0 * step - filtered, "rollout/filtered": float(filtered), "rollout/failed": 0.0,
            "rollout/expired": 0.0, "rollout_corr/is_mean": is_mean}


def test_plain_lines_off_a_terminal_with_eta_and_in_flight():
    out, err = io.StringIO(), io.StringIO()
    sink = ProgressSink(10, out, tty=False, warn_stream=err)
    sink.log(1, step_rec(1))
    sink.log(2, step_rec(2, is_mean=math.nan))  # nothing trained: no is_mean=nan on the console
    lines = out.getvalue().splitlines()
    assert lines[0] == ("[step 1/10] reward=0.250 tok/s=120 step=2.0s gen=1.5 update=0.4 sync=0.05 in_flight=4 "
                        "failed_total=0 filtered_total=0 is_mean=1.000 eta=0:00:18")  # 9 steps left x 2 s
    assert lines[1].startswith("[step 2/10]") and "nan" not in lines[1] and lines[1].endswith("eta=0:00:16")
    assert err.getvalue() == ""


def test_warnings_are_shown_on_stderr_beside_the_lines():
    out, err = io.StringIO(), io.StringIO()
    sink = ProgressSink(10, out, tty=False, warn_stream=err)
    sink.log(1, step_rec(1, filtered=15))  # 15 of 16 finished rollouts filtered
    assert err.getvalue().startswith("warning: step 1: 15 of 16 rollouts were filtered")


def test_a_terminal_gets_a_progress_bar(monkeypatch):
    monkeypatch.setenv("COLUMNS", "160")  # rich's width off a real terminal
    out = io.StringIO()
    sink = ProgressSink(4, out, tty=True)
    for s in range(1, 5):
        sink.log(s, step_rec(s))
    sink.close()
    text = out.getvalue()
    assert "4/4" in text and "reward=1.000" in text and "[step" not in text


def test_tensorboard_sink_writes_event_files(tmp_path):
    sink = TensorBoardSink(tmp_path / "tb")
    sink.log(1, {"reward/mean": 0.5, "rollout_corr/is_mean": math.nan})
    sink.close()
    from tensorboardX.event_file_writer import EventFileWriter  # noqa: F401  (the writer we pinned)

    files = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert len(files) == 1 and b"reward/mean" in files[0].read_bytes()


def test_wandb_goes_online_only_with_an_api_key():
    assert resolve_wandb_mode("auto", {"WANDB_API_KEY": "k"}) == "online"
    assert resolve_wandb_mode("auto", {}) == "offline"
    assert resolve_wandb_mode("disabled", {"WANDB_API_KEY": "k"}) == "disabled"


def test_no_metrics_file_before_the_first_record(tmp_path):
    """A run that fails before its first step leaves no metrics.jsonl, so a rerun may reuse its
    run_dir (pre-flight refuses a run_dir holding a metrics.jsonl)."""
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    sink.close()
    assert not (tmp_path / "metrics.jsonl").exists()
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    sink.log(1, {"reward/mean": 0.5})
    sink.close()
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "reward/mean": 0.5}\n'


def test_quiet_console_sends_library_output_to_the_run_dir(tmp_path, monkeypatch):
    """Library records below logger.console_level and Python warnings go to RUN_DIR/logs/driver.log
    only; a warning of ours still reaches the console."""
    import logging
    import warnings

    from orchestrator.watch.console_log import QUIET_ENV, quiet_console

    for k in QUIET_ENV:  # quiet_console sets them for the processes it starts: restored after the test
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)
    console = io.StringIO()
    root = logging.getLogger()
    hydra_like = logging.StreamHandler(console)  # what Hydra's job_logging=stdout installs
    saved = (root.level, list(root.handlers))
    root.addHandler(hydra_like)
    try:
        path = quiet_console(tmp_path, "error")
        logging.getLogger("vllm.engine").warning("Triton is installed, but doesn't include CPU backend")
        logging.getLogger("ray").info("Started a local Ray instance.")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("torch.distributed.reduce_op is deprecated", FutureWarning)
        logging.getLogger("orchestrator.loop.common").error("rollout s-1 failed: boom")
        from orchestrator.watch.progress import phase

        printed = io.StringIO()
        phase("starting Ray", printed)  # the console lines also reach the driver log (it was empty after a run)
        ProgressSink(10, printed, tty=False, warn_stream=printed).log(1, step_rec(1, filtered=15))
        for h in root.handlers:
            h.flush()
        text = path.read_text()
        assert "CPU backend" in text and "reduce_op" in text and "Started a local Ray" in text
        assert "] starting Ray" in text and "[step 1/10] reward=0.250" in text and "WARNING" in text
        assert console.getvalue() == "rollout s-1 failed: boom\n"  # printed once, not logged twice
    finally:
        logging.captureWarnings(False)
        for h in list(root.handlers):
            if h not in saved[1]:
                root.removeHandler(h)
                h.close()
        ray_logger = logging.getLogger("ray")
        for h in list(ray_logger.handlers):
            if isinstance(h, logging.FileHandler):
                ray_logger.removeHandler(h)
        root.setLevel(saved[0])


def test_summary_text_says_how_many_rollouts_an_interrupted_run_left_running():
    from orchestrator.watch.progress import summary_text

    base = {"steps": 3, "rollout/dispatched": 128, "rollout/completed": 44, "rollout/filtered": 52}
    assert summary_text(base | {"rollout/open": 32}).splitlines()[1].startswith(
        "rollouts: 128 dispatched: 44 trained, 52 filtered, 0 failed, 0 expired, 32 still running when it stopped;")
    assert "still running" not in summary_text(base | {"rollout/open": 0})


def test_summary_json_is_standard_json_with_null_for_what_was_not_measured(tmp_path):
    """Issue 29: a task=gsm8k run's summary.json held a bare NaN, which strict parsers reject."""
    import json
    import math

    from orchestrator.watch.metrics import finite_json

    summary = {"reward/initial": math.nan, "reward/final": 0.5, "x": [math.inf, 1.0, {"y": -math.inf}], "n": 3}
    text = json.dumps(finite_json(summary), allow_nan=False)  # would raise on any NaN left
    assert json.loads(text) == {"reward/initial": None, "reward/final": 0.5, "x": [None, 1.0, {"y": None}], "n": 3}
    from orchestrator.watch.metrics import read_summary, write_summary

    path = tmp_path / "summary.json"
    write_summary(path, {"reward/initial": math.nan, "reward/final": 0.5})
    assert "NaN" not in path.read_text()
    back = read_summary(path)  # what the bench scripts do arithmetic on: NaN again, not None
    assert math.isnan(back["reward/initial"]) and back["reward/final"] == 0.5
