"""One model turn, whatever API asked for it: render, budget, route, generate, parse, record.

`TurnRunner.run` is shared by the OpenAI and Anthropic routes. Steps, in order:
1. refuse tools when the model's template has no known tool-call format (400 `tools_unsupported`),
   never a silent no-op; pin the session's date (its first turn's time, chat_template.pin_date)
   so the system message of a template that writes the date renders the same on every turn;
2. render the conversation to ids (chat_template.py), on a render thread (RENDER_THREADS) so one
   session's huge prompt never holds the event loop, and clamp max_tokens to the session's
   remaining context: a prompt that leaves no room is 400 `context_length_exceeded` in the API's own
   words (OpenAI's "This model's maximum context length is ..."; Anthropic's "prompt is too long:
   N tokens > M maximum"), and the session is marked `context_exceeded`, as it is when a generation
   is cut at the context's end: its rollout ends `truncated` (workers/rollout/overflow.py). When the
   messages continue a recorded turn (continuity.py, `continuity=True`), the prompt is the
   recorded tokens plus the rendered new text. With `history_mode="linear"` (linear.py), a request
   whose messages extend the previous turn's is the previous row's served ids plus the rendered new
   messages; one that does not is handled per `on_nonlinear` (reset, 400 `nonlinear_history`, or
   tree continuity for the rest of the session);
3. admit the turn against the session's turn cap (capture.begin_turn: 429 past it);
4. send it to the replica the router picks; a replica whose generate raises (anything but
   cancellation or a ValueError about the request; e.g. its process died) is taken out of
   rotation and the turn is tried on the next healthy replica: nothing of this turn was recorded,
   so running it again is exact. When none is left the turn waits up to `replica_wait_s` for a
   replacement (the driver's supervisor brings one up with the current weights and version), then
   fails: 503 `engine_failed`, and the session is marked `engine_lost`, so its rollout fails with
   that reason whatever the agent reports (workers/rollout/worker.py). A cancelled handler (the
   client disconnected) cancels the engine call, which aborts the request in the engine;
5. parse tool calls in the template's format (a call it cannot read: raw text, turn ill_formed;
   tool_choice "required" or a named function that the output does not honour: ill_formed too,
   as the gateway cannot constrain decoding); gpt-oss's harmony output is parsed from the
   generated ids by openai-harmony (harmony.py: content, reasoning, calls), with or without tools.
   After a harmony final answer (`<|return|>`, TemplateInfo.final_tokens) the format rewrites the
   history (analysis dropped, `<|end|>` written), so the next turn starts a new row in either
   history mode; inside a tool-call chain the history is kept and the session stays one row;
6. record the turn in the capture store (exact served ids; see capture.py) and remember it for
   continuity (when it ended on an added stop token). A stop string of
   several tokens (the engine stops on single ids only) is applied after generation: the answer
   and the record both end with the token that completed it, and the text leaves it out.

Invariant: a TurnOutcome is returned only for a recorded turn; every other exit raises, and is
counted in the app's metrics.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import datetime
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from workers.core.seeds import turn_seed
from workers.core.types import GenerateRequest, GenerateResult
from workers.gateway.capture import CaptureStore, Session, SessionNotFound, TurnKind, TurnRecord
from workers.gateway.chat_template import ChatRenderer, TemplateError, pin_date
from workers.gateway.continuity import TurnMemo, context_key, digest, find_continuation, message_key, remember
from workers.gateway.linear import closer, healed_text
from workers.gateway.metrics import Counters
from workers.gateway.openai_api import ApiError, ChatRequest, bad_request
from workers.gateway.router import ReplicaRouter

# threads that render and tokenize prompts off the event loop: a huge prompt of one session (12 MB
# held every other session's turns for 27 s when rendered on the loop) now occupies one of these while
# the loop keeps serving the others; the Rust tokenizer releases the GIL on long pieces
# (chat_template.GIL_FREE_ENCODE_CHARS), so small prompts still render beside it on another thread
RENDER_THREADS = 4
from workers.gateway.tool_parsers import ParsedOutput, parse_tool_calls

REPLICA_POLL_S = 0.1  # how often a turn waiting for a replacement replica looks again (seconds)
_KIND_COUNTER = {TurnKind.FIRST: "turns_first", TurnKind.CLEAN: "turns_clean", TurnKind.FORK: "turns_fork"}
DATE_PIN = "conversation_date"  # capture.pinned key of the session's date


@dataclass(frozen=True)
class _Rendered:
    """A request's prompt ids and what continuity needs to remember the turn."""

    ids: tuple[int, ...]
    keys: tuple[bytes, ...]
    context: str
    text: str


@dataclass(frozen=True)
class TurnOutcome:
    """A served and recorded turn: what the API layers shape their answer from.

    prompt_ids: [prompt_len] ids sent to the engine; result: its answer; parsed: content + calls.
    """

    completion_id: str
    created_s: int
    prompt_ids: tuple[int, ...]
    result: GenerateResult
    parsed: ParsedOutput
    record: TurnRecord
    stop_sequence: str | None = None  # the multi-token stop string that ended the output, if any


def generate_request(
    req: ChatRequest, session: Session, prompt_ids: tuple[int, ...], stop_ids: tuple[int, ...], request_id: str
) -> GenerateRequest:
    """Engine request with sampling defaults applied and max_tokens clamped to the context budget
    (its seed is the agent's; `TurnRunner.run` sets the turn's own, see `request_seed`).

    Raises ApiError(400, code=context_length_exceeded) when the prompt leaves no room to generate.
    """
    remaining = session.max_context_tokens - len(prompt_ids)
    if remaining < 1:
        n, ctx = len(prompt_ids), session.max_context_tokens
        raise ApiError(400, f"This model's maximum context length is {ctx} tokens. However, your messages resulted "
                       f"in {n} tokens, leaving no room to generate. Please reduce the length of the messages.",
                       param="messages", code="context_length_exceeded",
                       anthropic_message=f"prompt is too long: {n} tokens > {ctx - 1} maximum")
    defaults = session.sampling
    wanted = req.max_tokens or defaults.max_tokens or remaining
    temperature = defaults.temperature if defaults.enforce or req.temperature is None else req.temperature
    top_p = defaults.top_p if defaults.enforce or req.top_p is None else req.top_p
    return GenerateRequest(
        request_id=request_id,
        prompt_ids=prompt_ids,
        max_tokens=min(wanted, remaining),
        temperature=temperature,
        top_p=top_p,
        stop_token_ids=stop_ids,
        seed=req.seed,
    )


def request_seed(req: ChatRequest, session: Session, turn: int) -> int | None:
    """The sampling seed of the session's `turn`-th turn: `turn_seed(session seed, turn)`
    (workers/core/seeds.py) when the session has a seed and enforces its sampling or the agent sent
    none; else the agent's seed (None: unseeded)."""
    s = session.sampling
    if s.seed is not None and (s.enforce or req.seed is None):
        return turn_seed(s.seed, turn)
    return req.seed


def truncate_result(result: GenerateResult, n_keep: int) -> GenerateResult:
    """The first `n_keep` generated tokens of `result`, finished "stop" (a stop string ended there).

    The engine stops on ids only; the tokens it generated after a multi-token stop string are
    dropped from the answer and from the record alike, so the row holds what the agent saw.
    """
    versions = result.versions()[:n_keep]
    return GenerateResult(
        output_ids=result.output_ids[:n_keep],
        logprobs=result.logprobs[:n_keep],
        finish_reason="stop",
        policy_version=versions[-1],
        token_versions=versions if result.token_versions else (),
    )


class TurnRunner:
    """Runs turns for the routes of one app (see the module docstring)."""

    def __init__(self, capture: CaptureStore, router: ReplicaRouter, renderer: ChatRenderer, counters: Counters,
                 *, continuity: bool = True, history_mode: str = "tree", on_nonlinear: str = "reset",
                 replica_wait_s: float = 0.0, now: Callable[[], datetime.datetime] = datetime.datetime.now) -> None:
        self.capture = capture
        self.router = router
        self.renderer = renderer
        self.counters = counters
        self.continuity = continuity
        self.linear = history_mode == "linear"
        self.on_nonlinear = on_nonlinear
        self.replica_wait_s = replica_wait_s  # wait this long for a replacement when no replica is healthy
        self.now = now  # local time, as transformers' strftime_now: the date a session pins
        self._render_pool = concurrent.futures.ThreadPoolExecutor(RENDER_THREADS, thread_name_prefix="gateway-render")

    async def _off_loop(self, fn: Callable, *args):
        """`fn(*args)` on a render thread (prompt rendering and tokenization: CPU seconds for a huge
        prompt), so the event loop keeps serving every other session meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._render_pool, fn, *args)

    async def count_prompt_ids(self, req: ChatRequest) -> tuple[int, ...]:
        """`prompt_ids(req)` off the event loop."""
        return await self._off_loop(self.prompt_ids, req)

    def pinned(self, session: Session, req: ChatRequest) -> ChatRequest:
        """`req` with the session's date pinned into its template arguments (its first turn's)."""
        at = self.capture.pinned(session.session_id, DATE_PIN, self.now())
        return dataclasses.replace(req, chat_template_kwargs=pin_date(req.chat_template_kwargs, at))

    def check_tools(self, req: ChatRequest) -> None:
        """Raise ApiError(400, tools_unsupported) when tools are offered but cannot be parsed."""
        if req.tools and self.renderer.tool_format is None:
            raise bad_request(
                "tools were given but this model's chat template has no known tool-call format; configure "
                "gateway.chat_template (a template with tools) and/or gateway.tool_call_parser",
                param="tools",
                code="tools_unsupported",
            )

    def prompt_ids(self, req: ChatRequest) -> tuple[int, ...]:
        """[prompt_len] rendered ids of the request. Raises TemplateError, ApiError."""
        self.check_tools(req)
        return self.renderer.render(req.messages, req.tools, req.chat_template_kwargs)

    def _render(self, session: Session, req: ChatRequest) -> _Rendered:
        """The turn's prompt: the plain render, a healed linear history, or a continuation of a
        recorded turn."""
        self.check_tools(req)
        r, sid = self.renderer, session.session_id
        text = r.render_text(req.messages, req.tools, req.chat_template_kwargs)
        linear = self.linear and not self.capture.tree_only(sid)
        if not (self.continuity or linear):
            return _Rendered(r.encoder.encode(text), (), "", text)
        keys = tuple(message_key(m) for m in req.messages)
        plain = _Rendered(r.encoder.encode(text), keys, context_key(req.tools, req.chat_template_kwargs), text)
        if linear:
            healed = self._render_linear(sid, req, plain)
            if healed is not None:
                return healed
        return self._render_tree(sid, req, plain) if self.continuity else plain

    def _render_linear(self, sid: str, req: ChatRequest, plain: _Rendered) -> _Rendered | None:
        """history_mode=linear: the healed prompt, `plain` (first turn, already extending the row,
        or on_nonlinear=reset), or None (on_nonlinear=passthrough: tree mode from now on).
        Raises ApiError(400, nonlinear_history) with on_nonlinear=error."""
        memos = self.capture.memos(sid)
        if not memos:
            return plain
        last = memos[-1]
        n = len(last.messages)
        if last.context == plain.context and n < len(plain.keys) and plain.keys[:n] == last.messages:
            if self.capture.extends_a_row(sid, plain.ids):  # the template kept the history as served
                return plain
            if last.end_text in self.renderer.info.final_tokens:  # harmony after a final answer: the
                return plain  # format drops its analysis and writes <|end|>: a new row, not a non-linear history
            text = self._healed_text(req, n, last.end_text, plain.text)
            if text is not None:
                prefix = self.capture.row_prefix(sid, last.row_index, last.row_len)
                self.counters.add("turns_healed")
                self.counters.add("healed_prefix_tokens", len(prefix))
                return dataclasses.replace(plain, ids=prefix + self.renderer.encoder.encode(text))
        self.counters.add("turns_nonlinear")
        if self.on_nonlinear == "error":
            self.capture.mark_nonlinear(sid)  # its rollout fails, whatever the agent does with the 400
            raise bad_request("gateway.history_mode=linear: the messages do not extend the previous turn's (an edited, "
                              "dropped or reordered message, or other tools) and gateway.on_nonlinear=error",
                              param="messages", code="nonlinear_history")
        if self.on_nonlinear == "passthrough":
            self.capture.tree_only(sid, set_it=True)
            return None
        return plain

    def _healed_text(self, req: ChatRequest, n: int, end_text: str | None, full_text: str) -> str | None:
        """linear.healed_text for a request whose first `n` messages are the previous turn's."""
        r, tools, kwargs = self.renderer, req.tools, req.chat_template_kwargs
        before = list(req.messages[: n - 1])
        try:
            prefix = r.render_text(req.messages[:n], tools, kwargs, generation_prompt=False)
            if r.harmony is not None:  # each harmony message closes with the token the model ended it with
                close = end_text or ""
            else:
                close = closer(lambda body: r.render_text([*before, {"role": "assistant", "content": body}], tools,
                                                          kwargs, generation_prompt=False))
        except TemplateError:
            return None
        return healed_text(full_text, prefix, close, end_text, req.messages[n:])

    def _render_tree(self, sid: str, req: ChatRequest, plain: _Rendered) -> _Rendered:
        """Tree continuity (continuity.py): `plain`, or the recorded tokens plus the new text."""
        r, ids, keys, context, text = self.renderer, plain.ids, plain.keys, plain.context, plain.text
        memos = self.capture.memos(sid)
        if not memos or self.capture.extends_a_row(sid, ids):  # CLEAN already: no second render
            return plain
        cont = find_continuation(
            memos, keys, context, text,
            lambda n: r.render_text(req.messages[:n], req.tools, req.chat_template_kwargs, generation_prompt=False),
            lambda answer: self._answer_key(req, answer),
        )
        if cont is None:
            return plain
        self.counters.add("turns_continued")
        ids = self.capture.row_prefix(sid, cont.row_index, cont.row_len) + r.encoder.encode(cont.text)
        return _Rendered(ids, keys, context, text)

    def _answer_key(self, req: ChatRequest, text: str) -> bytes:
        """message_key of the assistant message an answer written as `text` is returned as
        (harmony: the text's ids parsed as generated ids are)."""
        fmt, h = self.renderer.tool_format, self.renderer.harmony
        if h is not None:
            parsed = h.parse(self.renderer.encoder.encode(text), tools_offered=bool(req.tools), whole=True)
        else:
            parsed = parse_tool_calls(text, fmt, req.tools) if req.tools and fmt is not None else ParsedOutput(text)
        calls = [{"function": {"name": c.name, "arguments": c.arguments()}} for c in parsed.tool_calls]
        return message_key({"role": "assistant", "content": parsed.content, "tool_calls": calls,
                            "reasoning_content": parsed.reasoning})

    def _remember(self, sid: str, req: ChatRequest, rendered: _Rendered, text: str, result: GenerateResult,
                  stop_ids: tuple[int, ...], record: TurnRecord) -> None:
        """Note the turn for continuity when it ended on an added stop token (see continuity.py);
        in linear mode every answer (linear.py closes a cut one whole)."""
        if not rendered.keys or not result.output_ids or result.finish_reason not in ("stop", "length"):
            return
        end_text = self.renderer.encoder.added_text(result.output_ids[-1])
        if result.finish_reason != "stop" or result.output_ids[-1] not in stop_ids:
            end_text = None
        if end_text is None and not self.linear:
            return
        memo = TurnMemo(
            messages=(*rendered.keys, self._answer_key(req, text)), context=rendered.context,
            prompt_chars=len(rendered.text), prompt_digest=digest(rendered.text), row_index=record.row_index,
            row_len=self.capture.row_len(sid, record.row_index), end_text=end_text,
        )
        remember(self.capture.memos(sid), memo)

    async def run(self, session: Session, req: ChatRequest, *, id_prefix: str = "chatcmpl-") -> TurnOutcome:
        """Serve one turn (see the module docstring for the steps and the errors raised)."""
        req = self.pinned(session, req)
        rendered = await self._off_loop(self._render, session, req)  # reads this session's capture state only
        prompt_ids = rendered.ids
        stops = self.renderer.stop_spec(req.stop)
        stop_ids = stops.ids
        completion_id = id_prefix + uuid.uuid4().hex
        try:
            gen = generate_request(req, session, prompt_ids, stop_ids, completion_id)  # its 400s: before the turn counts
        except ApiError as e:
            if e.code == "context_length_exceeded":  # a result, not a crash: the rollout ends truncated
                self.capture.mark_context_exceeded(session.session_id)
                self.counters.add("turns_context_exceeded")
            raise
        turn = self.capture.begin_turn(session.session_id)
        gen = dataclasses.replace(gen, seed=request_seed(req, session, turn))
        result = await self._generate(session.session_id, gen)
        if result.finish_reason == "abort":
            self.counters.add("turns_aborted")
            raise ApiError(503, "the inference replica aborted the request (weights update?); retry", type="server_error")
        cut = self.renderer.cut_at_stop_string(result.output_ids, stops.strings)
        stop_sequence = None
        if cut is None:
            text = self.renderer.decode(result.output_ids, finish_reason=result.finish_reason, stop_ids=stop_ids)
            if result.finish_reason == "stop" and result.output_ids:
                stop_sequence = stops.string_for(result.output_ids[-1])
        else:
            n_keep, text, stop_sequence = cut
            result = truncate_result(result, n_keep)
        parsed = self._parse(req, text, result.output_ids)
        try:
            record = self.capture.record_turn(session.session_id, prompt_ids, result, ill_formed=parsed.ill_formed)
        except SessionNotFound:
            self.counters.add("turns_unrecorded_closed")
            raise
        self._remember(session.session_id, req, rendered, text, result, stop_ids, record)
        c = self.counters
        c.add("turns_served")
        c.add(_KIND_COUNTER[record.kind])
        c.add("prompt_tokens", len(prompt_ids))
        c.add("tokens_generated", len(result.output_ids))
        c.add("tool_calls", len(parsed.tool_calls))
        if parsed.ill_formed:
            c.add("turns_ill_formed")
        if result.finish_reason == "length":  # cut at max_tokens; at the context's end the session is out of room
            c.add("turns_length")
            if len(prompt_ids) + len(result.output_ids) >= session.max_context_tokens:
                self.capture.mark_context_exceeded(session.session_id)
                c.add("turns_context_exceeded")
        return TurnOutcome(completion_id, int(time.time()), prompt_ids, result, parsed, record, stop_sequence)

    def _parse(self, req: ChatRequest, text: str, output_ids: tuple[int, ...]) -> ParsedOutput:
        """The answer's content and calls: harmony from the ids (always: content is the final
        channel's text), other formats from the text when tools were offered."""
        fmt, h = self.renderer.tool_format, self.renderer.harmony
        offered = bool(req.tools) and req.tool_choice != "none"
        if h is not None:
            parsed = h.parse(output_ids, tools_offered=offered)
        elif not offered or fmt is None:
            return ParsedOutput(content=text)
        else:
            parsed = parse_tool_calls(text, fmt, req.tools)
        if parsed.ill_formed or req.tool_choice in ("auto", "none"):
            return parsed
        names = {c.name for c in parsed.tool_calls}
        honoured = bool(names) if req.tool_choice == "required" else names == {req.tool_choice}
        if honoured:
            return parsed
        return dataclasses.replace(parsed, content=parsed.content if h is not None else text, ill_formed=True)

    async def _generate(self, session_id: str, gen: GenerateRequest) -> GenerateResult:
        deadline = time.monotonic() + self.replica_wait_s
        last: Exception | None = None
        while True:
            if self.router.num_healthy() > 0 or self.router.num_replicas() == 0:  # none at all: NoReplicas
                try:
                    return await self._generate_once(session_id, gen)
                except _ReplicaFailed as e:  # taken out of rotation: try the next healthy one
                    last = e.cause
                    continue
            if time.monotonic() >= deadline:
                break
            await asyncio.sleep(REPLICA_POLL_S)  # a replacement comes through set_engines
        self.capture.mark_engine_lost(session_id)  # the agent gets a 503: its reward must not be trained
        self.counters.add("turns_engine_lost")
        raise ApiError(
            503, f"inference replica failed: {type(last).__name__}: {last}", type="server_error", code="engine_failed"
        )

    async def _generate_once(self, session_id: str, gen: GenerateRequest) -> GenerateResult:
        t0 = time.perf_counter()
        with self.router.lease(session_id) as engine:
            try:
                return await engine.generate(gen)
            except asyncio.CancelledError:
                self.counters.add("turns_cancelled")
                raise
            except ValueError as e:  # the engine refused this request; the replica is fine
                raise bad_request(f"the inference engine rejected the request: {e}") from e
            except Exception as e:  # noqa: BLE001 - a failed replica is data: take it out, go on
                self.counters.add("replica_failures")
                self.router.mark_failed(engine)
                raise _ReplicaFailed(e) from e
            finally:
                self.counters.add("engine_busy_s", time.perf_counter() - t0)


class _ReplicaFailed(Exception):
    """A replica's generate raised (it was taken out of rotation); `cause` is what it raised."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(str(cause))
        self.cause = cause
