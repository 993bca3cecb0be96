"""Benchmark the CPU weight-sync paths against this machine's memcpy bandwidth.

For random fp32 models of each size (default 10M, 100M, 500M parameters, 1024-wide matrices) it
times --repeats pushes (median reported; broadcast paths after one warm-up push) from the trainer
to one receiver process, end to end (sender's tensors in memory -> the
receiver's own tensors hold the values), excluding process start and group setup:
  file: safetensors `save_file` into --file-dir, then `safe_open` + `get_tensor` + copy into the
        receiver's tensors (the path `make run` uses: TrainerWorker.export_weights and
        workers/inference/vllm_ext.py; here both halves run in this process, one after the other).
  file_tmpfs: the same with the file under /dev/shm (memory instead of disk).
  shm:  bucketed broadcast through /dev/shm slots (workers/weight_sync/transport.py), receiver in
        another process copying each tensor into its model.
  gloo: bucketed broadcast over a stateless gloo group (TCP on loopback), receiver as above.
LoRA rows (--lora-ranks, e.g. 8 64; issue 27): a rank-r adapter on every matrix of the model
(A [r, in], B [out, r], fp32), one sync each way, on the file path with the file under --file-dir:
  lora_adapter: the adapter alone, written as a PEFT directory (workers/trainer/lora.py
        `write_adapter_dir`, what `inference.lora_sync=adapter` sends) and read back into tensors;
  lora_merged:  W + (alpha / r) B A for every matrix (workers/trainer/lora.py `merged_state_dict`),
        then the full file path as `file` (what `inference.lora_sync=merged` sends).
  Each row reports bytes per sync and their ratio to the full-weight `file` sync (bytes_ratio,
  time_ratio against the lora_merged row of the same size and rank). vLLM's own load of the
  adapter (`add_lora`) or of the weights is not included.
memcpy: `dst.copy_(src)` of a --memcpy-mb buffer, best of 5 after a warm-up (single thread and
all threads), and again (1 thread, 256 MiB) right before each path, since other processes on a
shared machine change both: `fraction_of_memcpy` divides by that adjacent figure,
`fraction_of_best_memcpy` by the best figure of the run.

    python scripts/bench_weight_sync.py --out bench_weight_sync.json [--sizes 10e6 100e6 500e6]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workers.weight_sync.broadcast import new_group_info, send_weights  # noqa: E402
from workers.weight_sync.plan import TensorSpec, specs_of  # noqa: E402
from workers.weight_sync.receiver import run_receiver_process  # noqa: E402
from workers.weight_sync.transport import open_transport  # noqa: E402

WIDTH = 1024  # model matrices are [WIDTH, WIDTH] fp32 (4 MiB each) plus one remainder tensor


def random_model(num_params: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    left, i = int(num_params), 0
    while left > 0:
        n = min(left, WIDTH * WIDTH)
        shape = (WIDTH, n // WIDTH) if n % WIDTH == 0 else (n,)
        sd[f"layers.{i}.weight"] = torch.randn(shape, generator=g)
        left -= n
        i += 1
    return sd


def memcpy_bandwidth(nbytes: int, threads: int) -> float:
    """Best-of-5 bytes/s of dst.copy_(src) over nbytes with `threads` torch threads."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.ones(nbytes // 4)
        dst = torch.zeros_like(src)
        dst.copy_(src)  # warm-up: pages touched
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
        return nbytes / best
    finally:
        torch.set_num_threads(old)


def bench_file(sd: dict[str, torch.Tensor], directory: str, repeats: int) -> dict:
    from safetensors import safe_open
    from safetensors.torch import save_file

    targets = {n: torch.zeros_like(t) for n, t in sd.items()}
    path = os.path.join(directory, f"bench-{os.getpid()}.safetensors")
    times, writes = [], []
    try:
        for _ in range(repeats):
            t0 = time.perf_counter()
            save_file(sd, path, metadata={"format": "pt"})
            t1 = time.perf_counter()
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    targets[name].copy_(f.get_tensor(name))
            times.append(time.perf_counter() - t0)
            writes.append(t1 - t0)
            os.remove(path)
    finally:
        if os.path.exists(path):
            os.remove(path)
    for name in list(sd)[:: max(1, len(sd) // 8)]:  # spot check
        assert torch.equal(targets[name], sd[name]), name
    return {"times_s": times, "write_s": writes}


def lora_of(sd: dict[str, torch.Tensor], rank: int, seed: int = 1) -> dict[str, torch.Tensor]:
    """A rank-`rank` adapter (PEFT's full-model names) on every 2-D tensor of `sd`."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if t.dim() == 2:
            module = "base_model.model." + name.removesuffix(".weight")
            out[f"{module}.lora_A.default.weight"] = torch.randn(rank, t.shape[1], generator=g) * 0.01
            out[f"{module}.lora_B.default.weight"] = torch.randn(t.shape[0], rank, generator=g) * 0.01
    return out


def bench_lora(sd: dict[str, torch.Tensor], rank: int, directory: str, repeats: int) -> list[dict]:
    """lora_adapter and lora_merged rows (module docstring) for one model and rank."""
    from peft import LoraConfig
    from safetensors.torch import load_file

    from workers.trainer.lora import adapter_state_dict, merged_state_dict, write_adapter_dir
    from workers.weight_sync.lora import ADAPTER_WEIGHTS_FILE

    lora = lora_of(sd, rank)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["weight"])
    peft_sd = {f"base_model.model.{k.removesuffix('.weight')}.base_layer.weight" if sd[k].dim() == 2
               else f"base_model.model.{k}": v for k, v in sd.items()} | lora
    adapter_dir = os.path.join(directory, f"bench-adapter-{os.getpid()}")
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        write_adapter_dir(adapter_dir, config, adapter_state_dict(lora))
        received = load_file(os.path.join(adapter_dir, ADAPTER_WEIGHTS_FILE))
        times.append(time.perf_counter() - t0)
    adapter_bytes = os.path.getsize(os.path.join(adapter_dir, ADAPTER_WEIGHTS_FILE))
    assert len(received) == len(lora)
    import shutil

    shutil.rmtree(adapter_dir, ignore_errors=True)
    merge_times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        merged = merged_state_dict(peft_sd, 2.0)
        merge_times.append(time.perf_counter() - t0)
    merged_row = bench_file(merged, directory, repeats)
    merged_row["times_s"] = [m + f for m, f in zip(merge_times, merged_row["times_s"])]
    merged_row["merge_s"] = merge_times
    merged_bytes = sum(t.numel() * t.element_size() for t in merged.values())
    return [{"path": "lora_adapter", "times_s": times, "sync_bytes": adapter_bytes},
            {"path": "lora_merged", **merged_row, "sync_bytes": merged_bytes}]


def bench_broadcast(sd: dict[str, torch.Tensor], backend: str, bucket_mb: float, threads: int, repeats: int) -> dict:
    specs: list[TensorSpec] = specs_of(sd)
    info = new_group_info(backend, 1, timeout_s=600)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    versions = list(range(1, repeats + 2))
    proc = ctx.Process(target=run_receiver_process, args=(info, 1, specs, versions, results, threads), daemon=True)
    proc.start()
    sender = open_transport(info, 0)
    times, receiver_times = [], []
    try:
        for v in versions:  # push 1 warms up (slot files, page faults of the receiver's buffers)
            report = send_weights(sender, specs, sd.items(), version=v, bucket_bytes=int(bucket_mb * 2**20))
            outcome = results.get(timeout=600)
            if v > 1:
                times.append(report.elapsed_s)
                receiver_times.append(outcome.report.elapsed_s if outcome.report else float("nan"))
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
        sender.close()
    if outcome.error is not None:
        raise RuntimeError(f"{backend} receiver failed: {outcome.error}")
    probe = next(iter(sd))
    assert outcome.sums[probe] == float(sd[probe].double().sum())
    return {"times_s": times, "num_buckets": report.num_buckets, "receiver_times_s": receiver_times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=float, nargs="+", default=[10e6, 100e6, 500e6], help="parameters per model")
    ap.add_argument("--paths", nargs="+", default=["file", "file_tmpfs", "shm", "gloo"],
                    choices=["file", "file_tmpfs", "shm", "gloo"])
    ap.add_argument("--bucket-mb", type=float, default=16.0)
    ap.add_argument("--repeats", type=int, default=3, help="timed pushes per path and size (after a warm-up)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of sender and receiver")
    ap.add_argument("--memcpy-mb", type=float, default=512.0)
    ap.add_argument("--file-dir", default=tempfile.gettempdir())
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    ap.add_argument("--lora-ranks", type=int, nargs="*", default=[], help="LoRA rows at these ranks (e.g. 8 64)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    nbytes = int(args.memcpy_mb * 2**20)
    memcpy = {"1_thread": memcpy_bandwidth(nbytes, 1), f"{os.cpu_count()}_threads": memcpy_bandwidth(nbytes, os.cpu_count() or 1)}
    best_memcpy = max(memcpy.values())
    print(f"memcpy: " + ", ".join(f"{k} {v / 1e9:.2f} GB/s" for k, v in memcpy.items()), flush=True)
    rows = []
    for size in args.sizes:
        sd = random_model(int(size))
        total = sum(t.numel() * t.element_size() for t in sd.values())
        for path in args.paths:
            now = memcpy_bandwidth(256 * 2**20, 1)
            best_memcpy = max(best_memcpy, now)
            if path.startswith("file"):
                r = bench_file(sd, "/dev/shm" if path == "file_tmpfs" else args.file_dir, args.repeats)
            else:
                r = bench_broadcast(sd, path, args.bucket_mb, args.threads, args.repeats)
            r["elapsed_s"] = statistics.median(r["times_s"])
            r["best_s"] = min(r["times_s"])
            rate = total / r["elapsed_s"]
            r.update(path=path, num_params=int(size), bytes=total, bytes_per_s=rate, memcpy_bytes_per_s_now=now,
                     fraction_of_memcpy=rate / now, fraction_of_best_memcpy=rate / best_memcpy,
                     best_fraction_of_memcpy=total / r["best_s"] / now)
            rows.append(r)
            print(f"{int(size) / 1e6:6.0f}M params {total / 2**20:6.0f} MiB {path:10s} {r['elapsed_s']:7.3f} s "
                  f"{rate / 1e9:5.2f} GB/s  {100 * r['fraction_of_memcpy']:5.1f}% of memcpy now ({now / 1e9:.2f} GB/s); "
                  f"best push {100 * r['best_fraction_of_memcpy']:5.1f}%",
                  flush=True)
        for rank in args.lora_ranks:
            lora_rows = bench_lora(sd, rank, args.file_dir, args.repeats)
            merged_s = statistics.median(lora_rows[1]["times_s"])
            for r in lora_rows:
                r.update(num_params=int(size), lora_rank=rank, elapsed_s=statistics.median(r["times_s"]),
                         bytes_ratio=r["sync_bytes"] / total)
                r["time_ratio_vs_merged"] = r["elapsed_s"] / merged_s
                rows.append(r)
                print(f"{int(size) / 1e6:6.0f}M params rank {rank:3d} {r['path']:12s} {r['sync_bytes'] / 2**20:8.1f} MiB "
                      f"({100 * r['bytes_ratio']:5.2f}% of full) {r['elapsed_s']:7.3f} s "
                      f"({r['time_ratio_vs_merged']:.3f}x merged)", flush=True)
        del sd
    out = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                       "load_avg": os.getloadavg()},
           "memcpy_bytes_per_s": memcpy, "best_memcpy_bytes_per_s": best_memcpy, "bucket_mb": args.bucket_mb, "threads": args.threads, "results": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
