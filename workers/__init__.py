"""The parts the driver starts as Ray actors, and the pure kernel they share with it.

Packages (each keeps its logic in plain classes; `ray.remote` is applied where actors are created):
  core/         the pure kernel the driver imports most: message types, RL algorithms, placement,
                memory plan, tasks and datasets; no Ray, vLLM or HTTP import
  trainer/      the trainer ranks (FSDP2 or verl's engine) behind one `Trainer` protocol
  inference/    the vLLM replicas: token-in/token-out generation, versioned weight reloads
  weight_sync/  trainer -> replicas: one safetensors file, or a bucketed broadcast
  gateway/      the agents' OpenAI/Anthropic-compatible endpoint that records exact token ids
  rollout/      the rollout pool: one ACR invocation per sample, joined with the gateway's capture
  acr/          the ACR data-plane client (boto3/aiobotocore) and the cluster-wide ACR limits
  buffer/       the trajectory buffer over TransferQueue
  embedded/     local stand-ins for AWS and a real model: the ACR emulator, moto S3, the tiny model
"""
