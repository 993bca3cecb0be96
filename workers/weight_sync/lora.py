"""What the trainer, the adapter sync and the replicas agree on about LoRA adapters, without torch.

- The PEFT directory's file names (peft.utils.constants): the trainer writes them
  (workers/trainer/lora.py), a replica checks for them before loading (workers/inference/worker.py);
  and the name of a LoRA checkpoint's adapter directory, which the trainer writes
  (workers/trainer/shell.py) and the driver reads (pre-flight, resume, export).
- How many adapter versions one replica serves at once (`versions_served`): in async mode a request
  keeps the adapter it started on, and a version is trained while at most η versions older are
  still generating, so η + 1; in sync mode generation stops at every sync, so 1. The adapter
  sync keeps one directory more on disk (`directories_kept`): the version being loaded while
  every served one may still be read back by vLLM.

Invariant: these two numbers come from this module only (the replica's vLLM `max_loras`, the
dry run's memory of adapter slots, and the adapter sync's directories).
"""

from __future__ import annotations

ADAPTER_CONFIG_FILE = "adapter_config.json"  # PEFT's file names (peft.utils.constants)
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
LORA_ADAPTER_DIR = "lora_adapter"  # a LoRA checkpoint's PEFT adapter directory, beside the base weights


def versions_served(*, async_mode: bool, max_staleness: int) -> int:
    """Adapter versions one replica serves at once: `max_staleness` + 1 in async mode, else 1.
    Raises ValueError for a negative `max_staleness`."""
    if max_staleness < 0:
        raise ValueError(f"async.max_staleness must be >= 0, got {max_staleness}")
    return max_staleness + 1 if async_mode else 1


def directories_kept(*, async_mode: bool, max_staleness: int) -> int:
    """Adapter directories the adapter sync keeps on disk: every version served, plus the one loading."""
    return versions_served(async_mode=async_mode, max_staleness=max_staleness) + 1
