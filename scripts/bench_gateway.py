"""Benchmark of the rollout gateway's own overhead, with a zero-cost engine.

    python scripts/bench_gateway.py [--turns 2000] [--concurrency 32] [--out FILE.json]

Setup. A child process serves two aiohttp apps on 127.0.0.1: the real gateway (create_app with
the tiny model's tokenizer and chat template) and a "direct" endpoint that parses the same JSON
body and awaits the same engine without rendering, tokenizing, parsing or recording. The engine
is workers.embedded.sim_engine.ScriptedEngine (answers at once), so every millisecond measured is
HTTP + gateway work. The parent process is the load generator (aiohttp client, keep-alive): agents
run multi-turn conversations with a tool offered; the scripted model alternates a calculator tool
call and a text answer, and the agent sends back the assistant message and a tool result, as an
agent does. With --pin the server runs on CPU 0 and the client on CPU 1.

Figures (goals from issue 5: added p50 <= 1 ms, p99 <= 5 ms, >= 2000 turns/s on 2 cores):
  latency_ms.gateway / .direct   client round trip per turn, one turn in flight (p50, p99)
  latency_ms.added               gateway minus direct, per percentile: the gateway's own cost
  server_ms                      time inside the gateway's handler per turn (p50, p99)
  throughput_turns_per_s         turns completed per second with --concurrency agents in flight
  server_cpu_ms_per_turn         CPU time of the gateway process per gateway turn (HTTP included),
                                 measured with process_time: it does not depend on how busy the
                                 machine is, and 1000 / it is the turns/s one free core sustains
On a shared machine the wall-clock figures depend on the load (`config.loadavg_*`).

    python scripts/bench_gateway.py --huge-prompt [--huge-mb 2] [--small-agents 4] [--phase-s 20]

One agent's huge prompt against everyone else (issue 47): --small-agents agents run the tool
conversations above for --phase-s seconds alone, then for --phase-s seconds while one more session
keeps sending --huge-mb MiB prompts (varied words; each is rendered and tokenized, then answered 400
context_length_exceeded: far past the 8192-token context). Figures:
  small_latency_ms.alone / .beside_huge_prompts   small sessions' round trip per turn (p50, p90, p99)
  huge_prompt.latency_s                           the huge requests' own round trip
While the gateway rendered on its event loop, every small turn waited for each huge render.

    python scripts/bench_gateway.py --render-cost [--contexts 2048,8192,32768] [--out FILE.json]

Rendering cost with the real Qwen3 tokenizer and chat template (workers/embedded/real_tokenizers.py;
run `python -m workers.embedded.real_tokenizers` once): in process, no HTTP. One agent runs a
tool loop (thinking answer + hermes call, then a ~200-token tool result) until the context passes
the largest size; every turn goes through the gateway's TurnRunner (render, encode, parse,
record) with the zero-cost engine, once with token continuity and once without. Figures per
context size (the turns whose prompt is within 10% of it):
  turn_ms        TurnRunner.run per turn (p50): the gateway's whole per-turn work but HTTP
  render_ms      ChatRenderer.render of that prompt (template + tokenization, piece cache warm)
  render_cold_ms the same with an empty piece cache (a gateway seeing the conversation first)
  template_ms    the Jinja rendering alone (render_text)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SYSTEM = "You are a careful math assistant. Use the calculator tool for arithmetic. " * 3
CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
CALL_TEXT = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17*23"}}\n</tool_call>'
ANSWER_TEXT = "The result is 391."
TURNS_PER_SESSION = 8


def _percentiles(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    pick = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731
    return {"p50": round(pick(0.50), 4), "p90": round(pick(0.90), 4), "p99": round(pick(0.99), 4), "n": len(s)}


def serve(conn, num_sessions: int, pin: bool, use_uvloop: bool) -> None:
    """Child process: start both apps, send (urls, tokens), serve until told, send timings back."""
    if pin and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {0})
    if use_uvloop:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    from aiohttp import web

    from workers.core.types import GenerateRequest
    from workers.gateway.app import create_app
    from workers.gateway.capture import CaptureStore
    from workers.gateway.chat_template import ChatRenderer
    from workers.gateway.config import GatewayConfig
    from workers.gateway.router import ReplicaRouter
    from workers.embedded.sim_engine import ScriptedEngine
    from workers.embedded.tiny_model import ensure_tiny_model

    path = str(ensure_tiny_model())
    renderer = ChatRenderer.from_pretrained(path)
    tok = renderer.tokenizer
    ids = lambda t: (*tok.encode(t, add_special_tokens=False), tok.eos_token_id)  # noqa: E731
    engine = ScriptedEngine([ids(CALL_TEXT), ids(ANSWER_TEXT)], record=False)
    engine_serve = engine.generate

    async def alternate(req: GenerateRequest):  # call, answer, call, answer, ... per request
        engine.served %= 2
        return await engine_serve(req)

    engine.generate = alternate  # type: ignore[method-assign]
    cfg = GatewayConfig(model_path=path, served_model_name="tiny", max_context_tokens=8192)
    capture = CaptureStore(default_max_context_tokens=cfg.max_context_tokens)
    handler_s: list[float] = []

    @web.middleware
    async def timed(request, handler):
        t0 = time.perf_counter()
        try:
            return await handler(request)
        finally:
            handler_s.append(time.perf_counter() - t0)

    app = create_app(cfg, capture, ReplicaRouter([engine]), renderer=renderer)
    app.middlewares.insert(0, timed)

    async def direct(request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        res = await engine.generate(GenerateRequest(request_id="d", prompt_ids=(1, 2, 3), max_tokens=body.get("max_tokens") or 64))
        return web.Response(body=orjson.dumps({"output_ids": res.output_ids, "logprobs": res.logprobs}), content_type="application/json")

    direct_app = web.Application(client_max_size=cfg.max_body_bytes)
    direct_app.router.add_post("/direct", direct)

    async def main() -> None:
        runners = [web.AppRunner(a, access_log=None, handler_cancellation=True) for a in (app, direct_app)]
        urls = []
        for r in runners:
            await r.setup()
            site = web.TCPSite(r, "127.0.0.1", 0)
            await site.start()
            host, port = r.addresses[0][:2]
            urls.append(f"http://{host}:{port}")
        session_ids = [f"bench-session-{i:06d}-" + "0" * 24 for i in range(num_sessions)]
        tokens = [capture.open(sid, max_turns=10**6) for sid in session_ids]
        conn.send((urls, tokens))
        loop = asyncio.get_running_loop()
        profile = None
        while (msg := await loop.run_in_executor(None, conn.recv)) != "stop":
            if msg == "reset":  # start of the measured phases
                handler_s.clear()
                conn.send("ok")
            elif msg == "mark":  # start/end of the throughput phase: CPU time and turns so far
                if os.environ.get("BENCH_PROFILE"):
                    import cProfile

                    if profile is None:
                        profile = cProfile.Profile()
                        profile.enable()
                    else:
                        profile.disable()
                        profile.dump_stats(os.environ["BENCH_PROFILE"])
                conn.send((time.process_time(), len(handler_s)))
        conn.send({"handler_s": handler_s, "turns_recorded": sum(len(capture.turns(s)) for s in session_ids)})
        for r in runners:
            await r.cleanup()

    asyncio.run(main())


async def conversation(http, url: str, token: str, turns: int, latencies: list[float] | None) -> int:
    """One agent: `turns` model calls of a growing tool-using conversation. Returns turns done."""
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 17*23? Then add 9."}]
    for k in range(turns):
        body = orjson.dumps({"model": "tiny", "messages": messages, "tools": [CALC], "max_tokens": 64})
        t0 = time.perf_counter()
        async with http.post(url, data=body, headers=headers) as r:
            raw = await r.read()
        if latencies is not None:
            latencies.append(time.perf_counter() - t0)
        if r.status != 200:
            raise RuntimeError(f"turn {k}: HTTP {r.status}: {raw[:300]!r}")
        if url.endswith("/direct"):
            messages.append({"role": "user", "content": f"next {k}"})
            continue
        msg = orjson.loads(raw)["choices"][0]["message"]
        messages.append({k2: v for k2, v in msg.items() if v is not None})
        if msg.get("tool_calls"):
            messages.append({"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": "391"})
        else:
            messages.append({"role": "user", "content": f"Now add {k}."})
    return turns


async def run_client(urls: list[str], tokens: list[str], args, conn) -> dict:
    import aiohttp

    gw_url, direct_url = urls[0] + "/v1/chat/completions", urls[1] + "/direct"
    connector = aiohttp.TCPConnector(limit=args.concurrency * 2)
    async with aiohttp.ClientSession(connector=connector) as http:
        # warm-up: caches, connections
        await conversation(http, gw_url, tokens[0], TURNS_PER_SESSION, None)
        await conversation(http, direct_url, tokens[0], TURNS_PER_SESSION, None)
        n_lat = max(TURNS_PER_SESSION, args.latency_turns // TURNS_PER_SESSION * TURNS_PER_SESSION)
        conn.send("reset")
        conn.recv()
        gw_lat: list[float] = []
        direct_lat: list[float] = []
        for i in range(n_lat // TURNS_PER_SESSION):  # one turn in flight; alternate to share drift
            await conversation(http, gw_url, tokens[1 + i], TURNS_PER_SESSION, gw_lat)
            await conversation(http, direct_url, tokens[1 + i], TURNS_PER_SESSION, direct_lat)
        offset = 1 + n_lat // TURNS_PER_SESSION
        queue = list(range(offset, offset + args.turns // TURNS_PER_SESSION))

        async def agent() -> int:
            done = 0
            while queue:
                done += await conversation(http, gw_url, tokens[queue.pop()], TURNS_PER_SESSION, None)
            return done

        conn.send("mark")
        cpu0, turns0 = conn.recv()
        t0 = time.perf_counter()
        done = sum(await asyncio.gather(*(agent() for _ in range(args.concurrency))))
        wall = time.perf_counter() - t0
        conn.send("mark")
        cpu1, turns1 = conn.recv()
    g, d = _percentiles([x * 1e3 for x in gw_lat]), _percentiles([x * 1e3 for x in direct_lat])
    return {
        "latency_ms": {
            "gateway": g,
            "direct": d,
            "added": {q: round(g[q] - d[q], 4) for q in ("p50", "p90", "p99")},
        },
        "throughput_turns_per_s": round(done / wall, 1),
        "throughput_turns": done,
        "throughput_wall_s": round(wall, 3),
        "server_cpu_ms_per_turn": round((cpu1 - cpu0) * 1e3 / (turns1 - turns0), 4),
        "server_turns_per_s_per_free_core": round((turns1 - turns0) / (cpu1 - cpu0), 1),
    }


HUGE_SESSIONS = 4000  # sessions the server opens for --huge-prompt (small conversations use one each)


async def huge_prompt_client(urls: list[str], tokens: list[str], args) -> dict:
    """Small sessions' model-call latency alone, then while one more session keeps sending huge
    prompts (see the module docstring). Each phase runs `args.phase_s` seconds."""
    import random

    import aiohttp

    gw_url = urls[0] + "/v1/chat/completions"
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    unused = list(reversed(tokens[1:]))

    def huge_text() -> str:  # varied words (no BPE shortcut), new each time (no cache hit)
        words, size = [], 0
        while size < args.huge_mb * 2**20:
            w = "".join(rng.choice(letters) for _ in range(rng.randint(2, 9)))
            words.append(w)
            size += len(w) + 1
        return " ".join(words)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        await conversation(http, gw_url, tokens[0], TURNS_PER_SESSION, None)  # warm-up

        async def small_phase(latencies: list[float], deadline: float) -> None:
            async def agent() -> None:
                while time.perf_counter() < deadline and unused:
                    await conversation(http, gw_url, unused.pop(), TURNS_PER_SESSION, latencies)
            await asyncio.gather(*(agent() for _ in range(args.small_agents)))

        alone: list[float] = []
        await small_phase(alone, time.perf_counter() + args.phase_s)
        texts = [huge_text() for _ in range(2)]
        huge_s: list[float] = []
        huge_status: list[int] = []
        beside: list[float] = []
        deadline = time.perf_counter() + args.phase_s
        huge_token = unused.pop()

        async def huge_sender() -> None:
            i = 0
            while time.perf_counter() < deadline:
                body = orjson.dumps({"model": "tiny", "messages": [{"role": "user", "content": texts[i % 2]}],
                                     "max_tokens": 16})
                t0 = time.perf_counter()
                async with http.post(gw_url, data=body, headers={"Authorization": f"Bearer {huge_token}",
                                                                 "Content-Type": "application/json"}) as r:
                    await r.read()
                huge_s.append(time.perf_counter() - t0)
                huge_status.append(r.status)
                i += 1

        await asyncio.gather(huge_sender(), small_phase(beside, deadline))
    ms = lambda xs: _percentiles([x * 1e3 for x in xs])  # noqa: E731
    return {
        "small_latency_ms": {"alone": ms(alone), "beside_huge_prompts": ms(beside)},
        "huge_prompt": {"mb": args.huge_mb, "requests": len(huge_s), "status": sorted(set(huge_status)),
                        "latency_s": _percentiles(huge_s)},
        "small_agents": args.small_agents,
        "phase_s": args.phase_s,
    }


RENDER_WORDS = ("alpha beta gamma delta value result error file line test passed failed module "
                "function return import class self data index count total sum mean 0 1 2 3 4 5 6 7 8 9 "
                "the of and to in is for on with as by at from").split()


async def _render_cost_run(renderer, contexts: list[int], continuity: bool) -> dict:
    import random
    import statistics

    from workers.embedded.sim_engine import ScriptedEngine
    from workers.gateway.capture import CaptureStore
    from workers.gateway.chat_template import SegmentEncoder
    from workers.gateway.metrics import Counters
    from workers.gateway.openai_api import ChatRequest
    from workers.gateway.router import ReplicaRouter
    from workers.gateway.turns import TurnRunner

    tok = renderer.tokenizer
    call = "<think>\nI need the calculator.\n</think>\n\n" + CALL_TEXT
    engine = ScriptedEngine([(*tok.encode(call, add_special_tokens=False), tok.eos_token_id)], record=False)
    capture = CaptureStore(default_max_context_tokens=int(max(contexts) * 1.3))
    runner = TurnRunner(capture, ReplicaRouter([engine]), renderer, Counters(), continuity=continuity)
    session = capture.authenticate(capture.open("render-cost-" + "0" * 30, max_turns=10**6))
    rng = random.Random(0)
    messages: list[dict] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Check every file."}]
    turns: list[tuple[int, float, dict]] = []
    while not turns or turns[-1][0] < max(contexts) * 1.1:
        body = {"model": "qwen3", "messages": messages, "tools": [CALC]}
        req = ChatRequest.parse(body)
        t0 = time.perf_counter()
        out = await runner.run(session, req)
        turns.append((len(out.prompt_ids), time.perf_counter() - t0, body))
        tc = out.parsed.tool_calls[0]
        messages = [*messages, {"role": "assistant", "content": out.parsed.content or None, "tool_calls": [
            {"id": tc.id, "type": "function", "function": {"name": tc.name, "arguments": tc.arguments_json}}]},
            {"role": "tool", "tool_call_id": tc.id, "content": " ".join(rng.choice(RENDER_WORDS) for _ in range(150))}]
    figures = {}
    for n in contexts:
        near = [(p, dt, b) for p, dt, b in turns if abs(p - n) <= 0.1 * n]
        req = ChatRequest.parse(near[len(near) // 2][2])
        timed = lambda f: min(_time_once(f) for _ in range(5))  # noqa: E731
        cold = SegmentEncoder(tok)
        text = renderer.render_text(req.messages, req.tools)
        t0 = time.perf_counter()
        cold.encode(text)
        figures[str(n)] = {
            "turns": len(near),
            "prompt_tokens": near[len(near) // 2][0],
            "turn_ms": round(statistics.median(dt for _, dt, _ in near) * 1e3, 3),
            "render_ms": round(timed(lambda: renderer.render(req.messages, req.tools)) * 1e3, 3),
            "render_cold_ms": round((time.perf_counter() - t0) * 1e3, 3),
            "template_ms": round(timed(lambda: renderer.render_text(req.messages, req.tools)) * 1e3, 3),
        }
    kinds = [t.kind.value for t in capture.turns(session.session_id)]
    figures["clean_turns"] = f"{kinds.count('clean')}/{len(kinds) - 1}"
    return figures


def _time_once(f) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def render_cost(contexts: list[int]) -> dict:
    """Per-turn rendering figures with the real Qwen3 template (see the module docstring)."""
    from transformers import AutoTokenizer

    from workers.embedded.real_tokenizers import tokenizer_dir
    from workers.gateway.chat_template import ChatRenderer

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(str(tokenizer_dir("qwen3"))))
    out = {"template": f"qwen3 ({renderer.info.family})", "loadavg_at_start": [round(x, 2) for x in os.getloadavg()]}
    for continuity in (True, False):
        out["continuity" if continuity else "no_continuity"] = asyncio.run(_render_cost_run(renderer, contexts, continuity))
    out["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=4000, help="turns in the throughput phase")
    ap.add_argument("--latency-turns", type=int, default=800, help="turns per side in the latency phase")
    ap.add_argument("--concurrency", type=int, default=32, help="agents in flight in the throughput phase")
    ap.add_argument("--pin", action="store_true", help="server on CPU 0, client on CPU 1")
    ap.add_argument("--uvloop", action="store_true", help="serve on uvloop (the Ray actor runs on asyncio)")
    ap.add_argument("--out", type=Path, help="write the figures as JSON here")
    ap.add_argument("--render-cost", action="store_true", help="rendering cost with the real Qwen3 template instead")
    ap.add_argument("--contexts", default="2048,8192,32768", help="context sizes (tokens) for --render-cost")
    ap.add_argument("--huge-prompt", action="store_true",
                    help="small sessions' latency alone and beside one session sending huge prompts instead")
    ap.add_argument("--huge-mb", type=float, default=2.0, help="--huge-prompt: size of each huge prompt (MiB)")
    ap.add_argument("--small-agents", type=int, default=4, help="--huge-prompt: small agents in flight")
    ap.add_argument("--phase-s", type=float, default=20.0, help="--huge-prompt: seconds of each phase")
    args = ap.parse_args()
    if args.render_cost:
        text = json.dumps(render_cost([int(x) for x in args.contexts.split(",")]), indent=2)
        print(text)
        if args.out:
            args.out.write_text(text + "\n")
        return
    loadavg_start = [round(x, 2) for x in os.getloadavg()]
    num_sessions = 2 + args.latency_turns // TURNS_PER_SESSION + args.turns // TURNS_PER_SESSION
    if args.huge_prompt:
        num_sessions = HUGE_SESSIONS
    parent, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=serve, args=(child, num_sessions, args.pin, args.uvloop), daemon=True)
    proc.start()
    try:
        urls, tokens = parent.recv()
        if args.pin and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {1})
        if args.huge_prompt:
            parent.send("reset")
            parent.recv()
            result = asyncio.run(huge_prompt_client(urls, tokens, args))
        else:
            result = asyncio.run(run_client(urls, tokens, args, parent))
        parent.send("stop")
        server = parent.recv()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    result["server_ms"] = _percentiles([x * 1e3 for x in server["handler_s"]]) if server["handler_s"] else None
    result["turns_recorded"] = server["turns_recorded"]
    result["config"] = {
        "turns_per_session": TURNS_PER_SESSION,
        "concurrency": args.concurrency,
        "pin": args.pin,
        "event_loop": "uvloop" if args.uvloop else "asyncio",
        "loadavg_at_start": loadavg_start,
        "cpus": os.cpu_count(),
        "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
