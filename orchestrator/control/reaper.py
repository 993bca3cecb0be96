"""The run's reaper: whatever kills the driver (SIGKILL included), nothing it started outlives it.

`start_reaper(run_dir)` launches `python -m orchestrator.control.reaper` in its own session (a terminal's
Ctrl-C does not reach it) with a pipe from the driver on its stdin. Until the driver is gone, the
reaper records, every `SCAN_INTERVAL_S`, the driver's descendants (PID + start time: the local
stack's servers and agents, Ray's processes and actors, vLLM's engine cores) and the inodes of the
/dev/shm files they map (named semaphores `sem.mp-*`, weight-sync slots). When the driver's PID is
gone (the pipe closing at the driver's exit, however it happens, wakes it at once), it stops every
recorded process still alive with the same start time (SIGTERM, SIGKILL after `TERM_GRACE_S`),
unlinks the /dev/shm entries with a recorded inode, removes the checkpoint staging directories
a checkpoint write left behind (orchestrator/control/checkpoint.py `remove_staging`), and stops the
ACR sessions the run's open-session journal still holds (`stop_left_sessions`: through
StopRuntimeSession at the run's request rate, for at most `SWEEP_S`; on a run that ended normally the
journal is empty). The next start of the same run_dir stops what is left then (orchestrator/main.py),
e.g. when the reaper died with the driver's node.

Invariants: only processes descended from the driver (seen while it lived) are killed, each
matched by PID and start time (a reused PID is never hit); only /dev/shm files those processes
mapped are unlinked; the reaper never outlives its cleanup. Processes started in the last
`SCAN_INTERVAL_S` before a SIGKILL may escape it; each server the run starts also dies with its
parent by itself (workers/embedded/local_stack.py: PR_SET_PDEATHSIG) and Ray's own processes are
fate-shared by Ray.

Callers: orchestrator/main.py starts it first thing in `run`.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

SCAN_INTERVAL_S = 0.5  # between two records of the driver's descendants (seconds)
TERM_GRACE_S = 2.0  # SIGTERM -> SIGKILL for what outlived the driver: lets it run its own cleanup (seconds)
EXIT_POLL_S = 0.05  # once the pipe has closed, how often to look for the driver's PID (seconds)
SWEEP_S = 30.0  # the reaper's bound on stopping the ACR sessions a dead driver left open (seconds)
SHM_DIR = Path("/dev/shm")


class Reaper:
    """Driver-side handle: the reaper process and the pipe whose closing tells it the driver is gone."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc

    @property
    def pid(self) -> int:
        return self.proc.pid


def start_reaper(run_dir: Path, log_path: Path | None = None, *, acr_region: str | None = None,
                 acr_requests_per_s: float = 25.0) -> Reaper:
    """Start the reaper of this process (see the module docstring). The pipe stays open for this
    process's whole life: the kernel closes it when the process exits, however it exits.
    acr_region / acr_requests_per_s: the region (None: each ARN's own) and request rate of the
    StopRuntimeSession calls for what the run's session journal still holds."""
    log = open(log_path, "ab") if log_path is not None else subprocess.DEVNULL
    region = ["--acr-region", acr_region] if acr_region else []
    try:
        proc = subprocess.Popen([sys.executable, "-m", "orchestrator.control.reaper", "--parent", str(os.getpid()),
                                 "--run-dir", str(run_dir), "--acr-requests-per-s", str(acr_requests_per_s), *region],
                                stdin=subprocess.PIPE, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
                                env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                    p for p in (str(Path(__file__).resolve().parents[1]),
                                                os.environ.get("PYTHONPATH", "")) if p)})
    finally:
        if log is not subprocess.DEVNULL:
            log.close()
    return Reaper(proc)


def _shm_mapped(pid: int) -> set[int]:
    """Inodes of the /dev/shm files `pid` maps. Inodes, not names: glibc's sem_open maps a temp file
    and links it under the semaphore's name (sem.mp-*) before unlinking the temp name, so the maps
    show only the temp name, "(deleted)"; the inode is the same file's."""
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
            return {int(fields[4]) for fields in (line.split(None, 5) for line in f)
                    if len(fields) == 6 and fields[5].startswith(str(SHM_DIR) + "/")}
    except (OSError, ValueError):
        return set()


class Record:
    """What the reaper has seen of the driver's descendants: (pid, start time) and /dev/shm paths."""

    def __init__(self, parent: int) -> None:
        import psutil

        self._psutil = psutil
        self.parent = parent
        self.procs: dict[int, float] = {}
        self.shm: set[int] = set()  # inodes of /dev/shm files
        self._parent_created: float | None = None

    def scan(self) -> bool:
        """Record the driver's descendants now; False when the driver is gone."""
        ps = self._psutil
        try:
            parent = ps.Process(self.parent)
            if self._parent_created is None:
                self._parent_created = parent.create_time()
            if parent.create_time() != self._parent_created or parent.status() == ps.STATUS_ZOMBIE:
                return False
            children = parent.children(recursive=True)
        except ps.NoSuchProcess:
            return False
        me = os.getpid()
        for c in children:
            if c.pid == me:
                continue
            try:
                self.procs.setdefault(c.pid, c.create_time())
            except ps.NoSuchProcess:
                continue
            self.shm |= _shm_mapped(c.pid)
        self.shm |= _shm_mapped(self.parent)
        seen = {c.pid for c in children}
        self.rescan([pid for pid in self.alive() if pid not in seen])  # recorded, reparented since
        return True

    def rescan(self, pids: list[int]) -> None:
        """Record the /dev/shm mappings of `pids` (recorded processes, wherever they now hang)."""
        for pid in pids:
            self.shm |= _shm_mapped(pid)

    def alive(self) -> list[int]:
        """Recorded processes still running (same PID and start time, not a zombie)."""
        return still_running(self.procs.items())


def still_running(procs) -> list[int]:
    """PIDs of `procs` ((pid, create_time) pairs, create_time as psutil gives it) that still run the
    same process (a reused PID has another start time) and are not zombies."""
    import psutil

    out = []
    for pid, created in procs:
        try:
            p = psutil.Process(pid)
            if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            continue
    return out


def reap(record: Record, run_dir: Path | None) -> dict[str, int]:
    """Stop what is left of the run (SIGTERM, then SIGKILL after `TERM_GRACE_S`; its /dev/shm
    mappings are recorded once more first, a process may have made one on its way out), unlink
    its /dev/shm files, remove checkpoint staging dirs; returns how many of each were found."""
    left = record.alive()
    record.rescan(left)
    for pid in left:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + TERM_GRACE_S
    while (still := record.alive()) and time.monotonic() < deadline:
        time.sleep(EXIT_POLL_S)
    record.rescan(still)
    for pid in still:
        _signal(pid, signal.SIGKILL)
    unlinked = 0
    try:
        entries = [e for e in os.scandir(SHM_DIR) if e.inode() in record.shm]
    except OSError:
        entries = []
    for entry in entries:
        try:
            os.unlink(entry.path)
            unlinked += 1
        except OSError:
            pass
    staged = 0
    if run_dir is not None:
        from orchestrator.control.checkpoint import remove_staging

        staged = len(remove_staging(run_dir))
    return {"stopped": len(left), "killed": len(still), "shm_unlinked": unlinked, "staging_removed": staged}


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def watch(parent: int, stdin_fd: int, run_dir: Path | None) -> dict[str, int]:
    """Record the driver's descendants until `parent` is gone, then reap. The pipe on `stdin_fd`
    closing (the driver exiting) switches to fast polling; the driver's PID going away, pipe or not,
    ends the watch."""
    record = Record(parent)
    pipe_open = True
    while record.scan():
        if pipe_open:
            ready, _, _ = select.select([stdin_fd], [], [], SCAN_INTERVAL_S)
            pipe_open = not (ready and not os.read(stdin_fd, 4096))
        else:
            time.sleep(EXIT_POLL_S)
    return reap(record, run_dir)


def stop_left_sessions(run_dir: Path, *, region: str | None, requests_per_s: float, deadline_s: float):
    """Stop the ACR sessions the open-session journal of `run_dir` holds (workers/acr/sweep.py);
    returns the SweepResult. Never raises for a stop that failed (its entry stays)."""
    import asyncio

    from workers.acr.client import AcrClientConfig
    from workers.acr.sweep import sweep_run_dir

    return asyncio.run(sweep_run_dir(run_dir, AcrClientConfig(region_name=region), rate_per_s=requests_per_s,
                                     deadline_s=deadline_s))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="kill what a driver started once the driver is gone")
    p.add_argument("--parent", type=int, required=True)
    p.add_argument("--run-dir", default=None)
    p.add_argument("--acr-region", default=None)
    p.add_argument("--acr-requests-per-s", type=float, default=25.0)
    args = p.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the driver's end ends the reaper
    run_dir = Path(args.run_dir) if args.run_dir else None
    found = watch(args.parent, sys.stdin.fileno(), run_dir)
    print(f"reaper: driver {args.parent} gone; {found}", flush=True)
    if run_dir is not None:  # after the processes: no rollout actor still uses a session
        swept = stop_left_sessions(run_dir, region=args.acr_region, requests_per_s=args.acr_requests_per_s,
                                   deadline_s=SWEEP_S)
        if swept.found:
            print(f"reaper: ACR sessions left open: {swept}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
