"""The trainer: one Ray actor per data-parallel rank, and `TrainerGroup`, which drives N ranks as one.

The driver hands a train order (keys, groups, rewards: no token); each rank reads its own rows.

One shell, two engines, one protocol:
  protocol.py     `Trainer` (what the driver calls; TrainerWorker, VerlTrainerWorker and TrainerGroup
                  implement it) and `TrainerEngine` (the model-specific seam behind the shell)
  shell.py        TrainerShell: process group, rollout correction and metrics, weight / optimizer
                  files, the weight-sync group
  worker.py       TrainerWorker: the shell around FsdpEngine (an HF causal LM under FSDP2; gloo on CPU,
                  NCCL on GPU)
  verl_worker.py  VerlTrainerWorker: the shell around VerlEngine (verl's training engine, trainer.name=verl)
  verl_parts.py   what VerlEngine hands to verl's engine
  settings.py     TrainerSettings, VerlSettings and their choice lists (no torch at import)
  helpers.py      per-token log-probs, tied weights, atomic file writes, the update plan (pure)
  scale.py        token-budget micro-batches, bf16 mixed precision, activation checkpointing
  order.py        split a train order across ranks by whole groups, merge the ranks' metrics (no torch)
  rows.py         RowReader: a rank reads its own rows of an order from the trajectory buffer
  train_batch.py  a rank's padded TrainBatch from its rows and order (GRPO advantages); build_train_batch
  group.py        TrainerGroup (the driver's one adapter of the trainer) and start_trainer_ranks
  lora.py         LoRA on the trainer's model (PEFT): wrapping, and the adapter's ways out
Rendezvous of the ranks: workers/weight_sync/rendezvous.py.
"""
