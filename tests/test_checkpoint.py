"""Checkpoints: atomic save, `latest` pointer, refusal of corrupt or partial checkpoints, prompt
cursor and staleness counters restored exactly, trainer weights + optimizer resumed bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from workers.core.algorithms.batch import TrainBatch
from orchestrator.control.checkpoint import (
    LATEST_FILENAME,
    CheckpointError,
    RunState,
    checkpoints_dir,
    load_checkpoint,
    load_latest,
    stage_checkpoint,
)
from orchestrator.loop.prompts import PromptCycle
from orchestrator.loop.staleness import Admission, AdmissionState
from stand_ins import ManualVersions, random_qwen2
from workers.core.types import TrajectoryRow
from workers.trainer.worker import TrainerSettings, TrainerWorker

ROWS = [{"input_id": f"p{i}", "prompt": f"question {i}"} for i in range(7)]


def fake_trainer_files(stage) -> None:
    """Stands in for TrainerWorker.save_hf/save_optimizer in the tests about files, not tensors."""
    stage.model_dir.mkdir()
    (stage.model_dir / "config.json").write_text('{"model_type": "qwen2"}')
    (stage.model_dir / "model.safetensors").write_bytes(b"\x01" * 4096)
    stage.optimizer_path.write_bytes(b"\x02" * 1024)


def run_state(step: int, cycle: PromptCycle, *, version: int | None = None, pending=()) -> RunState:
    v = step if version is None else version
    return RunState(step=step, policy_version=v, next_group_id=3 * step, prompts=cycle.state(),
                    admission=AdmissionState(policy_version=v, trained_groups=2 * step), pending_rows=tuple(pending))


def save(run_dir: Path, state: RunState, **kw) -> Path:
    with stage_checkpoint(run_dir, state.step, **kw) as stage:
        fake_trainer_files(stage)
        return stage.commit(state)


# --- prompt cursor: save, restore, compare --------------------------------------------------------

@pytest.mark.parametrize("drawn_before", [0, 3, 7, 12])  # fresh, mid-epoch, at an epoch edge, 2nd epoch
def test_prompts_drawn_after_a_restore_are_the_same(tmp_path, drawn_before):
    original = PromptCycle(ROWS, seed=11)
    original.next_rows(drawn_before)
    save(tmp_path, run_state(1, original))
    expected = [r["input_id"] for r in original.next_rows(20)]  # crosses at least two epochs

    ckpt = load_latest(tmp_path)
    restored = PromptCycle.from_state(ROWS, ckpt.state.prompts)
    assert [r["input_id"] for r in restored.next_rows(20)] == expected
    assert restored.epoch == original.epoch


def test_prompt_state_refuses_a_changed_dataset():
    state = PromptCycle(ROWS, seed=0).state()
    with pytest.raises(ValueError, match="dataset changed"):
        PromptCycle.from_state(ROWS[:-1] + [{"input_id": "other", "prompt": "x"}], state)


def test_run_state_round_trips_with_pending_rows(tmp_path):
    cycle = PromptCycle(ROWS, seed=2)
    pending = cycle.next_rows(2)  # drawn, dispatched, not trained at save time
    state = run_state(4, cycle, pending=pending)
    save(tmp_path, state)
    assert load_latest(tmp_path).state == state


def test_admission_resumes_from_the_checkpointed_state(tmp_path):
    versions = ManualVersions(0)
    adm = Admission(versions, max_staleness=1, groups_per_update=2)
    for _ in range(4):
        adm.on_admitted()
        adm.on_finished(kept=True)
    adm.on_trained(2)
    versions.v = 1
    cycle = PromptCycle(ROWS, seed=0)
    state = RunState(step=1, policy_version=1, next_group_id=4, prompts=cycle.state(), admission=adm.state())
    save(tmp_path, state)

    loaded = load_latest(tmp_path).state
    resumed = Admission(ManualVersions(loaded.policy_version), max_staleness=1, groups_per_update=2)
    resumed.restore(loaded.admission)
    # (η + v + 1)·B - trained = (1 + 1 + 1)·2 - 2 = 4
    assert resumed.free_slots() == 4 and resumed.counts().trained == 2


# --- atomicity, pointer, refusal ------------------------------------------------------------------

def test_no_checkpoint_means_a_fresh_run(tmp_path):
    assert load_latest(tmp_path) is None


def test_latest_moves_and_old_checkpoints_are_pruned(tmp_path):
    cycle = PromptCycle(ROWS, seed=0)
    for step in (1, 2, 3):
        save(tmp_path, run_state(step, cycle), keep_last=2)
    assert load_latest(tmp_path).state.step == 3
    names = sorted(p.name for p in checkpoints_dir(tmp_path).iterdir())
    assert names == [LATEST_FILENAME, "step-00000002", "step-00000003"]  # no staging leftovers


def test_latest_is_a_relative_symlink_users_can_cd_into(tmp_path):
    """Issue 47 (item 8): `checkpoints/latest` was a text file where users expect a link. It is a
    relative symlink (the run dir can be moved or copied), replaced on every commit: no temp link
    stays behind, and the path through it reaches the newest checkpoint's files."""
    import os

    cycle = PromptCycle(ROWS, seed=0)
    for step in (1, 2):
        save(tmp_path, run_state(step, cycle))
    latest = checkpoints_dir(tmp_path) / LATEST_FILENAME
    assert latest.is_symlink() and os.readlink(latest) == "step-00000002"
    assert (latest / "model" / "config.json").is_file() and (latest / "run_state.json").is_file()
    assert not list(checkpoints_dir(tmp_path).glob(".*"))  # no temp link, no staging left
    moved = tmp_path.parent / f"{tmp_path.name}-moved"
    tmp_path.rename(moved)  # relative: still points at the moved run's own checkpoint
    assert load_latest(moved).state.step == 2


def test_a_run_dir_written_by_an_earlier_version_still_resumes(tmp_path):
    """Run dirs written before the symlink hold a text file naming the checkpoint: every reader
    (resume, the documented eval path, the trainer-lost message's checkpoint, pre-flight's "is there
    a checkpoint") still takes it, and the next commit turns it into a link."""
    from orchestrator.control.checkpoint import has_latest, latest_checkpoint_dir, resolve_latest
    from orchestrator.control.preflight import set_aside_attempt

    cycle = PromptCycle(ROWS, seed=0)
    first = save(tmp_path, run_state(1, cycle))
    latest = checkpoints_dir(tmp_path) / LATEST_FILENAME
    latest.unlink()
    latest.write_text("step-00000001\n")  # what earlier versions wrote
    assert load_latest(tmp_path).state.step == 1 and latest_checkpoint_dir(tmp_path) == first
    assert has_latest(tmp_path)
    assert resolve_latest(latest / "model") == first / "model"
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    assert set_aside_attempt(tmp_path) is None  # a checkpoint to resume from: nothing set aside
    save(tmp_path, run_state(2, cycle))
    assert latest.is_symlink() and load_latest(tmp_path).state.step == 2
    assert set_aside_attempt(tmp_path) is None and (tmp_path / "metrics.jsonl").is_file()  # the link too


def test_a_pointer_temp_link_left_by_a_crash_is_removed_without_following_it(tmp_path):
    """A crash between creating the temp link and os.replace leaves `.latest-*.tmp` -> a checkpoint:
    remove_staging unlinks the link and keeps the checkpoint it points at."""
    import os

    from orchestrator.control.checkpoint import remove_staging

    path = save(tmp_path, run_state(1, PromptCycle(ROWS, seed=0)))
    left = checkpoints_dir(tmp_path) / f".{LATEST_FILENAME}-123-abcd.tmp"
    os.symlink(path.name, left)
    assert remove_staging(tmp_path) == [left]
    assert not left.is_symlink() and load_latest(tmp_path).state.step == 1


def test_a_failed_save_leaves_the_previous_checkpoint_in_charge(tmp_path):
    cycle = PromptCycle(ROWS, seed=0)
    save(tmp_path, run_state(1, cycle))
    with pytest.raises(RuntimeError, match="trainer died"):
        with stage_checkpoint(tmp_path, 2) as stage:
            fake_trainer_files(stage)
            raise RuntimeError("trainer died")
    with stage_checkpoint(tmp_path, 2) as stage:
        pass  # left without commit
    assert load_latest(tmp_path).state.step == 1
    assert sorted(p.name for p in checkpoints_dir(tmp_path).iterdir()) == [LATEST_FILENAME, "step-00000001"]


def test_commit_refuses_missing_trainer_files(tmp_path):
    with stage_checkpoint(tmp_path, 1) as stage:
        with pytest.raises(CheckpointError, match="save the weights first"):
            stage.commit(run_state(1, PromptCycle(ROWS, seed=0)))
    assert load_latest(tmp_path) is None


def corrupt_flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda p: corrupt_flip_byte(p / "model" / "model.safetensors"), "model.safetensors is corrupt: sha256"),
        (lambda p: (p / "optimizer.pt").write_bytes(b"\x02" * 10), "optimizer.pt is corrupt: 10 bytes"),
        (lambda p: (p / "run_state.json").unlink(), "run_state.json missing"),
        (lambda p: (p / "manifest.json").unlink(), "partial: manifest.json missing"),
        (lambda p: (p / "manifest.json").write_text("{not json"), "manifest.json is corrupt"),
    ],
    ids=["flipped-weight-byte", "truncated-optimizer", "missing-run-state", "no-manifest", "bad-manifest"],
)
def test_a_corrupt_or_partial_checkpoint_is_refused(tmp_path, damage, message):
    path = save(tmp_path, run_state(1, PromptCycle(ROWS, seed=0)))
    damage(path)
    with pytest.raises(CheckpointError, match=message):
        load_latest(tmp_path)


@pytest.mark.parametrize("form", ["symlink", "text file"])
def test_a_pointer_to_a_missing_checkpoint_is_refused(tmp_path, form):
    import os

    path = save(tmp_path, run_state(1, PromptCycle(ROWS, seed=0)))
    latest = checkpoints_dir(tmp_path) / LATEST_FILENAME
    latest.unlink()
    os.symlink("step-00000009", latest) if form == "symlink" else latest.write_text("step-00000009\n")
    with pytest.raises(CheckpointError, match="step-00000009, which does not exist"):
        load_latest(tmp_path)
    assert load_checkpoint(path).state.step == 1  # the checkpoint itself is fine


def test_a_run_state_that_does_not_match_its_manifest_is_refused(tmp_path):
    path = save(tmp_path, run_state(1, PromptCycle(ROWS, seed=0)))
    d = json.loads((path / "run_state.json").read_text())
    d["format"] = 99
    text = json.dumps(d)
    (path / "run_state.json").write_text(text)  # rewritten: the manifest catches it first
    with pytest.raises(CheckpointError, match="run_state.json is corrupt"):
        load_checkpoint(path)


def test_pending_rows_must_be_json(tmp_path):
    cycle = PromptCycle(ROWS, seed=0)
    with stage_checkpoint(tmp_path, 1) as stage:
        fake_trainer_files(stage)
        with pytest.raises(CheckpointError, match="not JSON-serializable"):
            stage.commit(run_state(1, cycle, pending=[{"input_id": "p", "blob": object()}]))


# --- the trainer: weights + optimizer resume exactly -----------------------------------------------

VOCAB = 64


@pytest.fixture(scope="module")
def checkpoint_tiny_model(tmp_path_factory) -> str:
    return random_qwen2(tmp_path_factory.mktemp("ckpt_tiny_qwen2"), vocab=VOCAB, hidden_size=32, max_positions=64)


@pytest.fixture
def checkpoint_trainers():
    made: list[TrainerWorker] = []

    def build(model_path) -> TrainerWorker:
        w = TrainerWorker(TrainerSettings(model_path=str(model_path), lr=1e-2, weight_decay=0.0,
                                          micro_batch_size=4, seed=0))
        made.append(w)
        return w

    yield build
    for w in reversed(made):  # the first one owns the process group: close it last
        w.close()


def batch(seed: int) -> TrainBatch:
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(4):
        ids = torch.randint(1, VOCAB, (9,), generator=gen).tolist()
        mask = (0, 0, 0) + (1,) * 6
        rows.append(TrajectoryRow(tuple(ids), mask, tuple(-4.0 * m for m in mask), (-1,) * 3 + (0,) * 6))
    return TrainBatch.from_rows(rows, [1.0, -1.0, 0.5, -0.5], pad_id=0)


def test_trainer_resumes_weights_and_optimizer_exactly(tmp_path, checkpoint_tiny_model, checkpoint_trainers):
    """Train 2 steps, checkpoint, resume in a new worker; the next step matches the uninterrupted
    worker's. Without the optimizer state (fresh AdamW moments) the step differs."""
    a = checkpoint_trainers(checkpoint_tiny_model)
    a.train_batch(batch(1))
    a.train_batch(batch(2))
    with stage_checkpoint(tmp_path, 2) as stage:
        a.save_hf(str(stage.model_dir))
        a.save_optimizer(str(stage.optimizer_path))
        stage.commit(run_state(2, PromptCycle(ROWS, seed=0)))
    ckpt = load_latest(tmp_path)

    b = checkpoint_trainers(ckpt.model_dir)
    b.load_optimizer(str(ckpt.optimizer_path))
    assert b.num_updates == 2
    fresh = checkpoint_trainers(ckpt.model_dir)  # weights only

    ma, mb = a.train_batch(batch(3)), b.train_batch(batch(3))
    fresh.train_batch(batch(3))
    assert mb["actor/pg_loss"] == ma["actor/pg_loss"] and mb["actor/grad_norm"] == ma["actor/grad_norm"]  # the next step's loss
    wa, wb, wf = a.full_state_dict(), b.full_state_dict(), fresh.full_state_dict()
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], atol=1e-6, rtol=0, msg=name)
    assert max(float((wf[n] - wa[n]).abs().max()) for n in wa) > 1e-4


def test_load_optimizer_refuses_another_file(tmp_path, checkpoint_tiny_model, checkpoint_trainers):
    t = checkpoint_trainers(checkpoint_tiny_model)
    bogus = tmp_path / "bogus.pt"
    torch.save({"weights": torch.zeros(1)}, bogus)
    with pytest.raises(ValueError, match="not an optimizer checkpoint"):
        t.load_optimizer(str(bogus))


def test_run_state_of_another_format_is_refused():
    d = run_state(1, PromptCycle(ROWS, seed=0)).to_json()
    with pytest.raises(CheckpointError, match="format 99"):
        RunState.from_json(d | {"format": 99})
    with pytest.raises(CheckpointError, match="malformed"):
        RunState.from_json({k: v for k, v in d.items() if k != "prompts"})


@pytest.mark.parametrize("form", ["symlink", "text file"])
def test_the_documented_eval_command_resolves_checkpoints_latest(tmp_path, form):
    """Issue 29: `model.path=RUN/checkpoints/latest/model` (docs/training.md's evaluation command)
    exited 2 when `latest` was a pointer file, not a directory. Either form (the symlink written now,
    the text file of earlier versions) resolves to the checkpoint's own path."""
    import os
    import re

    from orchestrator.config import ConfigError
    from orchestrator.control.checkpoint import CheckpointError, resolve_latest
    from orchestrator.control.preflight import check_model
    from stand_ins import REPO, compose_config

    documented = re.search(r"model\.path=(\S+)", (REPO / "docs" / "training.md").read_text()).group(1)
    assert documented.endswith("checkpoints/latest/model")
    run = tmp_path / documented.split("/checkpoints/")[0]
    model = run / "checkpoints" / "step-00000004" / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    latest = run / "checkpoints" / "latest"
    os.symlink("step-00000004", latest) if form == "symlink" else latest.write_text("step-00000004\n")
    cfg = compose_config(["mode=eval", f"model.path={tmp_path / documented}"])
    check_model(cfg)
    assert cfg.model.path == str(model)
    assert resolve_latest(tmp_path / "elsewhere" / "latest" / "model") == tmp_path / "elsewhere" / "latest" / "model"
    latest.unlink()
    os.symlink("step-00000009", latest) if form == "symlink" else latest.write_text("step-00000009\n")  # gone
    with pytest.raises(CheckpointError, match="step-00000009"):
        resolve_latest(tmp_path / documented)
    with pytest.raises(ConfigError, match="^model.path"):
        check_model(compose_config(["mode=eval", f"model.path={tmp_path / documented}"]))
