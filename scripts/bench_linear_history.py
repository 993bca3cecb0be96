"""Rows and tokens per rollout with `gateway.history_mode` tree vs linear, on the real templates.

One rollout = one tool conversation of `--turns` answers (tool calls, then a final answer) through
the real gateway and the official OpenAI SDK, answered by a scripted engine that writes each call
either as the template renders it (canonical) or as compact JSON (what models often write). Per
template family it prints the rows the capture store recorded and the tokens those rows hold
(what the trainer gets: a prefix shared by several rows is counted in each), for both modes.

    python scripts/bench_linear_history.py            # after `make tokenizers`
    python scripts/bench_linear_history.py --turns 8 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.embedded.real_tokenizers import tokenizer_dir, trl_template  # noqa: E402
from workers.embedded.sim_engine import ScriptedEngine  # noqa: E402
from workers.gateway.chat_template import ChatRenderer  # noqa: E402
from workers.gateway.config import GatewayConfig  # noqa: E402
from workers.gateway.server import GatewayServer  # noqa: E402

SESSION = "bench-linear-session-" + "0" * 24
TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the repository.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
# (name, tokenizer, TRL template or None for the tokenizer's own, template kwargs, tool-call format)
FAMILIES = [
    ("qwen2_5", "qwen2_5", None, None, "hermes"),
    ("qwen3_think", "qwen3", None, None, "hermes"),
    ("qwen3_nothink", "qwen3", None, {"enable_thinking": False}, "hermes"),
    ("qwen3_5_xml", "qwen3", "qwen3_5_nothink", None, "qwen3_coder"),
    ("llama3_2", "llama3_2", None, None, "llama3_json"),
]


def call_text(fmt: str, path: str, style: str) -> str:
    args = {"path": path}
    sep = (",", ":") if style == "compact" else (", ", ": ")
    if fmt == "hermes":
        return "<tool_call>\n" + json.dumps({"name": "read_file", "arguments": args}, separators=sep) + "\n</tool_call>"
    if fmt == "llama3_json":
        return json.dumps({"name": "read_file", "parameters": args}, separators=sep)
    return f"<tool_call>\n<function=read_file>\n<parameter=path>\n{path}\n</parameter>\n</function>\n</tool_call>"


async def rollout(renderer: ChatRenderer, fmt: str, kwargs: dict | None, style: str, turns: int,
                  history_mode: str) -> dict:
    tok = renderer.tokenizer
    think = "<think>\nI read a file.\n</think>\n\n" if kwargs is None and fmt == "hermes" and "qwen3" in str(
        renderer.info.family) else ""
    answers = [think + call_text(fmt, f"src/mod_{i}.py", style) for i in range(turns - 1)] + [think + "Fixed."]
    outputs = [(*tok.encode(a, add_special_tokens=False), renderer.base_stop_ids[0]) for a in answers]
    cfg = GatewayConfig(model_path="unused", served_model_name="m", max_context_tokens=32768, history_mode=history_mode)
    server = GatewayServer(cfg, [ScriptedEngine(outputs)], renderer=renderer)
    await server.start()
    try:
        token = await server.open_session(SESSION)
        msgs: list = [{"role": "user", "content": "The tests fail. Find the bug in src/ and fix it."}]
        extra = {"chat_template_kwargs": kwargs} if kwargs else None
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key=token, max_retries=0) as c:
            for i in range(turns):
                r = await c.chat.completions.create(model="m", messages=msgs, tools=TOOLS, extra_body=extra)
                msg = r.choices[0].message
                msgs.append(msg)
                for tc in msg.tool_calls or ():
                    body = "\n".join(f"def f_{i}_{k}(x):\n    return x + {k}" for k in range(8))
                    msgs.append({"role": "tool", "tool_call_id": tc.id, "content": body})
        cap = await server.close_session(SESSION)
        m = server.metrics()
    finally:
        await server.stop()
    return {"rows": len(cap.rows), "tokens": sum(len(r.token_ids) for r in cap.rows),
            "generated": sum(r.num_generated for r in cap.rows), "healed": m.turns_healed, "forks": m.turns_fork}


async def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=6, help="answers per rollout (the last is the final text)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    results = []
    print(f"{'family':<14} {'style':<9} {'tree rows':>9} {'tokens':>7} {'linear rows':>11} {'tokens':>7} "
          f"{'rows':>6} {'tokens':>7}")
    for name, tok_name, template, kwargs, fmt in FAMILIES:
        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir(tok_name)))
        renderer = ChatRenderer(tok, chat_template=trl_template(template) if template else None)
        for style in ("canonical", "compact") if fmt != "qwen3_coder" else ("canonical",):
            tree = await rollout(renderer, fmt, kwargs, style, args.turns, "tree")
            lin = await rollout(renderer, fmt, kwargs, style, args.turns, "linear")
            assert tree["generated"] == lin["generated"]  # both modes record every generated token once
            results.append({"family": name, "style": style, "tree": tree, "linear": lin})
            print(f"{name:<14} {style:<9} {tree['rows']:>9} {tree['tokens']:>7} {lin['rows']:>11} {lin['tokens']:>7} "
                  f"{lin['rows'] / tree['rows'] - 1:>+6.0%} {lin['tokens'] / tree['tokens'] - 1:>+7.0%}")
    if args.json:
        args.json.write_text(json.dumps({"turns": args.turns, "results": results}, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
