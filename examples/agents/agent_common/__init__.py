"""Helpers shared by the example agents (standalone: imports nothing from the orchestrator).

- `rollout_contract`: the agent side of the S3-result contract (boto3, aiohttp, openai);
- `sandbox`: run commands in an ACR session's sandbox through InvokeAgentRuntimeCommand (boto3);
- `grading`: grade a finished coding episode in a clean second sandbox, with reward-hacking flags
  (standard library; any SandboxClient).
"""
