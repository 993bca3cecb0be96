"""Trajectory capture: the gateway's record of every model turn of every open session.

Pure logic (no HTTP, no Ray, no clock): the HTTP routes feed it facts (a session opened, a turn
was generated, a session closed) and read back decisions (who a token belongs to, which row a turn
went to, the rows of a closed session).

Recording rule. A session holds rows; each row is a token sequence ``prompt + output + prompt
extension + output + ...``. A turn whose prompt ids start with ALL the tokens of an existing row
(that row's last prompt + last output, and everything before) is appended to that row: the new
prompt-extension tokens get loss mask 0 and version -1, the generated tokens loss mask 1, their
sampled log-prob and the policy version that produced each of them (`GenerateResult.versions()`:
a weight update that lands mid-turn gives one turn two versions) (CLEAN). A turn that extends no row
starts a new row (FORK; the very first turn is FIRST). When several rows are extended the longest
one wins (ties: the most recently touched), so an agent that interleaves an unrelated side call
with its main conversation (a summariser, a sub-agent) still yields one row per conversation.

Invariant (defended by ``record_turn`` and tests/test_gateway_capture.py): at every call boundary,
for every row, the concatenation of the turns' (prompt extension, output) pieces equals the row's
token ids; mask 1 marks exactly the engine-generated tokens, each with its own log-prob and
version; every recorded turn is in exactly one row. A closed session cannot be authenticated or
recorded into again.

Session tokens. ``open`` returns ``secrets.token_urlsafe(32)`` (256 random bits). The store keeps
only ``sha256(token)`` and looks sessions up by that digest in a dict. A dict lookup on the raw
token would compare the attacker's string with stored ones character by character on a hash
collision; on the digest, the attacker controls no prefix of what is compared (finding an input
whose digest shares a prefix with a stored one is a preimage problem), and the final check is
``hmac.compare_digest`` anyway, so the comparison is constant-time. Digests of closed sessions are
remembered (at most CLOSED_TOKENS_KEPT, oldest forgotten first) so that a late request with a
closed session's token is told "closed" (SessionClosed, HTTP 409) rather than "unknown" (401).

Turn cap. A session admits at most ``max_turns`` turns (``begin_turn`` counts each request sent to
the engine, whether or not it is recorded); the next one raises TurnLimitExceeded (HTTP 429).

Callers: workers/gateway/app.py (authenticate, record_turn), workers/gateway/server.py (open,
close for the rollout workers).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import secrets
from collections import OrderedDict
from dataclasses import dataclass

from workers.core.types import PROMPT_VERSION, GenerateResult, SessionCapture, TrajectoryRow

TOKEN_BYTES = 32  # session token entropy in bytes (256 bits); token_urlsafe gives 43 chars
CLOSED_TOKENS_KEPT = 1_000_000  # closed-session digests remembered for 409 answers (32 B each)
DEFAULT_MAX_TURNS = 256  # turns per session unless the opener says otherwise


class CaptureError(Exception):
    """Base class of capture-store errors."""


class Unauthorized(CaptureError):
    """The bearer token belongs to no open session (unknown, malformed or already closed)."""


class SessionNotFound(CaptureError):
    """A session id that was never opened, or was already closed."""


class SessionClosed(CaptureError):
    """The token belongs to a session that was closed (the rollout is over)."""


class TurnLimitExceeded(CaptureError):
    """The session already used its `max_turns` turns."""


class SessionExists(CaptureError):
    """``open`` was called twice with the same session id while the first is still open."""


class TurnKind(enum.Enum):
    """How a turn was recorded relative to the session's existing rows."""

    FIRST = "first"  # first turn of the session: starts row 0
    CLEAN = "clean"  # prompt extends an existing row exactly: appended to it
    FORK = "fork"  # prompt extends no row: starts a new row


@dataclass(frozen=True)
class SamplingDefaults:
    """Sampling parameters a session applies to its requests.

    max_tokens: generated-token cap when the request gives none (None: the remaining context).
    enforce: True makes temperature/top_p override what the agent asks for (on-policy sampling
        regardless of the agent's settings); False uses them only where the request is silent.
    seed: the session's base sampling seed (workers/core/seeds.py): turn t samples with
        `turn_seed(seed, t)`, over the agent's own seed when `enforce` (an agent sending one fixed
        seed would make a group's n samples identical); None: the agent's seed, else unseeded.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None
    enforce: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"sampling temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"sampling max_tokens must be >= 1, got {self.max_tokens}")


@dataclass(frozen=True)
class Session:
    """What an authenticated request learns about its session (read-only view)."""

    session_id: str
    max_context_tokens: int
    sampling: SamplingDefaults
    max_turns: int = DEFAULT_MAX_TURNS


@dataclass(frozen=True)
class TurnRecord:
    """One recorded turn: where it went and how many tokens it added.

    row_index: index of the row in the session's rows (creation order).
    num_prompt_ext: prompt tokens appended to the row before the output (whole prompt for FIRST/FORK).
    policy_version: version of the turn's last generated token (per-token versions are in the row).
    """

    session_id: str
    turn_index: int
    kind: TurnKind
    row_index: int
    num_prompt_ext: int
    num_output: int
    policy_version: int
    finish_reason: str
    ill_formed: bool = False  # the output opened a tool call the gateway could not parse


class _Row:
    """Mutable builder of one TrajectoryRow (private to the store)."""

    __slots__ = ("token_ids", "loss_mask", "logprobs", "versions", "last_turn")

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.last_turn = -1

    def extended_by(self, prompt_ids: tuple[int, ...]) -> bool:
        n = len(self.token_ids)
        return len(prompt_ids) >= n and list(prompt_ids[:n]) == self.token_ids

    def append(self, prompt_ext: tuple[int, ...], result: GenerateResult, turn_index: int) -> None:
        self.token_ids.extend(prompt_ext)
        self.loss_mask.extend([0] * len(prompt_ext))
        self.logprobs.extend([0.0] * len(prompt_ext))
        self.versions.extend([PROMPT_VERSION] * len(prompt_ext))
        self.token_ids.extend(result.output_ids)
        self.loss_mask.extend([1] * len(result.output_ids))
        self.logprobs.extend(result.logprobs)
        self.versions.extend(result.versions())  # per token: a weight update may land mid-turn
        self.last_turn = turn_index

    def freeze(self) -> TrajectoryRow:
        return TrajectoryRow(
            token_ids=tuple(self.token_ids),
            loss_mask=tuple(self.loss_mask),
            rollout_logprobs=tuple(self.logprobs),
            versions=tuple(self.versions),
        )


class _SessionState:
    __slots__ = ("view", "digest", "rows", "turns", "started", "memos", "engine_lost", "tree_only", "nonlinear",
                 "pins", "context_exceeded")

    def __init__(self, view: Session, digest: bytes) -> None:
        self.view = view
        self.digest = digest
        self.rows: list[_Row] = []
        self.turns: list[TurnRecord] = []
        self.started = 0  # turns admitted by begin_turn
        self.memos: list = []  # the turn runner's notes on this session (continuity.TurnMemo)
        self.engine_lost = False  # a turn found no replica to serve it (mark_engine_lost)
        self.tree_only = False  # linear history gave up on this session (gateway.on_nonlinear=passthrough)
        self.nonlinear = False  # a request was refused as non-linear (gateway.on_nonlinear=error)
        self.pins: dict[str, object] = {}  # values fixed for the session's life (pinned)
        self.context_exceeded = False  # the session ran out of context (mark_context_exceeded)


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


class CaptureStore:
    """Open sessions, their secret tokens and their recorded rows.

    Not thread-safe: one event loop owns it (the gateway's).
    """

    def __init__(self, *, default_max_context_tokens: int, default_sampling: SamplingDefaults | None = None) -> None:
        if default_max_context_tokens < 2:
            raise ValueError(f"default_max_context_tokens must be >= 2, got {default_max_context_tokens}")
        self._default_ctx = default_max_context_tokens
        self._default_sampling = default_sampling or SamplingDefaults()
        self._sessions: dict[str, _SessionState] = {}
        self._by_digest: dict[bytes, str] = {}
        self._closed: OrderedDict[bytes, None] = OrderedDict()  # digests of closed sessions' tokens

    # -- lifecycle -------------------------------------------------------------------------

    def open(
        self,
        session_id: str,
        *,
        max_context_tokens: int | None = None,
        sampling: SamplingDefaults | None = None,
        max_turns: int | None = None,
    ) -> str:
        """Open a session and return its secret bearer token.

        max_context_tokens: prompt + generated tokens allowed per request (None: store default).
        max_turns: turns the session may run (None: DEFAULT_MAX_TURNS).
        Raises SessionExists if `session_id` is open; ValueError on an empty id, a budget < 2 or
        max_turns < 1.
        """
        if not session_id:
            raise ValueError("session_id must be a non-empty string")
        if session_id in self._sessions:
            raise SessionExists(f"session {session_id!r} is already open")
        ctx = self._default_ctx if max_context_tokens is None else max_context_tokens
        if ctx < 2:
            raise ValueError(f"max_context_tokens must be >= 2, got {ctx}")
        turns = DEFAULT_MAX_TURNS if max_turns is None else max_turns
        if turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {turns}")
        token = secrets.token_urlsafe(TOKEN_BYTES)
        digest = _digest(token)
        view = Session(
            session_id=session_id, max_context_tokens=ctx, sampling=sampling or self._default_sampling, max_turns=turns
        )
        self._sessions[session_id] = _SessionState(view, digest)
        self._by_digest[digest] = session_id
        return token

    def authenticate(self, token: str | None) -> Session:
        """Return the open session that owns `token`.

        Raises Unauthorized for a missing or unknown token, SessionClosed for a closed session's.
        """
        if not token:
            raise Unauthorized("missing session token")
        digest = _digest(token)
        session_id = self._by_digest.get(digest)
        state = self._sessions.get(session_id) if session_id is not None else None
        if state is None or not hmac.compare_digest(state.digest, digest):
            if digest in self._closed:
                raise SessionClosed("the session of this token is closed")
            raise Unauthorized("unknown session token")
        return state.view

    def begin_turn(self, session_id: str) -> int:
        """Admit one more turn of an open session; return how many it has now admitted.

        Raises SessionNotFound if the session is not open, TurnLimitExceeded past max_turns.
        """
        state = self._sessions.get(session_id)
        if state is None:
            raise SessionNotFound(f"session {session_id!r} is not open")
        if state.started >= state.view.max_turns:
            raise TurnLimitExceeded(f"session used all of its {state.view.max_turns} turns")
        state.started += 1
        return state.started

    def mark_engine_lost(self, session_id: str) -> None:
        """Record that a turn of this session could not be served (its replica died and none was
        left): the session's capture says `engine_lost`. No-op for a session that is not open."""
        state = self._sessions.get(session_id)
        if state is not None:
            state.engine_lost = True

    def mark_nonlinear(self, session_id: str) -> None:
        """Record that a request of this session was refused as non-linear (on_nonlinear=error):
        its capture says `nonlinear`. No-op for a session that is not open."""
        state = self._sessions.get(session_id)
        if state is not None:
            state.nonlinear = True

    def mark_context_exceeded(self, session_id: str) -> None:
        """Record that the session ran out of context (a request refused 400 context_length_exceeded,
        or a generation cut at the context's end): its capture says `context_exceeded` and its rollout
        ends `truncated`. No-op for a session that is not open."""
        state = self._sessions.get(session_id)
        if state is not None:
            state.context_exceeded = True

    def close(self, session_id: str) -> SessionCapture:
        """Close the session, revoke its token and return its rows (creation order).

        Raises SessionNotFound if the session is not open.
        """
        state = self._sessions.pop(session_id, None)
        if state is None:
            raise SessionNotFound(f"session {session_id!r} is not open")
        del self._by_digest[state.digest]
        self._closed[state.digest] = None
        if len(self._closed) > CLOSED_TOKENS_KEPT:
            self._closed.popitem(last=False)
        return SessionCapture(
            session_id=session_id,
            rows=tuple(r.freeze() for r in state.rows),
            num_turns=len(state.turns),
            num_ill_formed_turns=sum(t.ill_formed for t in state.turns),
            engine_lost=state.engine_lost,
            nonlinear=state.nonlinear,
            context_exceeded=state.context_exceeded,
        )

    # -- recording -------------------------------------------------------------------------

    def record_turn(
        self,
        session_id: str,
        prompt_ids: tuple[int, ...] | list[int],
        result: GenerateResult,
        *,
        ill_formed: bool = False,
    ) -> TurnRecord:
        """Record one generated turn of an open session (see the module's recording rule).

        prompt_ids: [prompt_len] ids the engine was given; result: its answer; ill_formed: the
        answer opened a tool call that could not be parsed (kept on the TurnRecord and counted).
        Raises SessionNotFound if the session is not open (e.g. closed while the turn ran);
        ValueError if a generated token carries a negative policy version.
        """
        state = self._sessions.get(session_id)
        if state is None:
            raise SessionNotFound(f"session {session_id!r} is not open; turn not recorded")
        if result.output_ids and min(result.versions()) < 0:
            raise ValueError(f"generated tokens must carry a policy version >= 0, got {min(result.versions())}")
        prompt = tuple(prompt_ids)
        turn_index = len(state.turns)
        row_index = self._row_extended_by(state, prompt)
        if row_index is None:
            kind = TurnKind.FIRST if not state.rows else TurnKind.FORK
            state.rows.append(_Row())
            row_index = len(state.rows) - 1
        else:
            kind = TurnKind.CLEAN
        row = state.rows[row_index]
        prompt_ext = prompt[len(row.token_ids) :]
        row.append(prompt_ext, result, turn_index)
        record = TurnRecord(
            session_id=session_id,
            turn_index=turn_index,
            kind=kind,
            row_index=row_index,
            num_prompt_ext=len(prompt_ext),
            num_output=len(result.output_ids),
            policy_version=result.policy_version,
            finish_reason=result.finish_reason,
            ill_formed=ill_formed,
        )
        state.turns.append(record)
        return record

    # -- queries ---------------------------------------------------------------------------

    def turns(self, session_id: str) -> tuple[TurnRecord, ...]:
        """Turn records of an open session, in arrival order. Raises SessionNotFound."""
        state = self._sessions.get(session_id)
        if state is None:
            raise SessionNotFound(f"session {session_id!r} is not open")
        return tuple(state.turns)

    def memos(self, session_id: str) -> list:
        """The session's list of notes (owned by the caller's logic, dropped with the session:
        turns.py keeps continuity.TurnMemo entries here). Raises SessionNotFound."""
        state = self._sessions.get(session_id)
        if state is None:
            raise SessionNotFound(f"session {session_id!r} is not open")
        return state.memos

    def pinned(self, session_id: str, key: str, value: object) -> object:
        """The session's value under `key`: `value` on the first call, the first call's value on
        every later one (turns.py pins the conversation's date). Raises SessionNotFound."""
        state = self._sessions.get(session_id)
        if state is None:
            raise SessionNotFound(f"session {session_id!r} is not open")
        return state.pins.setdefault(key, value)

    def tree_only(self, session_id: str, *, set_it: bool = False) -> bool:
        """Whether linear history gave up on this session (then tree continuity serves it); with
        `set_it`, mark it so first. Raises SessionNotFound."""
        state = self._sessions.get(session_id)
        if state is None:
            raise SessionNotFound(f"session {session_id!r} is not open")
        state.tree_only = state.tree_only or set_it
        return state.tree_only

    def row_prefix(self, session_id: str, row_index: int, length: int) -> tuple[int, ...]:
        """The first `length` token ids of a row of an open session (rows only grow, so a prefix
        read later is the same tokens). Raises SessionNotFound, IndexError past the row's end."""
        state = self._sessions.get(session_id)
        if state is None:
            raise SessionNotFound(f"session {session_id!r} is not open")
        row = state.rows[row_index]
        if not 0 <= length <= len(row.token_ids):
            raise IndexError(f"row {row_index} has {len(row.token_ids)} tokens, asked for {length}")
        return tuple(row.token_ids[:length])

    def row_len(self, session_id: str, row_index: int) -> int:
        """Number of tokens of a row of an open session. Raises SessionNotFound, IndexError."""
        state = self._sessions.get(session_id)
        if state is None:
            raise SessionNotFound(f"session {session_id!r} is not open")
        return len(state.rows[row_index].token_ids)

    def extends_a_row(self, session_id: str, prompt_ids: tuple[int, ...]) -> bool:
        """Whether `prompt_ids` would be recorded CLEAN (it extends a row). Raises SessionNotFound."""
        state = self._sessions.get(session_id)
        if state is None:
            raise SessionNotFound(f"session {session_id!r} is not open")
        return self._row_extended_by(state, tuple(prompt_ids)) is not None

    def num_open(self) -> int:
        """Number of open sessions."""
        return len(self._sessions)

    def is_open(self, session_id: str) -> bool:
        return session_id in self._sessions

    @staticmethod
    def _row_extended_by(state: _SessionState, prompt: tuple[int, ...]) -> int | None:
        best: int | None = None
        for i, row in enumerate(state.rows):
            if not row.extended_by(prompt):
                continue
            if best is None:
                best = i
                continue
            cur = state.rows[best]
            if (len(row.token_ids), row.last_turn) > (len(cur.token_ids), cur.last_turn):
                best = i
        return best
