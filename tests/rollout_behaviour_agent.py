"""A real ACR agent whose result is chosen by the dataset row's `behaviour` field, for the
rollout worker tests (run as a script by the ACR emulator, `stand_ins.BEHAVIOUR_AGENT`; not collected).

Built on `bedrock_agentcore.runtime.BedrockAgentCoreApp`. Every invocation first makes ONE chat
call to the rollout gateway with the official `openai` SDK (`_rollout["base_url"]`, `api_key`,
`model_id`), so the gateway records tokens for the session, then writes an echo object
`_echo/{session_id}.json` to the results bucket (the `_rollout` dict it received, the session id
from ACR's session header, the reply text) so a test can check what reached the agent. Then, by
`behaviour`, at the result key `{exp_id}/{input_id}/{session_id}.json`:

- ok: `{"rewards": 0.75}`;            - list: `{"rewards": [0.1, 0.6]}` (the last item counts);
- no_result: nothing;                 - nan: `{"rewards": NaN}` (non-standard JSON, allow_nan);
- missing: `{"status_code": 500}`;    - not_number: `{"rewards": "high"}`;
- slow: sleeps `sleep_s` inside the invocation, then writes `{"rewards": 1.0}`;
- slow_result: answers the invocation at once, writes `{"rewards": 1.0}` `sleep_s` later
  (the agentcore-rl-toolkit shape: acknowledge, then finish in the background);
- crash: raises (the SDK answers HTTP 500, ACR a RuntimeClientError), writes nothing;
- overflow: two more turns on the same conversation, the third with a tool result far longer than
  the context: the gateway answers 400 `context_length_exceeded`, the agent catches it (as an agent
  that treats overflow as the end of its episode does) and writes `{"rewards": 0.75}`;
- store_down: the object store is down when the agent writes its reward (its put goes to a port
  nothing listens on: botocore's real EndpointConnectionError for the result's URL), and once it is
  back the agent writes the toolkit's error object with that exception as its `stop_reason`, as the
  example agents do (examples/agents/letters_agent/app.py): what killing moto mid-run looks like;
- bucket_gone: the same, but the store answers without the bucket (moto restarted, its bucket not
  yet created again): the put goes to a bucket moto does not have (botocore's real NoSuchBucket).
"""

from __future__ import annotations

import asyncio
import json
import os

import boto3
import openai
from bedrock_agentcore.runtime import BedrockAgentCoreApp

app = BedrockAgentCoreApp()
_s3 = boto3.client("s3")  # endpoint, region and dummy credentials come from the emulator's env
_background: set[asyncio.Task] = set()
RESULTS = {
    "ok": {"rewards": 0.75},
    "list": {"rewards": [0.1, 0.6]},
    "nan": {"rewards": float("nan")},
    "missing": {"status_code": 500},
    "not_number": {"rewards": "high"},
    "slow": {"rewards": 1.0},
    "slow_result": {"rewards": 1.0},
}


async def _put(bucket: str, key: str, body: dict) -> None:
    data = json.dumps(body, allow_nan=True).encode()
    await asyncio.to_thread(_s3.put_object, Bucket=bucket, Key=key, Body=data, ContentType="application/json")


def _reward_into_a_dead_store(bucket: str, key: str) -> dict:
    """`store_down`: the put of `{"rewards": 0.75}` fails (S3 unreachable); the error object to write."""
    import socket

    from botocore.config import Config

    with socket.socket() as s:  # a port nothing listens on once closed: connection refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", config=Config(retries={"max_attempts": 1}))
    try:
        dead.put_object(Bucket=bucket, Key=key, Body=b'{"rewards": 0.75}', ContentType="application/json")
    except Exception as exc:  # noqa: BLE001  as the example agents catch it
        return {"status_code": 500, "stop_reason": f"{type(exc).__name__}: {exc}"}
    raise RuntimeError("the put into a closed port should have failed")


async def _late_result(bucket: str, key: str, body: dict, sleep_s: float) -> None:
    await asyncio.sleep(sleep_s)
    await _put(bucket, key, body)


async def _overflow(client: openai.AsyncOpenAI, r: dict, prompt: str, reply: str) -> None:
    """Turns 2 and 3 of the `overflow` behaviour; turn 3 must be refused for its length."""
    msgs = [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply},
            {"role": "user", "content": "Again."}]
    second = await client.chat.completions.create(model=r["model_id"], messages=msgs, max_tokens=r.get("max_tokens"))
    msgs += [{"role": "assistant", "content": second.choices[0].message.content}, {"role": "user", "content": "q " * 2000}]
    try:
        await client.chat.completions.create(model=r["model_id"], messages=msgs, max_tokens=r.get("max_tokens"))
    except openai.BadRequestError as e:
        if e.code != "context_length_exceeded":
            raise
    else:
        raise RuntimeError("turn 3 should have overflowed the context")


RESULTS["overflow"] = {"rewards": 0.75}


@app.entrypoint
async def invoke(payload, context):
    r = payload["_rollout"]
    behaviour = payload.get("behaviour", "ok")
    session_id = context.session_id
    async with openai.AsyncOpenAI(base_url=r["base_url"], api_key=r["api_key"], max_retries=0, timeout=30) as client:
        resp = await client.chat.completions.create(
            model=r["model_id"],
            messages=[{"role": "user", "content": payload.get("prompt", "Repeat the letter q 4 times.")}],
            max_tokens=r.get("max_tokens"),
        )
        if behaviour == "overflow":
            await _overflow(client, r, payload.get("prompt", "Repeat the letter q 4 times."),
                            resp.choices[0].message.content)
    echo = {"rollout": r, "session_id": session_id, "reply": resp.choices[0].message.content}
    await _put(r["s3_bucket"], f"_echo/{session_id}.json", echo)
    if behaviour == "crash":
        raise RuntimeError("agent asked to crash")
    key = f"{r['exp_id']}/{r['input_id']}/{session_id}.json"
    sleep_s = float(payload.get("sleep_s", 10.0))
    if behaviour == "slow":
        await asyncio.sleep(sleep_s)
    if behaviour == "slow_result":
        task = asyncio.get_running_loop().create_task(_late_result(r["s3_bucket"], key, RESULTS[behaviour], sleep_s))
        _background.add(task)
        task.add_done_callback(_background.discard)
    elif behaviour == "store_down":
        await _put(r["s3_bucket"], key, await asyncio.to_thread(_reward_into_a_dead_store, r["s3_bucket"], key))
    elif behaviour == "bucket_gone":
        try:
            await _put(f"{r['s3_bucket']}-gone", key, {"rewards": 0.75})
        except Exception as exc:  # noqa: BLE001  as the example agents catch it
            await _put(r["s3_bucket"], key, {"status_code": 500, "stop_reason": f"{type(exc).__name__}: {exc}"})
        else:
            raise RuntimeError("a put into a bucket moto does not have should have failed")
    elif behaviour != "no_result":
        await _put(r["s3_bucket"], key, RESULTS[behaviour])
    return {"status": "processing", "result_key": key, "session_id": session_id}


if __name__ == "__main__":
    app.run(port=int(os.environ["PORT"]))
