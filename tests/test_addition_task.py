"""task=addition (workers/core/tasks/addition.py): the real model's task. Its splits never share an
unordered pair, its rows are a pure function of (num, seed, split), and the registry hands the
held-out split to validation."""

from __future__ import annotations

import pytest

from orchestrator.tasks import TASKS
from workers.core.tasks import addition


def _unordered(row: dict) -> frozenset[int]:
    a, b = (int(x) for x in row["prompt"].removeprefix("What is ").split("?")[0].split(" + "))
    assert a + b == row["answer"]  # the row's answer is its prompt's sum
    return frozenset((a, b))


def test_the_splits_partition_the_100_ordered_pairs_by_unordered_pair():
    train, test = addition.split_pairs("train"), addition.split_pairs("test")
    assert (len(train), len(test)) == (80, 20)  # 11 held-out unordered pairs: 9 with a != b (x2) + 2 doubles
    assert set(train) | set(test) == {(a, b) for a in range(10) for b in range(10)}
    train_u = {frozenset(p) for p in train}
    assert not train_u & {frozenset(p) for p in test}  # no held-out prompt is a trained one with operands swapped


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_rows_never_cross_splits_whatever_the_seed(seed):
    train = {_unordered(r) for r in addition.make_rows(500, seed, "train")}
    test = {_unordered(r) for r in addition.make_rows(None, seed, "test")}
    assert not train & test


def test_rows_are_deterministic_unique_and_cycle_through_every_pair():
    rows = addition.make_rows(200, 3, "train")
    assert rows == addition.make_rows(200, 3, "train") != addition.make_rows(200, 4, "train")
    assert len({r["input_id"] for r in rows}) == 200
    first_pass = [r["prompt"] for r in rows[:80]]  # each pass is a shuffle of all 80 prompts
    assert len(set(first_pass)) == 80 and len(set(r["prompt"] for r in rows[80:160])) == 80
    every = addition.make_rows(None, 3, "test")
    assert len(every) == 20 and len({r["prompt"] for r in every}) == 20
    assert all(r["input_id"].startswith("addition-test-3-") for r in every)


def test_bad_arguments_name_the_problem():
    with pytest.raises(ValueError, match="num >= 0"):
        addition.make_rows(-1, 0)
    with pytest.raises(ValueError, match="split must be one of"):
        addition.split_pairs("validation")


def test_the_registry_serves_the_held_out_split_for_validation_and_the_arith_agent():
    class Params:  # the task group's values the loader reads (configs/task/addition.yaml)
        num_prompts, seed, data_path, max_turns, val_num_prompts, val_data_path, prompt_key = None, 0, None, 1, None, None, "prompt"

    entry = TASKS["addition"]
    assert entry.agent.parent.name == "arith_agent" and entry.agent.is_file()
    train, test = entry.rows(Params, "train"), entry.rows(Params, "test")
    assert (len(train), len(test)) == (80, 20)
    assert not {_unordered(r) for r in train} & {_unordered(r) for r in test}
