"""The unified view of a job: every rank's lines in one terminal, and the final summary.

Two views implement the supervisor's ``View`` protocol:

* ``PlainView`` (here) — when stdout is not a terminal (CI): one line per log line,
  ``[<rank> <host>] <text>``, greppable; dlrun's own notices start with ``dlrun:``, each
  host's GPUs too (``dlrun: gpu h1 util …``, at most every ``dlrun.run.gpus.PLAIN_EVERY`` s).
* ``LiveView`` (``dlrun.run.live``) — on a terminal: rich's ``Live`` owns the screen.

The text of summaries is built by pure functions (``summary_lines``, ``root_cause_lines``) so
both views — and tests — share it. ``ranks`` limits which ranks are shown on screen; the
per-rank log files always keep everything.
"""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import sys
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import TextIO

from dlrun.render import WorkerCommand, mask_argv, printable
from dlrun.run.gpus import GpuSample, PlainThrottle, plain_line
from dlrun.run.gpus import summary_lines as gpu_lines
from dlrun.run.result import Attempt, RankState, RunResult
from dlrun.run.rootcause import signal_text


def duration_text(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, sec = divmod(int(seconds), 60)
    return f"{minutes}m{sec:02d}s"


def root_cause_lines(result: RunResult, commands: Sequence[WorkerCommand]) -> list[str]:
    """The root-cause block: rank, host, exit code, command, the exception it raised (its
    traceback's last frames, what ``@record`` wrote), the signal that killed it, the warnings
    dlrun gave before the start, and its last lines."""
    root = result.root_cause
    if root is None:
        if not result.hang:
            return []
        return [f"dlrun: root cause: job {result.hang[0]}", *result.hang[1:],
                *(f"  {text}" for text in result.flight_recorder)]
    by_rank = {c.rank: c for c in commands}
    lines = [f"dlrun: root cause: rank {root.rank} on host {root.host} exited with code {root.exit_code}"]
    if root.state == RankState.LOST:
        lines[0] = f"dlrun: root cause: host {root.host} (rank {root.rank}): {root.error}"
    elif root.error:
        lines.append(f"  error: {root.error}")
    lines.extend(f"  {text}" for text in result.raised_first)  # what the failure may only follow from
    lines.extend(f"  {text}" for text in result.flight_recorder)  # which rank the dumps say is behind
    if root.rank in by_rank and by_rank[root.rank].argv:  # a detached job's record may not have it
        argv = [a if len(a) <= 200 else f"<inline program, {len(a)} bytes>" for a in mask_argv(by_rank[root.rank].argv)]
        lines.append(f"  command: {printable(shlex.join(argv))}")
    recorded_line = root.error_file[-1] if root.error_file else None
    if root.error_file:  # what the rank itself recorded comes first
        lines.append(f"  error file (TORCHELASTIC_ERROR_FILE of rank {root.rank}):")
        lines.extend(f"    | {text}" for text in root.error_file)
    if root.exception and root.exception[-1] != recorded_line:  # @record's message says it already
        died_of = root.exception_final or root.exit_code == 1  # 1: Python's own exit on an uncaught exception
        lines.append(f"  exception (last frames of rank {root.rank}'s traceback):" if died_of else
                     f"  an earlier traceback of rank {root.rank} (many lines came after it: it may have been"
                     " caught):")
        lines.extend(f"    | {text}" for text in root.exception)
    lines.extend(f"  hint: {text}" for text in root.hint)
    if root.state != RankState.LOST and (killed := signal_text(root.exit_code)):
        lines.append(f"  {killed}")
    lines.extend(f"  warning before the start: {text}" for text in result.warnings)
    if root.tail:
        lines.append(f"  last {len(root.tail)} line{'s' if len(root.tail) != 1 else ''} of rank {root.rank}:")
        lines.extend(f"    | {text}" for text in root.tail)
    return lines


def attempt_text(attempt: Attempt) -> str:
    """How one attempt ended, in a line: its root cause, or success, or the signal."""
    root = attempt.root_cause
    if attempt.exit_code == 0:
        end = "succeeded"
    elif root is not None and root.state == RankState.LOST:
        end = f"host {root.host} lost (rank {root.rank}): {(root.error or '').splitlines()[0][:160]}"
    elif root is not None:
        end = f"rank {root.rank} on host {root.host} exited with code {root.exit_code}"
    elif attempt.hang:
        end = attempt.hang
    elif attempt.interrupted_by is not None:
        end = f"interrupted by signal {attempt.interrupted_by}"
    else:
        end = f"failed with exit code {attempt.exit_code}"
    hosts = f"{len(attempt.hosts)} host{'s' if len(attempt.hosts) != 1 else ''}"
    without = f", without {', '.join(attempt.dropped)}" if attempt.dropped else ""
    return f"attempt {attempt.number + 1} (job {attempt.job_id}, {hosts}{without}): {end}"


def attempt_lines(result: RunResult) -> list[str]:
    """Every attempt's end, once the job ran more than once (``--max-restarts``)."""
    if len(result.history) < 2:
        return []
    return [f"dlrun: {len(result.history)} attempts:", *(f"  {attempt_text(a)}" for a in result.history)]


def summary_lines(result: RunResult) -> list[str]:
    """The closing table: rank, host, exit code, state, duration; then where the logs are."""
    width = max([4, *(len(r.host) for r in result.ranks)])
    lines = [f"{'rank':>4}  {'host':<{width}}  {'exit':>4}  {'state':<11}  duration"]
    for r in result.ranks:
        code = "-" if r.exit_code is None else str(r.exit_code)
        lines.append(f"{r.rank:>4}  {r.host:<{width}}  {code:>4}  {r.state.value:<11}  {duration_text(r.duration)}")
    lines.extend(gpu_summary_lines(result))
    ok = sum(1 for r in result.ranks if r.state == RankState.SUCCEEDED)
    stopped = sum(1 for r in result.ranks if r.state == RankState.STOPPED)
    if result.ok and stopped:  # tf-ps: the chief's end ended the job, and dlrun stopped the servers
        verdict = f"dlrun: job succeeded ({ok} ranks finished, {stopped} servers stopped by dlrun)"
    elif result.ok:
        verdict = f"dlrun: all {len(result.ranks)} ranks succeeded"
    elif result.hang and result.root_cause is None:
        verdict = "dlrun: job hung; every rank stopped (--hang-timeout)"
    elif result.interrupted_by is not None and result.root_cause is None:
        verdict = f"dlrun: interrupted by signal {result.interrupted_by}; every rank stopped"
    else:
        verdict = f"dlrun: job failed ({ok}/{len(result.ranks)} ranks succeeded)"
    lines.extend(attempt_lines(result))
    if not result.restarting:  # an attempt run again is not the job's end: the restart's notice says it failed
        lines.append(f"{verdict}; exit code {result.exit_code}")
    if result.log_dir is not None:
        lines.append(f"dlrun: logs in {result.log_dir}/")
    return lines


def gpu_summary_lines(result: RunResult) -> list[str]:
    """Each host's GPUs over the job (mean utilization, peak memory), then the idle warnings."""
    return [*gpu_lines(result.gpu_summary), *(f"dlrun: warning: {w}" for w in result.gpu_warnings)]


class ReaderGone(io.TextIOBase):
    """A stream whose reader may go away (``dlrun launch … | head``): its lines are then dropped,
    that is said once on stderr, and the job goes on; the logs have every line. (Before, the
    closed pipe stopped every rank and dlrun exited 1 without a word.)"""

    def __init__(self, inner: TextIO) -> None:
        super().__init__()
        self.inner = inner
        self.gone = False

    def write(self, text: str) -> int:
        if not self.gone:
            try:
                return self.inner.write(text)
            except BrokenPipeError:
                self._gone()
        return len(text)

    def flush(self) -> None:
        if not self.gone:
            try:
                self.inner.flush()
            except BrokenPipeError:
                self._gone()

    def _gone(self) -> None:
        self.gone = True
        with contextlib.suppress(OSError, ValueError):  # later writes (the summary) land nowhere
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self.inner.fileno())
            os.close(null)
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.write("dlrun: the output was closed (a pager or | head ended): the job goes on, every line"
                             " in its logs\n")


class PlainView:
    """``[<rank> <host>] <text>`` lines on a stream (CI, pipes, files)."""

    def __init__(self, out: TextIO | None = None, ranks: Collection[int] | None = None) -> None:
        self.out: TextIO = ReaderGone(out or sys.stdout)  # type: ignore[assignment]
        self.show = set(ranks) if ranks is not None else None
        self.prefix: dict[int, str] = {}
        self.commands: Sequence[WorkerCommand] = ()
        self.gpu_due = PlainThrottle()

    def start(self, commands: Sequence[WorkerCommand], log_dir: Path | None) -> None:
        self.commands = commands
        self.prefix = {c.rank: f"[{c.rank} {c.host_name}] " for c in commands}
        hosts = len({c.host_name for c in commands})
        self.notice(f"starting {len(commands)} ranks on {hosts} host{'s' if hosts != 1 else ''}"
                    + (f"; logs in {log_dir}/" if log_dir else ""))

    def line(self, rank: int, text: str, stream: str) -> None:
        if self.show is None or rank in self.show:
            self.out.write(self.prefix[rank] + text + "\n")

    def lines(self, rank: int, texts: Sequence[str], stream: str) -> None:
        if self.show is None or rank in self.show:
            prefix = self.prefix[rank]
            self.out.write(prefix + ("\n" + prefix).join(texts) + "\n")

    def state(self, rank: int, state: RankState, exit_code: int | None) -> None:
        pass  # a failed or lost rank is announced by the supervisor's notice, with its host

    def notice(self, text: str) -> None:
        self.out.write(f"dlrun: {text}\n")
        self.out.flush()

    def gpus(self, host: str, samples: Sequence[GpuSample]) -> None:
        if self.gpu_due.due(samples):
            self.notice(plain_line(host, samples))

    def flush(self) -> None:
        self.out.flush()

    def finish(self, result: RunResult) -> None:
        for text in [*root_cause_lines(result, self.commands), *summary_lines(result)]:
            self.out.write(text + "\n")
        self.out.flush()
