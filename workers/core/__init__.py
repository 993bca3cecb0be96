"""The pure layer that driver and workers share: message types, RL algorithms, placement
planning, task definitions.

Rule: nothing here imports the rest of `workers` or anything of `orchestrator`, and nothing
imports Ray, vLLM or an HTTP library. `types`, `placement` and `tasks` import without torch;
`algorithms` is plain torch on tensors.

Modules and packages:
  types.py        the messages that cross the seams (requests, rows, samples, train orders)
  algorithms/     GRPO advantages, PPO loss, rollout correction, rejection, TrainBatch (torch)
  tasks/          task datasets and the one loader of dataset files
  placement.py    GPU placement plan: placement groups and the bundle of each actor
  memory_plan.py  memory estimate per GPU (or of one CPU machine) before anything starts
  calls.py        call a part alike as a Ray actor handle or a plain object (PartClient, invoke)
  netaddr.py      addresses agents call back on; reachability warnings
  passk.py        evaluation statistics: pass@k, mean with standard error, percentiles
  seeds.py        sampling seeds as a pure function of what a rollout is
  bounds.py       how long a driver's control call to a part may wait (PartTimeout past it)
"""
