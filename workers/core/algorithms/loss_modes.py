"""The loss aggregation modes (verl's `loss_agg_mode` names), without torch, so that the config can
take its choice list from the module that gives the modes their meaning
(workers/core/algorithms/losses.py `aggregate_loss` implements them)."""

from __future__ import annotations

from typing import Literal

LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
LOSS_AGG_MODES: tuple[LossAggMode, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
