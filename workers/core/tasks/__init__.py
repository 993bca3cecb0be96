"""Task datasets: deterministic prompt rows that the rollout pool sends to agents.

A task module exposes `make_rows(num, seed) -> list[dict]`; every row is JSON-serialisable,
has a unique `input_id` and a `prompt`, plus whatever its agent's reward needs. Rows never use
the payload keys reserved by the rollout contract (`RESERVED_KEYS`).
"""

from __future__ import annotations

RESERVED_KEYS: frozenset[str] = frozenset({"_rollout", "_config", "_agentcore_runtime"})
