"""Config: every shipped config composes into a valid RunConfig; bad values stop the run naming the key."""

import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from orchestrator.config import ConfigError, RunConfig, register, to_run_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
GROUPS = sorted(p.name for p in CONFIGS.iterdir() if p.is_dir())


def _compose(overrides: list[str]) -> RunConfig:
    register()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return to_run_config(compose(config_name="config", overrides=["run_dir=/tmp/x", *overrides]))


@pytest.mark.parametrize(
    "group,choice",
    [(g, p.stem) for g in GROUPS for p in sorted((CONFIGS / g).glob("*.yaml"))],
)
def test_every_shipped_config_loads(group, choice):
    prefix = "+" if group == "experiment" else ""  # experiments are optional presets
    cfg = _compose([f"{prefix}{group}={choice}"])
    assert isinstance(cfg, RunConfig)
    if group == "experiment":  # blog_<mode>_<sync_every>
        _, mode, k = choice.split("_")
        assert (cfg.mode.name, cfg.mode.sync_every) == (mode, int(k))


def test_default_config_is_the_embedded_default():
    cfg = _compose([])
    assert (cfg.mode.name, cfg.rollout.name, cfg.model.path) == ("sync", "local", None)
    assert cfg.samples_per_step == cfg.rollout.batch_size * cfg.rollout.n


@pytest.mark.parametrize(
    "override,key",
    [
        ("rollout.n=0", "rollout.n"),
        ("rollout.batch_size=-1", "rollout.batch_size"),
        ("mode.sync_every=3", "mode.sync_every"),  # 8 groups do not split into 3 mini-batches
        ("trainer.lr=0", "trainer.lr"),
        ("rollout.top_p=1.5", "rollout.top_p"),
        ("logger.sinks=[console,tensorboard]", "logger.sinks"),
        ("inference.max_model_len=16", "rollout.max_tokens"),  # 16 answer tokens do not fit
        ("rollout.max_tokens=600", "rollout.max_context_tokens"),  # 512-token budget < answer
        ("rollout.n=1", "rollout.n"),  # GRPO: a group of one has no baseline, nothing would train
        ("+bogus.key=1", "bogus"),  # a typo added with + must not be ignored
        ("model.path=/nonexistent/model", "model.path"),
        ("rollout.poll_initial_s=-1", "rollout.poll_initial_s"),
        ("async.max_staleness=-1", "async.max_staleness"),
        ("async.on_stale=keep", "async.on_stale"),
        ("+trainer.total_stepz=3", "trainer.total_stepz"),  # a typo inside a group, added with +
        ("+rollout.acr.limits.rps=9", "rollout.acr.limits.rps"),  # ... and in a nested dataclass
        ("run_dir=", "run_dir"),  # empty: would write the run into the current directory
        ("trainer.weight_sync.backend=nccl", "trainer.weight_sync.backend"),  # needs CUDA, cluster=local is CPU
    ],
)
def test_bad_value_names_the_key(override, key):
    with pytest.raises(ConfigError, match=rf"^{key.replace('.', chr(92) + '.')}"):
        _compose([override])


def test_cli_bad_value_exits_nonzero_before_ray_with_the_key(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator.main", "rollout.n=0", f"run_dir={tmp_path / 'r'}"],
        capture_output=True, text=True, timeout=60, cwd=CONFIGS.parent,
    )
    assert proc.returncode != 0
    assert "rollout.n" in proc.stderr
    assert "ray" not in proc.stdout.lower()  # failed before any part started


def test_cli_unknown_mode_exits_nonzero_naming_mode(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator.main", "mode=turbo", f"run_dir={tmp_path / 'r'}"],
        capture_output=True, text=True, timeout=60, cwd=CONFIGS.parent,
    )
    assert proc.returncode != 0
    assert "mode/turbo" in proc.stderr + proc.stdout


def test_run_dir_of_an_earlier_run_or_a_file_is_refused(tmp_path):
    """Regression (new-user report): a second run into the same run_dir appended its steps to the
    first run's metrics.jsonl, mixing two histories."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ConfigError, match="^run_dir already holds a run"):
        _compose_at(tmp_path)
    a_file = tmp_path / "metrics.jsonl"
    with pytest.raises(ConfigError, match="^run_dir exists and is not a directory"):
        _compose_at(a_file)


def _compose_at(run_dir):
    register()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return to_run_config(compose(config_name="config", overrides=[f"run_dir={run_dir}"]))
