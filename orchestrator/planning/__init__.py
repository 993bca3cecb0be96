"""Planning before a cluster is rented or a run started.

Modules and packages:
  dry_run.py   `dry_run=true`: placement per node and GPU and memory per GPU, printed; nothing starts
  simulate.py  the planner (`python -m orchestrator.planning.simulate`, scripts/simulate.py): one
               configuration or a sweep on the simulator, the best as Hydra overrides
  sim/         the cluster simulator: the shipped loops on a virtual clock over simulated hardware
"""
