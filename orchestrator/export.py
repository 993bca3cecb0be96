"""`python -m orchestrator.export RUN_DIR (--merge | --adapter) --out DIR`: a LoRA run's policy
out of its newest checkpoint.

- `--merge`: a Hugging Face model directory with the adapter merged into the base weights
  (PEFT `merge_and_unload`: W + (alpha / r) B A), fp32 safetensors, config and tokenizer files;
  transformers' `from_pretrained` and vLLM load it like any model.
- `--adapter`: the adapter alone, a PEFT directory (adapter_config.json +
  adapter_model.safetensors) to serve on the base model (vLLM `--lora-modules`, PEFT
  `PeftModel.from_pretrained`, or `mode=eval eval.adapter_path=DIR`).

RUN_DIR is a run directory (its `checkpoints/latest`, verified against its manifest) or a
checkpoint's model directory itself (base weights + `lora_adapter/`, what `TrainerWorker.save_hf`
writes with LoRA). Invariant: nothing is written unless the whole export succeeded (a temp
directory beside `--out`, renamed into place); an existing `--out` is refused.
Exit status: 0 written, 2 bad input (the message names it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

from orchestrator.control.checkpoint import CheckpointError, load_latest
from workers.weight_sync.lora import LORA_ADAPTER_DIR



def model_dir_of(path: Path) -> Path:
    """The checkpoint model directory of `path` (a run dir: its latest checkpoint's; else `path`).
    Raises ValueError when it holds no LoRA adapter, CheckpointError for a corrupt checkpoint."""
    ckpt = load_latest(path) if (path / "checkpoints").is_dir() else None
    if ckpt is None and (path / "config.yaml").is_file() and not (path / "config.json").is_file():
        raise ValueError(f"run {path} has no checkpoint to export (run with trainer.save_freq > 0, e.g. 10)")
    model = ckpt.model_dir if ckpt is not None else path
    if not (model / LORA_ADAPTER_DIR / "adapter_config.json").is_file():
        raise ValueError(f"{model} holds no LoRA adapter ({LORA_ADAPTER_DIR}/): export needs a run trained with "
                         "model.lora (a full fine-tune's checkpoint model/ is already a Hugging Face model)")
    return model


def export_merged(model: Path, out: Path) -> None:
    """Write base + adapter merged as a Hugging Face model directory at `out` (fp32)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, model / LORA_ADAPTER_DIR).merge_and_unload()
    merged.save_pretrained(out, safe_serialization=True)
    try:
        AutoTokenizer.from_pretrained(model).save_pretrained(out)
    except (OSError, ValueError):  # no tokenizer beside the weights: weights and config only
        pass


def export(path: Path, out: Path, *, merge: bool) -> Path:
    """Export the policy of `path` to `out` (module docstring); returns out. Raises ValueError for
    an existing `out` or a checkpoint without adapter, CheckpointError for a corrupt one."""
    if out.exists():
        raise ValueError(f"--out {out} exists; give a new directory")
    model = model_dir_of(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.partial-"))
    try:
        if merge:
            export_merged(model, tmp)
        else:
            shutil.copytree(model / LORA_ADAPTER_DIR, tmp, dirs_exist_ok=True)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m orchestrator.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a run directory, or a LoRA checkpoint's model directory")
    kind = parser.add_mutually_exclusive_group(required=True)
    kind.add_argument("--merge", action="store_true", help="write the merged Hugging Face model")
    kind.add_argument("--adapter", action="store_true", help="write the PEFT adapter alone")
    parser.add_argument("--out", type=Path, required=True, help="the directory to write (must not exist)")
    args = parser.parse_args(argv)
    try:
        out = export(args.run_dir, args.out, merge=args.merge)
    except (ValueError, CheckpointError) as e:
        print(f"export: {e}", file=sys.stderr)
        return 2
    print(f"wrote {'merged model' if args.merge else 'adapter'} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
