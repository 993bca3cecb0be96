"""The trainer: one Ray actor per data-parallel rank, and `TrainerGroup`, which drives N ranks as one.

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
  shard.py        split a mini-batch across ranks by whole groups, merge the ranks' metrics
  group.py        TrainerGroup and start_trainer_ranks
  client.py       TrainerRankClient: the typed adapter for checkpoint and weight-sync calls
Rendezvous of the ranks: workers/weight_sync/rendezvous.py.
"""
