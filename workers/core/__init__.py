"""The pure layer that driver and workers share: message types, RL algorithms, placement
planning, task definitions.

Rule: nothing here imports the rest of `workers` or anything of `orchestrator`, and nothing
imports Ray, vLLM or an HTTP library. `types`, `placement` and `tasks` import without torch;
`algorithms` is plain torch on tensors.
"""
