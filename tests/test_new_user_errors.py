"""What a new user hit before the first step, each now a clear `config error:` naming our key
(exit 2) instead of a stack trace or a library's advice a minute later; the run dir stays reusable."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from orchestrator.wiring.runtime import agent_start_failure
from orchestrator.control.preflight import kv_cache_min_bytes

REPO = Path(__file__).resolve().parent.parent


def main_job(*overrides: str, timeout_s: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.main", "logger=console", *overrides], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout_s)


def test_kv_cache_minimum_is_one_full_sequence(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4,
                                                      "num_key_value_heads": 2, "hidden_size": 256}))
    # 2 (K, V) x 2 layers x 2 kv heads x 64 head dim x 4 bytes = 2048 B per token; vLLM CPU's blocks hold
    # 128 tokens, so 130 tokens take 2 blocks (a 0.00025 GiB cache passed a 16-token rounding, vLLM refused it)
    assert kv_cache_min_bytes(tmp_path, 130, "float32") == 2048 * 256
    assert kv_cache_min_bytes(tmp_path, 512, "bfloat16") == 1024 * 512
    # with inference.block_size=32 the same 130 tokens take 5 blocks of 32, not 2 of 128
    assert kv_cache_min_bytes(tmp_path, 130, "float32", block_tokens=32) == 2048 * 160


def test_agent_failure_quotes_the_agents_own_output_of_the_last_start(tmp_path):
    log = tmp_path / "emulator.log"
    tb = "Traceback (most recent call last):\n  File x\nRuntimeError: agent 0 (pid 1) exited with {}\n"
    log.write_text("old output\n" + tb.format(1) + "usage: agent --port N\nagent: error: bad flag\n" + tb.format(2))
    msg = agent_start_failure("emulator exited with 1", log)
    assert msg.startswith("the agent did not start (agent 0 (pid 1) exited with 2); its output:")
    assert "  | agent: error: bad flag" in msg and "old output" not in msg
    log.write_text("moto could not bind\n")
    assert agent_start_failure("moto exited with 1", log) is None  # not an agent's failure: left as it was


def test_too_small_kv_cache_exits_2_naming_the_key(tmp_path, tiny_model_dir):
    # tiny_model_dir: the cache check reads the built model's config.json (a fresh clone has none
    # until the first test that needs it builds it; a skip here never ran on CI). It is checked
    # before anything starts; a bad agent command, which needs the ACR stack to show, is in
    # tests/test_local_stack.py.
    kv = main_job("inference.kv_cache_gib=0.0001", f"run_dir={tmp_path / 'kv'}")
    assert kv.returncode == 2, kv.stderr[-2000:]
    assert kv.stderr.startswith("config error: inference.kv_cache_gib is too small for one "
                                "inference.max_model_len=512 sequence of this model: it needs at least")
    assert "gpu_memory_utilization" not in kv.stderr + kv.stdout and "Traceback" not in kv.stderr


def test_an_agent_missing_a_module_is_told_where_to_install_it(tmp_path):
    log = tmp_path / "emulator.log"
    log.write_text("Traceback (most recent call last):\n  File \"app.py\", line 3\n"
                   "ModuleNotFoundError: No module named 'agentcore_rl_toolkit'\n"
                   "Traceback (most recent call last):\n  File x\nRuntimeError: agent 0 (pid 7) exited with 1\n")
    msg = agent_start_failure("emulator exited with 1", log)
    assert msg is not None and "no module 'agentcore_rl_toolkit': install it where the agent runs" in msg


async def test_an_agent_command_that_is_not_a_program_fails_naming_it():
    import aiohttp
    import pytest

    from workers.embedded.emulator_agents import start_agents

    async with aiohttp.ClientSession() as http:
        with pytest.raises(RuntimeError, match=r"^agent 0 could not be started: 'no_such_agent_cmd': No such file"):
            await start_agents(["no_such_agent_cmd", "--port", "{port}"], 1, {}, http, start_timeout_s=5)
