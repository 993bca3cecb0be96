"""The default task: deterministic rows and the partial-credit reward."""

from __future__ import annotations

import json
import random

import pytest

from stand_ins import REPO, load_module
from workers.core.tasks import RESERVED_KEYS, letters

REWARD_PATH = REPO / "examples/agents/letters_agent/reward.py"
score = load_module(REWARD_PATH, "letters_reward_under_test").score


def test_make_rows_is_deterministic_and_seed_dependent():
    assert letters.make_rows(50, seed=7) == letters.make_rows(50, seed=7)
    assert letters.make_rows(50, seed=7) != letters.make_rows(50, seed=8)
    assert letters.make_rows(10, seed=7) == letters.make_rows(50, seed=7)[:10]  # a prefix is stable


def test_rows_are_unique_json_rows_without_reserved_keys():
    rows = letters.make_rows(500, seed=0)
    assert len({r["input_id"] for r in rows}) == 500
    assert json.loads(json.dumps(rows)) == rows
    for r in rows:
        assert not (RESERVED_KEYS & r.keys())
        assert r["letter"] in letters.LETTERS and len(r["letter"]) == 1
        assert letters.MIN_COUNT <= r["count"] <= letters.MAX_COUNT
        assert r["prompt"] == f"Repeat the letter {r['letter']} {r['count']} times."
    assert {r["count"] for r in rows} == set(range(letters.MIN_COUNT, letters.MAX_COUNT + 1))
    assert len({r["letter"] for r in rows}) == len(letters.LETTERS)


def test_make_rows_rejects_negative_num():
    assert letters.make_rows(0, seed=0) == []
    with pytest.raises(ValueError, match="num"):
        letters.make_rows(-1, seed=0)


def test_perfect_answer_scores_one():
    for row in letters.make_rows(100, seed=1):
        assert score(row, letters.format_answer(row["letter"], row["count"])) == 1.0


ROW = {"letter": "q", "count": 4}


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("q q q q", 1.0),
        ("qqqq", 1.0),  # whitespace is ignored
        ("  Q Q q q\n", 1.0),  # case-insensitive, surrounding space ignored
        ("q q", 0.5),  # 2 right of 4
        ("q", 0.25),
        ("q q q q q q q q", 0.5),  # 4 right, length 8: 4 / 8
        ("q q q q q", 0.8),  # 4 / 5
        ("q q q q.", 0.8),  # the period is a fifth character
        ("z z z z", 0.0),
        ("q z q z", 0.5),
        ("z q q q q", 0.6),  # positions 1..3 right (3), length 5: 3 / 5
        ("", 0.0),
        ("   ", 0.0),
    ],
)
def test_score_hand_checked(completion, expected):
    assert score(ROW, completion) == pytest.approx(expected)


def test_score_is_in_unit_interval_on_random_strings():
    rng = random.Random(0)
    alphabet = "qz .Q\n"
    for _ in range(2000):
        row = {"letter": rng.choice("qz"), "count": rng.randint(1, 6)}
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 20)))
        assert 0.0 <= score(row, text) <= 1.0


@pytest.mark.parametrize(
    "row", [{"count": 3}, {"letter": "ab", "count": 3}, {"letter": "a"}, {"letter": "a", "count": 0},
            {"letter": "a", "count": True}, {"letter": "a", "count": "3"}]
)
def test_score_rejects_malformed_rows(row):
    with pytest.raises(ValueError):
        score(row, "a a a")


# --- the one task registry (orchestrator/tasks.py) -----------------------------------------------

def test_registry_is_the_one_list_config_validation_accepts():
    from orchestrator.config import ConfigError, TaskConfig
    from orchestrator.tasks import TASK_NAMES, TASKS

    assert TASK_NAMES == tuple(TASKS)
    for name, entry in TASKS.items():
        assert entry.agent is None or entry.agent.is_file(), name  # None: the user's agent (task=custom)
        assert entry.a2a_agent is None or entry.a2a_agent.is_file(), name
        kwargs = {"data_path": "any.jsonl"} if entry.check_data is not None else {}
        assert TaskConfig(name=name, **kwargs).name == name  # every registered task validates
    with pytest.raises(ConfigError, match=r"^task\.name must be one of \['letters', 'addition', 'gsm8k', 'swe_mini', 'custom'\]"):
        TaskConfig(name="unregistered")


def test_a_task_with_a_data_file_needs_task_data_path_before_preflight():
    from orchestrator.config import ConfigError, TaskConfig
    from orchestrator.tasks import TASKS

    with_data = [n for n, e in TASKS.items() if e.check_data is not None]
    assert with_data == ["gsm8k", "custom"]
    with pytest.raises(ConfigError, match=r"^task\.data_path must be set for task=gsm8k"):
        TaskConfig(name="gsm8k", data_path=None)


def test_registry_loads_letters_rows_for_its_agent():
    from orchestrator.config import TaskConfig
    from orchestrator.tasks import TASKS

    rows = TASKS["letters"].rows(TaskConfig(num_prompts=5, seed=3), "train")
    assert rows == letters.make_rows(5, seed=3)
    assert TASKS["letters"].agent.parent == REWARD_PATH.parent  # reward.py sits beside the agent app


def test_letters_agent_draws_the_same_environment_time_for_the_same_rollout_in_every_run(monkeypatch):
    """bench_modes' configurations see the same delays (common random numbers): the delay follows
    the rollout's group and sample, not the experiment name or the session id's random suffix."""
    import sys
    import uuid

    from workers.rollout.contract import new_session_id

    monkeypatch.setenv("LETTERS_ENV_TIME_MEDIAN_S", "0.2")
    monkeypatch.setenv("LETTERS_ENV_TIME_SIGMA", "1.0")
    monkeypatch.setattr(sys, "path", list(sys.path))  # the app puts its own folders first
    before = set(sys.modules)
    try:
        app = load_module(REPO / "examples/agents/letters_agent/app.py", "letters_app_under_test")
        a = app.env_time_s(new_session_id("exp-sync_1", 7, 2))
        assert a == app.env_time_s(new_session_id("exp-async_2", 7, 2)) > 0
        draws = {app.env_time_s(new_session_id("exp-sync_1", g, i)) for g in range(8) for i in range(4)}
        assert len(draws) == 32 and a in draws  # a different draw per rollout
        assert app.env_time_s(f"free-form-{uuid.uuid4().hex[:8]}") != app.env_time_s("free-form-other")
        monkeypatch.setenv("LETTERS_ENV_TIME_MEDIAN_S", "0")
        assert app.env_time_s(new_session_id("exp", 7, 2)) == 0.0
    finally:
        for name in set(sys.modules) - before:  # its `reward` must not shadow another agent's
            del sys.modules[name]
