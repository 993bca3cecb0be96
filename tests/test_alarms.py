"""The health alarms (orchestrator/watch/alarms.py) on fed step metrics, and their report table.

Each alarm fires on the signal it watches (a malformed tool-call rate climbing, a masked fraction
climbing, trained rollouts shorter than the ones that finished, rollouts running out of context),
warns once when it starts and
once when it clears, and stays at 0 on flat, healthy series.
"""

from __future__ import annotations

import logging

import pytest

from orchestrator.watch.alarms import ALARMS, AlarmSettings, HealthAlarms
from orchestrator.loop.batching import agent_metric_means
from orchestrator.watch.report import alarm_steps, hacking_rows, write_html
from workers.core.types import SampleInfo
from orchestrator.watch.report_data import RunData


def healthy(step: int) -> dict[str, float]:
    """A step whose 100 turns had 1 malformed call, masked 0.5 %, trained = finished lengths."""
    return {"gateway/turns_served": 100.0 * step, "gateway/turns_ill_formed": 1.0 * step,
            "rollout_corr/rollout_rs_masked_fraction": 0.005,
            "rollout/response_tokens_mean": 300.0, "rollout/trained_response_tokens_mean": 300.0,
            "rollout/turns_mean": 6.0, "rollout/trained_turns_mean": 6.0, "rollout/truncated_share": 0.02}


def run(alarms: HealthAlarms, series: list[dict[str, float]]) -> list[dict[str, float]]:
    return [alarms.observe(i + 1, m) for i, m in enumerate(series)]


def test_healthy_run_raises_no_alarm(caplog):
    with caplog.at_level(logging.WARNING, logger="orchestrator.watch.alarms"):
        out = run(HealthAlarms(), [healthy(s) for s in range(1, 41)])
    assert all(set(o) == set(ALARMS) and not any(o.values()) for o in out)
    assert not caplog.records


def test_a_rising_malformed_rate_fires_then_clears(caplog):
    series, ill = [], 0.0
    for step in range(1, 31):
        rate = 0.01 if step <= 10 else 0.12 if step <= 20 else 0.0  # 1 % -> 12 % -> 0 %
        ill += 100 * rate
        series.append({**healthy(step), "gateway/turns_ill_formed": ill})
    with caplog.at_level(logging.WARNING, logger="orchestrator.watch.alarms"):
        out = run(HealthAlarms(AlarmSettings(window=5)), series)
    held = [i + 1 for i, o in enumerate(out) if o["alarm/malformed_tool_calls"] == 1.0]
    # fires once the last-5 mean reaches 5 % (and 2x the run's lowest window, 1 %): step 12's window
    # is 1,1,1,12,12 % (5.4 %); it clears when the 0 % steps bring it under 5 % (step 23: 12,12,0,0,0)
    assert held == list(range(12, 23)), held
    assert not any(o["alarm/masked_fraction"] or o["alarm/length_bias"] for o in out)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and "step 12: alarm/malformed_tool_calls" in messages[0] and "cleared" in messages[1]


def test_a_high_but_flat_rate_is_not_a_rise():
    flat = [{**healthy(s), "gateway/turns_ill_formed": 20.0 * s} for s in range(1, 31)]  # 20 % from the start
    assert not any(o["alarm/malformed_tool_calls"] for o in run(HealthAlarms(), flat))


def test_a_rising_masked_fraction_fires():
    series = [{**healthy(s), "rollout_corr/rollout_rs_masked_fraction": 0.005 if s <= 8 else 0.03}
              for s in range(1, 21)]
    out = run(HealthAlarms(AlarmSettings(window=4)), series)
    assert [o["alarm/masked_fraction"] for o in out][-1] == 1.0
    assert not any(o["alarm/masked_fraction"] for o in out[:9])


@pytest.mark.parametrize("short", ["rollout/trained_response_tokens_mean", "rollout/trained_turns_mean"])
def test_trained_rollouts_shorter_than_finished_ones_fire_the_length_bias(short):
    biased = [{**healthy(s), short: healthy(s)[short] * 0.6} for s in range(1, 11)]  # 40 % short
    out = run(HealthAlarms(AlarmSettings(window=3)), biased)
    assert [o["alarm/length_bias"] for o in out] == [0.0, 0.0] + [1.0] * 8
    mild = [{**healthy(s), short: healthy(s)[short] * 0.9} for s in range(1, 11)]  # within 20 %
    assert not any(o["alarm/length_bias"] for o in run(HealthAlarms(AlarmSettings(window=3)), mild))


def test_the_report_lists_the_steps_each_alarm_held(tmp_path):
    steps = [{"step": 1, **dict.fromkeys(ALARMS, 0.0)}, {"step": 2, **dict.fromkeys(ALARMS, 0.0),
                                                            "alarm/length_bias": 1.0}]
    table = alarm_steps(RunData(name="r", path=tmp_path, steps=steps))
    assert table == {"malformed_tool_calls": "none", "masked_fraction": "none", "length_bias": "2",
                     "truncated_share": "none", "reward_hacking": "none"}
    assert set(alarm_steps(RunData(name="old", path=tmp_path, steps=[{"step": 1}])).values()) == {"-"}


def test_a_high_truncated_share_fires_and_clears(caplog):
    """Issue 28 item 3: truncated rollouts (ran out of context) feed the alarms. 2 % truncated is
    healthy; 25 % for steps 6..12 fires once the last-4 mean reaches 10 %, and clears after."""
    shares = [0.02] * 5 + [0.25] * 7 + [0.0] * 8
    with caplog.at_level(logging.WARNING, logger="orchestrator.watch.alarms"):
        out = run(HealthAlarms(AlarmSettings(window=4)), [{**healthy(s + 1), "rollout/truncated_share": v}
                                                          for s, v in enumerate(shares)])
    held = [i + 1 for i, o in enumerate(out) if o["alarm/truncated_share"] == 1.0]
    # step 6's window is 2,2,2,25 % (7.75 %: silent); step 7's 2,2,25,25 % (13.5 %) fires; step 14's
    # 25,25,0,0 % (12.5 %) holds; step 15's 25,0,0,0 % (6.25 %) clears
    assert held == list(range(7, 15)), held
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and "step 7: alarm/truncated_share" in messages[0] and "rollout.max_context_tokens" \
        in messages[0] and "cleared" in messages[1]
    assert not any(o["alarm/malformed_tool_calls"] or o["alarm/length_bias"] for o in out)


def _graded(i: int, protected: float, episode_vs_graded: float) -> SampleInfo:
    return SampleInfo(session_id=f"s{i}", group_id=i, input_id="x", sample_index=0, status="completed", reward=0.0,
                      latency_s=1.0, agent_metrics=(("grading_s", 0.5), ("hacking/episode_vs_graded", episode_vs_graded),
                                                    ("hacking/outside_scope", 0.0), ("hacking/protected_paths", protected)))


def test_rising_reward_hacking_fires_from_the_graders_flags(caplog, tmp_path):
    """Issue 42 item 3: per step, the share of rollouts whose diff touched protected paths or whose
    episode tests passed where the clean grading failed; the alarm fires when it rises, the report
    lists it. 8 rollouts a step: none flagged for 5 steps, then 2 of 8 edit the test (25 %)."""
    clean = [_graded(i, 0.0, 0.0) for i in range(8)]
    hacked = [_graded(i, 1.0, 1.0 if i == 0 else 0.0) for i in range(2)] + clean[2:]
    plain = SampleInfo(session_id="p", group_id=9, input_id="y", sample_index=0, status="completed", reward=1.0,
                       latency_s=1.0)  # an agent that reports no flags is not in the share's denominator
    means = agent_metric_means(hacked + [plain])
    assert means == {"agent/grading_s": 0.5, "agent/hacking/episode_vs_graded": 1 / 8,
                     "agent/hacking/outside_scope": 0.0, "agent/hacking/protected_paths": 2 / 8}
    series = [agent_metric_means(clean)] * 5 + [means] * 6
    with caplog.at_level(logging.WARNING, logger="orchestrator.watch.alarms"):
        out = run(HealthAlarms(AlarmSettings(window=4)), [{**healthy(s + 1), **m} for s, m in enumerate(series)])
    held = [i + 1 for i, o in enumerate(out) if o["alarm/reward_hacking"] == 1.0]
    # a step's share is max(25 %, 12.5 %) = 25 %; step 6's window 0,0,0,25 % (6.25 %) passes the 5 % floor
    # and is above 2x the lowest window (0 %)
    assert held == list(range(6, 12)), held
    assert "step 6: alarm/reward_hacking" in caplog.records[0].getMessage()
    steps = [{"step": i + 1, **m, **o} for i, (m, o) in enumerate(zip(series, out))]
    rows = hacking_rows(RunData(name="r", path=tmp_path, steps=steps))
    assert rows["protected_paths (steps)"] == "6, 7, 8, 9, 10, 11" and rows["outside_scope (steps)"] == "none"
    assert rows["protected_paths (mean share)"] == pytest.approx(6 * 0.25 / 11)
    assert alarm_steps(RunData(name="r", path=tmp_path, steps=steps))["reward_hacking"] == "6, 7, 8, 9, 10, 11"
    html = write_html([RunData(name="r", path=tmp_path, steps=steps)], [], tmp_path).read_text()
    assert "<h2>Reward hacking</h2>" in html and "protected_paths (mean share)" in html
    assert hacking_rows(RunData(name="old", path=tmp_path, steps=[{"step": 1}])) == {}
