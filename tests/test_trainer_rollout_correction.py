"""TrainerWorker with rollout correction (no Ray): bypass vs decoupled, rejection in the real update.

A tiny random Qwen2 under FSDP2 on gloo, world size 1. Batches come from the driver's own
`build_train_batch` over real `Sample`s whose rollout log-probs are set from the trainer's own
log π_θ minus a chosen per-sample offset, so which samples the rules reject is known in advance.
"""

from __future__ import annotations

import pytest
import torch

from workers.core.algorithms.batch import TrainBatch
from workers.core.algorithms.rollout_correction_config import RejectionRule, RolloutCorrectionConfig
from orchestrator.loop.batching import Group
from stand_ins import groups_batch
from workers.core.types import Sample, TrajectoryRow
from workers.trainer.worker import TrainerSettings, TrainerWorker

VOCAB = 128  # the vocabulary of conftest's random_qwen2_dir


@pytest.fixture
def rc_trainer(random_qwen2_dir):
    """Builds TrainerWorkers with a given RolloutCorrectionConfig; closes them after the test."""
    made: list[TrainerWorker] = []

    def build(rc: RolloutCorrectionConfig, micro_batch_size: int = 2) -> TrainerWorker:
        w = TrainerWorker(TrainerSettings(model_path=random_qwen2_dir, lr=1e-3, weight_decay=0.0,
                                          micro_batch_size=micro_batch_size, seed=0, rollout_correction=rc))
        made.append(w)
        return w

    yield build
    for w in made:
        w.close()


# (group id, reward, per-token log-ratio offset log π_θ - log π_rollout) of each sample
SPEC = [(0, 1.0, 0.0), (0, 0.0, 1.0), (0, 0.5, 0.0), (1, 1.0, 0.0), (1, 0.0, 0.0), (1, 0.0, 0.0)]


def token_rows(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(1, VOCAB, (3 + 4 + i % 3,), generator=gen).tolist() for i in range(n)]


def samples_with_offsets(trainer: TrainerWorker, spec=SPEC) -> list[Sample]:
    """Samples whose rollout log-probs are log π_θ (current weights) minus each sample's offset."""
    ids = token_rows(len(spec))

    def row(tokens: list[int], lps: list[float]) -> TrajectoryRow:
        return TrajectoryRow(tuple(tokens), (0,) * 3 + (1,) * (len(tokens) - 3),
                             (0.0,) * 3 + tuple(lps), (-1,) * 3 + (0,) * (len(tokens) - 3))

    probe = TrainBatch.from_rows([row(t, [0.0] * (len(t) - 3)) for t in ids], [0.0] * len(ids), pad_id=0)
    lp = trainer.compute_logprobs(probe)
    out = []
    for i, ((gid, reward, offset), t) in enumerate(zip(spec, ids)):
        lps = (lp[i, 3:len(t)] - offset).tolist()
        out.append(Sample(session_id=f"s{i}", group_id=gid, input_id=f"p{gid}", sample_index=i,
                          rows=(row(t, lps),), reward=reward, status="completed", latency_s=0.1))
    return out


def groups_of(samples: list[Sample]) -> tuple[Group, ...]:
    by: dict[int, list[Sample]] = {}
    for s in samples:
        by.setdefault(s.group_id, []).append(s)
    return tuple(Group(g, tuple(m)) for g, m in sorted(by.items()))


def count_forwards(trainer: TrainerWorker) -> list[int]:
    calls = [0]
    trainer.model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def assert_same_weights(a: TrainerWorker, b: TrainerWorker) -> None:
    """Equal up to float32 reduction order: the two batches project different column sets onto the
    vocabulary (trained_columns), and Adam's first step (g / sqrt(v)) turns an ulp of a near-zero
    gradient into ~1e-6 of a weight; a sample that leaked into the step moves weights by ~lr = 1e-3."""
    sa, sb = a.full_state_dict(), b.full_state_dict()
    for name in sa:
        torch.testing.assert_close(sa[name], sb[name], atol=1e-5, rtol=0)


SEQ_RULE = RejectionRule("seq_mean_k3", upper=0.1)  # offset 1.0: k3 = e - 2 = 0.72 > 0.1 rejected; 0: kept


def test_bypass_skips_the_recompute_and_uses_rollout_as_old(rc_trainer):
    """3 micro-batches: decoupled runs 3 no-grad + 3 training forwards, bypass only the 3 training
    ones. Both report the same rollout_corr metrics (π_θ before the step is π_old); bypass's PPO
    ratio is π_θ/π_rollout, so its ppo_kl equals the rollout KL, decoupled's is 0."""
    dec, byp = rc_trainer(RolloutCorrectionConfig(mode="decoupled")), rc_trainer(RolloutCorrectionConfig(mode="bypass"))
    spec = [(0, 1.0, 0.5)] + SPEC[1:]  # sample 0 has A > 0 and ratio e^0.5 > 1 + ε: clipped in bypass
    batch = groups_batch(groups_of(samples_with_offsets(dec, spec)), pad_id=0, norm_adv_by_std=True)
    n_dec, n_byp = count_forwards(dec), count_forwards(byp)
    m_dec, m_byp = dec.train_batch(batch), byp.train_batch(batch)
    assert (n_dec[0], n_byp[0]) == (6, 3)
    for k, v in m_dec.items():
        if k.startswith("rollout_corr/"):
            assert m_byp[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    assert m_dec["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-6)
    assert m_byp["actor/ppo_kl"] == pytest.approx(m_byp["rollout_corr/kl"], abs=1e-6) and m_byp["actor/ppo_kl"] < -0.05
    assert m_byp["actor/pg_clipfrac"] > 0 and m_dec["actor/pg_clipfrac"] == 0.0
    sd_dec, sd_byp = dec.full_state_dict(), byp.full_state_dict()
    assert any(not torch.allclose(sd_dec[k], sd_byp[k], atol=1e-6) for k in sd_dec)


def test_bypass_equals_decoupled_without_weights_on_policy(rc_trainer):
    """On-policy data (π_rollout = π_θ): bypass and decoupled without IS weights take the same step."""
    on_policy = [(g, r, 0.0) for g, r, _ in SPEC]
    dec = rc_trainer(RolloutCorrectionConfig(mode="decoupled", is_level=None))
    byp = rc_trainer(RolloutCorrectionConfig(mode="bypass"))
    batch = groups_batch(groups_of(samples_with_offsets(dec, on_policy)), pad_id=0, norm_adv_by_std=True)
    dec.train_batch(batch)
    byp.train_batch(batch)
    assert_same_weights(dec, byp)


@pytest.mark.parametrize("mode", ["decoupled", "bypass"])
def test_rejected_sample_contributes_nothing(rc_trainer, mode):
    """seq_mean_k3 rejects sample 1 (offset 1) only: the step equals one without rules on the
    batch the driver would build without sample 1 (group 0 advantages over rewards [1, 0.5]).
    So its tokens get zero gradient, leave the token-mean normaliser, and its reward leaves the
    group statistics. Kept samples are on-policy, so IS weights are 1 there."""
    with_rule = rc_trainer(RolloutCorrectionConfig(mode=mode, rs=(SEQ_RULE,)))
    reference = rc_trainer(RolloutCorrectionConfig(mode=mode))
    samples = samples_with_offsets(with_rule)
    m = with_rule.train_batch(groups_batch(groups_of(samples), pad_id=0, norm_adv_by_std=True))
    kept = [s for i, s in enumerate(samples) if i != 1]
    m_ref = reference.train_batch(groups_batch(groups_of(kept), pad_id=0, norm_adv_by_std=True))
    assert_same_weights(with_rule, reference)
    assert m["actor/num_tokens"] == m_ref["actor/num_tokens"]
    assert m["rollout_corr/rs_excluded_sample_fraction"] == pytest.approx(1 / 6)
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 6)
    assert m["rollout_corr/rs_recomputed_groups"] == 1.0


def test_every_token_rejected_skips_the_step(rc_trainer):
    trainer = rc_trainer(RolloutCorrectionConfig(rs=(SEQ_RULE,)))
    far = [(g, r, 1.0) for g, r, _ in SPEC]
    batch = groups_batch(groups_of(samples_with_offsets(trainer, far)), pad_id=0, norm_adv_by_std=True)
    before = trainer.full_state_dict()
    m = trainer.train_batch(batch)
    assert m["actor/step_skipped"] == 1.0 and m["actor/num_tokens"] == 0.0
    assert m["rollout_corr/rollout_rs_masked_fraction"] == 1.0
    after = trainer.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_sequence_level_weights_reach_the_loss(rc_trainer):
    """Decoupled sequence-level TIS: sample 1 (offset 1 on 4..6 tokens) has weight min(e^{n}, 2) = 2."""
    trainer = rc_trainer(RolloutCorrectionConfig(is_level="sequence", is_threshold=2.0))
    batch = groups_batch(groups_of(samples_with_offsets(trainer)), pad_id=0, norm_adv_by_std=True)
    m = trainer.train_batch(batch)
    assert m["rollout_corr/rollout_is_seq_max"] == pytest.approx(2.0)
    assert m["rollout_corr/rollout_is_seq_min"] == pytest.approx(1.0, abs=1e-5)
    assert m["actor/step_skipped"] == 0.0
