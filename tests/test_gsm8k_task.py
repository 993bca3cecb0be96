"""task=gsm8k: the JSONL loader on the in-repo sample, its errors, the config group, the task registry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.config import TASK_NAMES, ConfigError, TaskConfig
from stand_ins import REPO, compose_config
from workers.core.tasks import RESERVED_KEYS, gsm8k

TEST_COPY = f"{gsm8k.SAMPLE_DIR}/test.jsonl"  # relative to the repository root, as users write it
TRAIN_COPY = f"{gsm8k.SAMPLE_DIR}/train.jsonl"
GOOD = {"question": "Tom has 3 apples and buys 1,200 more. How many?", "answer": "3 + 1200 = 1203\n#### 1,203"}


def _write(tmp_path: Path, lines: list[str]) -> Path:
    p = tmp_path / "mini.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


# --- the in-repository sample --------------------------------------------------------------------

def test_reads_every_row_of_the_sample_test_file_with_numeric_answers():
    rows = gsm8k.load_rows(TEST_COPY, None, seed=0, max_turns=3)
    assert len(rows) == 128  # the first 128 rows of the GSM8K test split
    first = rows[0]
    assert first["input_id"] == "gsm8k-test-1"
    assert first["question"].startswith("Janet\u2019s ducks lay 16 eggs per day.")
    assert first["answer"] == 18 and isinstance(first["answer"], int)  # "... #### 18"
    assert first["max_turns"] == 3
    assert len({r["input_id"] for r in rows}) == len(rows)
    assert all(isinstance(r["answer"], (int, float)) and not isinstance(r["answer"], bool) for r in rows)
    assert not any(RESERVED_KEYS & r.keys() for r in rows)
    json.dumps(rows)  # rows travel as JSON payloads


def test_subset_is_seeded_and_a_smaller_num_is_a_prefix():
    a = gsm8k.load_rows(TEST_COPY, 20, seed=7, max_turns=4)
    assert a == gsm8k.load_rows(TEST_COPY, 20, seed=7, max_turns=4)
    assert a != gsm8k.load_rows(TEST_COPY, 20, seed=8, max_turns=4)
    assert gsm8k.load_rows(TEST_COPY, 5, seed=7, max_turns=4) == a[:5]
    full = {r["input_id"]: r for r in gsm8k.load_rows(TEST_COPY, None, seed=0, max_turns=4)}
    assert all(full[r["input_id"]] == r for r in a)  # a subset of the file's rows, unchanged


def test_num_prompts_over_the_file_size_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"task.num_prompts=5000 must be in \[1, 128\]"):
        gsm8k.load_rows(TEST_COPY, 5000, seed=0, max_turns=4)


def test_the_sample_ships_in_the_repository_with_its_licence():
    rows = gsm8k.load_rows(TRAIN_COPY, None, seed=0, max_turns=4)
    assert len(rows) == 256  # the first 256 rows of the GSM8K train split
    assert rows[0]["input_id"] == "gsm8k-train-1"
    assert rows[0]["question"].startswith("Natalia sold clips to 48 of her friends in April")
    assert rows[0]["answer"] == 72
    sample = REPO / gsm8k.SAMPLE_DIR
    licence = (sample / "LICENSE").read_text()
    assert licence.startswith("MIT License") and "Copyright (c) 2021 OpenAI" in licence
    assert "openai/grade-school-math" in (sample / "README.md").read_text()  # where the rows come from
    # the default task.data_path resolves inside the repository, whatever the working directory
    default = gsm8k.resolve_data_path(compose_config(["task=gsm8k"]).task.data_path)
    assert default == (sample / "train.jsonl").resolve() and default.is_relative_to(REPO.resolve())


def test_no_repository_file_refers_to_a_path_beside_the_repository():
    """A clone placed alone must run: no file names the team's shared folder beside the repository."""
    outside = "../" + "shared"  # spelled in two parts so this file does not match itself
    suffixes = {".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".txt", ".cfg", ".ini", ".json"}
    hits = []
    for top in ("orchestrator", "workers", "configs", "scripts", "tests", "examples", "docs", ".ci"):
        for path in (REPO / top).rglob("*"):
            if path.is_file() and path.suffix in suffixes | {""} and "__pycache__" not in path.parts:
                text = path.read_text(errors="replace")
                hits += [f"{path.relative_to(REPO)}:{i}" for i, line in enumerate(text.splitlines(), 1)
                         if outside in line]
    for name in ("README.md", "Makefile", "pyproject.toml"):
        text = (REPO / name).read_text() if (REPO / name).is_file() else ""
        hits += [f"{name}:{i}" for i, line in enumerate(text.splitlines(), 1) if outside in line]
    assert hits == []


# --- errors --------------------------------------------------------------------------------------

def test_missing_file_names_task_data_path_and_the_resolved_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"task.data_path='nope/gsm8k.jsonl': no file at .*nope/gsm8k.jsonl"):
        gsm8k.load_rows("nope/gsm8k.jsonl", None, seed=0, max_turns=4, root=tmp_path)
    with pytest.raises(ValueError, match="task.data_path must be set"):
        gsm8k.resolve_data_path(None)


def test_relative_paths_resolve_against_the_repository_root_not_the_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert gsm8k.resolve_data_path(TEST_COPY) == (REPO / TEST_COPY).resolve()


@pytest.mark.parametrize(
    "bad,why",
    [
        ("{not json", "not valid JSON"),
        ('["a list"]', "expected a JSON object"),
        ('{"answer": "#### 3"}', "missing field 'question'"),
        ('{"question": "", "answer": "#### 3"}', "non-empty string 'question'"),
        ('{"question": "q?", "answer": 3}', "string 'answer'"),
        ('{"question": "q?", "answer": "it is 3"}', r"does not end in '#### <number>'"),
        ('{"question": "q?", "answer": "#### three"}', r"does not end in '#### <number>'"),
    ],
)
def test_a_bad_line_is_refused_naming_file_and_line(tmp_path, bad, why):
    path = _write(tmp_path, [json.dumps(GOOD), "", bad])
    with pytest.raises(gsm8k.DatasetError, match=rf"mini.jsonl:3: .*{why}"):
        gsm8k.load_rows(str(path), None, seed=0, max_turns=4)


@pytest.mark.parametrize("row,missing", [({"question": "q?", "solution": "#### 3"}, "answer"),
                                         ({"problem": "q?", "solution": "#### 3"}, "question")])
def test_a_row_without_the_documented_fields_names_them_not_verls(tmp_path, row, missing):
    """docs/agents.md documents `{"question", "answer"}` rows: a row lacking one is refused naming that field
    and the layout, not verl's `reward_model.ground_truth`; pre-flight adds the config key."""
    from orchestrator.control.preflight import check_task_data

    path = _write(tmp_path, [json.dumps(GOOD), json.dumps(row)])
    cfg = compose_config(["task=gsm8k", f"task.data_path={path}"])
    with pytest.raises(ConfigError) as err:
        check_task_data(cfg)
    assert str(err.value).startswith(f"task.data_path: {path}:2: missing field '{missing}' (fields: {sorted(row)})")
    assert '{"question": str, "answer": "... #### <number>"}' in str(err.value)
    assert "ground_truth" in str(err.value) and "missing field 'reward_model" not in str(err.value)


def test_thousands_commas_and_decimals_in_the_ground_truth():
    assert gsm8k.parse_final_number("x\n#### 1,203") == 1203
    assert gsm8k.parse_final_number("#### -4") == -4
    assert gsm8k.parse_final_number("#### 2.50 ") == 2.5


def test_an_empty_file_is_refused(tmp_path):
    path = _write(tmp_path, ["", "  "])
    with pytest.raises(gsm8k.DatasetError, match="no rows"):
        gsm8k.load_rows(str(path), None, seed=0, max_turns=4)


# --- config and registry -------------------------------------------------------------------------

def test_task_gsm8k_config_sets_the_tool_prompt_budgets_and_cli_overrides_win():
    cfg = compose_config(["task=gsm8k"])
    assert (cfg.task.name, cfg.task.data_path, cfg.task.num_prompts, cfg.task.max_turns) == (
        "gsm8k", TRAIN_COPY, None, 4)
    assert (cfg.rollout.max_tokens, cfg.rollout.max_context_tokens, cfg.inference.max_model_len) == (128, 1024, 1024)
    cfg = compose_config(["task=gsm8k", "rollout.max_tokens=64", f"task.data_path={TEST_COPY}", "task.num_prompts=10"])
    assert (cfg.rollout.max_tokens, cfg.task.data_path, cfg.task.num_prompts) == (64, TEST_COPY, 10)
    letters = compose_config([])  # the default task keeps its own budgets
    assert (letters.task.name, letters.rollout.max_tokens, letters.inference.max_model_len) == ("letters", 16, 512)


def test_a_missing_data_file_fails_preflight_naming_the_key():
    from orchestrator.control.preflight import check_task_data

    cfg = compose_config(["task=gsm8k", "task.data_path=/nonexistent/gsm8k.jsonl"])  # the schema reads values only
    with pytest.raises(ConfigError, match=r"^task.data_path='/nonexistent/gsm8k.jsonl': no file"):
        check_task_data(cfg)
    check_task_data(compose_config(["task=gsm8k"]))  # the default, the in-repository sample, is there
    with pytest.raises(ConfigError, match=r"^task.max_turns must be >= 1"):
        compose_config(["task=gsm8k", "task.max_turns=0"])
    with pytest.raises(ConfigError, match=r"^task.num_prompts must be >= 1"):
        compose_config(["task.num_prompts=null"])  # letters generates rows: it needs a count


def test_the_registry_covers_every_task_name_and_loads_rows_for_its_agent():
    from orchestrator.tasks import TASKS

    assert set(TASKS) == set(TASK_NAMES)
    for name, entry in TASKS.items():
        assert entry.agent is None or entry.agent.is_file(), name  # None: the user's agent (task=custom)
    rows = TASKS["gsm8k"].rows(TaskConfig(name="gsm8k", num_prompts=3, seed=1, data_path=TEST_COPY, max_turns=2), "train")
    assert [r["max_turns"] for r in rows] == [2, 2, 2]
    assert TASKS["gsm8k"].agent == REPO / "examples/agents/gsm8k_agent/app.py"
    assert len(TASKS["letters"].rows(TaskConfig(num_prompts=4), "train")) == 4
