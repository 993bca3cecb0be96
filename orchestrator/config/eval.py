"""`eval` group: batch evaluation (`mode=eval`) and validation during training (`trainer.test_freq`);
maps to the evaluation rollout pool's RolloutSettings (`eval_rollout_settings`) and to the
driver's EvalSettings (orchestrator/loop/validation.py)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Optional

from orchestrator.config.errors import check

if TYPE_CHECKING:
    from orchestrator.loop.validation import EvalSettings
    from workers.rollout.settings import RolloutSettings


@dataclass
class EvalConfig:
    """How a split is evaluated. n: samples per prompt (pass@k is reported for every k <= n).
    temperature / top_p: sampling of evaluation rollouts. max_prompts: the first prompts of the
    split that are evaluated (null: every prompt). pass_threshold: a sample counts as correct for
    pass@k when its reward >= this. serve_model: false evaluates the agent with its own model (no
    gateway, no engine; the payload carries no base_url / api_key / model_id); mode=eval only.
    progress: "auto" (a bar on a terminal, plain lines otherwise) | "bar" | "lines" | "none".
    max_concurrent_rollouts: evaluation rollouts in flight at once, as whole prompts (null: one
    training step's, rollout.batch_size x rollout.n: the bound the ACR limits were sized for).
    adapter_path: a PEFT LoRA adapter directory (`python -m orchestrator.export RUN_DIR --adapter`)
    served on the base model (`model.path`) by every replica (mode=eval; null: the model alone)."""

    n: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    max_prompts: Optional[int] = None
    pass_threshold: float = 1.0
    serve_model: bool = True
    progress: str = "auto"
    max_concurrent_rollouts: Optional[int] = None
    adapter_path: Optional[str] = None

    def __post_init__(self) -> None:
        check(self.n >= 1, "eval.n", "must be >= 1", self.n)
        check(self.temperature > 0, "eval.temperature", "must be > 0", self.temperature)
        check(0 < self.top_p <= 1, "eval.top_p", "must be in (0, 1]", self.top_p)
        check(self.max_prompts is None or self.max_prompts >= 1, "eval.max_prompts", "must be null or >= 1",
              self.max_prompts)
        check(self.max_concurrent_rollouts is None or self.max_concurrent_rollouts >= self.n,
              "eval.max_concurrent_rollouts", f"must be null or >= eval.n={self.n} (one prompt's samples)",
              self.max_concurrent_rollouts)
        check(self.progress in ("auto", "bar", "lines", "none"), "eval.progress",
              "must be one of ['auto', 'bar', 'lines', 'none']", self.progress)


def eval_rollout_settings(e: EvalConfig, base: RolloutSettings) -> RolloutSettings:
    """The training rollouts' settings with the evaluation's sampling; without a served model
    (`eval.serve_model=false`) no gateway URL, so the payload names no model endpoint."""
    return replace(base, exp_id=f"{base.exp_id}-eval", temperature=e.temperature, top_p=e.top_p,
                   gateway_base_url=base.gateway_base_url if e.serve_model else "")


def eval_settings(e: EvalConfig, *, step_rollouts: int) -> EvalSettings:
    """The driver-side evaluation settings (orchestrator/loop/validation.py); `step_rollouts`: one
    training step's rollouts (rollout.batch_size x rollout.n), the in-flight bound when
    eval.max_concurrent_rollouts is null."""
    from orchestrator.loop.validation import EvalSettings

    cap = e.max_concurrent_rollouts if e.max_concurrent_rollouts is not None else max(step_rollouts, e.n)
    return EvalSettings(n=e.n, pass_threshold=e.pass_threshold, max_prompts=e.max_prompts, max_concurrent_rollouts=cap)
