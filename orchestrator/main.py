"""Hydra entry point: `python -m orchestrator.main key=value ...`.

compose (Hydra) -> validate (`to_run_config`: a bad value exits with status 2 and a message naming
the key, before Ray or any server starts) -> pre-flight (orchestrator/control/preflight.py: file-system
checks, checkpoint, run_dir) -> build the parts (orchestrator/wiring/) -> run the sync or async
loop -> report (`RUN_DIR/summary.json`; the loop writes `RUN_DIR/metrics.jsonl`). `mode=eval`
builds no trainer and evaluates instead (orchestrator/evaluate.py: `RUN_DIR/eval.jsonl`,
`RUN_DIR/eval_summary.json`).

`dry_run=true` prints the plan (orchestrator/planning/dry_run.py) and starts nothing.

Exit status: 0 done (or a dry run that fits), 1 nothing trained (no rollout completed, or every
group was filtered), 2 config / checkpoint / GPU-placement error (or a dry run that does not fit),
3 a trainer rank died (the message names it and the checkpoint to resume from), 130 interrupted
(Ctrl-C or SIGTERM).

Invariant: everything this process starts is stopped on every exit path (normal end, error,
Ctrl-C, SIGTERM), servers by PID and actors through Ray; nothing is stopped by name. SIGINT and
SIGTERM are handled from this module's first line (orchestrator/control/stopping.py): before pre-flight
passed a signal exits at once (nothing started); after it, the first one unwinds the start, the
parts' build or the loop, and the run ends with `interrupted: true` in summary.json; a second one
exits without unwinding, once summary.json (`interrupted: true`) and the report are written
(`_last_words`, bounded). A driver killed outright (SIGKILL), or by a second signal, leaves the
cleanup to the run's reaper (orchestrator/control/reaper.py), started before anything else.
"""

from __future__ import annotations

if __name__ == "__main__":  # first, before the imports below take seconds: a Ctrl-C there is one line, exit 130
    from orchestrator.control.stopping import install_before_start

    install_before_start()

import asyncio
import contextlib
import dataclasses
import math
import sys
import threading
import time
from pathlib import Path
from typing import NoReturn

import hydra
from omegaconf import DictConfig, OmegaConf

from orchestrator.config import (ConfigError, RunConfig, acr_region, async_loop_settings, register, sync_loop_settings,
                                 to_run_config)
from orchestrator.watch.console_log import quiet_console
from orchestrator.watch.progress import phase, summary_text
from orchestrator.watch.run_watch import nothing_trained, stopped_early

register()
ENGINE_STOP_S = 2.0  # a vLLM engine-core process still there this long after SIGTERM is killed (seconds)
_STARTED: list[Path] = []  # the run_dir of the run this process started (pre-flight passed)
LEFT_SESSIONS_S = 60.0  # bound on stopping the ACR sessions an earlier run left open, at start (seconds)
REPORT_JOIN_S = 20.0  # an interrupted run waits this long at most for its report, drawn while it stops (seconds)
_INTERRUPTED_REPORT: list[threading.Thread] = []  # that report's drawing thread
_REPORT_DRAWN: list[Path] = []  # the report.html it wrote
_SUMMARY_WRITTEN: list[Path] = []  # the run dirs whose summary.json this process wrote


def _write_summary(run_dir: Path, summary: dict, pre, t_start: float) -> None:
    summary["resumed_from_step"] = pre.checkpoint.state.step if pre.checkpoint else None
    summary["wall_s"] = time.monotonic() - t_start
    from orchestrator.watch.metrics import write_summary

    write_summary(run_dir / "summary.json", summary)
    _SUMMARY_WRITTEN.append(run_dir)


def _own_run_dir(cfg: RunConfig, pre, t_start: float) -> None:
    """Past pre-flight: this run owns run_dir, its report is ours to write; a training run's second
    signal writes its summary and report before it exits (`_last_words`)."""
    _STARTED.append(pre.run_dir)
    if cfg.mode.name != "eval":  # an evaluation writes eval_summary.json as it ends, no summary.json
        from orchestrator.control.stopping import before_exit_at_once

        before_exit_at_once(lambda: _last_words(pre, t_start))


def _last_words(pre, t_start: float) -> None:
    """What a second signal leaves (orchestrator/control/stopping.py `exit_at_once`, in a thread while
    the main thread stands still): summary.json unless this process wrote one already (the
    interrupted run's own, written once its loop stopped), else `interrupted: true`,
    `exited_at_once: true`, the step and policy version of the last logged step (or of the resumed
    checkpoint), the other totals missing; and the report: the drawing the first signal started is
    waited for, else it is drawn now. Each outcome one line on stderr (os.write: a print may be
    what the signal interrupted)."""
    import os

    run_dir = pre.run_dir
    if run_dir not in _SUMMARY_WRITTEN:
        last, state = _last_logged_record(run_dir), pre.checkpoint.state if pre.checkpoint else None
        _write_summary(run_dir, {"steps": int(last.get("step", state.step if state else 0)),
                                 "policy_version": int(last.get("policy_version", state.policy_version if state else 0)),
                                 "interrupted": True, "exited_at_once": True}, pre, t_start)
    for thread in _INTERRUPTED_REPORT:
        thread.join()  # the caller bounds the whole
    where = " (no step was logged: no report)"
    if not _INTERRUPTED_REPORT:
        from orchestrator.watch.report import write_run_report

        try:
            if (path := write_run_report(run_dir)) is not None:
                _REPORT_DRAWN.append(path)
        except Exception as exc:  # noqa: BLE001  the summary is written; say why the report is not
            where = f"; the report was not drawn ({exc!r}): python -m orchestrator.watch.report {run_dir}"
    if _REPORT_DRAWN:
        where = f"; report: {_REPORT_DRAWN[-1]}"
    os.write(2, f"summary.json written (interrupted: true){where}\n".encode())


def _draw_report_while_stopping(run_dir: Path) -> None:
    """Start drawing RUN_DIR/report/ in a thread: an interrupted run's parts take seconds to shut
    down (engines, Ray), the plots are drawn meanwhile instead of after (`_report_at_end` joins)."""
    def draw() -> None:
        from orchestrator.watch.report import write_run_report

        with contextlib.suppress(Exception):  # the report is best effort; the exit line says so
            if (path := write_run_report(run_dir)) is not None:
                _REPORT_DRAWN.append(path)

    thread = threading.Thread(target=draw, name="interrupted-run-report", daemon=True)
    thread.start()
    _INTERRUPTED_REPORT.append(thread)


def run(cfg: RunConfig) -> dict:
    """Run the whole job described by `cfg`; return the summary (also written to summary.json).
    Raises ConfigError / CheckpointError from pre-flight, before anything starts. The first SIGINT
    or SIGTERM ends the run early: the summary then says `interrupted: true`."""
    from orchestrator.control.preflight import preflight
    from orchestrator.control.stopping import install_unwinding, mark

    t_start = time.monotonic()
    pre = preflight(cfg)
    run_dir = pre.run_dir
    install_unwinding()  # from here a signal unwinds what was started and summary.json says interrupted
    try:
        return _run_started(cfg, pre, t_start)
    except KeyboardInterrupt:  # outside the event loop: starting the local stack or Ray, or stopping
        summary = _interrupted_before_a_step(pre)
        if cfg.mode.name != "eval":  # an evaluation writes eval_summary.json, not summary.json
            _write_summary(run_dir, summary, pre, t_start)
            mark("summary.json written")
        return summary


def _stop_left_sessions(cfg: RunConfig, run_dir: Path) -> None:
    """Stop the ACR sessions an earlier run of `run_dir` left open (its driver was killed with its
    reaper: a lost node), before this run opens any; one line says what was found."""
    from orchestrator.control.reaper import stop_left_sessions

    acr = cfg.rollout.acr
    swept = stop_left_sessions(run_dir, region=acr_region(acr), requests_per_s=acr.limits.requests_per_s,
                               deadline_s=LEFT_SESSIONS_S)
    if swept.found:
        kept = (f"; {swept.kept} could not be stopped now and stay in {run_dir}/acr_sessions/ for the next start "
                "(they end at ACR's idle timeout otherwise)" if swept.kept else "")
        print(f"an earlier run of this run_dir left {swept.found} ACR session(s) in its journal: {swept.stopped} "
              f"stopped now, {swept.not_open} already closed, {swept.local} on its own local emulator (gone with "
              f"it){kept}", flush=True)


def _interrupted_before_a_step(pre) -> dict:
    """The summary of a run stopped before its loop ran a step: the resumed checkpoint's step, if any."""
    return {"steps": pre.checkpoint.state.step if pre.checkpoint else 0, "interrupted": True}


def _run_started(cfg: RunConfig, pre, t_start: float) -> dict:
    """`run` once pre-flight passed: every exit path stops what it started (the ExitStack)."""
    from orchestrator.wiring.runtime import start_runtime
    from orchestrator.control.reaper import start_reaper
    from orchestrator.control.stopping import Interrupts, RunInterrupted, install_unwinding, mark

    run_dir = pre.run_dir
    (run_dir / "logs").mkdir(exist_ok=True)
    acr = cfg.rollout.acr
    start_reaper(run_dir, run_dir / "logs" / "reaper.log", acr_region=acr_region(acr),  # however this process
                 acr_requests_per_s=acr.limits.requests_per_s)  # ends, what it started ends too
    _stop_left_sessions(cfg, run_dir)
    if pre.checkpoint is not None:
        state = pre.checkpoint.state
        print(f"resuming from {pre.checkpoint.path} (step {state.step}, policy version {state.policy_version})",
              flush=True)
    from orchestrator.control.resume_config import run_config_dict

    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(run_config_dict(cfg)))  # what a resume is compared with
    print(f"run_dir: {run_dir}", flush=True)
    _own_run_dir(cfg, pre, t_start)
    quiet_console(run_dir, cfg.logger.console_level)  # library output to RUN_DIR/logs/ from here on
    interrupts = Interrupts()
    with contextlib.ExitStack() as stack:
        stack.callback(mark, "local stack stopped")  # runs last: the stack unwinds last in, first out
        rt = start_runtime(cfg, pre, stack)
        install_unwinding()  # ray.init installed its own SIGTERM handler

        if cfg.mode.name == "eval":
            from orchestrator.evaluate import run_eval

            summary = asyncio.run(run_eval(cfg, rt, stack))
        else:
            try:
                summary = asyncio.run(_train(cfg, rt, stack, interrupts, pre, t_start))
            except RunInterrupted:  # while the parts were being built: no rollout ran
                summary = _interrupted_before_a_step(pre)
                if rt.local is not None:
                    with contextlib.suppress(Exception):  # the emulator's own count
                        summary["acr/sessions_open_at_exit"] = rt.local.stats().sessions_open
        install_unwinding()  # the loop's handlers went with the loop
    if cfg.mode.name == "eval":
        from orchestrator.watch.eval_report import eval_summary_text

        print(eval_summary_text(summary), flush=True)
        print(f"run_dir: {run_dir} (eval.jsonl, eval_summary.json)", flush=True)
        if (run_dir / "report" / "report.html").is_file():
            print(f"report: {run_dir / 'report' / 'report.html'}", flush=True)
        return {"rollout/completed": summary["completed"], "rollout/failed": summary["failed"]}
    _write_summary(run_dir, summary, pre, t_start)
    mark("summary.json written")
    if not summary["interrupted"]:  # an interrupted run says one line (main), the file has the rest
        print(summary_text(summary), flush=True)
        print(f"run_dir: {run_dir} (summary.json, metrics.jsonl, logs/)", flush=True)
    return summary


async def _train(cfg: RunConfig, rt, stack: contextlib.ExitStack, interrupts, pre, t_start: float) -> dict:
    """The training run inside the started runtime: its attempts, then the summary."""
    from orchestrator.control.stopping import mark

    interrupts.install()  # from here on the first signal stops the loop, not the process
    report, built, engines_down, restarts = await _train_attempts(cfg, rt, stack, interrupts)
    summary = await _summary(report, built, rt.local)
    summary["trainer/restarts"] = restarts
    mark("summary")
    if report is None:  # interrupted: summary.json now (rewritten at the end), the report meanwhile
        _write_summary(pre.run_dir, summary, pre, t_start)
        _draw_report_while_stopping(pre.run_dir)
    await engines_down
    return summary


async def _train_attempts(cfg: RunConfig, rt, stack: contextlib.ExitStack, interrupts):
    """Build the parts and run the loop; when a trainer rank dies with `trainer.max_restarts` left,
    discard the attempt and build it again from the last checkpoint (orchestrator/control/trainer_restart.py).
    Returns (report or None when interrupted, the last attempt's parts, its engines' shutdown, restarts)."""
    from orchestrator.wiring.training import build_parts
    from orchestrator.control.stopping import RunInterrupted
    from orchestrator.control.supervise import explain_trainer_loss, run_watched
    from orchestrator.control.trainer_restart import TrainerRestarts, discard

    restarts = TrainerRestarts(rt.run_dir, cfg.trainer.max_restarts)
    attempt_rt = rt
    while True:
        attempt = stack.enter_context(contextlib.ExitStack())  # its placement groups and buffer
        built = await interrupts.guard(build_parts(cfg, attempt_rt, attempt))
        phase(_training_line(cfg, attempt_rt.checkpoint))
        restart = None
        async with built.closing:  # rollouts stop their ACR sessions here, before the emulator stops
            try:  # a dead replica is replaced beside the loop (run_watched)
                report = await interrupts.guard(run_watched(_run_loop(cfg, built), built.watchers))
            except RunInterrupted:
                report = None
            except Exception as exc:
                lost = await explain_trainer_loss(exc, built.trainer_ranks, rt.run_dir)
                if lost is None:
                    raise
                if (restart := restarts.next_checkpoint()) is None:
                    raise lost from exc
                print(restarts.line(restart, str(lost)), flush=True)
            engines_down = asyncio.ensure_future(_stop_engines(built.replicas))  # while the parts close
        if restart is None:
            return report, built, engines_down, restarts.restarts
        await engines_down
        await discard(built.actors())
        attempt.close()
        attempt_rt = dataclasses.replace(rt, checkpoint=restart, model_path=str(restart.model_dir),
                                         attempt=restarts.restarts)


def _training_line(cfg: RunConfig, checkpoint) -> str:
    """The phase line before the first step: the steps this process will train (a resumed run: those
    left after its checkpoint, not trainer.total_steps, which counts the steps before it too)."""
    total = cfg.trainer.total_steps
    if checkpoint is None:
        return f"training: {total} steps; the first one waits for its first batch"
    done = checkpoint.state.step
    return (f"training: {total - done} steps left (steps {done + 1}..{total} of trainer.total_steps={total}); "
            "the first one waits for its first batch")


async def _bounded(aw, timeout_s: float = 5.0) -> None:
    """Await `aw`, giving up quietly after `timeout_s` seconds or on an error (shutdown calls)."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(timeout_s):
            await aw


async def _stop_engines(replicas: list) -> None:
    """Shut the vLLM engines down (bounded; Ray's shutdown kills whatever is left)."""
    from orchestrator.control.stopping import mark

    from workers.inference.client import ReplicaClient

    await _bounded(asyncio.gather(*(ReplicaClient(r).shutdown(ENGINE_STOP_S) for r in replicas)))
    mark("inference replicas shut down")


async def _run_loop(cfg: RunConfig, built):
    if cfg.mode.name == "async":
        from orchestrator.loop.async_loop import run_async

        return await run_async(built.parts, async_loop_settings(cfg), start=built.start)
    from orchestrator.loop.sync_loop import run_sync

    return await run_sync(built.parts, sync_loop_settings(cfg), start=built.start)


async def _summary(report, built, local) -> dict:
    """The run's totals: steps, rewards, the ledger's terminal counts, ACR calls and sessions.
    `report` None: the run was interrupted; steps and version are those of the last logged step.
    After a resume the counts and rewards cover the whole run (the checkpoint's counters and the
    kept metrics records are the first part), and so do the `acr/*` call counters (the checkpoint's
    plus this process's: calls a killed process made after its last checkpoint are not counted), and
    so do the failure reasons `rollout/failed/{reason}`; `acr/emulator_throttled` is the emulator's
    own count since this process started it."""
    from orchestrator.watch.metrics import reward_initial_final

    initial, final = reward_initial_final(built.logger.rewards)
    last = built.logger.last
    counts = report.counts if report is not None else built.parts.ledger.counts()
    acr_stats, acr_totals = {}, {}  # bounded: actors may be stuck

    async def pool_stats() -> None:
        acr_stats.update(await built.pool.acr_stats())
        acr_totals.update(await built.acr_totals())

    await _bounded(pool_stats())
    return {
        "steps": report.steps if report is not None else int(last.get("step", 0)),
        "policy_version": report.policy_version if report is not None else int(last.get("policy_version", 0)),
        "interrupted": report is None,
        "stopped": report.stopped if report is not None else None,  # the loop ended early: why
        "reward/initial": initial,
        "reward/final": final,
        **(built.parts.validator.initial_final() if built.parts.validator is not None else {}),
        **{k: counts[k] for k in sorted(counts)},
        "rollout/dispatched_per_trained_group": (counts["rollout/dispatched"] / counts["rollout/trained_groups"]
                                                 if counts.get("rollout/trained_groups") else math.nan),
        # the emulator's own count when local (the server's view), else what the workers left open
        "acr/sessions_open_at_exit": local.stats().sessions_open if local else acr_stats.get("sessions_open", 0),
        # acr/throttled, the same meaning local and on AWS: ThrottlingExceptions that reached a rollout after
        # botocore's retries (acr/retries counts the retried ones); locally also the emulator's own count of refusals
        **{k: 0 for k in ("acr/throttled", "acr/retries", "acr/requests")}, **acr_totals,
        **({"acr/emulator_throttled": local.stats().throttled} if local else {}),
    }


@contextlib.contextmanager
def _report_at_end(cfg: RunConfig):
    """Write RUN_DIR/report/ when the run leaves (done, failed or interrupted) once a step was
    logged; its path is the last line on the console. An interrupted run (exit 130) drew it while its
    parts stopped (`_draw_report_while_stopping`) so a Ctrl-C still ends the run fast; this waits for
    that thread (at most REPORT_JOIN_S) or names the command that draws it. A broken report never
    hides the run's error."""
    try:
        yield
    finally:
        if cfg.mode.name != "eval" and _STARTED:
            stopping = sys.exc_info()[1]
            if isinstance(stopping, SystemExit) and stopping.code == 130:
                for thread in _INTERRUPTED_REPORT:
                    thread.join(REPORT_JOIN_S)
                if _REPORT_DRAWN:
                    print(f"report: {_REPORT_DRAWN[-1]}", flush=True)
                elif (_STARTED[-1] / "metrics.jsonl").is_file():
                    print(f"report: python -m orchestrator.watch.report {_STARTED[-1]}", flush=True)
            else:
                try:
                    from orchestrator.watch.report import write_run_report

                    if (path := write_run_report(_STARTED[-1])) is not None:
                        print(f"report: {path}", flush=True)
                except Exception as exc:  # noqa: BLE001  the run's own outcome matters more
                    print(f"warning: the run report was not written: {exc!r}", file=sys.stderr, flush=True)


def _dry_run_data(cfg: RunConfig) -> None:
    """Read every row the run would read, as pre-flight does (a bad row is a config error naming the
    key, file, row and field), when the data files are on this machine; else say they were not read
    (a plan made away from the cluster)."""
    from orchestrator.control.preflight import check_task_data
    from orchestrator.tasks import TASKS

    if TASKS[cfg.task.name].check_data is None:  # a generated task (letters): no file to read
        return
    paths = [p for p in (cfg.task.data_path, cfg.task.val_data_path) if p]
    missing = [p for p in paths if not (Path(p).exists() or _data_path(p).exists())]
    if missing:
        print(f"dry run: data not read: {', '.join(missing)} not on this machine", flush=True)
        return
    check_task_data(cfg)
    print("dry run: data read: every row parses", flush=True)


def _data_path(path: str) -> Path:
    """A relative task data path as the gsm8k loader resolves it: against the repository root."""
    p = Path(path)
    return p if p.is_absolute() else Path(__file__).resolve().parent.parent / p


def _dry_run(cfg: RunConfig) -> None:
    """Print the plan (placement per node and GPU, memory per GPU); raise ConfigError when it cannot fit."""
    from orchestrator.planning.dry_run import build_plan, check_plan, format_plan

    plan = build_plan(cfg)
    print(format_plan(plan), flush=True)
    check_plan(plan)
    _dry_run_data(cfg)
    if plan.gpus or plan.host is not None:
        print("dry run: the plan fits; nothing was started", flush=True)
    else:  # cluster=local joining a Ray cluster: no memory was checked (the plan's header says so)
        print("dry run: memory not checked (the run joins a Ray cluster); nothing was started", flush=True)


def _last_logged_step(run_dir: Path) -> int:
    """The step of the last whole record of RUN_DIR/metrics.jsonl (0 when none)."""
    return int(_last_logged_record(run_dir).get("step", 0))


def _last_logged_record(run_dir: Path) -> dict:
    """The last whole step record of RUN_DIR/metrics.jsonl with a step ({} when none; a line cut
    short by a kill is skipped)."""
    import json

    last: dict = {}
    with contextlib.suppress(OSError):
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            with contextlib.suppress(ValueError, TypeError, KeyError):
                record = json.loads(line)
                int(record["step"])
                last = record
    return last


def _fail_if_disk_full(cfg: RunConfig, exc: BaseException) -> None:
    """When `exc` is an out-of-space error (orchestrator/control/disk_full.py): write summary.json
    saying so (best effort: the disk is full) and exit 1 with `run failed:` naming the path and what
    was being written. Returns for any other error (the caller re-raises it)."""
    from orchestrator.control.disk_full import disk_full, disk_full_message

    found = disk_full(exc)
    if found is None:
        return
    run_dir = _STARTED[-1] if _STARTED else Path(cfg.run_dir).resolve()
    message = disk_full_message(found, run_dir)
    if cfg.mode.name != "eval":
        from orchestrator.watch.metrics import write_summary

        try:
            write_summary(run_dir / "summary.json", {"steps": _last_logged_step(run_dir), "interrupted": False,
                                                     "failed": message})
        except OSError:
            message += " (summary.json could not be written either: the disk is still full)"
    _fail("run failed", message, 1)


def _leave_now(code: int) -> NoReturn:
    """Exit with `code` once the run has stopped everything it started and written its files: the
    atexit handlers run (log files flushed and closed), the interpreter's teardown of torch, Ray and
    vLLM modules (4-15 s on a loaded 2-core machine, measured by scripts/bench_stop.py) is skipped."""
    import atexit
    import os

    from orchestrator.control.stopping import mark

    mark("exit")
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _fail(kind: str, exc: BaseException | str, code: int) -> NoReturn:
    print(f"{kind}: {exc}", file=sys.stderr, flush=True)
    sys.exit(code)


@hydra.main(version_base="1.3", config_path="../configs", config_name="config")
def main(dcfg: DictConfig) -> None:
    try:
        cfg = to_run_config(dcfg)
    except ConfigError as exc:
        _fail("config error", exc, 2)
    with _report_at_end(cfg):
        _run_and_exit(cfg)


def _run_and_exit(cfg: RunConfig) -> None:
    from orchestrator.control.checkpoint import CheckpointError
    from orchestrator.control.supervise import TrainerLost
    from workers.core.placement import InsufficientGpusError

    if cfg.dry_run:  # the plan only: nothing starts (orchestrator/planning/dry_run.py)
        try:
            _dry_run(cfg)
        except (ConfigError, InsufficientGpusError) as exc:
            _fail("config error", exc, 2)
        return
    try:
        summary = run(cfg)
    except CheckpointError as exc:
        _fail("checkpoint error", exc, 2)
    except (ConfigError, InsufficientGpusError) as exc:  # pre-flight, or GPU placement before any actor
        _fail("config error", exc, 2)
    except TrainerLost as exc:
        _fail("trainer lost", exc, 3)
    except KeyboardInterrupt:
        _fail("interrupted", "stopped every process this run started", 130)
    except Exception as exc:  # a full disk anywhere (a trainer actor's export included) is named as one
        _fail_if_disk_full(cfg, exc)
        raise
    if summary.get("interrupted"):
        _fail("interrupted", f"stopped at step {summary['steps']}; stopped every process this run started "
                             f"(summary.json says interrupted: true)", 130)
    if cfg.mode.name == "eval":
        if summary.get("rollout/completed", 0) == 0 and summary.get("rollout/failed", 0) > 0:
            _fail("run failed", f"no rollout completed ({summary['rollout/failed']} failed; see logs/)", 1)
    elif summary.get("stopped"):  # a step in which every rollout failed: nothing could ever train
        _fail("run failed", stopped_early(summary), 1)
    elif (why := nothing_trained(summary)) is not None:  # every group filtered, or every rollout failed
        _fail("run failed", why, 1)


if __name__ == "__main__":
    from orchestrator.config.hydra_errors import check_overrides

    if (problem := check_overrides(sys.argv[1:])) is not None:  # Hydra's own failures: exit 2 too
        _fail("config error", problem, 2)
    try:
        main()
    except SystemExit as stop:
        if stop.code == 130:  # interrupted: everything is stopped and written by now
            _leave_now(130)
        raise
