"""Rollout dispatch benchmark: completion -> sample-in-buffer latency and rollouts per second.

Real parts: the ACR emulator with `workers.embedded.stub_agent` processes (model-free: each rollout
only reports a reward) and moto S3 (LocalStack), the AsyncAcrClient over botocore, the cluster-
wide limits (the same services and coalescing clients the Ray actors use, in this process), the
fast-completion result server, and the real GatewayServer in front of a zero-cost engine. The
RolloutWorker runs in this process; the sink records each put with its time.

Measured (written to --out as JSON, and printed):
- latency_ms p50/p99: result reaches the worker (agent POST, HTTP answer, or S3 hit) -> the sample
  is in the sink;
- rollouts_per_s: rollouts finished / wall time from the first dispatch to the last outcome;
- lost (requests without an outcome), duplicated (session ids stored twice, or outcomes per
  request != 1), leaked sessions (emulator sessions open after the run + worker-side count);
- terminal states and failure reasons, the faults the emulator injected, and the emulator's
  peak request rate and peak open sessions against the configured limits.

Run: `python scripts/bench_rollout.py --faults 0.2 --rollouts 10000 --out FILE.json`
(`--contract s3|http`, `--concurrency C` rollouts in flight, `--timeout-s` per rollout).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.core.types import GenerateRequest, GenerateResult, RolloutRequest, Sample  # noqa: E402
from workers.acr.client import AcrClientConfig, AsyncAcrClient  # noqa: E402
from workers.embedded.faults import FaultRates  # noqa: E402
from workers.acr.limits import AcrLimitsConfig, limit_clients, limit_stats, local_limits  # noqa: E402
from workers.embedded.local_stack import LocalStack  # noqa: E402
from workers.rollout.worker import RolloutSettings, RolloutWorker  # noqa: E402
from workers.rollout.results import ResultBoard, ResultServer  # noqa: E402

STUB_AGENT = [sys.executable, "-m", "workers.embedded.stub_agent"]
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
    sink = TimedSink()
    worker = RolloutWorker(settings, gateway, acr, sink, slots=clients.sessions, results=board, result_url=result_url)
    reqs = [RolloutRequest(group_id=i // 4, input_id=f"row-{i // 4}", sample_index=i % 4, row={"prompt": "p"})
            for i in range(args.rollouts)]
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

    procs = cpu_processes(stack)
    cpu0 = {name: cpu_s(p) for name, p in procs.items()}
    try:
        t0 = time.monotonic()
        await asyncio.gather(*(one(i) for i in range(len(reqs))))
        wall_s = time.monotonic() - t0
        cpu = {name: round(cpu_s(p) - cpu0[name], 2) for name, p in procs.items()}
        await clients.sessions.drain()
        rate_st, cap_st = await limit_stats(handles)
        emu = await asyncio.to_thread(stack.stats)
    finally:
        await server.stop()
        await acr.close()
        await gateway.stop()
    done = [o for o in outcomes if o is not None]
    stored = Counter(s.session_id for s in sink.samples)
    lat_ms = [o.result_to_stored_s * 1e3 for o in done if o.result_to_stored_s is not None]
    statuses = Counter(o.status for o in done)
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
        "load_avg_start_end": [args.load_start, list(os.getloadavg())],
        "cpu_s_during_run": cpu,  # where the CPU went: this process (client), emulator, agents, moto
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
