"""Checkpoints: save and resume everything a run needs to continue without losing a prompt.

Layout under `RUN_DIR/checkpoints/`:

    step-00000010/          one checkpoint (the optimizer-update count in the name)
        model/              HF model directory (config.json, model.safetensors, tokenizer files)
        optimizer.pt        full AdamW state + num_updates (`TrainerWorker.save_optimizer`)
        run_state.json      RunState: step, policy version, prompt cursor + RNG, admission counters,
                            prompts drawn but not yet trained (re-dispatched first on resume)
        manifest.json       size and sha256 of every other file; written last
    latest -> step-00000010 a relative symlink to the newest complete checkpoint; replaced atomically
                            (run dirs written before 2026-12 hold a text file naming it: still read)

Invariant: `latest` only ever names a complete checkpoint. A checkpoint is written in a hidden
staging directory, its manifest last, then renamed into place, and only then is `latest`
replaced (a temp symlink + os.replace, so `ls`, `cd` and `model.path=RUN/checkpoints/latest/model`
see a directory). Every reader (`latest_checkpoint_dir`) accepts the symlink and the text file
earlier versions wrote, so their run dirs still resume. Loading verifies every manifest entry
(present, same size, same sha256) and refuses a corrupt or partial checkpoint with
`CheckpointError`; nothing is half-loaded. A crash before the pointer moves leaves the previous
checkpoint in charge; what it leaves half-written (the hidden staging directory, a pointer's temp
link) is removed by `remove_staging`, which the run's reaper (orchestrator/control/reaper.py) and
the next start's pre-flight call.

Pure file I/O, no Ray. The trainer writes its own files into the paths a
`CheckpointStage` hands out. Callers: `orchestrator/loop/async_loop.py`, `orchestrator/main.py`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from orchestrator.loop.prompts import PromptCycleState
from orchestrator.loop.staleness import AdmissionState

FORMAT_VERSION = 1  # bump when RunState's JSON shape changes incompatibly
CHECKPOINTS_DIRNAME = "checkpoints"
LATEST_FILENAME = "latest"
MANIFEST_FILENAME = "manifest.json"
RUN_STATE_FILENAME = "run_state.json"
MODEL_DIRNAME = "model"
OPTIMIZER_FILENAME = "optimizer.pt"
_HASH_CHUNK_BYTES = 1 << 20  # read size when hashing checkpoint files


class CheckpointError(RuntimeError):
    """A checkpoint is missing, partial or corrupt (the message names the file)."""


@dataclass(frozen=True)
class RunState:
    """The driver's state at a checkpoint (JSON).

    step: optimizer updates done. policy_version: the version the saved weights carry.
    next_group_id: the id the next admitted group gets. prompts: PromptCycle state, or the
    DifficultySampler's JSON state (a dict with `kind: difficulty`) under task.sampler=difficulty.
    admission: staleness counters (`Admission.state()`). pending_rows: dataset rows drawn from
    `prompts` whose groups were running or buffered but not trained at save time; a resumed run
    dispatches them before drawing new rows, so no prompt is lost. counters: the run's cumulative
    counters at the checkpoint (the ledger's `settled_counts()`), continued by the resumed run.
    """

    step: int
    policy_version: int
    next_group_id: int
    prompts: PromptCycleState | dict
    admission: AdmissionState
    pending_rows: tuple[dict, ...] = ()
    counters: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.step < 0 or self.policy_version < 0 or self.next_group_id < 0:
            raise ValueError(f"RunState counters must be >= 0: step={self.step}, "
                             f"policy_version={self.policy_version}, next_group_id={self.next_group_id}")
        if self.admission.policy_version != self.policy_version:
            raise ValueError(f"RunState.policy_version {self.policy_version} differs from the admission "
                             f"state's {self.admission.policy_version}")

    def to_json(self) -> dict:
        return {
            "format": FORMAT_VERSION,
            "step": self.step,
            "policy_version": self.policy_version,
            "next_group_id": self.next_group_id,
            "prompts": self.prompts if isinstance(self.prompts, dict) else self.prompts.to_json(),
            "admission": {"policy_version": self.admission.policy_version,
                          "trained_groups": self.admission.trained_groups},
            "pending_rows": list(self.pending_rows),
            "counters": dict(self.counters),
        }

    @classmethod
    def from_json(cls, d: dict) -> RunState:
        """Raises CheckpointError on another format version, a missing key or a bad value."""
        if d.get("format") != FORMAT_VERSION:
            raise CheckpointError(f"run state format {d.get('format')!r}, this code reads {FORMAT_VERSION}")
        try:
            return cls(
                step=int(d["step"]),
                policy_version=int(d["policy_version"]),
                next_group_id=int(d["next_group_id"]),
                prompts=(dict(d["prompts"]) if d["prompts"].get("kind") == "difficulty"
                         else PromptCycleState.from_json(d["prompts"])),
                admission=AdmissionState(int(d["admission"]["policy_version"]), int(d["admission"]["trained_groups"])),
                pending_rows=tuple(d["pending_rows"]),
                counters={str(k): int(v) for k, v in d.get("counters", {}).items()},  # absent before counters
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"run state is malformed: {type(e).__name__}: {e}") from e


@dataclass(frozen=True)
class Checkpoint:
    """A verified checkpoint on disk."""

    path: Path
    state: RunState

    @property
    def model_dir(self) -> Path:
        """HF model directory: give it to TrainerSettings.model_path and the inference replicas."""
        return self.path / MODEL_DIRNAME

    @property
    def optimizer_path(self) -> Path:
        """For `TrainerWorker.load_optimizer`."""
        return self.path / OPTIMIZER_FILENAME


def checkpoints_dir(run_dir: Path | str) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIRNAME


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _point_latest(root: Path, name: str) -> None:
    """Make `root/latest` a relative symlink to `name` (a checkpoint directory beside it), atomically:
    a temp link in the same directory, then os.replace over the old pointer (a link, or the text
    file of earlier versions), so a reader sees the old checkpoint or the new one, never none."""
    tmp = root / f".{LATEST_FILENAME}-{os.getpid()}-{os.urandom(4).hex()}.tmp"
    os.symlink(name, tmp, target_is_directory=True)
    try:
        os.replace(tmp, root / LATEST_FILENAME)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    with contextlib.suppress(OSError):  # the rename's durability, as the manifest's; best effort
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temp file in the same directory and os.replace."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class CheckpointStage:
    """A checkpoint being written. Use as a context manager:

        with stage_checkpoint(run_dir, step) as stage:
            await trainer.save_hf(str(stage.model_dir))            # or the actor's .remote(...)
            await trainer.save_optimizer(str(stage.optimizer_path))
            path = stage.commit(run_state)

    Leaving the block without `commit` (or by an exception) deletes the staging directory and
    leaves `latest` untouched.
    """

    def __init__(self, run_dir: Path, step: int, keep_last: int) -> None:
        if step < 0:
            raise ValueError(f"checkpoint step must be >= 0, got {step}")
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self._root = checkpoints_dir(run_dir)
        self._root.mkdir(parents=True, exist_ok=True)
        self.step = step
        self._keep_last = keep_last
        self.staging_dir = Path(tempfile.mkdtemp(dir=self._root, prefix=f".{checkpoint_name(step)}-staging-"))
        self._done = False

    @property
    def model_dir(self) -> Path:
        return self.staging_dir / MODEL_DIRNAME

    @property
    def optimizer_path(self) -> Path:
        return self.staging_dir / OPTIMIZER_FILENAME

    def commit(self, state: RunState) -> Path:
        """Write run_state.json and the manifest, move the checkpoint into place, point `latest` at
        it, prune old ones; return its final path.

        Raises:
            CheckpointError: the model directory or optimizer file was not written, the run state
                does not belong to this step, or a pending row is not JSON-serializable.
        """
        if self._done:
            raise CheckpointError("commit on a finished checkpoint stage")
        if state.step != self.step:
            raise CheckpointError(f"run state is for step {state.step}, the stage for step {self.step}")
        if not (self.model_dir / "config.json").is_file():
            raise CheckpointError(f"{self.model_dir} holds no HF model (config.json missing): save the weights first")
        if not self.optimizer_path.is_file():
            raise CheckpointError(f"{self.optimizer_path} missing: save the optimizer state first")
        try:
            text = json.dumps(state.to_json(), indent=1)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"run state is not JSON-serializable (pending_rows?): {e}") from e
        (self.staging_dir / RUN_STATE_FILENAME).write_text(text, encoding="utf-8")

        files = {}
        for p in sorted(self.staging_dir.rglob("*")):
            if p.is_file():
                _fsync(p)
                rel = p.relative_to(self.staging_dir).as_posix()
                files[rel] = {"size_bytes": p.stat().st_size, "sha256": _sha256(p)}
        manifest = {"format": FORMAT_VERSION, "step": self.step, "files": files}
        _write_atomic(self.staging_dir / MANIFEST_FILENAME, json.dumps(manifest, indent=1))

        final = self._root / checkpoint_name(self.step)
        if final.exists():  # left by a crash before its pointer moved, or an earlier run: replace it
            shutil.rmtree(final)
        os.replace(self.staging_dir, final)
        _point_latest(self._root, final.name)
        self._done = True
        self._prune(keep=final.name)
        return final

    def _prune(self, keep: str) -> None:
        done = sorted(p for p in self._root.glob("step-*") if p.is_dir())
        for p in done[: max(0, len(done) - self._keep_last)]:
            if p.name != keep:
                shutil.rmtree(p, ignore_errors=True)

    def abort(self) -> None:
        if not self._done:
            shutil.rmtree(self.staging_dir, ignore_errors=True)
            self._done = True

    def __enter__(self) -> CheckpointStage:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.abort()


def remove_staging(run_dir: Path | str) -> list[Path]:
    """Remove what interrupted checkpoint writes left under `RUN_DIR/checkpoints/` (hidden staging
    directories, temp files of the `latest` pointer); returns the paths removed. Never touches a
    committed checkpoint or `latest`. Call it only when no checkpoint is being written."""
    root = checkpoints_dir(run_dir)
    removed = []
    for p in sorted(root.glob(".step-*-staging-*")) + sorted(root.glob(f".{LATEST_FILENAME}-*.tmp")):
        if p.is_dir() and not p.is_symlink():  # a pointer's temp link to a checkpoint: unlinked, never followed
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p)
    return removed


def stage_checkpoint(run_dir: Path | str, step: int, *, keep_last: int = 2) -> CheckpointStage:
    """Start writing the checkpoint of `step` under `run_dir`; keep the newest `keep_last` ones."""
    return CheckpointStage(Path(run_dir), step, keep_last)


def load_checkpoint(path: Path | str) -> Checkpoint:
    """Verify and read the checkpoint at `path`.

    Raises:
        CheckpointError: no manifest, a file missing, of another size or sha256, an unlisted
            file where a listed one is expected, or a malformed run state.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint directory at {path}")
    manifest_path = path / MANIFEST_FILENAME
    if not manifest_path.is_file():
        raise CheckpointError(f"{path} is partial: {MANIFEST_FILENAME} missing")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{manifest_path} is corrupt: {e}") from e
    if manifest.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{manifest_path}: format {manifest.get('format')!r}, this code reads {FORMAT_VERSION}")
    for required in (RUN_STATE_FILENAME, OPTIMIZER_FILENAME, f"{MODEL_DIRNAME}/config.json"):
        if required not in files:
            raise CheckpointError(f"{path} is partial: the manifest lists no {required}")
    for rel, meta in files.items():
        f = path / rel
        if not f.is_file():
            raise CheckpointError(f"{path} is partial: {rel} missing")
        if f.stat().st_size != meta["size_bytes"]:
            raise CheckpointError(f"{f} is corrupt: {f.stat().st_size} bytes, the manifest says {meta['size_bytes']}")
        if _sha256(f) != meta["sha256"]:
            raise CheckpointError(f"{f} is corrupt: sha256 differs from the manifest")
    try:
        state = RunState.from_json(json.loads((path / RUN_STATE_FILENAME).read_text(encoding="utf-8")))
    except ValueError as e:  # JSON decode (CheckpointError is a RuntimeError and passes through)
        raise CheckpointError(f"{path / RUN_STATE_FILENAME} is not JSON: {e}") from e
    if state.step != manifest.get("step"):
        raise CheckpointError(f"{path}: run state step {state.step} differs from the manifest's {manifest.get('step')}")
    return Checkpoint(path, state)


def load_latest(run_dir: Path | str) -> Checkpoint | None:
    """The checkpoint `RUN_DIR/checkpoints/latest` names, verified; None when there is no pointer
    (a fresh run). Raises CheckpointError when the pointer names a missing or bad checkpoint."""
    path = latest_checkpoint_dir(run_dir)
    return load_checkpoint(path) if path is not None else None


def latest_checkpoint_dir(run_dir: Path | str) -> Path | None:
    """The checkpoint directory `RUN_DIR/checkpoints/latest` names (not verified), None when there
    is no pointer. Reads both forms of the pointer (see the module docstring). Raises
    CheckpointError when it names no checkpoint directory beside it."""
    pointer = checkpoints_dir(run_dir) / LATEST_FILENAME
    return _pointed_to(pointer) if _is_pointer(pointer) else None


def has_latest(run_dir: Path | str) -> bool:
    """`RUN_DIR/checkpoints/latest` is there (either form; whether it names a good checkpoint is
    `load_latest`'s to say)."""
    return _is_pointer(checkpoints_dir(run_dir) / LATEST_FILENAME)


def _is_pointer(path: Path) -> bool:
    """A `latest` pointer is there: a symlink (even a dangling one) or an earlier version's file."""
    return path.is_symlink() or path.is_file()


def _pointed_to(pointer: Path) -> Path:
    """The checkpoint directory `pointer` names: the target of the symlink, or the name in the
    text file earlier versions wrote; CheckpointError when it names none (not a plain checkpoint
    name beside it, or a directory that does not exist)."""
    name = os.readlink(pointer) if pointer.is_symlink() else pointer.read_text(encoding="utf-8").strip()
    if not name or "/" in name or name.startswith("."):
        raise CheckpointError(f"{pointer} holds {name!r}, not a checkpoint name")
    target = pointer.parent / name
    if not target.is_dir():
        raise CheckpointError(f"{pointer} names {name}, which does not exist")
    return target


def resolve_latest(path: Path | str) -> Path:
    """`path` with a `checkpoints/latest` component replaced by the checkpoint it names, so the
    documented `model.path=RUN/checkpoints/latest/model` names the newest checkpoint's model by
    its own path (one that a later save does not move; an earlier version's pointer is a text file,
    not a directory). Any other path comes back unchanged. Raises CheckpointError when the pointer
    is there but names nothing usable."""
    p = Path(path)
    for i, part in enumerate(p.parts):
        if part != LATEST_FILENAME or i == 0 or p.parts[i - 1] != CHECKPOINTS_DIRNAME:
            continue
        pointer = Path(*p.parts[:i + 1])
        if not _is_pointer(pointer):
            return p
        return Path(_pointed_to(pointer), *p.parts[i + 1:])
    return p
