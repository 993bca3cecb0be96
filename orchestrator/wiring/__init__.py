"""Wiring: from a validated, pre-flighted config to running actors and the loop's parts.

Modules:
  runtime.py   before any actor: model weights, the local stack (rollout=local), Ray started or joined
  actors.py    the actors training and evaluation share: replicas, gateway, rollout pool; bounded close
  training.py  build_parts: every actor of a training run and its LoopParts
  eval.py      build_eval: mode=eval's parts (no trainer, no weight sync)
  placement_groups.py  the Ray side of GPU placement: placement groups per node and GPU, actor options
"""
