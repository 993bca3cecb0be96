"""Sampling seeds of rollouts: a pure function of what a rollout is, never of when or where it ran.

`session_seed(run_seed, input_id, group_id, sample_index)` is a rollout's base seed (the rollout
worker hands it to the gateway with the session's sampling); `turn_seed(session_seed, turn)` is the
vLLM `SamplingParams.seed` of the session's `turn`-th model turn (1-based, the gateway's turn
count). Both are blake2b hashes of their arguments (no process state, no random session id), so a
run resumed from a checkpoint, or a rollout re-dispatched under a new session id, samples the same
tokens as the uninterrupted run would have, wherever the batch it ran in; the n samples of a group
differ by `sample_index`, and a turn's seed differs from the other turns' of its session.

Invariant: the same arguments give the same seed in every process and Python version; seeds are
in [0, 2**31) (what every sampler's generator takes).
"""

from __future__ import annotations

import hashlib

SEED_BITS = 31


def _hash(*parts: object) -> int:
    h = hashlib.blake2b("\x00".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") >> (64 - SEED_BITS)


def session_seed(run_seed: int, input_id: str, group_id: int, sample_index: int) -> int:
    """Base sampling seed of one rollout (sample `sample_index` of group `group_id`, prompt `input_id`)."""
    return _hash("session", run_seed, input_id, group_id, sample_index)


def turn_seed(session_seed_: int, turn: int) -> int:
    """Sampling seed of the session's `turn`-th model turn (1-based)."""
    return _hash("turn", session_seed_, turn)
