"""The tiny default model: deterministic offline build, cache, HF + vLLM loading, ChatML."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from stand_ins import REPO, load_module
from workers.core.tasks import letters
from workers.embedded import tiny_model as tm

# A recipe that builds in seconds: a few warm-start steps still exercise the training path.
FAST = dataclasses.replace(tm.DEFAULT_RECIPE, warm_start_steps=4, warm_start_clean_steps=2, warm_start_batch=8)


@pytest.fixture(scope="module")
def tiny_model_dir() -> Path:
    """The default tiny model (built once into the shared cache, then reused)."""
    return tm.ensure_tiny_model()


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_build_is_byte_identical_in_two_dirs(tmp_path):
    a = tm.build_tiny_model(tmp_path / "a", FAST)
    b = tm.build_tiny_model(tmp_path / "b", FAST)
    fa, fb = _files(a), _files(b)
    assert set(fa) >= {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"}
    assert fa.keys() == fb.keys()
    for name in fa:
        assert fa[name] == fb[name], f"{name} differs between two builds of the same recipe"


def test_warm_start_changes_the_weights(tmp_path):
    """Guards against a warm start that silently trains nothing (FAST vs no warm start)."""
    cold = tm.build_tiny_model(tmp_path / "cold", dataclasses.replace(FAST, warm_start_steps=0, warm_start_clean_steps=0))
    warm = tm.build_tiny_model(tmp_path / "warm", FAST)
    w0, w1 = load_file(cold / "model.safetensors"), load_file(warm / "model.safetensors")
    assert not torch.equal(w0["lm_head.weight"], w1["lm_head.weight"])


def test_recipe_rejects_bad_values():
    with pytest.raises(ValueError, match="warm_start_clean_steps"):
        dataclasses.replace(FAST, warm_start_clean_steps=5)
    with pytest.raises(ValueError, match="answer_letter_p"):
        dataclasses.replace(FAST, answer_letter_p=1.5)


def test_cache_reuses_folder_and_recipe_change_rebuilds(tmp_path):
    p1 = tm.ensure_tiny_model(tmp_path, FAST)
    assert p1.parent == tmp_path.resolve() and p1.name == FAST.key()
    mtime = (p1 / "model.safetensors").stat().st_mtime_ns
    assert tm.ensure_tiny_model(tmp_path, FAST) == p1
    assert (p1 / "model.safetensors").stat().st_mtime_ns == mtime, "cached model was rebuilt"
    p2 = tm.ensure_tiny_model(tmp_path, dataclasses.replace(FAST, seed=1))
    assert p2 != p1 and (p2 / "config.json").is_file()
    assert json.loads((p1 / "recipe.json").read_text())["seed"] == 0


def test_concurrent_callers_get_one_complete_folder(tmp_path):
    with ThreadPoolExecutor(max_workers=3) as pool:
        paths = list(pool.map(lambda _: tm.ensure_tiny_model(tmp_path, FAST), range(3)))
    assert len(set(paths)) == 1
    leftovers = [p.name for p in tmp_path.iterdir() if p.is_dir() and p.name != FAST.key()]
    assert leftovers == [], f"temporary build folders left behind: {leftovers}"
    assert (paths[0] / "model.safetensors").is_file()


def test_cache_dir_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv(tm.CACHE_ENV, str(tmp_path))
    assert tm.ensure_tiny_model(recipe=FAST).parent == tmp_path.resolve()


def test_cli_prints_the_cached_path(tiny_model_dir):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-m", "workers.embedded.tiny_model", "--cache-dir", str(tiny_model_dir.parent)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=True,
    )
    assert Path(out.stdout.strip().splitlines()[-1]) == tiny_model_dir


def test_config_is_untied_qwen2(tiny_model_dir):
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert cfg["tie_word_embeddings"] is False
    assert cfg["head_dim"] == 64
    weights = load_file(tiny_model_dir / "model.safetensors")
    assert "lm_head.weight" in weights, "untied model must store its own output layer"
    assert not torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    gen = json.loads((tiny_model_dir / "generation_config.json").read_text())
    im_end = tok.convert_tokens_to_ids(tm.IM_END)
    assert im_end in gen["eos_token_id"] and cfg["eos_token_id"] == im_end
    assert tok.eos_token == tm.IM_END and tok.pad_token == tm.PAD_TOKEN


@pytest.mark.parametrize(
    "text", ["Repeat the letter q 4 times.", "q q q q", "Hello wörld! 12+30=42\n\n  tabs\tand ✓ emoji 🙂"]
)
def test_tokenizer_round_trips_and_matches_the_built_one(tiny_model_dir, text):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert ids == tm.build_tokenizer().encode(text, add_special_tokens=False)


def test_task_answers_are_one_token_per_letter(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert len(tok.encode("q q q q", add_special_tokens=False)) == 4
    assert 200 <= len(tok) <= 1024


def test_chat_template_is_chatml(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Repeat the letter q 2 times."},
        {"role": "assistant", "content": "q q"},
        {"role": "user", "content": "Again."},
    ]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nRepeat the letter q 2 times.<|im_end|>\n"
        "<|im_start|>assistant\nq q<|im_end|>\n"
        "<|im_start|>user\nAgain.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_gen = tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=False)
    assert no_gen.endswith("<|im_end|>\n") and "assistant" not in no_gen
    ids = tm.prompt_token_ids(tok, "hi")
    assert tok.convert_ids_to_tokens(ids)[0] == tm.IM_START
    assert tok.convert_ids_to_tokens(ids).count(tm.IM_START) == 2  # one token each, not split


def test_chat_template_renders_tools_and_tool_calls(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    msgs = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calc", "arguments": '{"e": "2+2"}'}}]},
        {"role": "tool", "content": "4"},
    ]
    text = tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n# Tools") and '"name": "calc"' in text
    assert '<tool_call>\n{"name": "calc", "arguments": {"e": "2+2"}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in text


def test_warm_started_model_answers_in_format_but_not_yet_right(tiny_model_dir):
    """The warm start teaches the answer shape; following the prompt is left to RL."""
    reward = load_module(REPO / "examples/agents/letters_agent/reward.py", "r")
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    rows = letters.make_rows(64, seed=3)
    torch.manual_seed(0)
    texts, scores = [], []
    for row in rows:
        ids = torch.tensor([tm.prompt_token_ids(tok, row["prompt"])])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                             top_p=1.0, top_k=0, max_new_tokens=letters.MAX_ANSWER_TOKENS)
        text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        texts.append(text)
        scores.append(reward.score(row, text))
    well_formed = sum(bool(re.fullmatch(r"[a-z]( [a-z])*", t)) for t in texts)
    assert well_formed >= 0.85 * len(texts), texts
    assert 0.02 < sum(scores) / len(scores) < 0.45, scores


VLLM_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from vllm import LLM, SamplingParams

    def main():
        llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=256, enforce_eager=True, seed=0)
        prompts = json.loads(sys.argv[2])
        msgs = [[{"role": "user", "content": p}] for p in prompts]
        outs = llm.chat(msgs, SamplingParams(temperature=1.0, top_p=1.0, max_tokens=16, seed=0))
        print("RESULT " + json.dumps([
            {"prompt_ids": list(o.prompt_token_ids), "ids": list(o.outputs[0].token_ids),
             "text": o.outputs[0].text, "finish": o.outputs[0].finish_reason} for o in outs]))

    if __name__ == "__main__":
        main()
    """
)


@pytest.mark.timeout(400)
def test_vllm_cpu_loads_and_generates_like_the_hf_model(tiny_model_dir, tmp_path):
    """vLLM CPU serves the tiny model: same prompt ids as HF, answers in format, low reward."""
    script = tmp_path / "vllm_gen.py"
    script.write_text(VLLM_SCRIPT)
    rows = letters.make_rows(64, seed=11)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run([sys.executable, str(script), str(tiny_model_dir), json.dumps([r["prompt"] for r in rows])],
                          env=env, capture_output=True, text=True, timeout=360)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    results = json.loads(lines[-1][len("RESULT "):])
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    im_end = tok.convert_tokens_to_ids(tm.IM_END)
    score = load_module(REPO / "examples/agents/letters_agent/reward.py", "letters_reward_vllm").score
    for row, r in zip(rows, results, strict=True):
        assert r["prompt_ids"] == tm.prompt_token_ids(tok, row["prompt"])
        assert 1 <= len(r["ids"]) <= 16 and all(0 <= i < len(tok) for i in r["ids"])
        if r["finish"] == "stop":
            assert r["ids"][-1] == im_end
    stopped = sum(r["finish"] == "stop" for r in results)
    assert stopped >= 0.85 * len(rows), "the warm-started model should end its answers with <|im_end|>"
    well_formed = sum(bool(re.fullmatch(r"\s*[a-z]( [a-z])*", r["text"])) for r in results)
    assert well_formed >= 0.85 * len(rows), [r["text"] for r in results]
    mean = sum(score(row, r["text"]) for row, r in zip(rows, results)) / len(rows)
    assert 0.02 < mean < 0.45, mean


def test_pure_torch_grpo_learns_the_task(tiny_model_dir):
    """The product's acceptance bar, in miniature: 60 GRPO steps of 8 x 4 at the recommended lr
    raise the mean reward of the last 10% of steps by >= 0.45 over the first 10% (measured
    0.59-0.70 over three seeds; the product bar is 0.3)."""
    check = load_module(REPO / "scripts/check_learnability.py", "check_learnability")
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(1234)
        means = check.run_grpo(model, tok, steps=60, batch=8, n=4, lr=check.RECOMMENDED_LR, seed=1234,
                               log=lambda _: None)
    finally:
        torch.set_num_threads(threads)
    first, last = check.summarize(means)
    assert first < 0.4 and last - first >= 0.45, (first, last, means)


def test_default_cache_is_the_repository_cache():
    """Regression: after the package move the default cache resolved to workers/.cache, so a clean
    clone rebuilt the model there and README's `.cache/models/` was never used."""
    assert tm.DEFAULT_CACHE_DIR == REPO / ".cache" / "models"
