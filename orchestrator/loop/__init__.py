"""The training loops and the pure controllers they are made of (no torch, Ray or HTTP import).

The loops hold each rollout's metadata only (`SampleInfo`: status, reward, versions, token counts,
row keys), read once from the buffer's tags after the rollout pool returned; an update is a
`TrainOrder` by row key, whose rows the trainer ranks read themselves.

Modules:
  common.py          LoopParts (the loops' Protocols), LoopPosition, group dispatch, weight sync, step end
  sync_loop.py       run_sync: generate a batch, train `sync_every` mini-batches, sync weights
  async_loop.py      run_async: generation never stops; updates as mini-batches fill, bounded staleness
  batching.py        groups, filters, mini-batch split, the train order, and the RolloutLedger (every
                     rollout ends once)
  staleness.py       admission by policy version (AReaL's rule) and the per-sample staleness verdict
  staleness_gate.py  AdmissionGate: the asyncio wrapper producers wait on for an admission slot
  concurrency.py     rollout.concurrency: fixed or adaptive (AIMD on the engines' KV usage) group limit
  throughput_concurrency.py  rollout.concurrency=adaptive: a running-group cap that seeks the best measured throughput
  slot_steering.py   adaptive with contract=a2a: the AIMD window sets the rollout-slot cap instead
  prompts.py         the seeded, resumable prompt cycle
  sampler.py         the difficulty-aware prompt sampler (task.sampler=difficulty)
  validation.py      evaluation of a split through a rollout pool; validation during training
  early_stop.py      a run whose agent cannot work with it stops after its first rollouts, saying why
"""
