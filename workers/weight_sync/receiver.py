"""A broadcast-weight-sync receiver that loads into plain torch tensors (an HF model's parameters or
a state dict), and a process entry point around it.

The vLLM receiver lives in workers/inference/vllm_ext.py (it streams into vLLM's in-place reload); this one
serves processes without vLLM: the benchmark (scripts/bench_weight_sync.py), the device check and
tests, and any HF-model consumer (an evaluator). Invariant: after `receive_weights(v)` returns,
every target tensor holds the pushed values (converted to the target's dtype) and `version() == v`;
on any error the version is unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from workers.weight_sync.broadcast import ReceiveReport, receive_weights
from workers.weight_sync.plan import TensorSpec, dtype_from_name
from workers.weight_sync.transport import BucketTransport, WeightGroupInfo, open_transport


class TensorReceiver:
    """Receives pushes into `targets` (name -> tensor, updated in place with `copy_`).

    A pushed name absent from `targets` raises KeyError, after the push is drained.
    """

    def __init__(self, targets: Mapping[str, torch.Tensor], *, device: torch.device | None = None,
                 initial_version: int = 0) -> None:
        self._targets = dict(targets)
        self._device = device
        self._version = initial_version
        self._transport: BucketTransport | None = None

    def version(self) -> int:
        return self._version

    def join_weight_group(self, info: WeightGroupInfo, rank: int) -> None:
        """Join as `rank` (>= 1); blocks until every rank joined with a collective backend."""
        if rank < 1:
            raise ValueError(f"receivers have ranks >= 1 (rank 0 is the trainer), got {rank}")
        self._transport = open_transport(info, rank, self._device)

    def receive_weights(self, version: int) -> ReceiveReport:
        """Receive the push of `version` (the plan must carry the same version; raises ValueError
        otherwise, after draining) and copy it into the targets."""
        if self._transport is None:
            raise RuntimeError("receive_weights before join_weight_group")
        missing: list[str] = []

        def load(tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
            for name, t in tensors:
                target = self._targets.get(name)
                if target is None:
                    missing.append(name)
                    continue
                with torch.no_grad():
                    target.copy_(t)

        report = receive_weights(self._transport, load, current_version=self._version, keep=False)
        if report.version != version:
            raise ValueError(f"expected a push of version {version}, got {report.version}")
        if missing:
            raise KeyError(f"pushed tensors unknown to this receiver: {missing[:5]} ({len(missing)} in all)")
        self._version = version
        return report

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None


@dataclass(frozen=True)
class PushOutcome:
    """What a receiver process reports per push: the report or the error, and per-tensor float64 sums
    (enough to compare with the sender exactly when values are small integers or exact floats)."""

    version: int
    report: ReceiveReport | None
    error: str | None
    sums: dict[str, float]


def run_receiver_process(info: WeightGroupInfo, rank: int, specs: list[TensorSpec], versions: list[int],
                         results: Any, num_threads: int = 1, device: str = "cpu") -> None:
    """Process entry (multiprocessing spawn): zero tensors per `specs` on `device`, join the group as
    `rank`, receive one push per entry of `versions`, put a PushOutcome per push on `results` (a
    Queue)."""
    torch.set_num_threads(num_threads)
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    targets = {s.name: torch.zeros(s.shape, dtype=dtype_from_name(s.dtype), device=dev) for s in specs}
    receiver = TensorReceiver(targets, device=dev)
    receiver.join_weight_group(info, rank)
    try:
        for v in versions:
            try:
                report, error = receiver.receive_weights(v), None
            except (ValueError, KeyError, RuntimeError) as e:
                report, error = None, f"{type(e).__name__}: {e}"
            sums = {n: float(t.double().sum()) for n, t in targets.items()}
            results.put(PushOutcome(v, report, error, sums))
    finally:
        receiver.close()
