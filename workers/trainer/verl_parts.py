"""The pieces `VerlTrainerWorker` (workers/trainer/verl_worker.py) hands to verl's training engine.

- `PlatformCPU` + `use_verl_cpu_platform()`: verl 0.9.1 ships CUDA, NPU and ROCm platforms only
  and falls back to CUDA when no accelerator is found, so `get_device_id()` would call
  `torch.cuda.current_device()` on a CPU-only build. verl's documented extension point
  (`verl.plugin.platform.PlatformRegistry.register` + `set_platform`) takes a new platform; this one
  is the host CPU with the gloo backend. It must be installed before verl's engine modules are
  imported (they read the device name at import).
- `to_verl_batch`: TrainBatch -> verl's no-padding TensorDict (jagged nested tensors, one row per
  sequence, `DatasetPadMode.NO_PADDING`), which `FSDPEngine.forward_backward_batch` consumes.
- `ppo_loss_function`: the engine's loss hook, computing OUR `ppo_clip_loss` (with rollout-correction
  IS weights) on the engine's log-probs.

Alignment: verl's log_probs[i] (and entropy[i]) of a packed sequence predict token i + 1 (the engine
rolls the labels left); TrainBatch's logprob[t] is the log-prob OF token t. `engine_to_batch_alignment`
shifts right by one inside each sequence and puts 0 at each sequence's first token, so both
trainers feed `ppo_clip_loss` the same [B, T] tensors. verl's `loss_mask` is already on the trained
token itself (its sft loss rolls it left to meet log_probs), so our loss_mask goes in unchanged and
the engine's `batch_num_tokens` (global sum of loss_mask) is our token-mean normaliser.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from tensordict import TensorDict

from workers.core.algorithms.batch import TrainBatch
from workers.core.algorithms.losses import PolicyLossConfig, ppo_clip_loss

METRIC_KEYS = ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower")


# --- verl platform: the host CPU -------------------------------------------------------------

def _make_platform_cpu_class():
    from verl.plugin.platform.platform_base import PlatformBase

    class PlatformCPU(PlatformBase):
        """verl platform for CPU-only hosts: device "cpu", gloo, no profiler, no IPC."""

        device_name = "cpu"  # type: ignore[assignment]  (a property in the base class)
        vendor_name = "cpu"  # type: ignore[assignment]

        @property
        def device_module(self) -> ModuleType:
            return torch.cpu

        def is_available(self) -> bool:
            return True

        def current_device(self) -> str:  # verl passes it to `.to(...)`: "cpu" is the device
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            return None

        def synchronize(self, device_index: int | None = None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        @contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> Any:
            return None

    return PlatformCPU


def use_verl_cpu_platform() -> None:
    """Make verl run on the host CPU: register and select `PlatformCPU`, and register verl's
    `FSDPEngineWithLMHead` for device "cpu" (verl registers it for cuda and npu only).

    Idempotent. A platform verl resolved earlier is replaced only when it is verl's no-accelerator
    fallback (the CUDA platform while CUDA is unavailable); an available accelerator platform raises
    RuntimeError. verl's FSDP engine module keeps the device name it read at import in a module
    global, used only to build Ulysses sequence-parallel meshes; it is set to "cpu" too.
    """
    from verl.plugin.platform import platform_manager as pm

    current = pm._current_platform
    if current is not None and current.device_name == "cpu":
        return
    if current is not None and current.is_available():
        raise RuntimeError(f"verl already runs on the available platform {current.device_name!r} in this process")
    cls = _make_platform_cpu_class()
    pm.PlatformRegistry.register(platform="cpu")(cls)
    pm.set_platform(cls())
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp import transformer_impl
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    transformer_impl.device_name = "cpu"

    backends = EngineRegistry._engines.get("language_model", {})
    for backend in ("fsdp", "fsdp2"):
        if "cpu" not in backends.get(backend, {}):
            EngineRegistry.register(model_type="language_model", backend=backend, device="cpu")(FSDPEngineWithLMHead)


# --- batch conversion ------------------------------------------------------------------------

def _jagged(padded: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """[B, T] right-padded -> jagged nested tensor of the first lengths[b] entries of each row."""
    mask = torch.arange(padded.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(lengths, 0)
    return torch.nested.nested_tensor_from_jagged(padded[mask].contiguous(), offsets=offsets)


def to_verl_batch(
    batch: TrainBatch,
    *,
    old_logprobs: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
    micro_batch_tokens: int,
    calculate_entropy: bool,
    global_batch_size: float | None = None,
    use_remove_padding: bool = False,
    temperature: float = 1.0,
) -> TensorDict:
    """verl's no-padding TensorDict for `batch` (every per-token field a jagged nested tensor).

    Args:
        batch: the mini-batch (right-padded [B, T]).
        old_logprobs, is_weights: [B, T] π_old log-probs and rollout-correction weights, or None
            (forward-only passes need neither).
        micro_batch_tokens: verl's `max_token_len_per_gpu` (dynamic micro-batches by token count;
            must be >= the longest row).
        calculate_entropy: ask the engine for per-token entropy.
        global_batch_size: sequences with >= 1 trained token, summed over data-parallel ranks
            (seq-mean loss modes).
        use_remove_padding: pack sequences (needs flash-attn varlen on GPU) or pad them.
        temperature: the rollout temperature; verl's engine divides the logits by it.

    Returns:
        TensorDict of batch size [B] with input_ids, position_ids, loss_mask, advantages,
        row_index ([B] long: the row of `batch`, so the loss hook can map micro-batches back), and
        old_log_probs / is_weights when given; plus the engine's non-tensor settings.

    Raises:
        ValueError: a row is empty or longer than `micro_batch_tokens`.
    """
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.dataset_utils import DatasetPadMode

    lengths = batch.attention_mask.sum(dim=-1).to(torch.long)
    if bool((lengths == 0).any()):
        raise ValueError("verl's engine cannot take an empty row (attention_mask all 0)")
    longest = int(lengths.max())
    if micro_batch_tokens < longest:
        raise ValueError(f"max tokens per micro-batch {micro_batch_tokens} < longest row {longest}")
    positions = torch.arange(batch.seq_len).unsqueeze(0).expand(batch.batch_size, -1)
    fields: dict[str, torch.Tensor] = {
        "input_ids": _jagged(batch.input_ids, lengths),
        "position_ids": _jagged(positions, lengths),
        "loss_mask": _jagged(batch.loss_mask.float(), lengths),
        "advantages": _jagged(batch.advantages.float(), lengths),
        "row_index": torch.arange(batch.batch_size, dtype=torch.long),
    }
    if old_logprobs is not None:
        fields["old_log_probs"] = _jagged(old_logprobs.float(), lengths)
    if is_weights is not None:
        fields["is_weights"] = _jagged(is_weights.float(), lengths)
    td = TensorDict(fields, batch_size=[batch.batch_size])
    tu.assign_non_tensor(
        td,
        pad_mode=DatasetPadMode.NO_PADDING,
        use_remove_padding=use_remove_padding,
        use_dynamic_bsz=True,
        max_token_len_per_gpu=int(micro_batch_tokens),
        use_fused_kernels=False,
        calculate_entropy=calculate_entropy,
        temperature=float(temperature),
        global_batch_size=global_batch_size,
    )
    return td


def engine_to_batch_alignment(values: torch.Tensor, seq_len: int) -> torch.Tensor:
    """verl's per-token output (jagged nested, values[i] about token i + 1) -> [B, seq_len] in
    TrainBatch alignment (out[b, t] about token t; column 0 and padding are 0). Keeps the graph."""
    flat = values.values()
    offsets = values.offsets().to(flat.device)
    lengths = offsets.diff()
    starts = offsets[:-1]
    shifted = torch.roll(flat, shifts=1, dims=0)  # shifted[j] = flat[j - 1]: about token j
    first = torch.zeros_like(flat, dtype=torch.bool)
    first[starts] = True
    shifted = torch.where(first, torch.zeros_like(shifted), shifted)
    rows = torch.repeat_interleave(torch.arange(len(lengths), device=flat.device), lengths)
    cols = torch.arange(flat.shape[0], device=flat.device) - torch.repeat_interleave(starts, lengths)
    out = torch.zeros(len(lengths), seq_len, dtype=flat.dtype, device=flat.device)
    return out.index_put((rows, cols), shifted)


def _padded(field: torch.Tensor, seq_len: int) -> torch.Tensor:
    """A jagged input field (already in TrainBatch alignment) -> [B, seq_len], 0 beyond each row."""
    return torch.nested.to_padded_tensor(field, 0.0, output_size=(field.size(0), seq_len))


# --- the loss hook ---------------------------------------------------------------------------

@dataclass
class PPOLossFunction:
    """verl loss hook `(model_output, data, dp_group) -> (loss, metrics)` computing OUR PPO clip loss.

    Per micro-batch: log π_θ from the engine (realigned), π_old / advantages / loss mask / IS
    weights from the micro-batch TensorDict, `ppo_clip_loss` normalised by the engine's global
    `batch_num_tokens` (token-mean) or our `global_batch_size` (seq-mean), times `dp_size`.
    Records token-weighted metric sums and, when `capture_logprobs`, log π_θ per row (for the
    bypass-mode rollout-correction metrics), since verl reorders rows into micro-batches.
    """

    loss_cfg: PolicyLossConfig
    batch_size: int
    seq_len: int
    capture_logprobs: bool = False
    seq_num_tokens: torch.Tensor | None = None  # [batch_size] trained tokens of each row's rollout (seq-mean-token-mean)
    sums: dict[str, float] = field(default_factory=dict)
    logprobs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.sums = {k: 0.0 for k in METRIC_KEYS} | {"actor/entropy": 0.0}
        if self.capture_logprobs:
            self.logprobs = torch.zeros(self.batch_size, self.seq_len)

    def __call__(self, model_output: dict, data: TensorDict, dp_group=None) -> tuple[torch.Tensor, dict]:
        lp = engine_to_batch_alignment(model_output["log_probs"], self.seq_len)
        device = lp.device
        mask = _padded(data["loss_mask"], self.seq_len).to(device)
        is_w = _padded(data["is_weights"], self.seq_len).to(device) if "is_weights" in data.keys() else None
        out = ppo_clip_loss(
            lp,
            _padded(data["old_log_probs"], self.seq_len).to(device),
            _padded(data["advantages"], self.seq_len).to(device),
            mask,
            self.loss_cfg,
            is_weights=is_w,
            dp_size=int(data["dp_size"]),
            batch_num_tokens=float(data["batch_num_tokens"]),
            global_batch_size=data["global_batch_size"],
            seq_num_tokens=None if self.seq_num_tokens is None else
            self.seq_num_tokens[data["row_index"].cpu()].to(device),  # verl reorders rows into micro-batches
        )
        n = float(mask.sum().item())
        self.sums["actor/pg_loss"] += float(out.loss.detach().item())
        self.sums["actor/pg_clipfrac"] += float(out.pg_clipfrac.item()) * n
        self.sums["actor/ppo_kl"] += float(out.ppo_kl.item()) * n
        self.sums["actor/pg_clipfrac_lower"] += float(out.pg_clipfrac_lower.item()) * n
        if "entropy" in model_output:
            ent = engine_to_batch_alignment(model_output["entropy"], self.seq_len).detach()
            self.sums["actor/entropy"] += float((ent * mask).sum().item())
        if self.logprobs is not None:
            self.logprobs[data["row_index"].cpu()] = lp.detach().float().cpu()
        return out.loss, {}
