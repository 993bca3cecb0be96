"""Prompt rendering and answer decoding with the served model's Hugging Face tokenizer.

`ChatRenderer.render` applies the tokenizer's chat template with the generation prompt and
returns the exact ids the engine is given (and the capture records); `decode` turns generated ids
into the answer text, leaving out a trailing stop token (the ids keep it).

Invariant: render never adds special tokens beyond what the template writes (the template owns
BOS/EOS placement), so a prompt re-rendered from an earlier answer extends the earlier ids
whenever the template and tokenizer round-trip the text (the CLEAN case of capture.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


class TemplateError(ValueError):
    """The chat template or tokenizer rejected the request (bad roles, unsupported stop, ...)."""


class ChatRenderer:
    """Chat template + tokenizer of the served model.

    base_stop_ids: ids that always end generation (eos plus configured extras).
    """

    def __init__(self, tokenizer: Any, *, extra_stop_token_ids: Sequence[int] = ()) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("tokenizer has no chat_template; the gateway needs one to render prompts")
        self.tokenizer = tokenizer
        ids = []
        if tokenizer.eos_token_id is not None:
            ids.append(int(tokenizer.eos_token_id))
        ids.extend(int(i) for i in extra_stop_token_ids if int(i) not in ids)
        if not ids:
            raise ValueError("tokenizer has no eos token and no extra_stop_token_ids were given")
        self.base_stop_ids: tuple[int, ...] = tuple(ids)

    @classmethod
    def from_pretrained(cls, model_path: str | Path, *, extra_stop_token_ids: Sequence[int] = ()) -> ChatRenderer:
        """Load the tokenizer from a local directory (no network access is attempted for a dir)."""
        from transformers import AutoTokenizer  # heavy import, deferred to construction

        tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        return cls(tokenizer, extra_stop_token_ids=extra_stop_token_ids)

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> tuple[int, ...]:
        """[prompt_len] ids of the templated conversation plus the assistant generation prompt.

        template_kwargs: extra variables for the template (e.g. enable_thinking for Qwen3).
        Raises TemplateError when the template rejects the conversation.
        """
        reserved = {"add_generation_prompt", "tokenize", "return_dict", "tools", "conversation"}
        extra = dict(template_kwargs or {})
        if reserved & extra.keys():
            raise TemplateError(f"chat_template_kwargs may not set {sorted(reserved & extra.keys())}")
        try:
            out = self.tokenizer.apply_chat_template(
                list(messages),
                tools=list(tools) if tools else None,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
                **extra,
            )
        except Exception as e:  # jinja TemplateError, TypeError from odd content, ...
            raise TemplateError(f"chat template rejected the messages: {e}") from e
        if hasattr(out, "keys"):  # BatchEncoding on transformers versions that ignore return_dict
            out = out["input_ids"]
        if out and isinstance(out[0], list):
            out = out[0]
        return tuple(int(i) for i in out)

    def stop_ids_for(self, stop: Sequence[str]) -> tuple[int, ...]:
        """Base stop ids plus one id per stop string; each string must be exactly one token.

        Raises TemplateError for a stop string that is several tokens (the engine stops on ids).
        """
        ids = list(self.base_stop_ids)
        for s in stop:
            enc = self.tokenizer.encode(s, add_special_tokens=False)
            if len(enc) != 1:
                raise TemplateError(
                    f"stop string {s!r} is {len(enc)} tokens; this gateway only supports single-token stop strings"
                )
            if enc[0] not in ids:
                ids.append(int(enc[0]))
        return tuple(ids)

    def decode(self, output_ids: Sequence[int], *, finish_reason: str, stop_ids: Sequence[int]) -> str:
        """Answer text of generated ids; a final stop token is left out when finish_reason is "stop"."""
        ids = list(output_ids)
        if finish_reason == "stop" and ids and ids[-1] in stop_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False)
