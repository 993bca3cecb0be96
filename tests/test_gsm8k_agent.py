"""The GSM8K agent: calculator, reward, the multi-turn tool loop, and the ACR app end to end.

The tool loop and the app talk over real sockets to a small OpenAI-compatible aiohttp server on
127.0.0.1 (`ScriptedModel`): a stand-in for the inference engine behind the OpenAI interface,
scripted per question so each test sees tool calls the tiny model would never produce. The app
test runs the real agent process under the ACR emulator with moto S3 (workers.embedded.local_stack).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid

import pytest
from aiohttp import web
from openai import AsyncOpenAI, BadRequestError

from stand_ins import REPO, ScriptedChatServer, chat_completion, load_module
from stand_ins import BlockingAcr
from workers.embedded.local_stack import LocalStack

AGENT_DIR = REPO / "examples/agents/gsm8k_agent"


def _load(name: str):
    """Import an agent module by path under a unique name (the agent's dir goes on sys.path for
    its sibling imports, as in its container)."""
    if str(AGENT_DIR) not in sys.path:
        sys.path.insert(0, str(AGENT_DIR))
    return load_module(AGENT_DIR / f"{name}.py", f"gsm8k_agent_{name}_under_test")


calc = _load("calculator")
reward = _load("reward")
tool_loop = _load("tool_loop")

# ---------------------------------------------------------------------------------------------
# the scripted model server
# ---------------------------------------------------------------------------------------------

Q_TOOL = "Natalia sold 48 clips in April and half as many in May. How many altogether?"
Q_TWO_CALLS = "two calls"
Q_LOOP = "always calls tools"
Q_OVERFLOW = "overflows on turn two"
Q_TOO_LONG = "overflows on turn one"
Q_BAD_TOOL = "calls an unknown tool"


def _tool_call(expr: str, name: str = "calculator") -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:8]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps({"expression": expr})}}


class ScriptedModel(ScriptedChatServer):
    """The scripted chat server (stand_ins) answering per question and turn (number of tool
    messages so far); also takes the rollout worker's result POSTs at /results/{sid}."""

    def __init__(self) -> None:
        super().__init__(self._reply, routes={"/results/{sid}": self._result})
        self.posted_results: dict[str, tuple[str | None, dict]] = {}  # session id -> (auth, body)

    def requests_for(self, question: str) -> list[dict]:
        return [r for r in self.requests if r["messages"][1]["content"] == question]

    def _answer(self, question: str, tool_msgs: int) -> tuple[int, dict]:
        overflow = {"error": {"message": "prompt over budget", "type": "invalid_request_error",
                              "param": "messages", "code": "context_length_exceeded"}}
        if question == Q_TOO_LONG or (question == Q_OVERFLOW and tool_msgs > 0):
            return 400, overflow
        if question == Q_TOOL and tool_msgs == 0:
            return 200, {"content": None, "tool_calls": [_tool_call("48 + 48 / 2")]}
        if question == Q_TWO_CALLS and tool_msgs == 0:
            return 200, {"content": "Let me compute.", "tool_calls": [_tool_call("2 * 3"), _tool_call("1 / 0")]}
        if question in (Q_LOOP, Q_OVERFLOW):
            return 200, {"content": f"step {tool_msgs}", "tool_calls": [_tool_call("1 + 1")]}
        if question == Q_BAD_TOOL and tool_msgs == 0:
            return 200, {"content": None, "tool_calls": [_tool_call("1", name="search")]}
        return 200, {"content": "She sold 72 clips.\n#### 72", "tool_calls": None}

    def _reply(self, body: dict) -> tuple[int, dict]:
        tool_msgs = sum(1 for m in body["messages"] if m["role"] == "tool")
        status, msg = self._answer(body["messages"][1]["content"], tool_msgs)
        if status != 200:
            return status, msg
        message = {"role": "assistant", "content": msg["content"]}
        if msg["tool_calls"]:
            message["tool_calls"] = msg["tool_calls"]
        return 200, chat_completion(body, message, finish_reason="tool_calls" if msg["tool_calls"] else "stop",
                                    usage=(100 + 10 * tool_msgs, 5))

    async def _result(self, request: web.Request) -> web.Response:  # the rollout worker's result_url
        self.posted_results[request.match_info["sid"]] = (request.headers.get("Authorization"), await request.json())
        return web.json_response({"ok": True})


@pytest.fixture(scope="module")
def model():
    server = ScriptedModel().start()
    yield server
    server.stop()


async def _episode(model: ScriptedModel, question: str, max_turns: int = 4):
    async with AsyncOpenAI(base_url=model.base_url, api_key="tok", max_retries=0, timeout=10) as client:
        return await asyncio.wait_for(
            tool_loop.run_episode(client, model="policy", question=question, max_turns=max_turns,
                                  sampling={"max_tokens": 32, "temperature": 0.5}), 20)


# ---------------------------------------------------------------------------------------------
# calculator
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("expr,value", [
    ("48 + 48 / 2", 72.0), ("(48 / 2) + 48", 72.0), ("-3 * -(2 + 1)", 9.0), ("7 // 2 + 7 % 2", 4.0),
    ("2 ** 10", 1024.0), ("1,200 * 3", 3600.0), ("$12.50 * 4", 50.0), ("0.1 + 0.2", 0.30000000000000004),
])
def test_calculator_evaluates_arithmetic(expr, value):
    assert calc.evaluate(expr) == value


@pytest.mark.parametrize("expr,why", [
    ("__import__('os').system('true')", "unsupported syntax"),
    ("open('/etc/passwd')", "unsupported syntax"),
    ("x + 1", "unsupported syntax: Name"),
    ("(1).__class__", "unsupported syntax: Attribute"),
    ("'a' * 3", "unsupported syntax: Constant"),
    ("True + 1", "unsupported syntax: Constant"),
    ("[1, 2]", "unsupported syntax: List"),
    ("1 < 2", "unsupported syntax: Compare"),
    ("2 ^ 3", "write \\*\\* instead"),
    ("1 / 0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("9 ** 9 ** 9", "exponent 387420489 is larger than 64"),
    ("10 ** 40", "result out of range"),
    ("1e308 * 10", "result out of range"),
    ("1" * 201, "longer than 200"),
    ("", "non-empty"),
    ("2 +", "not an arithmetic expression"),
])
def test_calculator_refuses_everything_but_bounded_arithmetic(expr, why):
    with pytest.raises(calc.CalculatorError, match=why):
        calc.evaluate(expr)


def test_run_tool_answers_text_and_never_raises():
    assert calc.run_tool('{"expression": "48 + 48 / 2"}') == "72"
    assert calc.run_tool('{"expression": "1 / 3"}') == "0.3333333333"
    assert calc.run_tool('{"expression": "1 / 0"}') == "error: division by zero"
    assert calc.run_tool("not json").startswith("error: arguments must be a JSON object")
    assert calc.run_tool('{"expr": "1"}').startswith("error: arguments must be a JSON object")
    assert calc.run_tool("").startswith("error: arguments must be a JSON object")


# ---------------------------------------------------------------------------------------------
# reward
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,answer", [
    ("She sold 72 clips.\n#### 72", 72.0),
    ("#### $1,200.", 1200.0),
    ("#### 18 (eggs), not 16", 18.0),  # the first number after the last ####
    ("#### 5\nrethinking... #### -3", -3.0),
    ("16 - 3 - 4 = 9 eggs, 9 * 2 = 18.", 18.0),  # no ####: the last number; the period is a full stop
    ("It costs $2,500,000 in total", 2500000.0),
    ("#### none\nso 7", 7.0),  # #### without a number falls back to the last number
    ("so 10-4", 4.0),  # a subtraction, not -4
    ("the change is -4", -4.0),
    ("#### .5", 0.5),
    ("q q q q", None),
    ("", None),
])
def test_extract_answer(text, answer):
    assert reward.extract_answer(text) == answer


def test_score_is_one_exactly_when_the_final_number_equals_the_ground_truth():
    row = {"answer": 18}
    assert reward.score(row, "#### 18") == 1.0
    assert reward.score(row, "The answer is 18.00") == 1.0
    assert reward.score(row, "#### 18.5") == 0.0
    assert reward.score(row, "18 is wrong, #### 17") == 0.0
    assert reward.score(row, "no number") == 0.0
    assert reward.score({"answer": 0.5}, "#### .5 or 0.5") == 1.0
    assert reward.score({"answer": 1_000_000}, "#### 1,000,000") == 1.0
    with pytest.raises(ValueError, match="numeric 'answer'"):
        reward.score({"answer": "18"}, "#### 18")
    with pytest.raises(ValueError, match="numeric 'answer'"):
        reward.score({}, "#### 18")


# ---------------------------------------------------------------------------------------------
# the tool loop, over real sockets
# ---------------------------------------------------------------------------------------------

async def test_a_tool_call_is_run_and_answered_with_a_tool_message_then_the_final_answer(model):
    ep = await _episode(model, Q_TOOL)
    assert (ep.end, ep.num_turns, ep.num_tool_calls) == ("answer", 2, 1)
    assert reward.score({"answer": 72}, ep.final_text) == 1.0
    assert ep.prompt_tokens == [100, 110]  # the server's usage of each turn
    first, second = model.requests_for(Q_TOOL)
    for req in (first, second):  # every turn offers the calculator, with the sampling settings
        assert [t["function"]["name"] for t in req["tools"]] == ["calculator"]
        assert req["tools"][0]["function"]["parameters"]["required"] == ["expression"]
        assert (req["model"], req["max_tokens"], req["temperature"], req["auth"]) == ("policy", 32, 0.5, "Bearer tok")
    assert [m["role"] for m in first["messages"]] == ["system", "user"]
    assert "#### <number>" in first["messages"][0]["content"]
    roles = [m["role"] for m in second["messages"]]
    assert roles == ["system", "user", "assistant", "tool"]
    call = second["messages"][2]["tool_calls"][0]
    assert (call["type"], call["function"]["name"], json.loads(call["function"]["arguments"])) == (
        "function", "calculator", {"expression": "48 + 48 / 2"})
    assert second["messages"][3] == {"role": "tool", "tool_call_id": call["id"], "content": "72"}


async def test_every_call_of_a_turn_gets_its_own_tool_message_in_order(model):
    ep = await _episode(model, Q_TWO_CALLS)
    assert (ep.end, ep.num_turns, ep.num_tool_calls) == ("answer", 2, 2)
    second = model.requests_for(Q_TWO_CALLS)[1]
    calls = second["messages"][2]["tool_calls"]
    assert second["messages"][2]["content"] == "Let me compute."
    assert [(m["tool_call_id"], m["content"]) for m in second["messages"][3:]] == [
        (calls[0]["id"], "6"), (calls[1]["id"], "error: division by zero")]


async def test_an_unknown_tool_gets_an_error_message_not_a_crash(model):
    ep = await _episode(model, Q_BAD_TOOL)
    assert (ep.end, ep.num_turns) == ("answer", 2)
    assert model.requests_for(Q_BAD_TOOL)[1]["messages"][3]["content"].startswith("error: unknown tool 'search'")


async def test_the_turn_cap_ends_an_episode_that_keeps_calling_tools(model):
    before = len(model.requests_for(Q_LOOP))
    ep = await _episode(model, Q_LOOP, max_turns=3)
    assert (ep.end, ep.num_turns, ep.num_tool_calls, ep.final_text) == ("max_turns", 3, 3, "step 2")
    assert len(model.requests_for(Q_LOOP)) - before == 3  # exactly max_turns model calls
    assert reward.score({"answer": 2}, ep.final_text) == 1.0  # "step 2": the last number


async def test_context_exceeded_after_a_turn_ends_the_episode_and_keeps_what_was_generated(model):
    ep = await _episode(model, Q_OVERFLOW)
    assert (ep.end, ep.num_turns, ep.num_tool_calls, ep.final_text) == ("context_exceeded", 1, 1, "step 0")


async def test_context_exceeded_on_the_first_turn_raises(model):
    with pytest.raises(BadRequestError) as info:
        await _episode(model, Q_TOO_LONG)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(ValueError, match="max_turns must be >= 1"):
        await _episode(model, Q_TOOL, max_turns=0)


# ---------------------------------------------------------------------------------------------
# the agent app: ACR emulator + moto S3 + the real agent process
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gsm8k_stack(local_stack):
    return local_stack([sys.executable, str(AGENT_DIR / "app.py")], num_agents=1)


def _payload(stack: LocalStack, model: ScriptedModel, question: str, answer, input_id: str, sid: str) -> dict:
    rollout = {"exp_id": "exp-gsm8k", "input_id": input_id, "s3_bucket": stack.bucket, "base_url": model.base_url,
               "model_id": "policy", "api_key": "session-token", "max_tokens": 64, "temperature": 1.0, "top_p": 1.0}
    if input_id.endswith("-1"):  # fast completion: also POST the result to the worker's result_url
        rollout["result_url"] = f"http://127.0.0.1:{model.port}/results/{sid}"
    return {"input_id": input_id, "question": question, "answer": answer, "max_turns": 3, "_rollout": rollout}


@pytest.mark.timeout(120)
def test_the_agent_app_runs_the_tool_loop_and_writes_its_reward_to_s3(gsm8k_stack, model, stack_env):
    stack_env(gsm8k_stack)
    c = BlockingAcr()
    arn = gsm8k_stack.agent_runtime_arn
    results = {}
    for input_id, question, answer in [("gsm8k-t-1", Q_TOOL, 72), ("gsm8k-t-2", Q_LOOP, 72),
                                       ("gsm8k-t-3", Q_TOO_LONG, 1)]:
        sid = f"rollout-{uuid.uuid4()}"
        ack = c.invoke(arn, sid, _payload(gsm8k_stack, model, question, answer, input_id, sid))
        key = f"exp-gsm8k/{input_id}/{sid}.json"
        assert ack == {"status": "processing", "s3_bucket": gsm8k_stack.bucket, "result_key": key}
        results[input_id] = c.wait_for_result(gsm8k_stack.bucket, key, timeout_s=30)
        assert c.stop_session(arn, sid)
    assert results["gsm8k-t-1"] == {"rewards": 1.0, "turns": 2, "tool_calls": 1, "end": "answer"}
    deadline = time.monotonic() + 10  # the POST follows the S3 write
    while not model.posted_results and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(model.posted_results.values()) == [("Bearer session-token", results["gsm8k-t-1"])]
    assert results["gsm8k-t-2"] == {"rewards": 0.0, "turns": 3, "tool_calls": 3, "end": "max_turns"}  # "step 2"
    # nothing generated: the toolkit's error object (no rewards), so the rollout ends failed at once
    assert results["gsm8k-t-3"] == {"status_code": 500, "stop_reason": results["gsm8k-t-3"]["stop_reason"]}
    assert results["gsm8k-t-3"]["stop_reason"].startswith("BadRequestError: ")
    assert results["gsm8k-t-3"]["stop_reason"].endswith("400 - prompt over budget")  # the server's message
    sent = [r for r in model.requests if r["auth"] == "Bearer session-token"]
    assert len(sent) == 2 + 3 + 1 and all(r["tools"][0]["function"]["name"] == "calculator" for r in sent)
    assert all((r["max_tokens"], r["top_p"]) == (64, 1.0) for r in sent)
    log = (gsm8k_stack.log_dir / "emulator.log").read_text()
    assert "input_id=gsm8k-t-1: gsm8k episode turns=2 tool_calls=1 prompt_tokens=100,110 end=answer reward=1.0" in log
