"""An HTTP-contract agent written with agentcore-rl-toolkit's `AgentCoreRuntimeApp`, unchanged,
for the emulator tests (run as a script, `stand_ins.TOOLKIT_HTTP_AGENT`; not collected). The
toolkit app handles the `_agentcore_runtime` start/get envelope and persists records under env
TOOLKIT_STATE_DIR; the entrypoint reads the reserved `_config` dict and returns `{"reward": r}`
(1.0 when the row's `answer` equals `_config["expected"]`), after `sleep_s` seconds; `fail` makes
it raise."""

from __future__ import annotations

import asyncio
import os

from agentcore_rl_toolkit import AgentCoreRuntimeApp

app = AgentCoreRuntimeApp(state_dir=os.environ.get("TOOLKIT_STATE_DIR"))


@app.entrypoint
async def rollout(payload, context):
    config = payload["_config"]
    await asyncio.sleep(float(payload.get("sleep_s", 0)))
    if payload.get("fail"):
        raise RuntimeError("asked to fail")
    reward = 1.0 if payload.get("answer") == config.get("expected") else 0.0
    return {"reward": reward, "session_id": context.session_id}


if __name__ == "__main__":
    app.run(port=int(os.environ["PORT"]))
