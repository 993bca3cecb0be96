"""Issue 28 item 4: compaction and sub-agents. One rollout, two lineages, two exact rows, one advantage.

An agent that compacts its history (its next request starts over from a summary) or runs a sub-agent
under the same session (requests with a conversation of their own, interleaved with the main one)
is recorded by the real GatewayServer (127.0.0.1, the tiny model's tokenizer and template, the
zero-cost ScriptedEngine at the engine seam, the official `openai` SDK) as one row per lineage, each
exactly the served ids with mask 1 on the generated tokens only. The driver's `build_train_batch`
gives both rows the rollout's one GRPO advantage, and the loss (every `algorithm.loss_agg_mode`, with
the trainer's denominators counting rollouts: `TrainBatch.num_trained_rollouts`,
`TrainBatch.rollout_num_tokens`) weighs the rollout exactly as if its tokens were one row: splitting
does not double its weight.
"""

from __future__ import annotations


import openai
import pytest
import torch

from stand_ins import groups_batch
from orchestrator.loop.batching import assemble
from stand_ins import make_row, make_sample
from workers.core.algorithms.advantages import grpo_outcome_advantages
from workers.core.algorithms.batch import TrainBatch
from workers.core.algorithms.losses import aggregate_loss
from workers.core.types import Sample, TrajectoryRow

MODEL_ID = "tiny-qwen2"
REPLY = "q q q q"
TIMEOUT_S = 20
SYSTEM = {"role": "system", "content": "You repeat letters."}
SUB_SYSTEM = {"role": "system", "content": "You are a sub-agent that checks answers."}


@pytest.fixture
async def gateway(tiny_gateway):
    async with tiny_gateway(REPLY, version=2, max_context_tokens=1024) as started:
        yield started


def lineages(kind: str) -> tuple[list[list[dict]], int]:
    """The agent's requests in order, and how many of them belong to the first lineage's row (the
    rest build the second). compaction: two turns, then the history replaced by a summary and two
    more turns; sub_agent: the main agent's and a sub-agent's turns interleaved."""
    a = {"role": "assistant", "content": REPLY}
    main1 = [SYSTEM, {"role": "user", "content": "Repeat the letter q 4 times."}]
    main2 = [*main1, a, {"role": "user", "content": "Again, please."}]
    if kind == "compaction":
        summary = [SYSTEM, {"role": "user", "content": "Summary so far: you repeated q 4 times, twice. Go on."}]
        return [main1, main2, summary, [*summary, a, {"role": "user", "content": "Once more."}]], 2
    sub1 = [SUB_SYSTEM, {"role": "user", "content": "Check: is 'q q q q' four q's?"}]
    sub2 = [*sub1, a, {"role": "user", "content": "Sure?"}]
    return [main1, sub1, main2, sub2], 2


@pytest.mark.parametrize("kind", ["compaction", "sub_agent"])
async def test_one_rollout_two_lineages_two_exact_rows_one_advantage(gateway, tiny_renderer, kind):
    server, engine = gateway
    requests, _ = lineages(kind)
    token = await server.open_session(f"lineages-{kind}")
    async with openai.AsyncOpenAI(base_url=server.base_url, api_key=token, max_retries=0, timeout=TIMEOUT_S) as c:
        for msgs in requests:
            await c.chat.completions.create(model=MODEL_ID, messages=msgs, max_tokens=32)
    cap = await server.close_session(f"lineages-{kind}")
    reply = engine.replies[0]
    n = len(reply)

    # two lineages -> two rows, each exactly the served prompt ids + the engine's ids, turn by turn
    last = {0: requests[2] if kind == "sub_agent" else requests[1], 1: requests[3]}
    first = {0: requests[0], 1: requests[1] if kind == "sub_agent" else requests[2]}
    assert cap.num_turns == 4 and len(cap.rows) == 2
    for i, row in enumerate(cap.rows):
        p1, p2 = tiny_renderer.render(first[i]), tiny_renderer.render(last[i])
        assert row.token_ids == p2 + reply and p2[:len(p1) + n] == p1 + reply  # the second turn extends the first
        expected_mask = [0] * len(p1) + [1] * n + [0] * (len(p2) - len(p1) - n) + [1] * n
        assert list(row.loss_mask) == expected_mask  # mask 1 on generated tokens only
        assert row.generated_versions() == [2] * 2 * n
    m = server.metrics()
    assert (m.turns_first, m.turns_clean, m.turns_fork) == (1, 2, 1)

    # the rollout's reward applies to both rows: one advantage, the same on each
    rollout = Sample(f"lineages-{kind}", 0, "in-0", 0, cap.rows, 1.0, "completed", 0.1, num_turns=cap.num_turns)
    peer = make_sample(0, 1, 0.0, rows=[make_row([1, 2, 3], [4, 5, 6, 7])])
    [group] = assemble([rollout, peer], filter_zero_variance=True).trainable
    batch = groups_batch((group,), pad_id=0, norm_adv_by_std=True)
    adv = grpo_outcome_advantages(torch.tensor([1.0, 0.0]), [0, 0], norm_adv_by_std=True).tolist()
    row_adv = [batch.advantages[r][batch.loss_mask[r] == 1].unique().tolist() for r in range(3)]
    assert row_adv == [[pytest.approx(adv[0])], [pytest.approx(adv[0])], [pytest.approx(adv[1])]]
    assert batch.samples.row_sample.tolist() == [0, 0, 1] and batch.num_trained_rollouts() == 2


def _merged(batch: TrainBatch) -> TrainBatch:
    """The same batch with the first sample's two rows laid end to end as one row (the same trained
    tokens with the same losses: what an agent that never compacted would have produced)."""
    lengths = batch.attention_mask.sum(dim=-1).tolist()
    a, b = lengths[0], lengths[1]
    t = a + b

    def cat(x: torch.Tensor) -> torch.Tensor:
        row = torch.cat([x[0, :a], x[1, :b]])
        other = torch.nn.functional.pad(x[2, :lengths[2]], (0, t - lengths[2]))
        return torch.stack([row, other])

    return TrainBatch(cat(batch.input_ids), cat(batch.attention_mask), cat(batch.loss_mask),
                      cat(batch.rollout_logprobs), cat(batch.advantages))


def _loss_and_rollout_weight(batch: TrainBatch, mode: str, num_seqs: int,
                             seq_num_tokens: torch.Tensor | None = None) -> tuple[float, float]:
    """(loss, the first rollout's term of it) with per-token loss L = advantage x (1 + token id / 100):
    a token's loss depends on the token, not on where its row put it."""
    loss_mat = batch.advantages * (1 + 0.01 * batch.input_ids.float())
    total = aggregate_loss(loss_mat, batch.loss_mask, mode, global_batch_size=num_seqs, seq_num_tokens=seq_num_tokens)
    first = batch.loss_mask.clone()
    first[-1] = 0  # only the first rollout's rows (the peer is the last row in both layouts)
    return float(total), float(aggregate_loss(loss_mat, first, mode, batch_num_tokens=batch.num_loss_tokens,
                                              global_batch_size=num_seqs, seq_num_tokens=seq_num_tokens))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_a_rollout_split_into_two_rows_weighs_the_same_as_one_row(mode):
    """The loss does not weight a rollout by how many rows it split into: with the trainer's
    denominators (`num_trained_rollouts`: rollouts, not rows; `rollout_num_tokens`: a row's rollout's
    trained tokens) the split batch's loss and the first rollout's term of it equal those of the
    merged layout. Counting rows instead (3, not 2), seq-mean-token-sum would shrink to 2/3 and every
    other rollout lose weight to the split one; per-row means would count the split rollout twice."""
    split_rows = (make_row([1, 2, 3], [4, 5, 6]), make_row([1, 9], [8, 7, 6, 5]))  # 3 + 4 trained tokens
    rollout = Sample("r", 0, "in-0", 0, split_rows, 1.0, "completed", 0.1)
    peer = make_sample(0, 1, 0.0, rows=[make_row([1, 2], [3, 4, 5, 6, 7])])
    [group] = assemble([rollout, peer], filter_zero_variance=True).trainable
    split = groups_batch((group,), pad_id=0, norm_adv_by_std=True)
    merged = _merged(split)
    assert (split.batch_size, merged.batch_size, split.num_trained_rollouts(), merged.num_trained_rollouts()) == (
        3, 2, 2, 2)
    assert split.num_loss_tokens == merged.num_loss_tokens == 12
    assert split.rollout_num_tokens().tolist() == [7.0, 7.0, 5.0] and merged.rollout_num_tokens().tolist() == [7.0, 5.0]
    got = _loss_and_rollout_weight(split, mode, split.num_trained_rollouts(), split.rollout_num_tokens())
    want = _loss_and_rollout_weight(merged, mode, merged.num_trained_rollouts(), merged.rollout_num_tokens())
    assert got == pytest.approx(want, rel=1e-6)
    by_rows = _loss_and_rollout_weight(split, mode, split.batch_size)  # the row-counting denominators
    if mode == "seq-mean-token-sum":
        assert by_rows[0] == pytest.approx(want[0] * 2 / 3, rel=1e-6)
    if mode == "seq-mean-token-mean":  # two row means over 3 rows: not the rollout's one mean over 2
        assert by_rows[1] != pytest.approx(want[1], rel=1e-3)


def test_num_trained_rollouts_counts_each_sample_once():
    rows = [make_row([1], [2, 3]), make_row([1, 4], [5]), make_row([1], [6])]
    masked = TrajectoryRow((1, 2), (0, 0), (0.0, 0.0), (-1, -1))  # stale sample kept with no gradient
    samples = [Sample("a", 0, "in", 0, tuple(rows[:2]), 1.0, "completed", 0.1),
               Sample("b", 0, "in", 1, (rows[2],), 0.0, "completed", 0.1),
               Sample("c", 0, "in", 2, (masked,), 0.5, "completed", 0.1)]
    [group] = assemble(samples, filter_zero_variance=True).trainable
    batch = groups_batch((group,), pad_id=0, norm_adv_by_std=True)
    assert batch.batch_size == 3 and batch.num_trained_rollouts() == 2  # 'c' has no row: nothing trained
    assert batch.select(0, 2).num_trained_rollouts() == 2  # no SampleTable: rows with a trained token
