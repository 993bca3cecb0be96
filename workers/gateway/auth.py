"""Who is calling: the session token from a request's headers.

OpenAI clients send `Authorization: Bearer <token>`, Anthropic clients `x-api-key: <token>`; both
headers are accepted on every route (the rollout hands the agent one token as its `api_key`). The
token is checked by CaptureStore.authenticate (sha256 digest lookup, `hmac.compare_digest`), never
logged, and never echoed in an error message. A credential over `MAX_TOKEN_CHARS` is refused here,
before hashing, as malformed (not as missing: the caller did send one).
"""

from __future__ import annotations

from collections.abc import Mapping

from workers.gateway.capture import Unauthorized

MAX_TOKEN_CHARS = 512  # longer credentials are refused before hashing (no session token is this long)


def session_token(headers: Mapping[str, str]) -> str | None:
    """The bearer token, else the x-api-key value, else None (none sent). Raises Unauthorized for a
    value over MAX_TOKEN_CHARS characters (its length only is named, never the value)."""
    scheme, _, token = headers.get("Authorization", "").partition(" ")
    value = token.strip() if scheme.lower() == "bearer" else ""
    value = value or headers.get("x-api-key", "").strip()
    if len(value) > MAX_TOKEN_CHARS:
        raise Unauthorized(f"malformed session token: {len(value)} characters, longer than any session token "
                           f"(at most {MAX_TOKEN_CHARS})")
    return value or None
