"""Bounds on the driver's control calls to its parts: how long a call that waits on a remote part
(an inference replica, a trainer rank, the weight-sync group) may take before the run gives up on it.

Each bound is a module-level number in seconds, read at call time by the typed adapters
(`PartClient.call_within`, workers/core/calls.py), which raise `PartTimeout` naming the part, the
call and the bound when it passes. A call that passes its bound is a stalled part: the caller treats it
as an error (the run stops with that message, or the sync that made it fails naming the replica), never
as a wait. Why bounds at all: an engine pause that never returned hung a whole run with no message
(prime-rl PR #2673 added the same bounds). The numbers are generous upper limits for a healthy part at
the largest size the configs ship (a 14B model on H100s, a 70B one in the planner); raise one here
when a larger model legitimately needs longer. Pure: no Ray, no asyncio. Callers: workers/core/calls.py
(`PartClient`), workers/inference/client.py, workers/weight_sync/parts.py.
"""

from __future__ import annotations

# policy_version, engine_load, kv_cache_usage, ping, pid: status reads an async actor answers in
# milliseconds even while it generates; a minute means its event loop is blocked or its node is gone
STATUS_S = 60.0
# sleep / wake_up of a colocated engine (the pause and resume around a training step): offloading or
# reloading a 70B's bf16 weights (140 GB) and KV cache over PCIe at ~10 GB/s is well under 5 minutes
PAUSE_RESUME_S = 600.0
# a replica's readiness (`start`): model load from local disk and CUDA graph capture; a 70B from a
# network disk at ~200 MB/s is ~12 minutes
ENGINE_START_S = 1800.0
# one weight-sync RPC: a file export or load (`export_weights`, `update_weights`, `load_adapter`), the
# broadcast group's setup (`open_weight_group`, `join_weight_group`; the collectives inside have their
# own timeout_s) and one broadcast (`broadcast_weights`, `receive_weights`), the post-sync probe; a 70B
# file written and read at ~1 GB/s is ~5 minutes
WEIGHT_SYNC_S = 1200.0
