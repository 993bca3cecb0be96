"""The trainer: one Ray actor per data-parallel rank, and `TrainerGroup`, which drives N ranks as one.

Modules:
  worker.py       TrainerWorker: an HF causal LM under FSDP2 (gloo on CPU, NCCL on GPU)
  verl_worker.py  VerlTrainerWorker: the same interface over verl's training engine (trainer.name=verl)
  verl_parts.py   what VerlTrainerWorker hands to verl's engine
  helpers.py      rendezvous URL, per-token log-probs, tied weights, atomic file writes (pure)
  scale.py        token-budget micro-batches, bf16 mixed precision, activation checkpointing
  shard.py        split a mini-batch across ranks by whole groups, merge the ranks' metrics
  group.py        TrainerGroup and start_trainer_ranks
"""
