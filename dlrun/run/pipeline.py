"""``dlrun launch``: the job pipeline from options to exit code, once for every engine.

``run_job`` checks the ``LaunchConfig`` (``dlrun.run.checks``), asks the engine
(``dlrun.run.engine``: ``dlrun.run.hosts.HostsEngine`` or ``dlrun.spark.driver.SparkEngine``)
to place each attempt's ranks, supervises them, shows them, restarts a failed job
(``max_restarts``) and returns the ``RunResult``; ``--dry-run`` stops after render (on SSH
hosts after the same session as a launch, with a push that writes nothing). It first
resolves ``--framework auto`` from the script's imports (``resolve_framework``). The view's
summary is the pipeline's: the supervisor only supervises (``Supervisor.supervise``), and
``run_job`` shows each attempt's summary once the engine has cleaned up.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from types import FrameType

from dlrun.logdir import private_folder
from dlrun.remote import rankpolicy
from dlrun.render import WorkerCommand, mask_argv, mask_env, plan_to_json, printable
from dlrun.run.checks import (
    check_local_inputs,
    check_ranks_shown,
    check_restart_options,
    check_script,
    keras_warning,
    warn_replaced_env,
)
from dlrun.run.config import DEFAULT_LOG_DIR, LaunchConfig, new_job_id, resolve_framework, say_framework
from dlrun.run.engine import Engine, Regrouped
from dlrun.run.hosts import HostsEngine
from dlrun.run.result import Attempt, RunResult, result_document
from dlrun.run.screen import make_view
from dlrun.run.supervisor import Supervisor, View


def dry_run_text(commands: Sequence[WorkerCommand]) -> str:
    """``--dry-run``'s text: secrets masked (env and the script's arguments), control characters
    escaped (the argv is JSON, which escapes them itself)."""
    lines = []
    for c in commands:
        s = c.spec
        lines.append(
            f"rank {s.rank}: host {printable(s.host.name)} ({printable(s.address)}) local_rank"
            f" {s.local_rank}/{s.local_size} cross_rank {s.cross_rank}/{s.cross_size}"
            f" task {s.task_type}:{s.task_index} port {s.port}"
        )
        shown = [a if len(a) <= 200 else f"<inline program, {len(a)} bytes>" for a in mask_argv(c.argv)]
        lines.append(f"  argv: {json.dumps(shown)}")
        if c.cwd:
            lines.append(f"  cwd:  {printable(c.cwd)}")
        for name, value in sorted(mask_env(c.env).items()):
            lines.append(f"  env:  {printable(name)}={printable(value)}")
    return "\n".join(lines)


@contextmanager
def forward_signals(supervisor: Supervisor) -> Iterator[None]:
    """SIGINT/SIGTERM to dlrun → the supervisor stops every rank (no process is left).

    Ctrl-Z (SIGTSTP) is refused with a notice: a stopped dlrun reads no output, so the ranks
    stall on their next print, and after the host timeout every agent stops the job.
    """

    def handler(signum: int, _frame: FrameType | None) -> None:
        supervisor.interrupt(signum)

    def no_suspend(_signum: int, _frame: FrameType | None) -> None:
        supervisor.notify("Ctrl-Z ignored: a suspended dlrun stalls the ranks' output, and its hosts stop the"
                          " job after --host-timeout; Ctrl-C stops the job")

    if threading.current_thread() is not threading.main_thread():  # the API, called from a thread:
        yield  # only the main thread may set handlers: signals stay the caller's
        return
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    previous[signal.SIGTSTP] = signal.signal(signal.SIGTSTP, no_suspend)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)




def restart_policy(config: LaunchConfig) -> dict[str, int | list[str] | None]:
    """The ``--dry-run --json`` document's ``restarts`` field (``checkpoint_dirs`` when given)."""
    policy: dict[str, int | list[str] | None] = {"max_restarts": config.max_restarts, "min_hosts": config.min_hosts}
    if config.checkpoint_dirs:
        policy["checkpoint_dirs"] = list(config.checkpoint_dirs)
    return policy


def restart_policy_text(config: LaunchConfig) -> str:
    """The restart policy, as ``--dry-run`` shows it."""
    folders = (f"\ncheckpoints: {', '.join(config.checkpoint_dirs)} made the same on every host before every"
               " attempt (per file, the newest copy written before a failure wins)" if config.checkpoint_dirs else "")
    if not config.max_restarts:
        return "restarts: none (a failed job ends; --max-restarts N runs it again)" + folders
    hosts = ("after a lost host, on the hosts left while at least "
             f"{config.min_hosts} remain (--min-hosts)" if config.min_hosts is not None
             else "always on the same hosts (a lost host is reconnected)")
    return (f"restarts: up to {config.max_restarts} after a failed rank or a lost host (not after Ctrl-C or"
            f" SIGTERM), {hosts}{folders}")


def run_job(config: LaunchConfig, engine: Engine | None = None, *, view: View | None = None) -> RunResult:
    """The pipeline, the same for every engine (default: ``HostsEngine``); how the job ended.

    ``--dry-run`` prints the commands and returns them (exit code 0). Otherwise every attempt is
    placed by the engine and supervised here; a failed one (a rank's failure or a lost host,
    never an interrupt) is run again (a new job id ``<job>-r<k>``, logs in
    ``<job>/attempt-<k>/``) up to ``max_restarts`` times; the hosts engine reconnects a lost host
    or, with ``min_hosts``, leaves it out (``HostsEngine.regroup``). ``view`` replaces the
    terminal's (tests, API).
    """
    engine = engine or HostsEngine()
    check_script(config)
    check_restart_options(config)
    config = engine.prepare(resolve_framework(config))  # the engine's own usage checks (--min-hosts)
    if config.detach:
        from dlrun.run.detach import check_detach

        check_detach(config, engine.detaches)
    job_id = new_job_id()
    # with a preflight, the hosts' own Keras decides (the engine's session warns then)
    warning = None if engine.probes(config) else keras_warning(config, engine.inventory)
    if config.dry_run:
        planned = engine.dry_run(config, job_id)  # Spark's refuses; the hosts engine says the framework first
        commands = planned.commands
        warn_replaced_env(config, commands)
        if config.json_output:
            document = plan_to_json(commands)
            document["restarts"] = restart_policy(config)
            if planned.pushes:  # Spark ships a zip, no push
                from dlrun.push.view import summary_json

                document["push"] = summary_json(planned.pushes)
            print(json.dumps(document, indent=2))
        else:
            if warning:
                print(f"dlrun: warning: {warning}", file=sys.stderr)
            print(dry_run_text(commands))
            if planned.ports_chosen and config.base_port is None:
                print("ports: free on each host now; a launch asks again and may get others (--base-port P fixes them)")
            print(restart_policy_text(config))
        return RunResult(ranks=(), exit_code=0, commands=commands, job_id=job_id, attempts=0)
    check_local_inputs(config, engine.inventory)
    say_framework(config)
    if warning:
        print(f"dlrun: warning: {warning}", file=sys.stderr)
    shown = view or make_view(config.ranks_shown, force_plain=config.plain)
    logs = Path(config.log_dir or DEFAULT_LOG_DIR) / job_id
    history: list[Attempt] = []
    with engine.session(config, job_id) as config:
        if config.detach:
            return engine.detach(config, job_id, shown)
        warnings = (warning,) if warning else engine.warnings
        # private, as the hosts' job folders are: the ranks' lines may hold secrets; its files are
        # made 0600 without following links (supervisor.private_file)
        private_folder(logs)
        attempt = 0
        dropped: tuple[str, ...] = ()
        while True:
            attempt_id = rankpolicy.attempt_job_id(job_id, attempt)
            result = _attempt(replace(config, attempt=attempt, run_id=job_id), engine, attempt_id, shown,
                              logs / f"attempt-{attempt}" if config.max_restarts else logs, warnings=warnings)
            history.append(Attempt(attempt, attempt_id, tuple(dict.fromkeys(r.host for r in result.ranks)),
                                   result.exit_code, result.root_cause, result.interrupted_by, dropped,
                                   result.hang[0] if result.hang else ""))
            final = replace(result, job_id=job_id, attempts=attempt + 1, history=tuple(history))
            last = not rankpolicy.restart(attempt, config.max_restarts, result.exit_code, result.interrupted_by).again
            regrouped = Regrouped() if last else engine.regroup(config, result)
            why_not = regrouped.refused
            if why_not is not None:
                shown.notice(f"not restarting: {why_not}")
            shown.finish(replace(final, restarting=not last and why_not is None))
            if last or why_not is not None:
                return _recorded(final, logs)
            newly = regrouped.dropped
            dropped = (*dropped, *newly)
            where = f" without {', '.join(newly)} (lost)" if newly else ""
            shown.notice(rankpolicy.restart_notice(attempt, config.max_restarts, result.exit_code,
                                                   engine.restart_unit, where))
            attempt += 1
            signum = _pause(rankpolicy.RESTART_PAUSE)
            if signum is not None:
                shown.notice(f"signal {signum} before the restart: not restarting")
                shown.notice(f"interrupted by signal {signum}; exit code {128 + signum}")  # the verdict CI looks for
                return _recorded(replace(final, exit_code=128 + signum, interrupted_by=signum), logs)


def _recorded(final: RunResult, logs: Path) -> RunResult:
    """The job's end, also as ``<logs>/result.json`` (``result_document``): a file that cannot be
    written costs a warning, not the result."""
    try:
        fd = os.open(logs / "result.json", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with open(fd, "w", encoding="utf-8") as fh:
            json.dump(result_document(final), fh, indent=1)
            fh.write("\n")
    except OSError as exc:
        print(f"dlrun: warning: {logs}/result.json not written: {exc.strerror or exc}", file=sys.stderr)
    return final


def _pause(seconds: float) -> int | None:
    """Wait between attempts; an interrupt (SIGINT, SIGTERM, SIGHUP) ends the wait and is returned."""
    if threading.current_thread() is not threading.main_thread():
        time.sleep(seconds)
        return None
    caught: list[int] = []
    woken = threading.Event()

    def handler(signum: int, _frame: FrameType | None) -> None:
        caught.append(signum)
        woken.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        woken.wait(seconds)
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
    return caught[0] if caught else None


def _attempt(config: LaunchConfig, engine: Engine, job_id: str, view: View, log_dir: Path, *,
             warnings: tuple[str, ...] = ()) -> RunResult:
    """One attempt: placed by the engine and supervised; the caller shows its summary once the
    engine cleaned up."""
    with engine.place(config, job_id, view) as placement:
        if config.attempt == 0:  # once, not again for each restart (--min-hosts may leave fewer ranks)
            check_ranks_shown(config, len(placement.commands))
            warn_replaced_env(config, placement.commands)
        else:
            hosts = len({c.host_name for c in placement.commands})
            notes = "".join(f"; {note}" for note in placement.notes)
            view.notice(f"attempt {config.attempt + 1} of {config.max_restarts + 1} (restart {config.attempt},"
                        f" job {job_id}): {len(placement.commands)} ranks on {hosts} host{'s' if hosts != 1 else ''}"
                        f"{notes}")
        supervisor = Supervisor(
            placement.transport,
            placement.commands,
            view,
            log_dir=log_dir,
            grace=config.grace,
            host_timeout=config.ssh.host_timeout,
            pidns=config.pidns,
            ends_job=placement.ends_job,
            agents=placement.agents,
            gpu_every=config.gpu_every,
            gpu_idle_after=config.gpu_idle_after,
            hang_timeout=config.hang_timeout,
            control_id=config.run_id or job_id,
        )
        with forward_signals(supervisor), placement.watch():
            result = supervisor.supervise()  # the summary is shown by run_job, after the engine cleaned up
        placement.done(result)
    result = replace(result, warnings=warnings)  # repeated in a failure's root cause
    return result


def launch(config: LaunchConfig, engine: Engine | None = None) -> int:
    """Run the whole pipeline; return the exit code for the shell."""
    return run_job(config, engine).exit_code
