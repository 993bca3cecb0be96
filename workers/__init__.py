"""Ray actors of the orchestrator: trainer, inference, rollout pool, gateway, ACR client.

Each module keeps its logic in a plain class; `ray.remote` is applied where actors are created.
"""
