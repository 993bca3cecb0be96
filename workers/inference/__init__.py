"""Inference replicas: one vLLM engine each, token-in/token-out, with versioned weight reloads.

Modules:
  worker.py    InferenceWorker: the engine, generate, pause/resume around weight swaps
  segments.py  one GenerateResult from the engine segments that weight updates cut apart (pure)
  swap.py      the pause around a load, and the broadcast receiver
  vllm_ext.py  vLLM worker extension that reloads weights inside vLLM's worker process
"""
