"""Inference replicas: one vLLM engine each, token-in/token-out, with versioned weight reloads.

Modules:
  worker.py         InferenceWorker: generate, prompt log-probs, weight updates, sleep / wake-up
  client.py         ReplicaClient: the one typed adapter the driver calls a replica through
  settings.py       InferenceSettings, IN_FLIGHT_MODES, EngineInfo, SleepReport (no vLLM, no torch)
  engine.py         building the vLLM engine (start_engine), the KV-cache usage hook
  vllm_requests.py  requests and finished outputs in vLLM's types
  segments.py       one GenerateResult from the engine segments that weight updates cut apart (pure)
  swap.py           the pause around a weight load, the broadcast receiver, WeightsGate
  vllm_ext.py       vLLM worker extension that reloads weights inside vLLM's worker process
  adapters.py       the LoRA adapter versions one replica serves, and which it drops
"""
