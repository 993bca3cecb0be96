"""The cluster simulator: the product's loops on a virtual clock over simulated hardware.

    clock.py     VirtualLoop: asyncio whose time jumps to the next timer or hardware event
    engine.py    SimReplica: continuous batching over a KV cache in tokens, preemption, prefix cache
    agent.py     SimAgents: multi-turn ACR episodes; SimRolloutActor (RolloutPool's seam), SimStore
    parts.py     SimTrainer, SimWeightSync, replica sleep/wake, the per-step probe, the timeline
    workload.py  workloads as YAML (workloads/*.yaml)
    run.py       simulate(): one configuration, the figures, metrics.jsonl / summary.json / timeline.jsonl
    calibrate.py the two free time scales fitted to one measured row
    machine.py   SharedCpu: one CPU machine shared by every part (processor sharing), for CPU-run fits

The planner on top is orchestrator/planning/simulate.py. Nothing here imports Ray, vLLM or torch.
"""
