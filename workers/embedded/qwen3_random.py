"""`model=qwen3_random`: a random-init small Qwen3-architecture model with the real Qwen3
tokenizer and chat template, built offline and cached like the tiny model.

`ensure_qwen3_random()` returns a Hugging Face model directory (`Qwen3ForCausalLM`, float32,
untied embeddings: vLLM CPU keeps a stale output layer after a weight reload when they are tied)
whose tokenizer files are the official Qwen3 ones (151,669 tokens, the original Qwen3 chat
template with `<think>` and hermes `<tool_call>` blocks) from the real-tokenizer cache
(workers/embedded/real_tokenizers.py; fetched once at install time). The weights are a seeded
random init: the model writes random tokens, so it earns no reward; it exists to run every part
of the product (vLLM, gateway rendering with the real template, trainer, weight sync) on a real
vocabulary and template, where the tiny model's home-made ones hide real-model failures.

Invariants: the build is a pure function of `Qwen3RandomRecipe` and the pinned tokenizer files;
the cache folder name carries a hash of both (tiny_model.cached_model_dir: complete or absent).
Callers: orchestrator/wiring/runtime.py (model.name=qwen3_random, model.path unset), tests.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from workers.embedded.real_tokenizers import NPM_PINS, tokenizer_dir
from workers.embedded.tiny_model import BUILD_THREADS, built_model_dir, cached_model_dir

QWEN3_VOCAB_SIZE = 151_669  # len() of the pinned Qwen3 tokenizer: the built model's vocab_size
RECIPE_VERSION = 1  # bump when the build code changes in a way the recipe fields don't capture


@dataclass(frozen=True)
class Qwen3RandomRecipe:
    """Everything the build depends on besides the tokenizer; its hash names the cache folder.

    Sizes: ~19.5 M parameters, nearly all in the two 151,669 x 64 embedding matrices (78 MB fp32).
    """

    seed: int = 0
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 1
    num_key_value_heads: int = 1
    head_dim: int = 64  # vLLM CPU attention supports 32, 64, 80, ...
    max_position_embeddings: int = 4096
    rope_theta: float = 1_000_000.0  # Qwen3's

    def key(self) -> str:
        blob = json.dumps({"v": RECIPE_VERSION, "tokenizer": vars(NPM_PINS["qwen3"]), **dataclasses.asdict(self)},
                          sort_keys=True)
        return f"qwen3-random-v{RECIPE_VERSION}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


DEFAULT_RECIPE = Qwen3RandomRecipe()


def ensure_qwen3_random(cache_dir: str | Path | None = None, recipe: Qwen3RandomRecipe = DEFAULT_RECIPE) -> Path:
    """Path of the built model, building it on first use (cache root as tiny_model's).

    Raises real_tokenizers.MissingRealTokenizers when the Qwen3 tokenizer has not been fetched.
    """
    tokenizer_dir("qwen3")  # fail early, naming the fetch command
    return cached_model_dir(cache_dir, recipe.key(), lambda out: build_qwen3_random(out, recipe))


def built_qwen3_random(cache_dir: str | Path | None = None, recipe: Qwen3RandomRecipe = DEFAULT_RECIPE) -> Path | None:
    """The folder `ensure_qwen3_random` returns if it is already built, else None (builds nothing)."""
    return built_model_dir(cache_dir, recipe.key())


def build_qwen3_random(out_dir: str | Path, recipe: Qwen3RandomRecipe = DEFAULT_RECIPE) -> Path:
    """Write tokenizer, config, generation config and seeded random weights into `out_dir`."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir("qwen3")))
    tokenizer.save_pretrained(out)
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = Qwen3Config(
        architectures=["Qwen3ForCausalLM"], vocab_size=len(tokenizer), hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size, num_hidden_layers=recipe.num_hidden_layers,
        num_attention_heads=recipe.num_attention_heads, num_key_value_heads=recipe.num_key_value_heads,
        head_dim=recipe.head_dim, max_position_embeddings=recipe.max_position_embeddings,
        rope_theta=recipe.rope_theta, tie_word_embeddings=False, bos_token_id=pad, eos_token_id=eos,
        pad_token_id=pad, dtype="float32",
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(BUILD_THREADS)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(recipe.seed)
            model = Qwen3ForCausalLM(config)
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(bos_token_id=pad, eos_token_id=[eos, pad], pad_token_id=pad).save_pretrained(out)
    (out / "recipe.json").write_text(json.dumps(dataclasses.asdict(recipe), indent=2, sort_keys=True) + "\n")
    for f in out.iterdir():
        f.chmod(0o644)
    out.chmod(0o755)
    return out
