"""Prompt rendering and answer decoding with the served model's Hugging Face tokenizer.

`ChatRenderer.render` applies the chat template (the tokenizer's, or an override file, as vLLM's
`--chat-template`) with the generation prompt and returns the exact ids the engine is given (and
the capture records); `decode` turns generated ids into the answer text, leaving out a trailing
stop token (the ids keep it). `info` is what the chat-template registry knows of the template
(template_registry.identify: family, tool-call format, extra turn-ending tokens, whether it can be
served); `tool_format` is the tool-call format the template teaches (or the configured parser).
For gpt-oss (harmony) the renderer also holds `harmony` (workers/gateway/harmony.py): the
template is repaired once (the tool-call header in the order the model samples) and messages
pass through `harmony.template_messages` before every render.

Date. Templates that write today's date (gpt-oss's "Current date:", Llama 3.x's "Today Date:")
call transformers' `strftime_now`; `pin_date` shadows it with a fixed time (a template variable
takes precedence over the environment's global), so a session renders the same system message on
every turn (turns.py pins the session's first turn) and never forks at midnight.

Speed. Rendering the text is cheap (the compiled template is cached by transformers); tokenizing
a long conversation is not (about 1 ms per 3 kB here). `SegmentEncoder` splits the text at added
tokens (`<|im_start|>`, `<|im_end|>`, ...) and caches each piece's ids, so a turn tokenizes only
the messages it adds. This is exact, not an approximation: a fast tokenizer extracts added tokens
before normalization and pre-tokenization and encodes the text between them independently, so
the concatenation of the pieces' ids equals the ids of the whole text. It is used only when that
holds (a fast tokenizer whose added tokens strip nothing and are not normalized); otherwise the
whole text is encoded (tests/test_gateway_fidelity.py compares both on random texts).

Invariant: render never adds special tokens beyond what the template writes (the template owns
BOS/EOS placement), so a prompt re-rendered from an earlier answer extends the earlier ids
whenever the template and tokenizer round-trip the text (the CLEAN case of capture.py).
"""

from __future__ import annotations

import datetime
import functools
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.gateway.harmony import HarmonyCodec, repair_template, template_messages
from workers.gateway.template_registry import TemplateInfo, identify
from workers.gateway.tool_parsers import TOOL_FORMATS, ToolFormat

SEGMENT_CACHE_ENTRIES = 32768  # cached text pieces (LRU); ~a few hundred conversations' messages
SEGMENT_CACHE_MAX_CHARS = 65536  # longer pieces are encoded every time (bounded memory)
# pieces at least this long are encoded through the Rust tokenizer's `encode_batch`, which releases
# the GIL while it works (its `encode` holds it: a 2 MB piece held every other thread ~7 s, measured
# 2026-12-06); shorter ones through `encode`, cheaper per call. Same ids either way. Characters.
GIL_FREE_ENCODE_CHARS = 4096
_RESERVED_KWARGS = frozenset({"add_generation_prompt", "tokenize", "return_dict", "tools", "conversation", "chat_template"})


class TemplateError(ValueError):
    """The chat template or tokenizer rejected the request (bad roles, unsupported stop, ...)."""


DATE_KWARG = "strftime_now"  # transformers' template global for the current time (see the module docstring)


@dataclass(frozen=True)
class PinnedClock:
    """`strftime_now(fmt)` for a template, fixed at `at`; str() is `at` in ISO form, so a
    continuity context key (continuity.context_key) built from the kwargs is stable."""

    at: datetime.datetime

    def __call__(self, fmt: str) -> str:
        return self.at.strftime(fmt)

    def __str__(self) -> str:
        return self.at.isoformat()


def pin_date(template_kwargs: dict[str, Any] | None, at: datetime.datetime) -> dict[str, Any]:
    """`template_kwargs` plus `strftime_now` fixed at `at` (the caller's own value, if any, wins)."""
    return {DATE_KWARG: PinnedClock(at), **(template_kwargs or {})}


class SegmentEncoder:
    """Text -> ids with a per-piece cache (see the module docstring for why it is exact)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        safe = self._backend is not None and all(
            not (t.lstrip or t.rstrip or t.single_word or t.normalized) for t in added.values()
        )
        self.segmented = bool(safe and added)
        self._added_ids = {t.content: int(i) for i, t in added.items()}
        contents = sorted(self._added_ids, key=len, reverse=True)  # longest first = leftmost-longest
        self._split = re.compile("(" + "|".join(re.escape(c) for c in contents) + ")") if contents else None
        self._cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._cache_lock = threading.Lock()  # the gateway encodes in a thread pool (turns.py)

    def _piece(self, text: str) -> tuple[int, ...]:
        with self._cache_lock:
            hit = self._cache.get(text)
            if hit is not None:
                self._cache.move_to_end(text)
                return hit
        if len(text) >= GIL_FREE_ENCODE_CHARS:
            ids = tuple(self._backend.encode_batch([text], add_special_tokens=False)[0].ids)
        else:
            ids = tuple(self._backend.encode(text, add_special_tokens=False).ids)
        if len(text) <= SEGMENT_CACHE_MAX_CHARS:
            with self._cache_lock:
                self._cache[text] = ids
                if len(self._cache) > SEGMENT_CACHE_ENTRIES:
                    self._cache.popitem(last=False)
        return ids

    def added_text(self, token_id: int) -> str | None:
        """The text of `token_id` when it is an added token (`<|im_end|>`, ...), else None."""
        if not hasattr(self, "_added_text"):
            self._added_text = {i: c for c, i in self._added_ids.items()}
        return self._added_text.get(int(token_id))

    def encode(self, text: str) -> tuple[int, ...]:
        """[n] ids of `text`, no special tokens added (equal to `tokenizer.encode(text, add_special_tokens=False)`)."""
        if not self.segmented:
            return tuple(self._tok.encode(text, add_special_tokens=False))
        out: list[int] = []
        for piece in self._split.split(text):
            if not piece:
                continue
            special = self._added_ids.get(piece)
            if special is not None:
                out.append(special)
            else:
                out.extend(self._piece(piece))
        return tuple(out)


@dataclass(frozen=True)
class StopSpec:
    """How a request's stop strings are enforced.

    ids: base stop ids plus the id of each single-token stop string (the engine stops on them);
    strings: the longer stop strings, cut after generation (`ChatRenderer.cut_at_stop_string`);
    string_of_id: (id, stop string) for the single-token ones (to report which one ended a turn).
    """

    ids: tuple[int, ...]
    strings: tuple[str, ...] = ()
    string_of_id: tuple[tuple[int, str], ...] = ()

    def string_for(self, token_id: int) -> str | None:
        return dict(self.string_of_id).get(token_id)


class ChatRenderer:
    """Chat template + tokenizer of the served model.

    base_stop_ids: ids that always end generation (eos plus configured extras).
    chat_template: override of the tokenizer's template (the text of a Jinja file), or None.
    tool_call_parser: "auto" (detect from the template), a format of tool_parsers, or "none".
    tool_format: the resulting format, None when tools cannot be parsed for this model.
    harmony: openai-harmony's codec for a gpt-oss template (parse ids, stop ids), else None.
    Raises ValueError when the tokenizer has no template and none is given, no stop id exists, or
    the parser does not fit the template (harmony either way); HarmonyVocabError for a harmony
    template over a tokenizer that is not gpt-oss's.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        extra_stop_token_ids: Sequence[int] = (),
        chat_template: str | None = None,
        tool_call_parser: str = "auto",
    ) -> None:
        self.template: str | None = chat_template or getattr(tokenizer, "chat_template", None)
        if not isinstance(self.template, str):
            raise ValueError(
                "tokenizer has no chat_template (or has several); give gateway.chat_template, a Jinja file"
            )
        self.tokenizer = tokenizer
        self.info: TemplateInfo = identify(self.template)
        self.harmony: HarmonyCodec | None = None
        if self.info.family == "harmony":
            self.template = repair_template(self.template)
            self.harmony = HarmonyCodec(tokenizer)
        ids = []
        if tokenizer.eos_token_id is not None:
            ids.append(int(tokenizer.eos_token_id))
        vocab_added = {t.content: int(i) for i, t in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items()}
        family_stops = [vocab_added[t] for t in self.info.stop_tokens if t in vocab_added]
        ids.extend(i for i in (*map(int, extra_stop_token_ids), *family_stops) if i not in ids)
        if not ids:
            raise ValueError("tokenizer has no eos token and no extra_stop_token_ids were given")
        self.base_stop_ids: tuple[int, ...] = tuple(ids)
        if tool_call_parser == "auto":
            self.tool_format: ToolFormat | None = self.info.tool_format  # type: ignore[assignment]
        elif tool_call_parser == "none":
            self.tool_format = None
        elif tool_call_parser in TOOL_FORMATS:
            self.tool_format = tool_call_parser  # type: ignore[assignment]
        else:
            raise ValueError(f"gateway.tool_call_parser must be 'auto', 'none' or one of {TOOL_FORMATS}, got {tool_call_parser!r}")
        if self.tool_format is not None and (self.tool_format == "harmony") != (self.harmony is not None):
            raise ValueError(f"gateway.tool_call_parser={self.tool_format} does not fit the chat template "
                             f"({self.info.family}): harmony is gpt-oss's format and gpt-oss writes no other")
        self.encoder = SegmentEncoder(tokenizer)
        # stop_spec(stop strings) -> StopSpec; raises TemplateError for an empty string
        self.stop_spec = functools.lru_cache(maxsize=1024)(self._stop_ids_for)
        self._token_text = functools.lru_cache(maxsize=65536)(self._one_token_text)

    @classmethod
    def from_pretrained(
        cls,
        model_path: str | Path,
        *,
        extra_stop_token_ids: Sequence[int] = (),
        chat_template_path: str | None = None,
        tool_call_parser: str = "auto",
    ) -> ChatRenderer:
        """Load the tokenizer from a local directory (no network access is attempted for a dir).

        chat_template_path: a Jinja file that replaces the tokenizer's template (None: keep it).
        """
        from transformers import AutoTokenizer  # heavy import, deferred to construction

        tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        template = Path(chat_template_path).read_text() if chat_template_path else None
        return cls(
            tokenizer, extra_stop_token_ids=extra_stop_token_ids, chat_template=template, tool_call_parser=tool_call_parser
        )

    def render_text(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        *,
        generation_prompt: bool = True,
    ) -> str:
        """The templated conversation plus (generation_prompt) the assistant generation prompt, as text.

        template_kwargs: extra variables for the template (e.g. enable_thinking for Qwen3;
        `pin_date(...)` fixes the date). Harmony: messages go through harmony.template_messages.
        Raises TemplateError when the template rejects the conversation.
        """
        if self.harmony is not None:
            messages = template_messages(messages)
        extra = dict(template_kwargs or {})
        if _RESERVED_KWARGS & extra.keys():
            raise TemplateError(f"chat_template_kwargs may not set {sorted(_RESERVED_KWARGS & extra.keys())}")
        try:
            text = self.tokenizer.apply_chat_template(
                list(messages),
                tools=list(tools) if tools else None,
                chat_template=self.template,
                add_generation_prompt=generation_prompt,
                tokenize=False,
                **extra,
            )
        except Exception as e:  # jinja TemplateError, TypeError from odd content, ...
            raise TemplateError(f"chat template rejected the messages: {e}") from e
        if not isinstance(text, str):
            raise TemplateError(f"chat template rendered {type(text).__name__}, not text")
        return text

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> tuple[int, ...]:
        """[prompt_len] ids of `render_text(...)`. Raises TemplateError (see render_text)."""
        return self.encoder.encode(self.render_text(messages, tools, template_kwargs))

    def _stop_ids_for(self, stop: tuple[str, ...]) -> StopSpec:
        if any(not s for s in stop):
            raise TemplateError("stop strings must be non-empty")
        ids = list(self.base_stop_ids)
        strings, by_id = [], {}
        for s in stop:
            enc = self.tokenizer.encode(s, add_special_tokens=False)
            if len(enc) == 1:
                by_id.setdefault(int(enc[0]), s)
                if enc[0] not in ids:
                    ids.append(int(enc[0]))
            else:
                strings.append(s)
        return StopSpec(ids=tuple(ids), strings=tuple(strings), string_of_id=tuple(by_id.items()))

    def cut_at_stop_string(self, output_ids: Sequence[int], stops: Sequence[str]) -> tuple[int, str, str] | None:
        """Where the first stop string ends in the decoded output, as (n_tokens, text, stop string).

        n_tokens: the shortest prefix of `output_ids` whose text contains the stop string (the
        tokens the answer really used); text: the decoded output before the stop string (OpenAI
        leaves the stop sequence out). None when no stop string occurs.
        """
        if not stops or not output_ids:
            return None
        full = self.tokenizer.decode(list(output_ids), skip_special_tokens=False)
        hits = [(i, s) for s in stops if (i := full.find(s)) >= 0]
        if not hits:
            return None
        at, stop = min(hits)
        end = at + len(stop)
        lo, hi = 1, len(output_ids)  # smallest k with len(decode(ids[:k])) >= end (monotone in k)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self.tokenizer.decode(list(output_ids[:mid]), skip_special_tokens=False)) >= end:
                hi = mid
            else:
                lo = mid + 1
        return lo, full[:at], stop

    def decode(self, output_ids: Sequence[int], *, finish_reason: str, stop_ids: Sequence[int]) -> str:
        """Answer text of generated ids; a final stop token is left out when finish_reason is "stop"."""
        ids = list(output_ids)
        if finish_reason == "stop" and ids and ids[-1] in stop_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _one_token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def token_texts(self, output_ids: Sequence[int]) -> list[str]:
        """The text of each id on its own (for per-token log-probs; a split UTF-8 char shows as U+FFFD)."""
        return [self._token_text(int(i)) for i in output_ids]
