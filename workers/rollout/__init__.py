"""The rollout pool: one ACR invocation per sample, joined with the gateway's token capture.

Modules:
  contract.py  the two agent contracts as pure functions: payloads out, rewards in
  results.py   fast completion: agents POST their result to the worker that waits for it
  settings.py  RolloutSettings: the one default and check of each value the rollout config sets
  worker.py    RolloutWorker: invoke, wait for the result, stop the session, collect the capture
  actor.py     RolloutActor: the async Ray actor around one RolloutWorker, and its spawner
  pool.py      RolloutPool: spreads rollouts over the actors, replaces a dead one and settles its rollouts
  clients.py   typed adapters: rollout actors, the gateway's sessions, the sample store
"""
