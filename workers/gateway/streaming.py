"""Server-sent events (SSE) answers for streamed requests.

The engine seam is token-in/token-out and returns a whole turn, so a streamed answer is written
after the turn is recorded, as one buffer holding every event (the SDKs parse it as a stream all
the same). OpenAI streams `data: {json}` lines ended by `data: [DONE]`; Anthropic streams
`event: NAME` + `data: {json}` pairs.

Invariant: a stream is only opened (status 200 sent) for a turn that is already recorded, so an
error can still be answered with its own status and error body.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import orjson
from aiohttp import web

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "Connection": "keep-alive"}


def openai_sse(chunks: Iterable[dict[str, Any]]) -> bytes:
    """`data: {chunk}\\n\\n` per chunk, then `data: [DONE]\\n\\n`."""
    return b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def anthropic_sse(events: Iterable[tuple[str, dict[str, Any]]]) -> bytes:
    """`event: NAME\\ndata: {json}\\n\\n` per event."""
    return b"".join(b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n" for name, data in events)


async def send_sse(request: web.Request, payload: bytes) -> web.StreamResponse:
    """Write a complete event stream and end the response."""
    resp = web.StreamResponse(status=200, headers=SSE_HEADERS)
    await resp.prepare(request)
    await resp.write(payload)
    await resp.write_eof()
    return resp
