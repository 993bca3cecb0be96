"""The trainer's two seams: what the driver calls (`Trainer`) and what an engine provides (`TrainerEngine`).

`Trainer` is the one interface of a trainer as the loops, the checkpointer and the weight sync see
it. Three classes implement it: `TrainerWorker` (HF FSDP2) and `VerlTrainerWorker` (verl's engine),
both a `TrainerShell` (workers/trainer/shell.py) around an engine, and `TrainerGroup`
(workers/trainer/group.py), which drives N ranks as one and is what the driver holds: its methods
are coroutines of the same arguments (`await trainer.update(order)`). `TRAINER_METHODS` names
the methods; tests/test_trainer_group.py checks that all three classes take the same arguments.

`TrainerEngine` is the model-specific part behind the shell: forwards, the training step, the
full weights and the optimizer state. The shell owns the rest (process group, rollout correction,
metrics, file framing, the weight-sync group), so the two engines apply the same algorithm and
write the same files.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from workers.core.algorithms.batch import TrainBatch
    from workers.core.types import OrderData, TrainOrder
    from workers.weight_sync.broadcast import SendReport
    from workers.weight_sync.plan import TensorSpec
    from workers.weight_sync.transport import WeightGroupInfo

TRAINER_METHODS = (
    "open_data", "update", "compute_logprobs", "full_state_dict", "export_weights", "save_hf", "save_optimizer",
    "load_optimizer", "open_weight_group", "broadcast_weights", "close",
)


class Trainer(Protocol):
    """One trainer (a rank, or a group of ranks). Collective methods must reach every rank."""

    def open_data(self, data: "OrderData") -> None:
        """What every train order of the run shares (the buffer's handle, the pad id, the advantage
        setting), once before the first `update`; the rank connects its buffer client with it."""
        ...

    def update(self, order: "TrainOrder") -> dict[str, float]:
        """One optimizer step on a train order (each rank reads its rows from the trajectory
        buffer); `actor/*`, `rollout_corr/*`, `perf/total_num_tokens` and `trainer/rows_read` metrics."""
        ...

    def compute_logprobs(self, batch: "TrainBatch") -> "torch.Tensor":
        """log π [B, T] under the current weights, no grad (column 0 and padding are 0)."""
        ...

    def full_state_dict(self) -> dict[str, "torch.Tensor"]:
        """Full fp32 weights under HF names, on CPU."""
        ...

    def export_weights(self, path: str) -> str:
        """The full weights as one safetensors file at `path` (atomic); returns path."""
        ...

    def save_hf(self, directory: str) -> str:
        """An HF model directory `from_pretrained` loads; returns directory."""
        ...

    def save_optimizer(self, path: str) -> str:
        """Full AdamW state (HF parameter names) and `num_updates`; returns path."""
        ...

    def load_optimizer(self, path: str) -> None:
        """Restore a `save_optimizer` file (from either engine)."""
        ...

    def open_weight_group(self, info: "WeightGroupInfo") -> None:
        """Rank 0 joins the weight-sync group as its sender."""
        ...

    def broadcast_weights(self, version: int) -> "SendReport | None":
        """Send the current weights as `version` to the weight-sync group."""
        ...

    def close(self) -> None:
        """Release the weight-sync group and the process group."""
        ...


@dataclass(frozen=True)
class StepInputs:
    """What the shell hands an engine's training step (after rollout correction).

    old_logprobs: log π_old [rows, seq]. is_weights: IS weights [rows, seq] or None. num_tokens,
    num_seqs: trained tokens / rollouts (`TrainBatch.num_trained_rollouts`: a rollout of several rows
    counts once) of the whole mini-batch over all ranks (the loss
    normalisers). capture_logprobs: record log π_θ of the training forward ([rows, seq], for the
    bypass-mode metrics).
    """

    old_logprobs: "torch.Tensor"
    is_weights: "torch.Tensor | None"
    num_tokens: float
    num_seqs: float
    capture_logprobs: bool
    seq_num_tokens: "torch.Tensor | None" = None  # [rows] trained tokens of each row's rollout (seq-mean-token-mean)


@dataclass(frozen=True)
class StepOutcome:
    """One training step of one rank. sums: this rank's `actor/pg_loss` (sum of its micro-batch
    losses) and token-weighted sums of pg_clipfrac, ppo_kl, pg_clipfrac_lower, entropy. grad_norm:
    the global norm before clipping; skipped: no optimizer step (non-finite norm). logprobs: log π_θ
    [rows, seq] of the training forward when asked (`StepInputs.capture_logprobs`), else None."""

    sums: dict[str, float]
    grad_norm: float
    skipped: bool
    logprobs: "torch.Tensor | None"


class TrainerEngine(Protocol):
    """The model-specific part of a trainer rank (HF FSDP2: workers/trainer/worker.py; verl:
    workers/trainer/verl_worker.py). Methods marked collective run on every rank together."""

    def compute_logprobs(self, batch: "TrainBatch", *, trained_only: bool = False) -> "torch.Tensor":
        """log π [B, T] float32 on CPU, no grad (collective). trained_only: only the tokens of
        `batch.loss_mask` need be scored (the others may be 0); an engine may score all of them."""
        ...

    def train_step(self, train: "TrainBatch", inputs: StepInputs) -> StepOutcome:
        """Zero grads, forward/backward every micro-batch, clip, step unless the norm is not
        finite (collective)."""
        ...

    def lr(self) -> float: ...

    def weight_specs(self) -> list["TensorSpec"]:
        """Name, full shape and sync dtype of every tensor `full_tensors` yields, in its order."""
        ...

    def full_tensors(self) -> Iterator[tuple[str, "torch.Tensor"]]:
        """(HF name, full tensor) one at a time, tied aliases left out (collective: iterate to the end)."""
        ...

    def full_state_dict(self) -> dict[str, "torch.Tensor"]:
        """Full fp32 CPU weights under HF names, tied aliases left out (collective)."""
        ...

    def write_hf_metadata(self, directory: str) -> None:
        """config.json, generation config and tokenizer files when the source has them (rank 0)."""
        ...

    def optimizer_state(self) -> dict[str, Any]:
        """Full AdamW state keyed by HF parameter names, on CPU (collective)."""
        ...

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """Load an `optimizer_state` dict into this rank's optimizer."""
        ...
