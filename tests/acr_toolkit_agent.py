"""An agent written with the public agentcore-rl-toolkit decorator, unchanged, for the emulator
tests (run as a script, `stand_ins.TOOLKIT_S3_AGENT`; not collected). S3-result contract: reward
1.0 when the row's `answer` is "yes"; a row with `raise` makes the rollout raise (the toolkit then
writes its error object)."""

from __future__ import annotations

import os

from agentcore_rl_toolkit import AgentCoreRLApp

app = AgentCoreRLApp()


@app.rollout_entrypoint
def rollout(payload):
    if payload.get("raise"):
        raise RuntimeError("asked to fail")
    return {"rewards": 1.0 if payload.get("answer") == "yes" else 0.0}


if __name__ == "__main__":
    app.run(port=int(os.environ["PORT"]))
