"""Datasets in the formats users have (JSONL, Parquet in verl's schema, `datasets` save_to_disk)
through one loader; a bad row is named (file, row, field) by pre-flight, before anything starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.config import ConfigError
from orchestrator.control.preflight import preflight
from stand_ins import REPO, compose_config
from workers.core.tasks import custom, gsm8k
from workers.core.tasks.dataset_files import DatasetError, read_records

GSM8K = [{"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7"},
         {"question": "A box holds 1,200 pens; 200 are sold. How many are left?", "answer": "#### 1,000"}]


def verl_rows() -> list[dict]:
    """GSM8K rows as verl's examples/data_preprocess/gsm8k.py writes them."""
    return [{"data_source": "openai/gsm8k", "ability": "math",
             "prompt": [{"role": "user", "content": r["question"] + " Let's think step by step."}],
             "reward_model": {"style": "rule", "ground_truth": r["answer"].rsplit("#### ", 1)[1].replace(",", "")},
             "extra_info": {"split": "train", "index": i, "answer": r["answer"], "question": r["question"]}}
            for i, r in enumerate(GSM8K)]


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_parquet(path, rows) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def write_save_to_disk(path, rows) -> str:
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return str(path)


@pytest.mark.parametrize("writer,name", [(write_jsonl, "g.jsonl"), (write_parquet, "g.parquet"),
                                         (write_save_to_disk, "g_disk")])
def test_gsm8k_reads_every_format_and_verls_schema_alike(tmp_path, writer, name):
    own = gsm8k.read_file(_written(writer, tmp_path / name, GSM8K))
    verl = gsm8k.read_file(_written(writer, tmp_path / f"verl-{name}", verl_rows()))
    expected = [(r["question"], n) for r, n in zip(GSM8K, (7, 1000))]
    assert [(r["question"], r["answer"]) for r in own] == expected
    assert [(r["question"], r["answer"]) for r in verl] == expected
    assert len({r["input_id"] for r in own}) == 2


@pytest.mark.parametrize("writer,name", [(write_jsonl, "c.jsonl"), (write_parquet, "c.parquet"),
                                         (write_save_to_disk, "c_disk")])
def test_custom_rows_pass_every_field_through(tmp_path, writer, name):
    rows = custom.load_rows(_written(writer, tmp_path / name, verl_rows()), "prompt", None, 0, 3)
    stem = Path(name).stem
    assert [r["input_id"] for r in rows] == [f"{stem}-0", f"{stem}-1"]  # extra_info.index
    for row, src in zip(rows, verl_rows()):
        assert row == {**src, "input_id": row["input_id"], "max_turns": 3}


def test_a_dataset_dict_directory_names_its_splits(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(GSM8K)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DatasetError, match=r"a DatasetDict \(splits: train\); point the path at one split"):
        read_records(tmp_path / "dd")
    assert len(read_records(tmp_path / "dd" / "train")) == 2


@pytest.mark.parametrize("content,where", [
    (b"", r"bad.jsonl: no rows"),
    (json.dumps(GSM8K[0]).encode() + b"\n" + json.dumps({"question": "q?"}).encode() + b"\n",
     r"^task.data_path: .*bad.jsonl:2: missing field 'answer'"),
    (json.dumps(GSM8K[0]).encode() + b"\n\n" + b'{"question": "caf\xe9", "answer": "#### 1"}\n',
     r"bad.jsonl:3: not UTF-8"),
])
def test_preflight_names_file_row_and_field(tmp_path, content, where):
    (tmp_path / "bad.jsonl").write_bytes(content)
    cfg = compose_config(["task=gsm8k", f"task.data_path={tmp_path / 'bad.jsonl'}"], run_dir=tmp_path / "run")
    with pytest.raises(ConfigError, match=where):
        preflight(cfg)
    assert not (tmp_path / "run").exists()  # stopped before anything was created


def test_custom_rows_need_the_prompt_field_and_no_reserved_key(tmp_path):
    write_jsonl(tmp_path / "c.jsonl", [{"prompt": "hi"}, {"question": "no prompt"}])
    with pytest.raises(DatasetError, match=r"c.jsonl:2: missing field 'prompt'"):
        custom.read_rows(tmp_path / "c.jsonl", "prompt")
    write_jsonl(tmp_path / "c.jsonl", [{"prompt": "hi", "_rollout": {}}])
    with pytest.raises(DatasetError, match=r"c.jsonl:1: field '_rollout' is reserved"):
        custom.read_rows(tmp_path / "c.jsonl", "prompt")
    write_jsonl(tmp_path / "c.jsonl", [{"prompt": "a", "input_id": "x"}, {"prompt": "b", "input_id": "x"}])
    with pytest.raises(DatasetError, match=r"c.jsonl:2: field 'input_id' 'x' repeats .*c.jsonl:1"):
        custom.read_rows(tmp_path / "c.jsonl", "prompt")


def test_main_stops_on_a_bad_row_with_config_error_and_exit_2(tmp_path):
    """A non-UTF-8 line: `config error:` naming file and line, exit 2, nothing started (no run_dir)."""
    (tmp_path / "bad.jsonl").write_bytes(json.dumps(GSM8K[0]).encode() + b"\n\xff\xfe\n")
    out = subprocess.run([sys.executable, "-m", "orchestrator.main", "task=gsm8k",
                          f"task.data_path={tmp_path / 'bad.jsonl'}", f"run_dir={tmp_path / 'run'}"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"config error: task.data_path: {tmp_path / 'bad.jsonl'}:2: not UTF-8" in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "run").exists()


def _written(writer, path, rows) -> Path:
    return Path(writer(path, rows))
