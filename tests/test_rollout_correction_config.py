"""`algorithm.rollout_correction` through Hydra: typed once at validation, errors name the key."""

from __future__ import annotations

import pytest

from orchestrator.config import ConfigError
from stand_ins import compose_config
from workers.core.algorithms.rollout_correction_config import RejectionRule, RolloutCorrectionConfig, parse_is_threshold

KEY = "algorithm.rollout_correction"


def test_default_is_decoupled_token_tis_two():
    typed = compose_config([]).algorithm.rollout_correction.typed()
    assert typed == RolloutCorrectionConfig(mode="decoupled", is_level="token", is_threshold=2.0)


def test_band_rules_and_mode_from_the_command_line_become_typed_floats():
    cfg = compose_config([
        f"{KEY}.mode=bypass", f"{KEY}.is_level=sequence", f"{KEY}.is_threshold='0.5_2.0'",
        f"{KEY}.rs=[{{name:seq_mean_k3,threshold:0.01}},{{name:token_k1,lower:0.5,upper:2.0}},"
        f"{{name:seq_sum_k1,threshold:4.0}}]",
    ])
    typed = cfg.algorithm.rollout_correction.typed()
    assert (typed.mode, typed.is_level, typed.is_threshold, typed.is_threshold_lower) == ("bypass", "sequence", 2.0, 0.5)
    assert typed.rs == (
        RejectionRule("seq_mean_k3", upper=0.01),
        RejectionRule("token_k1", lower=0.5, upper=2.0),
        RejectionRule("seq_sum_k1", lower=0.25, upper=4.0),
    )
    assert all(isinstance(v, float) for v in (typed.is_threshold, typed.is_threshold_lower))


@pytest.mark.parametrize(
    "override,key",
    [
        (f"{KEY}.mode=sometimes", f"{KEY}.mode"),
        (f"{KEY}.is_level=geometric", f"{KEY}.is_level"),
        (f"{KEY}.is_threshold=0.9", f"{KEY}.is_threshold"),
        (f"{KEY}.is_threshold='2.0_0.5'", f"{KEY}.is_threshold"),
        (f"{KEY}.is_threshold='a_b'", f"{KEY}.is_threshold"),
        (f"{KEY}.rs=[{{name:seq_max_k1,threshold:2.0}}]", f"{KEY}.rs[0].name"),
        (f"{KEY}.rs=[{{name:token_k2,threshold:0.1}},{{name:seq_mean_k3}}]", f"{KEY}.rs[1].threshold"),
        (f"{KEY}.rs=[{{name:token_k1,lower:2.0,upper:0.5}}]", f"{KEY}.rs[0].lower"),
    ],
)
def test_bad_value_names_the_key(override, key):
    with pytest.raises(ConfigError, match="^" + key.replace(".", r"\.").replace("[", r"\[").replace("]", r"\]")):
        compose_config([override])


def test_parse_is_threshold():
    assert parse_is_threshold(2) == (2.0, None)
    assert parse_is_threshold("1.5") == (1.5, None)
    assert parse_is_threshold(" 0.5_2.0 ") == (2.0, 0.5)
    for bad in (True, "", "x", "0_2", "-1", None):
        with pytest.raises(ValueError, match="is_threshold"):
            parse_is_threshold(bad)
