"""The RL algorithms on tensors: what the trainer ranks apply, checked against verl's helpers.

Modules:
  advantages.py                 GRPO outcome advantages, normalised within each group
  losses.py                     PPO clipped policy loss and the loss aggregation modes
  loss_modes.py                 the aggregation mode names, without torch (the config imports them)
  rollout_correction.py         IS weights, rejection masks and diagnostics between pi_old and pi_rollout
  rollout_correction_config.py  typed rollout-correction settings (no torch)
  rejection.py                  a rejection mask applied to a mini-batch and its advantages
  batch.py                      TrainBatch: the padded tensors of one mini-batch
"""
