"""Which Ray cluster a run uses, and whether it answers before `ray.init` waits on it.

Invariant: a run joins a cluster only when told to (`cluster.address`, or `RAY_ADDRESS` under
`ray job submit`), and a cluster it is told to join that does not answer is a config error that
names the key within `RAY_PROBE_TIMEOUT_S`, never a silent hang. Pure apart from one TCP connect.
Callers: orchestrator/wiring/runtime.py (start_runtime), tests.
"""

from __future__ import annotations

import os

from orchestrator.config import ConfigError, RunConfig

RAY_PROBE_TIMEOUT_S = 5.0  # bound on reaching a joined cluster's GCS port before ray.init (seconds)


def ray_address(cfg: RunConfig) -> str:
    """The Ray cluster a run uses: `cluster.address`, else `RAY_ADDRESS` (set by `ray job submit`),
    else "local": a cluster of its own, even when another one runs on the machine (`ray start`
    leaves /tmp/ray/ray_current_cluster, which a plain `ray.init()` would join silently, without
    the local stack's endpoints)."""
    return cfg.cluster.address or os.environ.get("RAY_ADDRESS") or "local"


def ray_system_config(cfg: RunConfig) -> dict:
    """`ray.init(_system_config=...)` for a cluster the driver starts itself: the GCS keeps at most
    `cluster.task_events_max` task events (0: Ray's own default). Without the cap a long run's GCS
    grows by about 3 KB per actor call up to Ray's 100,000 (measured with scripts/soak.py)."""
    cap = cfg.cluster.task_events_max
    return {"task_events_max_num_task_in_gcs": cap} if cap else {}


def check_cluster_reachable(address: str, key: str, timeout_s: float = RAY_PROBE_TIMEOUT_S) -> None:
    """Raise ConfigError naming `key` when no Ray cluster answers at `address` ("auto", "host:port"
    or "ray://host:port") within `timeout_s`: ray.init would wait for minutes without a word."""
    import socket

    target = address.removeprefix("ray://")
    try:
        if target == "auto":
            from ray._private.services import canonicalize_bootstrap_address_or_die

            target = canonicalize_bootstrap_address_or_die("auto")
        host, _, port = target.rpartition(":")
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError) as exc:  # ConnectionError is an OSError
        raise ConfigError(f"{key}: no Ray cluster answers at {address!r} ({exc}); start it (`ray start --head`) "
                          f"or unset {key} to let the run start its own") from None
