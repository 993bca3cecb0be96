"""One source per setting: a value the config maps onto a worker's settings has one default (in
the settings dataclass) and one check (its `__post_init__`); validating a config returns values and
writes nothing into it.

Regression (issue 24 item 6): RolloutSettings declared push_grace_s, the poll backoff and the
contract checks a second time, with other defaults than the `rollout` group's (A2A polling
0.05/5.0 vs 0.02/0.5), and `algorithm.rollout_correction` stored its parsed form in the config
while validating it. These tests fail when the two sources drift apart again.
"""

from dataclasses import fields, is_dataclass

import pytest

from orchestrator.config import ConfigError
from orchestrator.config.algorithm import RolloutCorrectionConfig
from orchestrator.config.rollout import AcrLimitsSchema, RolloutConfig, acr_client_config, rollout_settings
from stand_ins import compose_config
from workers.acr.client import AcrClientConfig
from workers.acr.limits import AcrLimitsConfig
from workers.core.algorithms.rollout_correction_config import RolloutCorrectionConfig as TypedRolloutCorrection
from workers.rollout.settings import RolloutSettings


def test_rollout_settings_of_a_default_config_are_the_settings_defaults():
    """Every field the default `rollout` group hands the rollout workers equals the worker's own
    default: the worker has no second default that could differ."""
    run = dict(exp_id="e", agent_runtime_arn="arn", gateway_base_url="http://gw", model_id="m")
    got = rollout_settings(RolloutConfig(), **run)
    r = RolloutConfig()
    own = RolloutSettings(**run, qualifier=r.acr.qualifier, s3_bucket=r.acr.s3_bucket, max_tokens=r.max_tokens,
                          temperature=r.temperature, top_p=r.top_p, timeout_s=r.timeout_s,
                          max_context_tokens=r.max_context_tokens)
    assert got == own


def test_acr_client_and_limits_of_a_default_config_are_their_defaults():
    r = RolloutConfig()
    assert acr_client_config(r) == AcrClientConfig(region_name=r.acr.region)
    assert AcrLimitsSchema().typed() == AcrLimitsConfig()
    assert RolloutCorrectionConfig().typed() == TypedRolloutCorrection()


def test_the_http_and_a2a_polls_take_the_configs_backoff():
    """One backoff for every result poll: S3 HEAD (the ACR client), A2A GetTask and HTTP `get`."""
    r = RolloutConfig(poll_initial_s=0.1, poll_max_s=3.0)
    s = rollout_settings(r, exp_id="e", agent_runtime_arn="arn", gateway_base_url="", model_id="m")
    c = acr_client_config(r)
    assert (s.poll_initial_s, s.poll_max_s) == (c.poll_initial_s, c.poll_max_s) == (0.1, 3.0)


@pytest.mark.parametrize("override,key", [
    (dict(push_grace_s=-1.0), "rollout.push_grace_s"),
    (dict(poll_initial_s=1.0, poll_max_s=0.5), "rollout.poll_max_s"),
    (dict(timeout_s=0.0), "rollout.timeout_s"),
    (dict(setup_timeout_s=5.0), "rollout.setup_timeout_s"),
])
def test_a_bad_rollout_value_is_refused_by_the_one_check_naming_its_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        RolloutConfig(**override)


def _config_nodes(node, path="cfg"):
    if is_dataclass(node) and not isinstance(node, type):
        yield path, node
        for f in fields(node):
            yield from _config_nodes(getattr(node, f.name), f"{path}.{f.name}")
    elif isinstance(node, (list, tuple)):
        for i, item in enumerate(node):
            yield from _config_nodes(item, f"{path}[{i}]")
    elif isinstance(node, dict):
        for k, item in node.items():
            yield from _config_nodes(item, f"{path}.{k}")


def test_validation_writes_nothing_into_the_config():
    """A validated config node holds its declared fields and nothing else (no parsed form stored
    beside them: validation returns values)."""
    cfg = compose_config(["algorithm.rollout_correction.rs=[{name: token_k1, threshold: 2.0}]"])
    for path, node in _config_nodes(cfg):
        assert set(vars(node)) == {f.name for f in fields(node)}, path


INFERENCE_SHARED = ("dtype", "max_model_len", "gpu_memory_utilization", "max_num_batched_tokens", "block_size",
                    "enable_prefix_caching", "enforce_eager", "max_num_seqs")


def test_inference_and_gateway_groups_take_their_settings_defaults():
    from orchestrator.config.gateway import GatewayGroupConfig
    from orchestrator.config.inference import inference_settings
    from workers.gateway.config import GatewayConfig
    from workers.inference.settings import InferenceSettings

    cfg = compose_config([])
    got = inference_settings(cfg.inference, mode=cfg.mode, async_=cfg.async_, cluster=cfg.cluster, seed=0,
                             model_path="m", replica=0, initial_policy_version=0)
    own = InferenceSettings(model_path="m")
    assert {k: getattr(got, k) for k in INFERENCE_SHARED} == {k: getattr(own, k) for k in INFERENCE_SHARED}
    g, gw = GatewayGroupConfig(), GatewayConfig
    assert all(getattr(g, k) == next(f.default for f in fields(gw) if f.name == k)
               for k in ("port", "advertise_url", "history_mode", "on_nonlinear"))


def test_the_trainer_group_takes_the_trainer_settings_defaults():
    """`trainer.lr`, `weight_decay`, `grad_clip`, `micro_batch_size` and `seed` default to
    TrainerSettings' own (they were 7e-4 / 0.0 / 32 in the config and 1e-6 / 0.01 / 4 in the
    settings): a trainer built from a default config equals one built from the settings' defaults."""
    from workers.trainer.settings import TrainerSettings

    t = compose_config([]).trainer
    own = TrainerSettings(model_path="m")
    assert (t.lr, t.weight_decay, t.grad_clip, t.micro_batch_size, t.seed) == (
        own.lr, own.weight_decay, own.grad_clip, own.micro_batch_size, own.seed)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_every_loss_agg_mode_reaches_the_trainer(mode):
    """docs/training.md tells a toolkit user to set `algorithm.loss_agg_mode=seq-mean-token-sum`:
    the config took only token-mean (its own shorter list) and never passed the value on."""
    from orchestrator.config.trainer import trainer_settings

    cfg = compose_config([f"algorithm.loss_agg_mode={mode}"])
    settings = trainer_settings(cfg.trainer, algorithm=cfg.algorithm, inference=cfg.inference, model_path="m")
    assert settings.loss_agg_mode == settings.policy_loss_config().loss_agg_mode == mode
