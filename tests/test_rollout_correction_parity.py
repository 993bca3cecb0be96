"""Rollout correction against verl 0.9.1's `rollout_corr_helper`, option by option, plus the pinned
k1-band difference.

Every parity test feeds ours and verl's `compute_rollout_correction_and_rejection_mask` the same
seeded random log-probs with right padding (rows of 1..seq-1 trained tokens), and asserts weights,
masks and every metric (same key set) agree to 1e-6 (relative 1e-6 for large values such as
exp(20)). Thresholds are reciprocal-symmetric where verl's k1 semantics differ from ours.
"""

from __future__ import annotations

import math

import pytest
import torch

from stand_ins import random_mask
from workers.core.algorithms.rollout_correction import (
    REJECTION_NAMES,
    RejectionRule,
    RolloutCorrectionConfig,
    compute_rollout_correction,
    rejection_mask,
)

rollout_corr_helper = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")

SHAPES = [(1, 5), (4, 7), (8, 33), (16, 64)]
SEEDS = [0, 1, 2]
ATOL = 1e-6

# one symmetric threshold per rule, sized so that some rows/tokens pass and some are rejected with
# per-token log-ratio noise N(0, 0.5²): k1 rules take C (band [1/C, C]), k2/k3 rules an upper bound
RULE_THRESHOLDS: dict[str, float] = {
    "token_k1": 1.5, "seq_sum_k1": 3.0, "seq_mean_k1": 1.05,
    "token_k2": 0.05, "seq_sum_k2": 1.5, "seq_mean_k2": 0.12, "seq_max_k2": 0.6,
    "token_k3": 0.05, "seq_sum_k3": 1.5, "seq_mean_k3": 0.12, "seq_max_k3": 0.6,
}


def random_inputs(seed: int, bsz: int, seq: int, noise: float = 0.5) -> tuple[torch.Tensor, ...]:
    """(old, rollout, mask): right-padded float mask with 1..seq-1 tokens from column 1; log-probs 0 off it."""
    gen = torch.Generator().manual_seed(seed)
    mask = random_mask(gen, bsz, seq)
    rollout = -torch.rand(bsz, seq, generator=gen) * 3.0 * mask
    old = (rollout + torch.randn(bsz, seq, generator=gen) * noise) * mask
    return old, rollout, mask


def our_rule(name: str, c: float) -> RejectionRule:
    return RejectionRule.from_spec(name, threshold=c)


def verl_spec(name: str, c: float) -> str:
    """verl's threshold string: k1 rules as an explicit symmetric 'lo_hi' band, others the bound."""
    return f"{1.0 / c!r}_{c!r}" if name.endswith("k1") else repr(c)


def assert_metrics_equal(ours: dict[str, float], want: dict[str, float]) -> None:
    assert set(ours) == set(want), (sorted(set(ours) - set(want)), sorted(set(want) - set(ours)))
    for name, value in want.items():
        assert ours[name] == pytest.approx(value, rel=1e-6, abs=ATOL), name


# --- IS weights: token / sequence, TIS / IcePop ----------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("level,noise", [("token", 0.5), ("sequence", 0.15)])
@pytest.mark.parametrize("threshold", [2.0, 1.5, "0.5_2.0", "0.8_1.6"])
def test_is_weights_match_verl(seed, shape, level, noise, threshold):
    """Weights and IS metrics; the IcePop band is applied to r in both (verl inverts only k1 RS bands)."""
    old, rollout, mask = random_inputs(seed, *shape, noise=noise)
    if isinstance(threshold, str):
        lo, hi = (float(x) for x in threshold.split("_"))
        cfg = RolloutCorrectionConfig(is_level=level, is_threshold=hi, is_threshold_lower=lo)
    else:
        cfg = RolloutCorrectionConfig(is_level=level, is_threshold=threshold)
    ours = compute_rollout_correction(old, rollout, mask, cfg)
    assert ours.weights is not None
    if not bool(ours.weights.any()):  # the band rejected every weight: verl divides by zero in its ESS
        with pytest.raises(ZeroDivisionError):
            rollout_corr_helper.compute_rollout_correction_and_rejection_mask(
                old, rollout, mask, rollout_is=level, rollout_is_threshold=threshold)
        assert ours.metrics["rollout_corr/rollout_is_eff_sample_size"] == 0.0
        return
    want_proto, want_mask, want_metrics = rollout_corr_helper.compute_rollout_correction_and_rejection_mask(
        old, rollout, mask, rollout_is=level, rollout_is_threshold=threshold
    )
    torch.testing.assert_close(ours.weights, want_proto.batch["rollout_is_weights"], atol=ATOL, rtol=1e-6)
    torch.testing.assert_close(ours.loss_mask, want_mask)
    assert_metrics_equal(ours.metrics, want_metrics)


def test_icepop_band_zeroes_weights_outside_and_tis_caps():
    """r = e^{-1}, 1, e^{0.5}, e^{1}: band [0.5, 2] keeps 1 and e^{0.5} only; TIS C=2 caps e^1 at 2."""
    old = torch.tensor([[0.0, -1.0, 0.0, 0.5, 1.0]])
    rollout, mask = torch.zeros(1, 5), torch.tensor([[0.0, 1, 1, 1, 1]])
    band = compute_rollout_correction(old, rollout, mask, RolloutCorrectionConfig(is_threshold=2.0, is_threshold_lower=0.5))
    tis = compute_rollout_correction(old, rollout, mask, RolloutCorrectionConfig(is_threshold=2.0))
    torch.testing.assert_close(band.weights, torch.tensor([[0.0, 0.0, 1.0, math.exp(0.5), 0.0]]))
    torch.testing.assert_close(tis.weights, torch.tensor([[0.0, math.exp(-1.0), 1.0, math.exp(0.5), 2.0]]))
    assert band.metrics["rollout_corr/rollout_is_oob_ratio"] == pytest.approx(0.5)
    assert "rollout_corr/rollout_is_oob_ratio" not in tis.metrics


def test_sequence_weights_are_the_row_product_on_every_token():
    old = torch.tensor([[0.0, 0.2, 0.3, 0.0], [0.0, -0.1, 0.0, 0.0]])
    mask = torch.tensor([[0.0, 1, 1, 0], [0.0, 1, 0, 0]])
    rc = compute_rollout_correction(old, torch.zeros(2, 4), mask, RolloutCorrectionConfig(is_level="sequence"))
    want = torch.tensor([[0.0, math.exp(0.5), math.exp(0.5), 0.0], [0.0, math.exp(-0.1), 0.0, 0.0]])
    torch.testing.assert_close(rc.weights, want)


# --- rejection masks: every option, and all at once ---------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", REJECTION_NAMES)
def test_each_rejection_option_matches_verl(seed, shape, name):
    old, rollout, mask = random_inputs(seed, *shape)
    c = RULE_THRESHOLDS[name]
    want_mask, want_metrics = rollout_corr_helper.compute_rollout_rejection_mask(
        old - rollout, mask, rollout_rs=name, rollout_rs_threshold=verl_spec(name, c)
    )
    ours_mask, ours_metrics = rejection_mask(old - rollout, mask, (our_rule(name, c),))
    torch.testing.assert_close(ours_mask, want_mask)
    assert_metrics_equal(ours_metrics, want_metrics)


def test_rejection_thresholds_reject_something_and_keep_something():
    """Guard for the parity test above: each option's threshold rejects and keeps some tokens."""
    old, rollout, mask = random_inputs(0, 16, 64)
    for name, c in RULE_THRESHOLDS.items():
        kept, _ = rejection_mask(old - rollout, mask, (our_rule(name, c),))
        assert 0 < kept.sum() < mask.sum(), name


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("is_level", ["token", "sequence", None])
def test_all_rules_with_is_weights_match_verl(seed, shape, is_level):
    """Every rule at once (a token must pass all) plus IS weights and off-policy metrics."""
    old, rollout, mask = random_inputs(seed, *shape, noise=0.2)
    names = list(REJECTION_NAMES)
    thresholds = {n: RULE_THRESHOLDS[n] * (4.0 if not n.endswith("k1") else 1.5) for n in names}  # keep some
    cfg = RolloutCorrectionConfig(is_level=is_level, rs=tuple(our_rule(n, thresholds[n]) for n in names))
    want_proto, want_mask, want_metrics = rollout_corr_helper.compute_rollout_correction_and_rejection_mask(
        old, rollout, mask, rollout_is=is_level, rollout_is_threshold=2.0,
        rollout_rs=",".join(names), rollout_rs_threshold=",".join(verl_spec(n, thresholds[n]) for n in names),
    )
    ours = compute_rollout_correction(old, rollout, mask, cfg)
    torch.testing.assert_close(ours.loss_mask, want_mask)
    if is_level is None:
        assert ours.weights is None and want_proto is None
    else:
        torch.testing.assert_close(ours.weights, want_proto.batch["rollout_is_weights"], atol=ATOL, rtol=1e-6)
    assert_metrics_equal(ours.metrics, want_metrics)


def test_verl_metric_names_are_emitted():
    old, rollout, mask = random_inputs(3, 4, 9)
    rc = compute_rollout_correction(old, rollout, mask, RolloutCorrectionConfig(rs=(our_rule("seq_mean_k3", 0.1),)))
    for name in ("rollout_is_mean", "rollout_is_max", "rollout_is_eff_sample_size", "rollout_rs_masked_fraction",
                 "rollout_rs_seq_masked_fraction", "kl", "k3_kl", "log_ppl_diff", "chi2_token", "chi2_seq",
                 "rollout_rs_seq_mean_k3_mean", "rollout_rs_seq_mean_k3_masked_fraction"):
        assert f"rollout_corr/{name}" in rc.metrics, name


# --- the documented k1 band vs verl's inverted one -------------------------------------------


def test_asymmetric_k1_band_bounds_the_ratio_where_verl_bounds_its_inverse():
    """With band 0.6_1.4 on r = π_old/π_rollout: r = 1.5 is above 1.4, so we reject it, while verl
    (which bounds 1/r = 0.667 to [0.6, 1.4]) keeps it; r = 0.65 is inside [0.6, 1.4], we keep it,
    while verl (1/r = 1.54 > 1.4) rejects it. r = 1.0 is kept by both."""
    old = torch.log(torch.tensor([[1.0, 1.5, 0.65, 1.0]]))
    rollout = torch.zeros(1, 4)
    mask = torch.tensor([[0.0, 1, 1, 1]])
    ours, _ = rejection_mask(old - rollout, mask, (RejectionRule("token_k1", lower=0.6, upper=1.4),))
    verl, _ = rollout_corr_helper.compute_rollout_rejection_mask(old - rollout, mask, "token_k1", "0.6_1.4")
    assert ours.tolist() == [[0.0, 0.0, 1.0, 1.0]]
    assert verl.tolist() == [[0.0, 1.0, 0.0, 1.0]]
    # the reciprocal band [1/1.4, 1.4] ≈ [0.714, 1.4] makes them agree: 1.5 and 0.65 both rejected
    ours_sym, _ = rejection_mask(old - rollout, mask, (RejectionRule("token_k1", lower=1 / 1.4, upper=1.4),))
    verl_sym, _ = rollout_corr_helper.compute_rollout_rejection_mask(old - rollout, mask, "token_k1", "1.4")
    assert ours_sym.tolist() == verl_sym.tolist() == [[0.0, 0.0, 0.0, 1.0]]


def test_seq_k1_bands_bound_the_ratio_product_and_geometric_mean():
    """Row r = (2, 2): product 4, geometric mean 2. seq_sum_k1 [0.5, 5] keeps, [0.5, 3] rejects;
    seq_mean_k1 [0.5, 2.5] keeps, [0.5, 1.5] rejects."""
    old = torch.log(torch.tensor([[1.0, 2.0, 2.0]]))
    mask = torch.tensor([[0.0, 1, 1]])
    lr = old - torch.zeros(1, 3)

    def kept(name: str, lo: float, hi: float) -> bool:
        m, _ = rejection_mask(lr, mask, (RejectionRule(name, lower=lo, upper=hi),))
        return bool(m.sum() == 2)

    assert kept("seq_sum_k1", 0.5, 5.0) and not kept("seq_sum_k1", 0.5, 3.0)
    assert kept("seq_mean_k1", 0.5, 2.5) and not kept("seq_mean_k1", 0.5, 1.5)


# --- typed config ------------------------------------------------------------------------------


def test_rule_specs_validate_and_name_the_key():
    assert RejectionRule.from_spec("token_k1", threshold=2.0) == RejectionRule("token_k1", lower=0.5, upper=2.0)
    assert RejectionRule.from_spec("seq_max_k3", threshold=0.1) == RejectionRule("seq_max_k3", upper=0.1)
    with pytest.raises(ValueError, match=r"^algorithm\.rollout_correction\.rs\[2\]\.threshold is required"):
        RejectionRule.from_spec("seq_mean_k3", key="algorithm.rollout_correction.rs[2]")
    with pytest.raises(ValueError, match="not lower/upper"):
        RejectionRule.from_spec("token_k2", lower=0.1, upper=0.2)
    with pytest.raises(ValueError, match="lower must be <= upper"):
        RejectionRule.from_spec("token_k1", lower=2.0, upper=0.5)
    with pytest.raises(ValueError, match="name must be one of"):
        RejectionRule.from_spec("seq_max_k1", threshold=2.0)
    with pytest.raises(ValueError, match="at most once"):
        RolloutCorrectionConfig(rs=(RejectionRule("token_k2", upper=1.0), RejectionRule("token_k2", upper=2.0)))
    with pytest.raises(ValueError, match="mode"):
        RolloutCorrectionConfig(mode="sometimes")  # type: ignore[arg-type]


def test_mode_decides_whether_weights_are_applied():
    assert RolloutCorrectionConfig(mode="decoupled").applies_weights
    assert not RolloutCorrectionConfig(mode="bypass").applies_weights
    assert not RolloutCorrectionConfig(mode="decoupled", is_level=None).applies_weights


def test_k3_kl_is_never_negative_on_near_on_policy_tokens():
    """Issue 29: ρ - log ρ - 1 >= 0 by definition, but in float32 exp(x) rounds to 1 for |x| < 6e-8
    and the mean came out at -1.3e-9 on on-policy steps; the metric is clamped at 0."""
    from workers.core.algorithms.rollout_correction import offpolicy_metrics

    old = torch.full((2, 5), -1e-3)  # near-certain tokens: float32 resolves a 3e-8 difference here
    rollout = old - 3e-8  # log ratio 3e-8: exp rounds to 1.0, so each term is -3e-8
    mask = torch.ones(2, 5)
    assert float((torch.exp(old - rollout) - (old - rollout) - 1).mean()) < 0  # what the raw estimator gives
    assert offpolicy_metrics(old, rollout, mask)["k3_kl"] == 0.0
