"""An agent written with the public agentcore-rl-toolkit decorator, unchanged, for the emulator
tests (run as a script, not collected). Reward 1.0 when the row's `answer` is "yes"."""

from __future__ import annotations

import os

from agentcore_rl_toolkit import AgentCoreRLApp

app = AgentCoreRLApp()


@app.rollout_entrypoint
def rollout(payload):
    return {"rewards": 1.0 if payload.get("answer") == "yes" else 0.0}


if __name__ == "__main__":
    app.run(port=int(os.environ["PORT"]))
