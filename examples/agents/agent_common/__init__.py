"""Helpers shared by the example agents (standalone: imports nothing from the orchestrator)."""
