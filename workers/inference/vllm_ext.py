"""vLLM worker extension: reload the policy weights in place, from a safetensors file or from the
trainer's bucketed broadcast (workers/weight_sync/broadcast.py).

vLLM mixes this class into its worker class (engine arg `worker_extension_cls=
"workers.inference.vllm_ext.WeightReloadExtension"`), so its methods run inside the worker process with
`self.model_runner` and `self.vllm_config` at hand; the engine reaches them through
`AsyncLLM.collective_rpc("reload_weights_from_file", args=(path,))`. Method names must not clash
with the worker's own attributes (vLLM asserts that when it injects the class).

Why not `model.load_weights(...)` directly: on the CPU backend every linear layer is re-packed
after loading (oneDNN / SGL kernels) and its `weight` parameter is replaced by an empty tensor, so
a second `load_weights` fails with "Attempted to load weight ... into parameter (torch.Size([0]))".
vLLM's in-place reload (`model_runner.reload_weights`, vllm/model_executor/model_loader/reload/)
rebuilds each layer in checkpoint format, loads, re-runs `process_weights_after_loading` (the
re-pack), and copies back into the original storage. That is what we call.

Invariant after `reload_weights_from_file` returns: every parameter of the model, including the
output layer's packed copy, holds the file's values; a stale output layer raises instead of
returning (`StaleOutputLayerError`). Callers must reset the prefix cache afterwards (KV blocks
computed with the old weights would otherwise be reused); `InferenceWorker.update_weights` does.

Broadcast path: `join_weight_sync_group(info, rank_offset)` once (this worker becomes rank
rank_offset + its rank inside the engine, so the tensor-parallel workers of one replica get
consecutive ranks), then per push `receive_weights_broadcast(version, current_version)`: the
buckets stream straight into the same in-place reload (kept tensors, since the layer-wise reload
holds a layer's tensors until the layer is complete), then the same tied-output refresh and check.

This module is imported by vLLM's worker process by dotted path, so it imports only torch,
safetensors, this package's weight-sync modules (torch only) and (lazily) vLLM.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from safetensors import safe_open

from workers.weight_sync.broadcast import receive_weights
from workers.weight_sync.transport import BucketTransport, WeightGroupInfo, open_transport

# Max |packed lm_head(x) - x @ W^T| accepted by the freshness check, fp32 logits on a random probe;
# packed kernels differ from torch.matmul only by summation order (~1e-6 here).
LM_HEAD_CHECK_ATOL = 1e-3
LM_HEAD_CHECK_ROWS = 4  # probe rows for the check; tiny cost next to a reload


class StaleOutputLayerError(RuntimeError):
    """The output layer (lm_head) still computes with weights older than the ones just loaded."""


class WeightReloadExtension:
    """Methods mixed into vLLM's worker (CPUWorker / GPU Worker); see the module docstring."""

    def reload_weights_from_file(self, path: str) -> int:
        """Load every tensor of the safetensors file at `path` into the running model.

        The file holds a full Hugging Face state dict (names such as `model.layers.0.mlp.up_proj.
        weight`, `lm_head.weight`), as written by `TrainerWorker.export_weights`. Returns the number
        of tensors read from the file. Raises FileNotFoundError if the file is missing, and
        StaleOutputLayerError if the output layer did not pick up the new weights.
        """
        num_loaded = 0

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal num_loaded
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    num_loaded += 1
                    yield name, f.get_tensor(name)

        # Worker.reload_weights sets the current vLLM config and calls the model runner's
        # in-place layerwise reload (checkpoint format: names and shapes as in the HF file).
        self.reload_weights(weights_iterator=tensors(), is_checkpoint_format=True)  # type: ignore[attr-defined]
        self._refresh_tied_output_layer()
        self._check_output_layer_fresh()
        return num_loaded

    def join_weight_sync_group(self, info: WeightGroupInfo | dict, rank_offset: int) -> int:
        """Join the weight-sync group as rank `rank_offset + self.rank`; return that rank. Blocks
        until every rank joined with a collective backend (gloo / nccl). Raises RuntimeError if
        this worker already joined a group. `info` may arrive as a dict: AsyncLLM's engine-core
        RPC serializes dataclass arguments with msgpack."""
        if isinstance(info, dict):
            info = WeightGroupInfo(**info)
        if getattr(self, "_weight_sync_transport", None) is not None:
            raise RuntimeError("this vLLM worker already joined a weight-sync group")
        rank = rank_offset + int(getattr(self, "rank", 0))
        device = getattr(self, "device", None)
        device = device if isinstance(device, torch.device) else torch.device("cpu")
        self._weight_sync_transport: BucketTransport | None = open_transport(info, rank, device)
        return rank

    def receive_weights_broadcast(self, version: int, current_version: int) -> int:
        """Receive the trainer's push of `version` and load it in place; return the tensor count.

        Run while nothing is scheduled (the caller pauses or drains the engine) and reset the prefix
        cache afterwards, as for `reload_weights_from_file`. Raises ValueError (after draining the
        push) when the pushed version is not `version` or not newer than `current_version`,
        RuntimeError before `join_weight_sync_group`, StaleOutputLayerError as the file path does.
        """
        transport = getattr(self, "_weight_sync_transport", None)
        if transport is None:
            raise RuntimeError("receive_weights_broadcast before join_weight_sync_group")

        def load(tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
            self.reload_weights(weights_iterator=tensors, is_checkpoint_format=True)  # type: ignore[attr-defined]

        report = receive_weights(transport, load, current_version=current_version, keep=True)
        if report.version != version:
            raise ValueError(f"expected weights of version {version}, received version {report.version}")
        self._refresh_tied_output_layer()
        self._check_output_layer_fresh()
        return report.num_tensors

    def leave_weight_sync_group(self) -> None:
        """Close this worker's side of the weight-sync group (no-op if it never joined)."""
        transport = getattr(self, "_weight_sync_transport", None)
        if transport is not None:
            transport.close()
            self._weight_sync_transport = None

    def output_layer_is_tied(self) -> bool:
        """Whether lm_head shares its weight with the input embedding (config `tie_word_embeddings`)."""
        hf_config = self.vllm_config.model_config.hf_config  # type: ignore[attr-defined]
        text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        return bool(getattr(text_config, "tie_word_embeddings", False))

    def _output_layer(self) -> torch.nn.Module | None:
        model = self.model_runner.model  # type: ignore[attr-defined]
        return getattr(model, "lm_head", None)

    def _refresh_tied_output_layer(self) -> None:
        """With tied embeddings the checkpoint has no `lm_head.weight`: the reload updates the
        shared embedding weight in place but never re-packs lm_head's kernel copy (CPU backend),
        so the logits would come from the old weights. Re-running the layer's post-load step
        re-packs it from the (already updated) shared weight."""
        lm_head = self._output_layer()
        if lm_head is None or not self.output_layer_is_tied():
            return
        quant_method = getattr(lm_head, "quant_method", None)
        if quant_method is not None and hasattr(quant_method, "process_weights_after_loading"):
            quant_method.process_weights_after_loading(lm_head)

    @torch.no_grad()
    def _check_output_layer_fresh(self) -> None:
        """Compare lm_head's kernel (packed on CPU) with a plain matmul against its current weight.

        Raises StaleOutputLayerError on a mismatch. Skipped when the layer keeps no full 2-D weight
        (quantized or pipeline-split layers), where there is nothing to compare against.
        """
        lm_head = self._output_layer()
        weight = getattr(lm_head, "weight", None) if lm_head is not None else None
        quant_method = getattr(lm_head, "quant_method", None) if lm_head is not None else None
        if weight is None or weight.ndim != 2 or weight.numel() == 0 or quant_method is None:
            return
        gen = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(LM_HEAD_CHECK_ROWS, weight.shape[1], generator=gen, dtype=torch.float32)
        x = x.to(device=weight.device, dtype=weight.dtype)
        bias = getattr(lm_head, "bias", None)
        packed = quant_method.apply(lm_head, x, bias).float()
        reference = torch.nn.functional.linear(x, weight, bias).float()
        err = (packed - reference).abs().max().item()
        if err > LM_HEAD_CHECK_ATOL:
            raise StaleOutputLayerError(
                f"lm_head kernel disagrees with its weight after reload (max abs diff {err:.3g} > "
                f"{LM_HEAD_CHECK_ATOL}); tied embeddings={self.output_layer_is_tied()}. The engine "
                "would sample from stale logits; restart the engine or untie the embeddings."
            )
