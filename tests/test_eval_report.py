"""The end of a mode=eval run (issue 29): one summary line and a report with the reward
distribution and pass@k, instead of a raw JSON dump and no report."""

from orchestrator.loop.validation import EvalRecord, summarize
from orchestrator.watch.eval_report import eval_summary_text, write_eval_report


def _records():
    out = []
    for p in range(3):
        for j in range(2):
            ok = not (p == 2 and j == 1)
            out.append(EvalRecord(prompt_index=p, input_id=f"p{p}", sample_index=j, reward=float(p == 0 or j == 0) if ok else None,
                                  status="completed" if ok else "failed", reason=None if ok else "timeout", error=None,
                                  tokens_in=5, tokens_out=3, turns=1, latency_s=0.5, policy_version=0))
    return out


def test_eval_ends_with_a_summary_line_and_a_report_with_both_plots(tmp_path):
    records = _records()
    summary = {"split": "test", **summarize(records, n=2, pass_threshold=1.0, wall_s=10.0)}
    line = eval_summary_text(summary)
    assert line.startswith("eval: 3 prompts x 2 = 6 rollouts of the test split in 10s: reward ")
    assert "pass@1 " in line and "pass@2 1.000" in line and "1 failed (timeout 1)" in line
    path = write_eval_report(tmp_path, [r.reward for r in records if r.status == "completed"], summary)
    text = path.read_text()
    assert sorted(p.name for p in (tmp_path / "report").glob("*.png")) == ["pass_at_k.png", "reward_hist.png"]
    assert "reward_hist.png" in text and "pass_at_k.png" in text and "pass@2" in text
    assert (tmp_path / "report" / "reward_hist.png").read_bytes()[:4] == b"\x89PNG"
