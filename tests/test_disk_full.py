"""A full disk (issue 47, item 5): with the run directory on a 3 MB tmpfs the weight export failed
inside the trainer actor with a raw traceback and no summary.json. The out-of-space error, however
Ray wraps it, now ends the run with `run failed:` naming the path and what was being written (exit 1)
and a summary.json that says so; any other error is left alone."""

from __future__ import annotations

import errno
import json

import pytest
from ray.exceptions import RayTaskError

import orchestrator.main as entry
from orchestrator.control.disk_full import disk_full, disk_full_message, what_was_written
from stand_ins import compose_config


def _enospc(path) -> OSError:
    return OSError(errno.ENOSPC, "No space left on device", str(path))


def _as_ray_raises(cause: OSError) -> BaseException:
    """The error as the driver receives it from a trainer actor's method (Ray's dual-class wrapper)."""
    try:
        raise cause
    except OSError as c:
        return RayTaskError("TrainerShell.export_weights", "Traceback ...", c).as_instanceof_cause()


def test_disk_full_is_found_through_rays_wrapper_causes_and_groups(tmp_path):
    wrapped = _as_ray_raises(_enospc(tmp_path / "weights" / "policy-v3.safetensors"))
    assert disk_full(wrapped).path == str(tmp_path / "weights" / "policy-v3.safetensors")
    try:
        try:
            raise _enospc(tmp_path / "metrics.jsonl")
        except OSError as e:
            raise RuntimeError("step end failed") from e
    except RuntimeError as chained:
        assert disk_full(chained).path.endswith("metrics.jsonl")
    assert disk_full(ExceptionGroup("loop", [ValueError("x"), wrapped])) is not None
    assert disk_full(OSError(errno.EACCES, "Permission denied", "/x")) is None
    assert disk_full(RuntimeError("no space in the queue")) is None


def test_what_was_written_is_named_by_its_place_in_the_run_dir(tmp_path):
    assert "weight sync" in what_was_written(str(tmp_path / "weights" / "policy-v1.safetensors"), tmp_path)
    assert "checkpoint" in what_was_written(str(tmp_path / "checkpoints" / ".staging-3" / "optimizer.pt"), tmp_path)
    assert "outside the run directory" in what_was_written("/elsewhere/x", tmp_path)
    line = disk_full_message(disk_full(_enospc(tmp_path / "weights" / "p.safetensors")), tmp_path)
    assert line.startswith(f"no space left on device writing {tmp_path / 'weights' / 'p.safetensors'}: the policy")
    assert "trainer.resume_mode=auto" in line


def test_the_entry_point_ends_a_full_disk_run_with_run_failed_and_a_summary(tmp_path, monkeypatch, capsys):
    """The write made to fail as the tmpfs made it: the trainer actor's export raises ENOSPC after
    two logged steps; the driver exits 1 with one line and writes summary.json."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n" + json.dumps({"step": 2}) + "\n")
    failing = _as_ray_raises(_enospc(run_dir / "weights" / "policy-v3.safetensors"))

    def run(cfg):
        raise failing

    monkeypatch.setattr(entry, "run", run)
    with pytest.raises(SystemExit) as exit_:
        entry._run_and_exit(compose_config(run_dir=run_dir))
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith(f"run failed: no space left on device writing {run_dir / 'weights'}")
    assert "Traceback" not in err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["interrupted"] is False and "no space left" in summary["failed"]


def test_any_other_error_is_not_reworded(tmp_path, monkeypatch):
    monkeypatch.setattr(entry, "run", lambda cfg: (_ for _ in ()).throw(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):
        entry._run_and_exit(compose_config(run_dir=tmp_path / "run"))
    assert not (tmp_path / "run" / "summary.json").exists()
