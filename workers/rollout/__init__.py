"""The rollout pool: one ACR invocation per sample, joined with the gateway's token capture.

Modules:
  contract.py  the two agent contracts as pure functions: payloads out, rewards in
  results.py   fast completion: agents POST their result to the worker that waits for it
  settings.py  RolloutSettings: the one default and check of each value the rollout config sets
  worker.py    RolloutWorker: invoke, wait for the result, stop the session, collect the capture
  actor.py     RolloutActor: the async Ray actor around one RolloutWorker, and its spawner
  pool.py      RolloutPool: spreads rollouts over the actors, replaces a dead one and settles its rollouts
  clients.py   typed adapters: rollout actors, the gateway's sessions, the sample store
  a2a.py       the A2A contract, client half: one rollout is one A2A task over ACR invocations
  lifecycle.py the A2A contract's bounded lifecycle: setup, then a rollout slot, then the rollout
  stops.py     the ACR session stops of one worker: no session outlives its run
  failures.py  why a rollout failed: the closed set of reasons, from an exception to its reason
  overflow.py  `rollout.overflow`: a truncated rollout's fate
  recovery.py  the rollouts of a dead rollout actor: keep, re-dispatch once or fail (pure)
  put_batcher.py  PutBatcher: an actor's sample puts gathered into batched store writes, exactly once
"""
