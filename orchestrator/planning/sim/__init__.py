"""The cluster simulator: the product's loops on a virtual clock over simulated hardware.

    clock.py     VirtualLoop: asyncio whose time jumps to the next timer or hardware event
    engine.py    SimReplica: continuous batching over a KV cache in tokens, preemption, prefix cache
    agent.py     SimAgents: multi-turn ACR episodes in the A2A lifecycle (container slot, setup, rollout
                 slot); SimRolloutActor (RolloutPool's seam), SimStore
    slots.py     SlotQueue: a FIFO slot cap with its slot-seconds (container and rollout slots)
    lifecycle.py simulate_lifecycle(): a saturated pool of rollouts, no loop (scripts/bench_swe.py)
    parts.py     SimTrainer, SimWeightSync, replica sleep/wake, the per-step probe, the timeline
    workload.py  workloads as YAML (workloads/*.yaml)
    run.py       simulate(): one configuration, the figures, metrics.jsonl / summary.json / timeline.jsonl
    calibrate.py the two free time scales fitted to one measured row
    machine.py   SharedCpu: one CPU machine shared by every part (processor sharing), for CPU-run fits
    public_check.py  the simulator held against the public report's four rows, one trainer throughput at a time

The planner on top is orchestrator/planning/simulate.py. Nothing here imports Ray, vLLM or torch.
"""
