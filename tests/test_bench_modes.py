"""scripts/bench_modes.py on the real model (`--model-experiment smollm2_local`): each of the four
configurations' overrides compose into the config the main job accepts, with the blog's choices
(mode, mini-batches per sync, a batch of that many mini-batches) on the real-model preset."""

from __future__ import annotations

import sys

import pytest

from stand_ins import REPO, compose_config

sys.path.insert(0, str(REPO / "scripts"))
import bench_modes  # noqa: E402


@pytest.mark.parametrize("name, mode, k", [("sync_1", "sync", 1), ("sync_2", "sync", 2), ("async_1", "async", 1),
                                           ("async_2", "async", 2), ("async_2_no_partial", "async", 2)])
def test_real_model_configurations_compose_with_the_blog_choices(name, mode, k, tmp_path):
    cfg = compose_config(bench_modes.experiment_overrides(name, "smollm2_local"), run_dir=tmp_path)
    assert (cfg.model.name, cfg.task.name) == ("smollm2_135m", "addition")
    assert (cfg.mode.name, cfg.mode.sync_every, cfg.rollout.batch_size) == (mode, k, 8 * k)  # mini-batch: 8 groups
    assert cfg.trainer.val_before_train and cfg.trainer.test_freq > cfg.trainer.total_steps  # first and last step only
    assert bench_modes.syncs(name, 12) * k == 12  # every configuration makes the same 12 optimizer updates


def test_without_a_model_experiment_the_blog_presets_run():
    assert bench_modes.experiment_overrides("async_1_no_partial", None) == ["+experiment=blog_async_1"]
