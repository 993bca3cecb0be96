"""A tiny real ACR agent for the emulator tests (run as a script, `stand_ins.ECHO_AGENT`; not collected).

Built on `bedrock_agentcore.runtime.BedrockAgentCoreApp` like any ACR container app. It answers
`{"pid", "session_id", "payload", "headers"}` so a test can see which process served a session,
which session header reached it and which forwardable headers (the SDK's request_headers) arrived; payload `{"fail": true}` raises (HTTP 500 from the SDK);
payload `{"stream": n}` answers n server-sent events.
"""

from __future__ import annotations

import os

from bedrock_agentcore.runtime import BedrockAgentCoreApp

app = BedrockAgentCoreApp()


@app.entrypoint
def invoke(payload, context):
    if payload.get("fail"):
        raise RuntimeError("asked to fail")
    if payload.get("stream"):
        return ({"i": i, "session_id": context.session_id} for i in range(int(payload["stream"])))
    headers = dict(context.request_headers or {})
    return {"pid": os.getpid(), "session_id": context.session_id, "payload": payload, "headers": headers}


if __name__ == "__main__":
    app.run(port=int(os.environ["PORT"]))
