"""Pure logic of the ACR emulator: session routing and lifetimes, rate limits, peak measurements.

No I/O and no clock: every method takes `now_s` (monotonic seconds) from the caller.

Invariants (checked by tests/test_acr_emulator.py):
- open == created - stopped - expired at every call boundary; each open session maps to one
  agent for its whole life (sticky);
- a session is *created* by the first call that names it; a creation passes the open-session
  quota (ServiceQuotaExceededException) and the creation token bucket (ThrottlingException), and
  a refused creation creates nothing; calls on an open session are not creation-limited;
- a session expires when it has had no call in flight and no activity (a call, or a HealthyBusy
  ping of its agent) for `idle_timeout_s`, or `max_lifetime_s` after creation, whatever it is doing;
- `RateWindow.peak` is the largest number of calls ever seen inside any window of `window_s`
  ending at a recorded call (exact: every timestamp is kept until it leaves the window);
- a stopped session's container is gone: `was_stopped` names it (the last STOPPED_KEPT stops) so
  the command route refuses what its agent was still running instead of opening it again.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

DEFAULT_SESSION_IDLE_TIMEOUT_S = 900.0  # ACR's default idle session timeout (15 min)
DEFAULT_SESSION_MAX_LIFETIME_S = 28_800.0  # ACR's default maximum session lifetime (8 h)
STOPPED_KEPT = 65_536  # stopped session ids remembered (about 5 MiB at most)


class TokenBucket:
    """Token bucket: `rate_per_s` tokens per second, at most `burst` stored. Time is passed in.

    try_acquire(now_s) takes one token if one is available. Raises ValueError on a non-positive
    rate or burst, or when time goes backwards.
    """

    def __init__(self, rate_per_s: float, burst: float, now_s: float) -> None:
        if rate_per_s <= 0:
            raise ValueError(f"session_rate_per_s must be > 0, got {rate_per_s}")
        if burst < 1:
            raise ValueError(f"session_burst must be >= 1, got {burst}")
        self._rate = rate_per_s
        self._burst = float(burst)
        self._tokens = float(burst)
        self._last = now_s

    def try_acquire(self, now_s: float) -> bool:
        if now_s < self._last:
            raise ValueError(f"time went backwards: {now_s} < {self._last}")
        self._tokens = min(self._burst, self._tokens + (now_s - self._last) * self._rate)
        self._last = now_s
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False


class RateWindow:
    """Counts calls in a sliding window of `window_s` seconds and remembers the peak count."""

    def __init__(self, window_s: float = 1.0) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self._window_s = window_s
        self._times: deque[float] = deque()
        self.peak = 0
        self.total = 0

    def record(self, now_s: float) -> int:
        """Record one call at now_s; returns the number of calls in (now_s - window_s, now_s]."""
        self._times.append(now_s)
        self.total += 1
        while self._times[0] <= now_s - self._window_s:
            self._times.popleft()
        self.peak = max(self.peak, len(self._times))
        return len(self._times)


@dataclass(frozen=True)
class EmulatorStats:
    """Counters of one emulator; JSON at GET /_emulator/stats.

    invocations / commands / stops: InvokeAgentRuntime / InvokeAgentRuntimeCommand /
    StopRuntimeSession calls received (refused ones included); requests: all three together.
    peak_request_rate: most calls of any kind received within one sliding 1 s window.
    peak_open: most sessions open at once. throttled: creations refused by the token bucket or
    requests refused by the request-rate limit (injected throttle faults are in faults_injected).
    faults_injected: per fault kind, sessions that got it (emulator-side kinds: answers sent).
    sessions_expired_max_lifetime: the expired sessions that reached `max_lifetime_s` (the rest of
    `sessions_expired` went idle).
    """

    sessions_open: int
    sessions_created: int
    sessions_stopped: int
    sessions_expired: int
    peak_open: int
    throttled: int
    invocations: int
    open_per_agent: tuple[int, ...]
    agent_pids: tuple[int, ...]
    agent_ports: tuple[int, ...]  # each agent serves /ping and /invocations on 127.0.0.1:port
    commands: int = 0
    stops: int = 0
    requests: int = 0
    peak_request_rate: int = 0
    quota_refused: int = 0
    max_open_sessions: int | None = None
    faults_injected: dict[str, int] = field(default_factory=dict)
    sessions_expired_max_lifetime: int = 0

    @classmethod
    def from_json(cls, d: dict) -> "EmulatorStats":
        tuples = {k: tuple(d[k]) for k in ("open_per_agent", "agent_pids", "agent_ports")}
        return cls(**{**d, **tuples})


class SessionRefused(Exception):
    """A new session could not be created; `error` is the ACR exception name to answer with."""

    def __init__(self, error: str, message: str) -> None:
        super().__init__(message)
        self.error = error


@dataclass
class _Session:
    agent: int
    created_s: float
    last_active_s: float
    inflight: int = 0


class SessionTable:
    """Routes sessions to agents, counts them and ends them on idle timeout or max lifetime."""

    def __init__(
        self,
        num_agents: int,
        limiter: TokenBucket,
        *,
        idle_timeout_s: float = DEFAULT_SESSION_IDLE_TIMEOUT_S,
        max_lifetime_s: float = DEFAULT_SESSION_MAX_LIFETIME_S,
        max_open: int | None = None,
    ) -> None:
        if num_agents < 1:
            raise ValueError(f"num_agents must be >= 1, got {num_agents}")
        if idle_timeout_s <= 0 or max_lifetime_s <= 0:
            raise ValueError(f"idle_timeout_s and max_lifetime_s must be > 0, got {idle_timeout_s}, {max_lifetime_s}")
        if max_open is not None and max_open < 1:
            raise ValueError(f"max_open_sessions must be >= 1, got {max_open}")
        self._num_agents = num_agents
        self._limiter = limiter
        self._idle_timeout_s = idle_timeout_s
        self._max_lifetime_s = max_lifetime_s
        self.max_open = max_open
        self._sessions: dict[str, _Session] = {}
        self._dead: set[int] = set()
        self._stopped: OrderedDict[str, None] = OrderedDict()  # the most recent STOPPED_KEPT stopped ids
        self.created = self.stopped = self.expired = self.expired_max_lifetime = self.peak_open = 0
        self.throttled = self.quota_refused = 0

    def mark_dead(self, agent: int) -> bool:
        """Agent `agent` exited: route no new sessions to it. True the first time it is marked."""
        if agent in self._dead:
            return False
        self._dead.add(agent)
        return True

    def mark_alive(self, agent: int) -> None:
        """Agent `agent` was restarted (a fresh process at its index): route sessions to it again."""
        self._dead.discard(agent)

    def is_open(self, session_id: str) -> bool:
        return session_id in self._sessions

    def route(self, session_id: str, now_s: float) -> tuple[int, bool]:
        """Agent index for `session_id` and whether this call created the session.

        The call is in flight until `release(session_id, now_s)`; a session with a call in flight
        does not idle-expire. Raises SessionRefused("ThrottlingException") when the creation
        rate is exceeded, ("ServiceQuotaExceededException") at max_open,
        ("InternalServerException") when no agent is alive.
        """
        s = self._sessions.get(session_id)
        if s is not None:
            s.last_active_s = now_s
            s.inflight += 1
            return s.agent, False
        if self.max_open is not None and len(self._sessions) >= self.max_open:
            self.quota_refused += 1
            raise SessionRefused("ServiceQuotaExceededException", f"open sessions at quota {self.max_open}")
        alive = [a for a in range(self._num_agents) if a not in self._dead]
        if not alive:
            raise SessionRefused("InternalServerException", "no agent process is alive")
        if not self._limiter.try_acquire(now_s):
            self.throttled += 1
            raise SessionRefused("ThrottlingException", "Rate exceeded for session creation")
        load = self.open_per_agent()
        agent = min(alive, key=lambda a: (load[a], a))
        self._sessions[session_id] = _Session(agent=agent, created_s=now_s, last_active_s=now_s, inflight=1)
        self.created += 1
        self.peak_open = max(self.peak_open, len(self._sessions))
        return agent, True

    def release(self, session_id: str, now_s: float) -> None:
        """A call routed by `route` has ended (no-op when the session ended meanwhile)."""
        s = self._sessions.get(session_id)
        if s is not None:
            s.inflight = max(0, s.inflight - 1)
            s.last_active_s = now_s

    def keep_alive(self, agent: int, now_s: float) -> None:
        """Agent `agent` answered /ping HealthyBusy: its sessions are active now."""
        for s in self._sessions.values():
            if s.agent == agent:
                s.last_active_s = now_s

    def stop(self, session_id: str) -> bool:
        """Close a session; False when it is not open (never created, stopped or expired)."""
        if self._sessions.pop(session_id, None) is None:
            return False
        self.stopped += 1
        self._stopped[session_id] = None
        if len(self._stopped) > STOPPED_KEPT:
            self._stopped.popitem(last=False)
        return True

    def was_stopped(self, session_id: str) -> bool:
        """`session_id` was ended by StopRuntimeSession (among the last STOPPED_KEPT stops) and
        not opened again since."""
        return session_id in self._stopped and session_id not in self._sessions

    def expire(self, now_s: float) -> list[str]:
        """End idle and over-age sessions; returns their ids (callers release their resources)."""
        aged = {sid for sid, s in self._sessions.items() if now_s - s.created_s >= self._max_lifetime_s}
        gone = [
            sid
            for sid, s in self._sessions.items()
            if sid in aged or (s.inflight == 0 and now_s - s.last_active_s >= self._idle_timeout_s)
        ]
        for sid in gone:
            del self._sessions[sid]
        self.expired += len(gone)
        self.expired_max_lifetime += len(aged)
        return gone

    def open_per_agent(self) -> list[int]:
        load = [0] * self._num_agents
        for s in self._sessions.values():
            load[s.agent] += 1
        return load

    def agent_of(self, session_id: str) -> int | None:
        s = self._sessions.get(session_id)
        return None if s is None else s.agent

    def snapshot(self, agent_pids: tuple[int, ...] = (), agent_ports: tuple[int, ...] = ()) -> EmulatorStats:
        """Session counters now (call `expire` first to count due expiries); call counters are
        the server's, left 0 here."""
        return EmulatorStats(
            sessions_open=len(self._sessions),
            sessions_created=self.created,
            sessions_stopped=self.stopped,
            sessions_expired=self.expired,
            sessions_expired_max_lifetime=self.expired_max_lifetime,
            peak_open=self.peak_open,
            throttled=self.throttled,
            invocations=0,
            open_per_agent=tuple(self.open_per_agent()),
            agent_pids=agent_pids,
            agent_ports=agent_ports,
            quota_refused=self.quota_refused,
            max_open_sessions=self.max_open,
        )
