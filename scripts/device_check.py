"""Device check for one GPU (H200 class): CUDA, FSDP2 bf16 training throughput, CUDA weight transfer.

Runs with PyTorch + transformers only (no vLLM, no Ray, no network) and writes one JSON of figures
to $OUT/device_check.json when $OUT is set (and to --out when given). Sections, each timed; a
failing section records its error, the others still run, and the exit status is 1:
  env:      torch / CUDA / NCCL versions, device name and memory, bf16 support.
  trainer:  TrainerWorker (FSDP2, world size 1, NCCL) on a random-init Qwen2 of ~0.5B parameters
            (Qwen2.5-0.5B shapes) with bf16 mixed precision, activation checkpointing and token-
            budget micro-batches; one warm-up update, then timed updates: tokens/s (trained
            sequence tokens per second of `update`, which includes the pi_old forward) and peak
            GPU memory.
  transfer: the bucketed weight-sync protocol (workers/weight_sync/broadcast.py) from this process
            to a second process on the same GPU through CUDA IPC slots ("cuda_ipc"; NCCL refuses
            two ranks on one GPU), the 0.5B state dict in bf16; one warm-up push, timed pushes:
            GB/s. Also the host path ("shm") for comparison, and NCCL when --try-nccl is given (receiver on
            cuda:1; skipped, not failed, on a one-GPU machine, where NCCL refuses two ranks).
  sync_memory: `--sync-pushes` (default 8) cuda_ipc pushes of the same weights; the sender's
            torch.cuda.memory_reserved after each. Fails when it grows by more than
            RESERVED_GROWTH_LIMIT_BYTES per push after the warm-up: a leak like vLLM #52950 (packed weight
            transfer stranding 2 GiB of allocator cache per call) shows here as a steady climb.
  nccl_net: which network NCCL uses (one-rank NCCL init with NCCL_DEBUG=INFO in a child process:
            its "Using network ..." line, the NET/Plugin lines) and whether this node has EFA devices
            (/sys/class/infiniband/*/device/driver -> efa). Fails when an EFA node's NCCL uses "Socket":
            the aws-ofi-nccl plugin was not found (LD_LIBRARY_PATH, NCCL_NET_PLUGIN), so cross-node
            collectives run over TCP at a fraction of the bandwidth, silently. `--nccl-net-only` runs
            this section alone (in seconds): run it on every node of a multi-node run.
`--dry-run` runs the same code on CPU with a tiny config (host "shm" transfer; no sync_memory, no
nccl_net) in well under a minute; tests/test_device_check.py runs it.

    bash scripts/device_check.sh                  # GPU machine
    bash scripts/device_check.sh --nccl-net-only  # each node of a multi-node cluster
    bash scripts/device_check.sh --dry-run        # anywhere
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Qwen2.5-0.5B shapes (494M parameters with tied embeddings); the dry run uses a tiny config
QWEN2_0_5B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                  tie_word_embeddings=True, rope_theta=1000000.0)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)
# sync_memory: growth of the sender's reserved CUDA memory per push (bytes) above which the pushes leak;
# a bucketed push of the same weights reuses its slots, so a healthy path stays flat after the warm-up,
# while vLLM #52950 grew 2 GiB per sync
RESERVED_GROWTH_LIMIT_BYTES = 256 * 2**20
# nccl_net: NCCL's line naming the network it picked (NCCL_DEBUG=INFO), e.g. "NCCL INFO Using network Socket",
# "... Using network IB", "... Using network Libfabric" / "AWS Libfabric" (aws-ofi-nccl on EFA)
_NCCL_NETWORK = re.compile(r"NCCL INFO Using network (?P<name>.+?)\s*$", re.MULTILINE)
# a one-rank NCCL communicator: enough for NCCL to load its net plugin and print the network it uses
_NCCL_INIT = """
import os, torch, torch.distributed as dist
torch.cuda.set_device(0)
dist.init_process_group("nccl", init_method="tcp://127.0.0.1:" + os.environ["NCCL_CHECK_PORT"], rank=0, world_size=1)
t = torch.ones(1, device="cuda"); dist.all_reduce(t); torch.cuda.synchronize(); dist.destroy_process_group()
"""


def nccl_network(log: str) -> str | None:
    """The network NCCL says it uses in `log` (its NCCL_DEBUG=INFO output): "Socket", "IB",
    "Libfabric", "AWS Libfabric", ...; None when no such line is there."""
    found = _NCCL_NETWORK.findall(log)
    return found[-1] if found else None


def efa_devices(sys_class_infiniband: Path = Path("/sys/class/infiniband")) -> list[str]:
    """The RDMA devices of this node whose kernel driver is `efa` (AWS Elastic Fabric Adapter)."""
    if not sys_class_infiniband.is_dir():
        return []
    return sorted(d.name for d in sys_class_infiniband.iterdir()
                  if (d / "device" / "driver").exists() and (d / "device" / "driver").resolve().name == "efa")


def nccl_net_problem(network: str | None, efa: list[str]) -> str | None:
    """Why this node's NCCL network is wrong, or None: an EFA node must not use sockets, and on an EFA
    node a log that names no network is a failure too (elsewhere it is only reported)."""
    if network is None:
        return (f"this node has EFA ({', '.join(efa)}) and NCCL printed no 'Using network' line (NCCL_DEBUG=INFO), "
                "so which network it uses is unknown; see nccl_log") if efa else None
    if efa and network.strip().lower() == "socket":
        return (f"this node has EFA ({', '.join(efa)}) but NCCL uses Socket: the aws-ofi-nccl plugin was not "
                "loaded, so cross-node collectives run over TCP; put its lib folder (e.g. /opt/amazon/ofi-nccl/lib) "
                "on LD_LIBRARY_PATH or set NCCL_NET_PLUGIN, and FI_PROVIDER=efa")
    return None


def check_nccl_net() -> dict:
    """nccl_net (see the module docstring). Raises RuntimeError with nccl_net_problem's reason."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET", "NCCL_CHECK_PORT": str(port)}
    proc = subprocess.run([sys.executable, "-c", _NCCL_INIT], env=env, capture_output=True, text=True, timeout=180)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"one-rank NCCL init failed (exit {proc.returncode}): {log[-2000:]}")
    network, efa = nccl_network(log), efa_devices()
    out = {"network": network, "efa_devices": efa, "nccl_net_plugin_env": os.environ.get("NCCL_NET_PLUGIN"),
           "plugin_lines": [line.strip() for line in log.splitlines() if "NET/Plugin" in line or "NET/OFI" in line][:20],
           "nccl_log": log[-4000:]}
    problem = nccl_net_problem(network, efa)
    if problem:
        raise RuntimeError(f"{problem} (network={network!r}, efa={efa})")
    return out


def reserved_growth_per_push(reserved_bytes: list[int]) -> float:
    """Mean growth of reserved memory per push (bytes) from the first sample to the last; 0 for fewer
    than two samples. reserved_bytes: torch.cuda.memory_reserved after each push, warm-up excluded."""
    if len(reserved_bytes) < 2:
        return 0.0
    return (reserved_bytes[-1] - reserved_bytes[0]) / (len(reserved_bytes) - 1)


def check_sync_memory(sd: dict, pushes: int, bucket_mb: float) -> dict:
    """sync_memory (see the module docstring). Raises RuntimeError when reserved memory climbs."""
    out = check_transfer("cuda_ipc", sd, pushes, bucket_mb, "cuda:0")
    growth = reserved_growth_per_push(out["sender_reserved_bytes"])
    out["reserved_growth_bytes_per_push"] = growth
    if growth > RESERVED_GROWTH_LIMIT_BYTES:
        raise RuntimeError(f"the sender's torch.cuda.memory_reserved grew {growth / 2**20:.0f} MiB per push over "
                           f"{pushes} pushes (limit {RESERVED_GROWTH_LIMIT_BYTES / 2**20:.0f} MiB): a leak across "
                           f"weight syncs (samples: {out['sender_reserved_bytes']})")
    return out


def write_json(results: dict, out: str | None) -> list[Path]:
    """Write `results` to $OUT/device_check.json (when OUT is set) and to `out`; returns the paths."""
    targets = [Path(os.environ["OUT"]) / "device_check.json"] if os.environ.get("OUT") else []
    if out:
        targets.append(Path(out))
    for path in targets:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2) + "\n")
    return targets


def section(results: dict, name: str):
    """Runner: results[name] = fn() plus elapsed_s, or the error; the JSON is rewritten after each
    section, so a crash or a timeout still leaves the figures gathered so far."""

    def run(fn):
        t0 = time.perf_counter()
        try:
            out = fn()
            results[name] = {"ok": True, **out}
        except Exception as e:  # recorded in the JSON; the exit status reports it
            results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        results[name]["elapsed_s"] = time.perf_counter() - t0
        print(f"[{name}] {json.dumps({k: v for k, v in results[name].items() if k != 'traceback'})}", flush=True)
        write_json(results, results["args"]["out"])
        return results[name]

    return run


def check_env(dry_run: bool) -> dict:
    out = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available(), "dry_run": dry_run}
    if dry_run:
        return out
    if not torch.cuda.is_available():
        raise RuntimeError("CUDA is not available")
    props = torch.cuda.get_device_properties(0)
    out.update(device=props.name, total_memory_gib=props.total_memory / 2**30, capability=f"{props.major}.{props.minor}",
               cuda=torch.version.cuda, nccl=".".join(map(str, torch.cuda.nccl.version())),
               bf16=torch.cuda.is_bf16_supported(), device_count=torch.cuda.device_count())
    return out


def build_model(directory: str, shapes: dict, device: torch.device) -> int:
    """Random-init Qwen2 with `shapes`, saved (bf16) to `directory`; returns the parameter count."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    with device:
        model = Qwen2ForCausalLM(Qwen2Config(**shapes))
    n = sum(p.numel() for p in model.parameters())
    model.to(torch.bfloat16).save_pretrained(directory)
    del model
    return n


def random_batch(num_rows: int, seq_len: int, vocab: int):
    """num_rows rows of seq_len tokens: a 64-token (dry run: 8) prompt, the rest generated, random
    advantages of both signs, rollout log-probs of -2 (stale enough for the IS weights to act)."""
    from workers.core.algorithms.batch import TrainBatch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (num_rows, seq_len), generator=g)
    prompt = min(64, seq_len // 4)
    loss_mask = torch.zeros(num_rows, seq_len)
    loss_mask[:, prompt:] = 1.0
    adv = torch.randn(num_rows, 1, generator=g) * loss_mask
    return TrainBatch(ids, torch.ones_like(ids), loss_mask, -2.0 * loss_mask, adv)


def check_trainer(args, model_dir: str, shapes: dict) -> dict:
    from workers.trainer.worker import TrainerSettings, TrainerWorker

    device = "cpu" if args.dry_run else "cuda"
    settings = TrainerSettings(model_path=model_dir, lr=1e-5, weight_decay=0.0, mixed_precision="bf16",
                               activation_checkpointing=True, max_tokens_per_micro_batch=args.tokens_per_micro_batch,
                               micro_batch_size=1, device=device, attn_implementation="sdpa")
    trainer = TrainerWorker(settings)
    try:
        batch = random_batch(args.rows, args.seq_len, shapes["vocab_size"])
        t0 = time.perf_counter()
        warm = trainer.train_batch(batch)
        warm_s = time.perf_counter() - t0
        if not args.dry_run:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times, metrics = [], warm
        for _ in range(args.steps):
            t0 = time.perf_counter()
            metrics = trainer.train_batch(batch)
            if not args.dry_run:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        tokens = args.rows * args.seq_len
        out = {"num_params": sum(p.numel() for p in trainer.model.parameters()), "rows": args.rows,
               "seq_len": args.seq_len, "tokens_per_update": tokens, "num_micro_batches": len(trainer.micro_batches(batch)),
               "warmup_update_s": warm_s, "update_s": times, "tokens_per_s": tokens * len(times) / sum(times),
               "grad_norm": metrics["actor/grad_norm"], "pg_loss": metrics["actor/pg_loss"],
               "step_skipped": metrics["actor/step_skipped"]}
        if not args.dry_run:
            out["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
            out["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        if metrics["actor/step_skipped"] or not metrics["actor/grad_norm"] > 0:
            raise RuntimeError(f"the update did not step: {metrics}")
        return out
    finally:
        trainer.close()
        del trainer
        if not args.dry_run:
            torch.cuda.empty_cache()


def check_transfer(backend: str, sd: dict, pushes: int, bucket_mb: float, receiver_device: str) -> dict:
    import multiprocessing as mp

    from workers.weight_sync.broadcast import new_group_info, send_weights
    from workers.weight_sync.plan import specs_of
    from workers.weight_sync.receiver import run_receiver_process
    from workers.weight_sync.transport import open_transport

    specs = specs_of(sd)
    total = sum(t.numel() * t.element_size() for t in sd.values())
    info = new_group_info(backend, 1, timeout_s=120)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    versions = list(range(1, pushes + 2))
    proc = ctx.Process(target=run_receiver_process, args=(info, 1, specs, versions, results, 1, receiver_device),
                       daemon=True)
    proc.start()
    sender_device = next(iter(sd.values())).device
    on_cuda = sender_device.type == "cuda"
    try:
        sender = open_transport(info, 0, sender_device)
        times, reserved = [], []
        for v in versions:
            report = send_weights(sender, specs, sd.items(), version=v, bucket_bytes=int(bucket_mb * 2**20))
            outcome = results.get(timeout=120)
            if outcome.error is not None:
                raise RuntimeError(f"receiver failed: {outcome.error}")
            if v > 1:  # push 1 warms up (slot allocation, IPC handles, page faults)
                times.append(report.elapsed_s)
                if on_cuda:
                    torch.cuda.synchronize(sender_device)
                    reserved.append(torch.cuda.memory_reserved(sender_device))
        sender.close()
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    probe = next(iter(sd))
    want = float(sd[probe].double().sum())
    if outcome.sums[probe] != want:
        raise RuntimeError(f"received {probe} differs: sum {outcome.sums[probe]} != {want}")
    return {"backend": backend, "bytes": total, "num_buckets": report.num_buckets, "push_s": times,
            "gb_per_s": total * len(times) / sum(times) / 1e9, "sender_device": str(sender_device),
            "receiver_device": receiver_device, "sender_reserved_bytes": reserved}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny config: checks the script itself")
    ap.add_argument("--rows", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="timed updates after one warm-up")
    ap.add_argument("--tokens-per-micro-batch", type=int, default=None)
    ap.add_argument("--pushes", type=int, default=None, help="timed weight pushes after one warm-up")
    ap.add_argument("--bucket-mb", type=float, default=512.0)
    ap.add_argument("--try-nccl", action="store_true", help="also try NCCL between two processes (needs 2 GPUs; skipped on one)")
    ap.add_argument("--sync-pushes", type=int, default=8, help="sync_memory: timed pushes after one warm-up")
    ap.add_argument("--nccl-net-only", action="store_true", help="only the nccl_net section (each node)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()
    dry = args.dry_run
    args.rows = args.rows or (4 if dry else 16)
    args.seq_len = args.seq_len or (32 if dry else 2048)
    args.steps = args.steps or (1 if dry else 3)
    args.pushes = args.pushes or (1 if dry else 3)
    args.tokens_per_micro_batch = args.tokens_per_micro_batch or (64 if dry else 16384)
    if dry:
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    shapes = TINY if dry else QWEN2_0_5B
    results: dict = {"started_unix_s": time.time(), "args": vars(args)}
    t_start = time.perf_counter()

    section(results, "env")(lambda: check_env(dry))
    if args.nccl_net_only:
        section(results, "nccl_net")(check_nccl_net)
        return finish(results, args, t_start)
    with tempfile.TemporaryDirectory(prefix="device-check-") as tmp:
        model_dir = os.path.join(tmp, "model")
        build = section(results, "build_model")(
            lambda: {"num_params": build_model(model_dir, shapes, torch.device("cpu" if dry else "cuda"))})
        if build["ok"]:
            section(results, "trainer")(lambda: check_trainer(args, model_dir, shapes))

    def state_dict(device: str) -> dict:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        with torch.device(device):
            model = Qwen2ForCausalLM(Qwen2Config(**shapes)).to(torch.bfloat16)
        sd = {k: v.detach() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
        return sd

    if dry:
        section(results, "transfer_shm")(lambda: check_transfer("shm", state_dict("cpu"), args.pushes, 1.0, "cpu"))
    else:
        gpu_sd = state_dict("cuda:0")
        section(results, "transfer_cuda_ipc")(
            lambda: check_transfer("cuda_ipc", gpu_sd, args.pushes, args.bucket_mb, "cuda:0"))
        section(results, "sync_memory")(lambda: check_sync_memory(gpu_sd, args.sync_pushes, args.bucket_mb))
        if args.try_nccl and torch.cuda.device_count() >= 2:
            section(results, "transfer_nccl")(
                lambda: check_transfer("nccl", gpu_sd, args.pushes, args.bucket_mb, "cuda:1"))
        elif args.try_nccl:  # seen on an H100: ncclInvalidUsage "Duplicate GPU detected : rank 0 and rank 1"
            results["transfer_nccl"] = {"ok": None, "skipped": "NCCL refuses two ranks on one GPU: needs 2 GPUs"}
            print(f"[transfer_nccl] {json.dumps(results['transfer_nccl'])}", flush=True)
        host_sd = {k: v.cpu() for k, v in gpu_sd.items()}
        del gpu_sd
        section(results, "transfer_shm")(lambda: check_transfer("shm", host_sd, args.pushes, args.bucket_mb, "cpu"))
        section(results, "nccl_net")(check_nccl_net)
    return finish(results, args, t_start)


def finish(results: dict, args, t_start: float) -> int:
    """Record what was imported and which sections failed, write the JSON; the exit status."""
    results["imported"] = {m: m in sys.modules for m in ("vllm", "ray")}
    results["total_s"] = time.perf_counter() - t_start
    failed = [k for k, v in results.items() if isinstance(v, dict) and v.get("ok") is False]
    if any(results["imported"].values()):
        failed.append("imported vllm/ray")
    results["failed"] = failed
    for path in write_json(results, args.out):
        print(f"wrote {path}", flush=True)
    print(f"device check {'FAILED: ' + ', '.join(failed) if failed else 'passed'} in {results['total_s']:.1f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
