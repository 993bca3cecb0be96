"""Fast completion: agents POST their result to the rollout worker that waits for it.

Each rollout actor serves `POST /results/{session_id}` (bearer: the session's secret token,
the same `api_key` the agent uses for the gateway) and passes `{base}/{session_id}` to the agent
as `_rollout.result_url` (S3 contract) or `_config.result_url` (HTTP contract). The body is the
result JSON exactly as written to S3. The worker waiting on that session is woken at once, so a
finished rollout does not wait for the next S3 poll; S3 stays the durable record and the
fallback (`wait_for_result`, bounded backoff) for agents that do not post.

Invariant: a result is delivered to the waiting worker at most once per session; a post for a
session nobody waits on (unknown, finished) answers 404, a wrong token 401 (constant-time
compare), and neither wakes anyone.

Callers: `workers.rollout.actor.RolloutActor` (one server per actor), tests and the bench.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from dataclasses import dataclass
from typing import Literal

from aiohttp import web

MAX_RESULT_BYTES = 10 * 2**20  # a result is a small JSON object; refuse anything bigger
PostVerdict = Literal["ok", "unknown", "unauthorized", "duplicate"]


@dataclass(frozen=True)
class PostedResult:
    """A result body as it arrived, with the arrival time (time.monotonic seconds)."""

    body: bytes
    arrived_s: float


class ResultBoard:
    """Sessions waiting for a posted result. One event loop owns it."""

    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._waiting: dict[str, tuple[str, asyncio.Future]] = {}
        self.posted = self.rejected = 0

    def expect(self, session_id: str, token: str) -> None:
        """Accept one result for `session_id` from a poster holding `token`."""
        if session_id in self._waiting:
            raise ValueError(f"session {session_id} is already expecting a result")
        self._waiting[session_id] = (token, asyncio.get_running_loop().create_future())

    def post(self, session_id: str, token: str | None, body: bytes) -> PostVerdict:
        entry = self._waiting.get(session_id)
        if entry is None:
            self.rejected += 1
            return "unknown"
        expected, fut = entry
        if token is None or not hmac.compare_digest(expected.encode(), token.encode()):
            self.rejected += 1
            return "unauthorized"
        if fut.done():
            return "duplicate"
        fut.set_result(PostedResult(body, self._clock()))
        self.posted += 1
        return "ok"

    async def wait(self, session_id: str) -> PostedResult:
        """The posted result of `session_id` (waits; KeyError if it is not expected)."""
        return await asyncio.shield(self._waiting[session_id][1])

    def future(self, session_id: str) -> asyncio.Future:
        """The future `post` resolves for `session_id` (KeyError if it is not expected). Await it
        shielded, or only through asyncio.wait: cancelling it would drop the result."""
        return self._waiting[session_id][1]

    def forget(self, session_id: str) -> None:
        entry = self._waiting.pop(session_id, None)
        if entry is not None and not entry[1].done():
            entry[1].cancel()

    def num_waiting(self) -> int:
        return len(self._waiting)


def _bearer(request: web.Request) -> str | None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


_STATUS = {"ok": 200, "duplicate": 200, "unknown": 404, "unauthorized": 401}


def result_routes(board: ResultBoard) -> list[web.RouteDef]:
    """`POST /results/{session_id}`: hand the body to the waiting worker (see module docstring)."""

    async def post_result(request: web.Request) -> web.Response:
        body = await request.read()
        verdict = board.post(request.match_info["session_id"], _bearer(request), body)
        return web.json_response({"result": verdict}, status=_STATUS[verdict])

    return [web.post("/results/{session_id}", post_result)]


class ResultServer:
    """An aiohttp listener for `result_routes` on `host:port` (0: a free port)."""

    def __init__(self, board: ResultBoard, host: str = "127.0.0.1", port: int = 0) -> None:
        self.board = board
        self._host, self._port = host, port
        self._runner: web.AppRunner | None = None
        self.base_url: str | None = None

    async def start(self) -> str:
        """Listen; return the base URL (`http://HOST:PORT/results`). Idempotent."""
        if self.base_url is not None:
            return self.base_url
        app = web.Application(client_max_size=MAX_RESULT_BYTES)
        app.add_routes(result_routes(self.board))
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self._host, self._port).start()
        host, port = self._runner.addresses[0][:2]
        self.base_url = f"http://{host}:{port}/results"
        return self.base_url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        self._runner = None
        self.base_url = None
