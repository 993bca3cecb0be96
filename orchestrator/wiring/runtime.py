"""The runtime of a run, before any actor starts: the weights every part starts from, the local
stack (`rollout=local`: the ACR emulator and moto S3) and Ray, started here or joined.

`start_runtime` builds the embedded model only when `model.path` is unset and starts the local
stack only when `rollout=local` (workers/embedded is imported on those branches only), then starts
its own local Ray, or joins the cluster `cluster.address` (or `RAY_ADDRESS`, set by `ray job
submit`) names after checking that something answers there (orchestrator/control/ray_cluster.py:
a dead cluster is a config error, not a silent hang; a cluster merely running on the machine is
never joined unasked).

Invariant: everything started here is registered on the caller's ExitStack (processes by PID, Ray
by its shutdown) as soon as it starts, so an error or a signal midway stops what already runs.
Callers: orchestrator/main.py, orchestrator/evaluate.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.config import ConfigError, RunConfig
from orchestrator.config.rollout import acr_region, local_fault_rates
from orchestrator.control.checkpoint import Checkpoint
from orchestrator.control.preflight import Preflight, check_kv_cache
from orchestrator.control.lora_targets import check_lora_targets
from orchestrator.control.preflight_aws import forwarded_aws_env
from orchestrator.control.ray_cluster import check_cluster_reachable, ray_address, ray_system_config
from orchestrator.control.stopping import interrupt_from, mark
from orchestrator.tasks import TASKS
from orchestrator.watch.progress import phase

if TYPE_CHECKING:
    from workers.embedded.local_stack import LocalStack


@dataclass(frozen=True)
class Runtime:
    """What runs before any actor: the weights every part starts from, the local stack
    (`rollout=local`, else None) and where the run writes."""

    run_dir: Path
    model_path: str
    checkpoint: Checkpoint | None
    local: LocalStack | None  # rollout=local only
    attempt: int = 0  # trainer restarts so far in this process (orchestrator/control/trainer_restart.py)

    @property
    def limits_suffix(self) -> str:
        """The name suffix of this attempt's cluster-wide limit actors: a restarted attempt gets its own
        (a discarded attempt's actors die with their last handle, so `get_if_exists` could return one
        that Ray is still destroying)."""
        return f"-attempt{self.attempt}" if self.attempt else ""


BARE_PYTHON = ("python", "python3")  # an agent_cmd starting with one of these runs on the driver's interpreter


def agent_command(cfg: RunConfig) -> list[str]:
    """The agent process the local emulator runs: `rollout.acr.agent_cmd`, else the task's app. A bare
    `python` / `python3` as its program is the driver's own interpreter (`sys.executable`): the
    README's commands run with `.venv/bin/python` outside the activated environment, and the agent
    must see the same packages (a bare `python` found another one, or none)."""
    if cfg.rollout.acr.agent_cmd:
        argv = shlex.split(cfg.rollout.acr.agent_cmd)
        return [sys.executable, *argv[1:]] if argv and argv[0] in BARE_PYTHON else argv
    agent = TASKS[cfg.task.name].agent_for(cfg.rollout.contract)
    assert agent is not None, "config validation requires rollout.acr.agent_cmd for a task without an agent"
    return [sys.executable, str(agent)]


def start_runtime(cfg: RunConfig, pre: Preflight, stack: contextlib.ExitStack) -> Runtime:
    """Model weights, the local stack (stopped by `stack`) and Ray (shut down by `stack`). Joining a
    cluster, the driver's AWS configuration (every AWS_* variable) goes to the actors in the job's
    runtime_env; without any, they use their node's own credential chain (its instance role)."""
    from orchestrator.watch.console_log import link_ray_logs, ray_init_options

    if cfg.model.path:
        model_path = str(Path(cfg.model.path).resolve())
    else:
        from workers.embedded.models import embedded_model_built, ensure_embedded_model

        built = embedded_model_built(cfg.model.name)
        phase(f"model: the {cfg.model.name} model " + ("(cached)" if built else "(built on first use, under a minute; cached after)"))
        model_path = str(ensure_embedded_model(cfg.model.name))  # an embedded model, built once
    if pre.checkpoint is not None:  # trainer and inference replicas start from the checkpoint's weights
        model_path = str(pre.checkpoint.model_dir)
    check_kv_cache(cfg, model_path)  # before any engine: names inference.kv_cache_gib and the minimum
    check_lora_targets(cfg, model_path)  # a typo'd target module is a config error, not a dead trainer
    if cfg.rollout.name == "local":
        phase(f"starting the local ACR emulator, moto S3 and {cfg.rollout.acr.num_agents} agent process(es)")
    local = _start_local_stack(cfg, pre.run_dir, stack) if cfg.rollout.name == "local" else None
    phase("starting Ray")
    import ray

    os.environ.setdefault("TQ_LOGGING_LEVEL", "ERROR")  # TQ warns about thread counts on every op
    address = ray_address(cfg)
    joining = address != "local"
    if joining:
        check_cluster_reachable(address, "cluster.address" if cfg.cluster.address else "RAY_ADDRESS")
    stack.callback(mark, "ray shut down")
    stack.callback(ray.shutdown)  # before ray.init: an init interrupted midway still stops what it started
    try:
        ray.init(address=address, num_cpus=cfg.cluster.num_cpus, include_dashboard=False,
                 num_gpus=None if joining else cfg.cluster.num_gpus,  # logical GPUs of a cluster we start
                 runtime_env={"env_vars": forwarded_aws_env(os.environ)} if joining else None,
                 **({} if joining else {"_system_config": ray_system_config(cfg)}),
                 **ray_init_options(cfg.logger.console_level))  # actors' output: RUN_DIR/logs/ray unless loud
    except SystemExit as exc:  # ray.init's own SIGTERM handler (sys.exit(15)) is in place while it runs
        interrupt_from(exc)
    if local is not None:  # on the way out its servers stop while Ray shuts down (ACR sessions are stopped by then)
        stack.callback(local.terminate)
    link_ray_logs(pre.run_dir)
    # build_parts' slow imports (torch, transformers, TransferQueue: seconds) here, where a Ctrl-C stops them at once
    import orchestrator.adapters.clients, transfer_queue.controller, transformers  # noqa: F401, E401
    return Runtime(run_dir=pre.run_dir, model_path=model_path, checkpoint=pre.checkpoint, local=local)


def _start_local_stack(cfg: RunConfig, run_dir: Path, stack: contextlib.ExitStack) -> LocalStack:
    from workers.embedded.local_stack import LocalStack, LocalStackError

    acr = cfg.rollout.acr
    local = LocalStack(agent_command(cfg), num_agents=acr.num_agents, session_rate_per_s=acr.session_rate_per_s,
                       bucket=acr.s3_bucket, region=acr_region(acr), agent_runtime_arn=acr.agent_runtime_arn,
                       log_dir=run_dir / "logs", agent_env={k: str(v) for k, v in acr.agent_env.items()},
                       faults=local_fault_rates(acr), protocol="A2A" if cfg.rollout.contract == "a2a" else "HTTP")
    try:
        stack.enter_context(local)
    except LocalStackError as exc:
        why = agent_start_failure(str(exc), run_dir / "logs" / "emulator.log")
        if why is None:
            raise
        raise ConfigError(f"rollout.acr.agent_cmd {shlex.join(agent_command(cfg))!r}: {why}") from None
    started = {**local.pids(), **{f"agent-{i}": pid for i, pid in enumerate(local.stats().agent_pids)}}
    (run_dir / "pids.json").write_text(json.dumps(started, indent=2) + "\n")  # for audits/tests
    os.environ.update(local.env)  # boto3 everywhere (driver, Ray workers) reads these
    return local


AGENT_OUTPUT_LINES = 20  # of the agent's own output quoted when it does not start
MISSING_MODULE = re.compile(r"ModuleNotFoundError: No module named '([^']+)'")


def agent_start_failure(error: str, emulator_log: Path) -> str | None:
    """When the local emulator failed because an agent did not start: what happened and the agent's
    own output (the emulator's log before the emulator's traceback); None for any other failure."""
    text = emulator_log.read_text(errors="replace") if emulator_log.is_file() else ""
    last = next((ln for ln in reversed(text.splitlines()) if ln.startswith("RuntimeError: agent ")), None)
    if last is None or "agent " not in error + text:
        return None
    before = text.rsplit("Traceback (most recent call last):", 1)[0].splitlines()
    ends = [i for i, ln in enumerate(before) if ln.startswith("RuntimeError: ")]  # an earlier run's traceback
    own = [ln for ln in before[ends[-1] + 1 if ends else 0:] if ln.strip()][-AGENT_OUTPUT_LINES:]
    shown = "\n".join(f"  | {ln}" for ln in own) if own else "  (it printed nothing)"
    missing = next((m.group(1) for ln in own if (m := MISSING_MODULE.search(ln))), None)
    hint = (f"\nthe agent's Python has no module {missing!r}: install it where the agent runs (the example "
            f"agents need `pip install -e .` of this repository, which `make run` does)") if missing else ""
    return (f"the agent did not start ({last.removeprefix('RuntimeError: ')}); its output:\n{shown}\n"
            f"(full log: {emulator_log}){hint}")
