"""Rollout dispatch benchmark: completion -> sample-in-buffer latency and rollouts per second.

Real parts: the ACR emulator with `workers.embedded.stub_agent` processes (model-free: each rollout
only reports a reward) and moto S3 (LocalStack), the AsyncAcrClient over botocore, the cluster-
wide limits (the same services and coalescing clients the Ray actors use, in this process), the
fast-completion result server, and the real GatewayServer in front of a zero-cost engine. The
RolloutWorker runs in this process, its puts through the rollout actor's PutBatcher
(`--put-batch-delay-ms`); the sink records each put with its time.

Measured (written to --out as JSON, and printed):
- latency_ms p50/p99: result reaches the worker (agent POST, HTTP answer, or S3 hit) -> the sample
  is in the sink;
- rollouts_per_s: rollouts finished / wall time from the first dispatch to the last outcome;
- lost (requests without an outcome), duplicated (session ids stored twice, or outcomes per
  request != 1), leaked sessions (emulator sessions open after the run + worker-side count);
- terminal states and failure reasons, the faults the emulator injected, and the emulator's
  peak request rate and peak open sessions against the configured limits;
- with `--driver` (the default), the driver's side of the data path as the loops run it: samples
  go into a real TransferQueue trajectory buffer (Ray, one storage unit), and once a group's
  results are in, a driver stage in its own thread and event loop (its own TQ client) clears the
  group's samples through the loop's store adapter by the keys the results carry
  (orchestrator/adapters/clients.py `BufferStore.clear_samples`; before issue 44 it listed the
  group's tags back from the buffer first, and before 1c351df it read the whole samples, tokens
  included). `driver.cpu_s_per_1000_rollouts` is that thread's CPU time per 1000 rollouts;
  `driver.bytes_per_rollout` what the driver receives per rollout, metered at its clients: the
  results' pickled size (what Ray would hand it) plus every TransferQueue answer its client got
  (`TrajectoryBuffer.meter_received`).

Run: `python scripts/bench_rollout.py --faults 0.2 --rollouts 10000 --out FILE.json`
(`--contract s3|http`, `--concurrency C` rollouts in flight, `--timeout-s` per rollout).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pickle
import queue
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.core.types import (PROMPT_VERSION, GenerateRequest, GenerateResult, RolloutRequest, Sample,  # noqa: E402
                                TrajectoryRow)
from workers.acr.client import AcrClientConfig, AsyncAcrClient  # noqa: E402
from workers.embedded.faults import FaultRates  # noqa: E402
from workers.acr.limits import AcrLimitsConfig, limit_clients, limit_stats, local_limits  # noqa: E402
from workers.embedded.local_stack import LocalStack  # noqa: E402
from workers.rollout.worker import RolloutSettings, RolloutWorker  # noqa: E402
from workers.rollout.put_batcher import MAX_DELAY_S, MAX_SAMPLES, PutBatcher  # noqa: E402
from workers.rollout.results import ResultBoard, ResultServer  # noqa: E402

STUB_AGENT = [sys.executable, "-m", "workers.embedded.stub_agent"]
GROUP_SIZE = 4  # rollouts per group (rollout.n)
MODEL_ID = "bench-model"


class ZeroCostEngine:
    """InferenceEngine that answers one eos token at once (the stub agent never asks, but a
    chat call would cost nothing)."""

    def __init__(self, eos_id: int) -> None:
        self._eos = eos_id

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        return GenerateResult((self._eos,), (0.0,), "stop", 0)


class TimedSink:
    """SampleSink that keeps every sample with the clock time it was stored."""

    def __init__(self) -> None:
        self.samples: list[Sample] = []
        self.times: list[float] = []

    async def put(self, samples: list[Sample], partition: str) -> None:
        now = time.monotonic()
        self.samples.extend(samples)
        self.times.extend([now] * len(samples))


class BufferSink(TimedSink):
    """TimedSink that also puts every sample into the trajectory buffer (the product's SampleSink).

    The stub agent makes no model call, so its samples have no rows; a sample that has none is
    stored with `row` (a synthetic trajectory of `--tokens-per-rollout` tokens, the second half
    generated) so that the buffer and its readers move what a real rollout's tokens would."""

    def __init__(self, buffer, row: TrajectoryRow | None) -> None:
        super().__init__()
        self._buffer = buffer
        self._row = row

    async def put(self, samples: list[Sample], partition: str) -> None:
        if self._row is not None:
            samples = [replace(s, rows=(self._row,)) if not s.rows else s for s in samples]
        await self._buffer.put(samples, partition)
        await super().put(samples, partition)


def synthetic_row(num_tokens: int) -> TrajectoryRow | None:
    """A trajectory of `num_tokens` tokens whose second half is generated (policy version 0)."""
    if num_tokens <= 0:
        return None
    gen = num_tokens // 2
    return TrajectoryRow(token_ids=tuple(range(100, 100 + num_tokens)), loss_mask=(0,) * (num_tokens - gen) + (1,) * gen,
                         rollout_logprobs=(0.0,) * (num_tokens - gen) + (-0.5,) * gen,
                         versions=(PROMPT_VERSION,) * (num_tokens - gen) + (0,) * gen)


class DriverStage:
    """The driver's part of the data path (see the module docstring), in its own thread and loop.

    `submit(group_id, results)` once every result of the group is in; `close()` waits for the
    queue to empty. Counts: groups cleared, samples, bytes received (metered), thread CPU s."""

    def __init__(self, handle, group_size: int, partition: str) -> None:
        self._handle, self._partition = handle, partition
        self._q: queue.Queue = queue.Queue()
        self.cpu_s = 0.0
        self.bytes_outcomes = self.bytes_store = self.groups = self.samples = 0
        self.errors: list[str] = []
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="driver-stage", daemon=True)
        self._thread.start()

    def submit(self, group_id: int, results: list) -> None:
        self._q.put((group_id, results))

    def close(self, timeout_s: float = 300.0) -> None:
        self._q.put(None)
        self._thread.join(timeout_s)

    async def _run(self) -> None:
        from orchestrator.adapters.clients import BufferStore
        from workers.buffer.store import TrajectoryBuffer
        from workers.core.calls import ByteMeter

        buffer = TrajectoryBuffer.connect(self._handle)
        answers = ByteMeter()
        buffer.meter_received(answers)
        store = BufferStore(buffer)
        try:
            while (item := await asyncio.to_thread(self._q.get)) is not None:
                t0 = time.thread_time()
                group_id, results = item
                try:
                    self.bytes_outcomes += len(pickle.dumps(results, protocol=5))
                    samples = [r.sample for r in results]  # what the loops hold
                    self.samples += len(samples)
                    await store.clear_samples(self._partition, samples)  # by the results' keys: no listing
                    self.bytes_store += answers.take()[0]
                except Exception as e:  # noqa: BLE001 - counted and reported, the bench goes on
                    self.errors.append(f"group {group_id}: {type(e).__name__}: {e}"[:300])
                self.groups += 1
                self.cpu_s += time.thread_time() - t0
        finally:
            buffer.close()


def start_buffer():
    """Ray (this machine's CPUs) and a TransferQueue trajectory buffer with one storage unit."""
    import ray

    from workers.buffer.store import BufferConfig, TrajectoryBuffer

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    return TrajectoryBuffer.start(BufferConfig(num_storage_units=1))


def cpu_processes(stack: LocalStack) -> dict:
    """psutil handles of this process and every server the stack started (agents included)."""
    import psutil

    procs = {"client": psutil.Process()}
    procs.update({name: psutil.Process(pid) for name, pid in stack.pids().items()})
    procs.update({f"agent-{i}": psutil.Process(pid) for i, pid in enumerate(stack.stats().agent_pids)})
    return procs


def cpu_s(p) -> float:
    """User + system CPU seconds of a psutil process (0.0 once it is gone)."""
    try:
        t = p.cpu_times()
    except Exception:  # noqa: BLE001 - the process exited
        return 0.0
    return t.user + t.system


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


async def run_bench(args: argparse.Namespace, stack: LocalStack) -> dict:
    from workers.gateway.chat_template import ChatRenderer
    from workers.gateway.config import GatewayConfig
    from workers.gateway.server import GatewayServer
    from workers.embedded.tiny_model import ensure_tiny_model

    model_dir = ensure_tiny_model()
    renderer = ChatRenderer.from_pretrained(model_dir)
    gateway = GatewayServer(GatewayConfig(model_path=str(model_dir), served_model_name=MODEL_ID, max_context_tokens=512),
                            [ZeroCostEngine(renderer.tokenizer.eos_token_id)], renderer=renderer)
    base_url = await gateway.start()
    limits_cfg = AcrLimitsConfig(requests_per_s=args.requests_per_s, max_open_sessions=args.max_open_sessions)
    handles = local_limits(limits_cfg)
    clients = limit_clients(handles)
    acr = await AsyncAcrClient(AcrClientConfig(max_pool_connections=args.concurrency + 16),
                               request_gate=clients.requests).start()
    board = ResultBoard()
    server = ResultServer(board)
    result_url = await server.start()
    settings = RolloutSettings(
        exp_id="bench", agent_runtime_arn=stack.agent_runtime_arn, qualifier=None, s3_bucket=stack.bucket,
        gateway_base_url=base_url, model_id=MODEL_ID, max_tokens=8, temperature=1.0, top_p=1.0,
        timeout_s=args.timeout_s, max_context_tokens=512, contract=args.contract, push_grace_s=args.push_grace_s,
        max_consecutive_bad_results=10**9)  # fmt: skip
    owner = start_buffer() if args.driver else None
    if owner is not None:
        from workers.buffer.store import TrajectoryBuffer

        writer = TrajectoryBuffer.connect(owner.handle)  # this loop's client (one buffer per event loop)
        sink: TimedSink = BufferSink(writer, synthetic_row(args.tokens_per_rollout))
        driver = DriverStage(owner.handle, GROUP_SIZE, "bench")
    else:
        sink, driver = TimedSink(), None
    puts = None if (args.put_batch_delay_ms or 0) < 0 else PutBatcher(
        sink, max_samples=args.put_batch_max or MAX_SAMPLES,
        max_delay_s=MAX_DELAY_S if args.put_batch_delay_ms is None else args.put_batch_delay_ms / 1e3)
    worker = RolloutWorker(settings, gateway, acr, puts or sink, slots=clients.sessions, results=board,
                           result_url=result_url)
    reqs = [RolloutRequest(group_id=i // GROUP_SIZE, input_id=f"row-{i // GROUP_SIZE}", sample_index=i % GROUP_SIZE,
                           row={"prompt": "p"}) for i in range(args.rollouts)]
    pending = Counter(r.group_id for r in reqs)
    outcomes: list = [None] * len(reqs)
    extra_outcomes = 0
    sem = asyncio.Semaphore(args.concurrency)

    async def one(i: int) -> None:
        nonlocal extra_outcomes
        async with sem:
            o = await worker.run(reqs[i], "bench")
        if outcomes[i] is not None:
            extra_outcomes += 1
        outcomes[i] = o
        gid = reqs[i].group_id
        pending[gid] -= 1
        if driver is not None and pending[gid] == 0:
            first = gid * GROUP_SIZE
            driver.submit(gid, outcomes[first:first + GROUP_SIZE])

    procs = cpu_processes(stack)
    cpu0 = {name: cpu_s(p) for name, p in procs.items()}
    try:
        t0 = time.monotonic()
        await asyncio.gather(*(one(i) for i in range(len(reqs))))
        wall_s = time.monotonic() - t0
        cpu = {name: round(cpu_s(p) - cpu0[name], 2) for name, p in procs.items()}
        if puts is not None:
            await puts.close()
        await clients.sessions.drain()
        rate_st, cap_st = await limit_stats(handles)
        emu = await asyncio.to_thread(stack.stats)
        if driver is not None:
            await asyncio.to_thread(driver.close)
    finally:
        await server.stop()
        await acr.close()
        await gateway.stop()
        if owner is not None:
            writer.close()
            owner.stop()
    done = [o for o in outcomes if o is not None]
    stored = Counter(s.session_id for s in sink.samples)
    lat_ms = [o.result_to_stored_s * 1e3 for o in done if o.result_to_stored_s is not None]
    statuses = Counter(o.sample.status for o in done)
    reasons = Counter(o.reason for o in done if o.reason is not None)
    trainable_without_reward = sum(1 for s in sink.samples if s.status == "completed" and s.reward is None)
    return {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "rollouts": len(reqs),
        "lost": len(reqs) - len(done),
        "duplicated": extra_outcomes + sum(c - 1 for c in stored.values() if c > 1) + (len(sink.samples) - len(stored)),
        "leaked_sessions": emu.sessions_open + worker.sessions_open,
        "leaked_slots": cap_st.in_use,
        "latency_ms": {"p50": percentile(lat_ms, 0.5), "p99": percentile(lat_ms, 0.99), "max": max(lat_ms, default=None),
                       "n": len(lat_ms)},
        "rollouts_per_s": len(done) / wall_s,
        "wall_s": wall_s,
        "terminal": dict(statuses),
        "failed_reasons": dict(reasons),
        "trainable_without_reward": trainable_without_reward,
        "faults_injected": emu.faults_injected,
        "limits": asdict(limits_cfg),
        "emulator": {"peak_request_rate": emu.peak_request_rate, "peak_open": emu.peak_open,
                     "requests": emu.requests, "sessions_created": emu.sessions_created,
                     "sessions_expired": emu.sessions_expired,
                     "sessions_expired_max_lifetime": emu.sessions_expired_max_lifetime, "throttled": emu.throttled},
        "limiter": {"rate_granted": rate_st.granted, "sessions_peak": cap_st.peak_in_use},
        "acr_client": asdict(acr.stats()),
        "store_writes": None if puts is None else {"writes": puts.writes, "samples": puts.samples},
        "load_avg_start_end": [args.load_start, list(os.getloadavg())],
        "cpu_s_during_run": cpu,  # where the CPU went: this process (client), emulator, agents, moto
        "driver": None if driver is None else {
            "groups": driver.groups, "samples": driver.samples, "errors": driver.errors[:5], "num_errors": len(driver.errors),
            "cpu_s": round(driver.cpu_s, 3), "cpu_s_per_1000_rollouts": round(1000 * driver.cpu_s / len(reqs), 3),
            "bytes_per_rollout": (driver.bytes_outcomes + driver.bytes_store) / len(reqs),
            "bytes_from_rollouts_per_rollout": driver.bytes_outcomes / len(reqs),
            "bytes_from_buffer_per_rollout": driver.bytes_store / len(reqs)},
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--faults", type=float, default=0.0, help="total injected fault rate, spread over all kinds")
    p.add_argument("--rollouts", type=int, default=2000)
    p.add_argument("--out", required=True)
    p.add_argument("--contract", choices=("s3", "http"), default="http")
    p.add_argument("--concurrency", type=int, default=128, help="rollouts in flight")
    p.add_argument("--num-agents", type=int, default=2)
    p.add_argument("--timeout-s", type=float, default=5.0, help="per-rollout timeout (slow/no_result faults hit it)")
    p.add_argument("--push-grace-s", type=float, default=0.5, help="s3: start S3 polling this long after invoke")
    p.add_argument("--requests-per-s", type=float, default=5000.0)
    p.add_argument("--max-open-sessions", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-uvloop", dest="uvloop", action="store_false", help="plain asyncio loop in this process")
    p.add_argument("--tokens-per-rollout", type=int, default=2048,
                   help="--driver: tokens of the synthetic trajectory stored with each sample (0: none)")
    p.add_argument("--put-batch-delay-ms", type=float, default=None,
                   help="the rollout worker's puts go through a PutBatcher with this delay (default: the product's, "
                        "workers/rollout/put_batcher.py); negative: no batcher, one store write per rollout")
    p.add_argument("--put-batch-max", type=int, default=None, help="the PutBatcher's max_samples (default: the product's)")
    p.add_argument("--no-driver", dest="driver", action="store_false",
                   help="samples go to an in-memory sink only: no TransferQueue, no driver stage")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.load_start = list(os.getloadavg())
    faults = FaultRates.uniform(args.faults, seed=args.seed) if args.faults > 0 else None
    log_dir = tempfile.mkdtemp(prefix="bench-rollout-")
    with LocalStack(STUB_AGENT, num_agents=args.num_agents, session_rate_per_s=1e6, session_burst=10**6,
                    max_open_sessions=args.max_open_sessions, faults=faults, log_dir=log_dir,
                    agent_env={"STUB_SLOW_S": str(args.timeout_s * 5)}) as stack:
        os.environ.update(stack.env)
        if args.uvloop:
            import uvloop

            report = uvloop.run(run_bench(args, stack))
        else:
            report = asyncio.run(run_bench(args, stack))
    report["log_dir"] = log_dir
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    lat = report["latency_ms"]
    print(json.dumps(report, indent=2))
    print(f"lost {report['lost']}, duplicated {report['duplicated']}, leaked sessions {report['leaked_sessions']}, "
          f"latency p50 {lat['p50']:.1f} ms / p99 {lat['p99']:.1f} ms, {report['rollouts_per_s']:.0f} rollouts/s")
    if report["driver"] is not None:
        d = report["driver"]
        print(f"driver: {d['cpu_s_per_1000_rollouts']:.2f} CPU s per 1000 rollouts, {d['bytes_per_rollout']:.0f} bytes "
              f"per rollout ({d['bytes_from_rollouts_per_rollout']:.0f} from the pool, {d['bytes_from_buffer_per_rollout']:.0f} "
              f"from the buffer), {d['num_errors']} read errors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
