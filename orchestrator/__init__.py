"""The driver: a control plane that composes a run, admits rollouts, orders updates and syncs weights.

Packages:
  config/    the Hydra config groups as typed dataclasses, validated where declared; the mapping onto
             each worker's own settings
  loop/      the sync and async loops and their pure controllers (ledger and batching, staleness and
             admission, concurrency, prompts, difficulty sampler, validation)
  watch/     what a person watches: metric sinks, the console's progress and warnings, library logs,
             CPU accounting, the run report
  control/   run control: stopping on signals, the reaper, pre-flight checks, the Ray cluster,
             supervision of replicas and servers, checkpoints and resume
  adapters/  the driver's typed clients of the actors (trainer, buffer, gateway, colocated engines)
  wiring/    wiring: the runtime (model, local stack, Ray), the shared actor starters, training's and
             evaluation's parts
  planning/  the dry-run plan and the cluster simulator (`sim/`) with its planner
Modules:
  main.py      `python -m orchestrator.main`: config -> pre-flight -> build -> loop -> outputs
  evaluate.py  `mode=eval`: evaluate a split, write eval.jsonl and eval_summary.json
  tasks.py     the task registry: `task.name` -> row loader, agent app, data-file check
  export.py    `python -m orchestrator.export`: a LoRA run's adapter, alone or merged into the base model

Imports run one way, down the floors of docs/architecture.md ("Import rules"), which
tests/test_layering.py reads and checks: main.py, evaluate.py, then wiring/ planning/ export.py,
control/ adapters/, config/, loop/, and watch/ tasks.py at the bottom.

Nothing in this package serves HTTP or holds model weights; heavy imports (Ray, vLLM, torch) happen
inside the functions that start actors, never at package import.
"""
