"""Chat-template registry: which model family a chat template belongs to, recognised by content.

`identify(template_text)` reads markers that only one family's templates write (the tool-call
syntax, the turn delimiters, the reasoning block) and returns a `TemplateInfo`: the family, its
tool-call format (vLLM's `--tool-call-parser` name for it; "harmony" for gpt-oss), whether it
renders a reasoning block, the tokens that end an assistant turn besides eos, and those after
which the format rewrites the history.

Known families (checked against the real templates of Qwen, Llama and gpt-oss shipped in TRL
1.16.0 and the official tokenizers, tests/test_gateway_templates.py):
  qwen3_coder  Qwen3.5+/Qwen3-Coder: XML `<function=...><parameter=...>` calls, `<think>` block
  qwen3        Qwen3 (both revisions: the original and TRL's, which accepts non-string content),
               Qwen3-Instruct-2507 (no reasoning) and other ChatML templates with `<think>` and
               hermes JSON calls
  qwen2_5      Qwen2.5 (hermes JSON calls, the "You are Qwen" default system message)
  chatml       any other ChatML template with hermes `<tool_call>` (the tiny model's)
  llama3       Llama 3.1 / 3.2: JSON `{"name", "parameters"}` calls, tool results as `ipython`
  harmony      gpt-oss: channels, calls to `functions.*` ended by `<|call|>`, final answers by
               `<|return|>` (parsed from ids by openai-harmony: workers/gateway/harmony.py)
  unknown      anything else: plain chat works, requests offering tools are refused

Invariant: the order of the checks goes from the most specific marker to the least, so a
template is never taken for a family whose markers are a subset of its own. Pure (no tokenizer).
Callers: workers/gateway/chat_template.py, tool_parsers.detect_tool_format.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Family = Literal["qwen3_coder", "qwen3", "qwen2_5", "chatml", "llama3", "harmony", "unknown"]
FAMILIES: tuple[Family, ...] = ("qwen3_coder", "qwen3", "qwen2_5", "chatml", "llama3", "harmony", "unknown")


@dataclass(frozen=True)
class TemplateInfo:
    """What the gateway needs to know about a chat template.

    tool_format: "hermes" | "qwen3_coder" | "llama3_json" | "harmony", or None (tools cannot be parsed).
    reasoning: the template renders a reasoning block (`<think>`, harmony's analysis channel).
    stop_tokens: texts of tokens that end an assistant turn besides the tokenizer's eos.
    final_tokens: end tokens after which the format rewrites the history (harmony's `<|return|>`:
        the next prompt writes `<|end|>` there and drops the turn's analysis), so the next turn
        cannot extend the served tokens and starts a new row.
    """

    family: Family
    tool_format: str | None
    reasoning: bool = False
    stop_tokens: tuple[str, ...] = ()
    final_tokens: tuple[str, ...] = ()


def identify(template: str | None) -> TemplateInfo:
    """The family of `template` (see the module docstring); `unknown` for None or no marker."""
    t = template or ""
    if "<|channel|>" in t and "<|start|>" in t:
        return TemplateInfo("harmony", "harmony", reasoning=True, stop_tokens=("<|call|>", "<|return|>"),
                            final_tokens=("<|return|>",))
    if "<|start_header_id|>" in t and "<|eot_id|>" in t:
        tools = '"parameters"' in t or "ipython" in t
        return TemplateInfo("llama3", "llama3_json" if tools else None, stop_tokens=("<|eot_id|>", "<|eom_id|>"))
    chatml_stops = ()  # ChatML ends a turn with <|im_end|>, the tokenizer's eos
    if "<function=" in t and "<parameter=" in t:
        return TemplateInfo("qwen3_coder", "qwen3_coder", reasoning="<think>" in t, stop_tokens=chatml_stops)
    if "<tool_call>" in t:
        if "<think>" in t or "multi_step_tool" in t:  # Qwen3 (thinking) and Qwen3-Instruct-2507
            return TemplateInfo("qwen3", "hermes", reasoning="<think>" in t, stop_tokens=chatml_stops)
        if "You are Qwen, created by Alibaba Cloud" in t:
            return TemplateInfo("qwen2_5", "hermes", stop_tokens=chatml_stops)
        return TemplateInfo("chatml", "hermes", stop_tokens=chatml_stops)
    return TemplateInfo("unknown", None, reasoning="<think>" in t, stop_tokens=chatml_stops)
