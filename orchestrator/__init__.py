"""Driver side of the async RL orchestrator: config, loops, staleness, batching, algorithms.

Nothing in this package serves HTTP or holds model weights; heavy imports (Ray, vLLM, CUDA)
happen inside the functions that need them, never at package import.
"""
