"""The unified view of a job: every rank's lines in one terminal, and the final summary.

Two views implement the supervisor's ``View`` protocol:

* ``PlainView`` — when stdout is not a terminal (CI): one line per log line,
  ``[<rank> <host>] <text>``, greppable; dlrun's own notices start with ``dlrun:``.
* ``LiveView`` — on a terminal: rich's ``Live`` owns the screen; a status table (rank, host,
  state, runtime, last line) stays at the bottom while log lines scroll above it, each
  rank's prefix in its own color.

The text of summaries is built by pure functions (``summary_lines``, ``root_cause_lines``) so
both views — and tests — share it. ``ranks`` limits which ranks are shown on screen; the
per-rank log files always keep everything.
"""

from __future__ import annotations

import shlex
import sys
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from dlrun.render import WorkerCommand
from dlrun.run.supervisor import RankState, RunResult

if TYPE_CHECKING:  # rich is imported only for the live view (~40 ms a job otherwise)
    from rich.console import Console
    from rich.live import Live
    from rich.table import Table

COLORS = ("cyan", "magenta", "green", "yellow", "blue", "bright_red", "bright_cyan", "bright_magenta")
STATE_STYLE = {
    RankState.PENDING: "dim",
    RankState.RUNNING: "bold cyan",
    RankState.SUCCEEDED: "bold green",
    RankState.FAILED: "bold red",
    RankState.STOPPED: "yellow",
    RankState.NOT_STARTED: "dim",
    RankState.LOST: "bold red",
}


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, sec = divmod(int(seconds), 60)
    return f"{minutes}m{sec:02d}s"


def root_cause_lines(result: RunResult, commands: Sequence[WorkerCommand]) -> list[str]:
    """The root-cause block: rank, host, exit code, command and its last lines."""
    root = result.root_cause
    if root is None:
        return []
    by_rank = {c.rank: c for c in commands}
    lines = [f"dlrun: root cause: rank {root.rank} on host {root.host} exited with code {root.exit_code}"]
    if root.state == RankState.LOST:
        lines[0] = f"dlrun: root cause: host {root.host} (rank {root.rank}): {root.error}"
    elif root.error:
        lines.append(f"  error: {root.error}")
    if root.rank in by_rank:
        argv = [a if len(a) <= 200 else f"<inline program, {len(a)} bytes>" for a in by_rank[root.rank].argv]
        lines.append(f"  command: {shlex.join(argv)}")
    if root.tail:
        lines.append(f"  last {len(root.tail)} line{'s' if len(root.tail) != 1 else ''} of rank {root.rank}:")
        lines.extend(f"    | {text}" for text in root.tail)
    return lines


def summary_lines(result: RunResult) -> list[str]:
    """The closing table: rank, host, exit code, state, duration; then where the logs are."""
    width = max([4, *(len(r.host) for r in result.ranks)])
    lines = [f"{'rank':>4}  {'host':<{width}}  {'exit':>4}  {'state':<11}  duration"]
    for r in result.ranks:
        code = "-" if r.exit_code is None else str(r.exit_code)
        lines.append(f"{r.rank:>4}  {r.host:<{width}}  {code:>4}  {r.state.value:<11}  {_duration(r.duration)}")
    ok = sum(1 for r in result.ranks if r.state == RankState.SUCCEEDED)
    stopped = sum(1 for r in result.ranks if r.state == RankState.STOPPED)
    if result.ok and stopped:  # tf-ps: the chief's end ended the job, and dlrun stopped the servers
        verdict = f"dlrun: job succeeded ({ok} ranks finished, {stopped} servers stopped by dlrun)"
    elif result.ok:
        verdict = f"dlrun: all {len(result.ranks)} ranks succeeded"
    elif result.interrupted_by is not None and result.root_cause is None:
        verdict = f"dlrun: interrupted by signal {result.interrupted_by}; every rank stopped"
    else:
        verdict = f"dlrun: job failed ({ok}/{len(result.ranks)} ranks succeeded)"
    lines.append(f"{verdict}; exit code {result.exit_code}")
    if result.log_dir is not None:
        lines.append(f"dlrun: logs in {result.log_dir}/")
    return lines


class PlainView:
    """``[<rank> <host>] <text>`` lines on a stream (CI, pipes, files)."""

    def __init__(self, out: TextIO | None = None, ranks: Collection[int] | None = None) -> None:
        self.out = out or sys.stdout
        self.show = set(ranks) if ranks is not None else None
        self.prefix: dict[int, str] = {}
        self.commands: Sequence[WorkerCommand] = ()

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

    def flush(self) -> None:
        self.out.flush()

    def finish(self, result: RunResult) -> None:
        for text in [*root_cause_lines(result, self.commands), *summary_lines(result)]:
            self.out.write(text + "\n")
        self.out.flush()


class LiveView:
    """A rich live status table under the scrolling, colored log of every rank."""

    def __init__(
        self,
        console: Console,
        ranks: Collection[int] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.console = console
        self.show = set(ranks) if ranks is not None else None
        self.clock = clock
        self.commands: Sequence[WorkerCommand] = ()
        self.states: dict[int, RankState] = {}
        self.codes: dict[int, int | None] = {}
        self.started: dict[int, float] = {}
        self.ended: dict[int, float] = {}
        self.last: dict[int, str] = {}
        self.live: Live | None = None
        self.log_dir: Path | None = None

    def start(self, commands: Sequence[WorkerCommand], log_dir: Path | None) -> None:
        self.commands = commands
        self.log_dir = log_dir
        for c in commands:
            self.states[c.rank] = RankState.PENDING
        from rich.text import Text

        line = Text.assemble(("dlrun", "bold"), f": starting {len(commands)} ranks")
        if log_dir:
            line.append("; logs in ").append(f"{log_dir}/", style="underline")
        self.console.print(line)
        from rich.live import Live

        self.live = Live(get_renderable=self.status_table, console=self.console, refresh_per_second=4)
        self.live.start()

    def status_table(self) -> Table:
        from rich.table import Table
        from rich.text import Text

        now = self.clock()
        rows = []
        for c in self.commands:
            state = self.states[c.rank]
            runtime = None
            if c.rank in self.started:
                runtime = self.ended.get(c.rank, now) - self.started[c.rank]
            label = state.value + ("" if self.codes.get(c.rank) in (None, 0) else f" ({self.codes[c.rank]})")
            rows.append((
                Text(str(c.rank), style=COLORS[c.rank % len(COLORS)]),
                Text(c.host_name),
                Text(label, style=STATE_STYLE[state]),
                Text(_duration(runtime)),
                # a rank's colours as colours, closed where the cell ends (not left on after exit)
                Text.from_ansi(self.last.get(c.rank, "")[:200]),
            ))
        # who and how come first, whole; the last line gets what is left of the terminal's width
        names = ("rank", "host", "state", "runtime")
        fixed = sum(max([len(name), *(row[i].cell_len for row in rows)]) for i, name in enumerate(names))
        room = max(8, self.console.width - fixed - 2 * len(names))  # two spaces between columns
        table = Table(box=None, pad_edge=False, show_edge=False, header_style="bold")
        for column in (*names, "last line"):
            table.add_column(column, no_wrap=True)
        for row in rows:
            row[-1].truncate(room, overflow="ellipsis")
            table.add_row(*row)
        return table

    def line(self, rank: int, text: str, stream: str) -> None:
        self.lines(rank, (text,), stream)

    def lines(self, rank: int, texts: Sequence[str], stream: str) -> None:
        """A chunk's lines in one print: each print redraws the status table under the log, so
        a print per line held dlrun to ~1000 lines/s and let a fast rank's output pile up."""
        if not texts:
            return
        self.last[rank] = texts[-1]
        if self.show is not None and rank not in self.show:
            return
        from rich.text import Text

        host = self.commands[rank].host_name if rank < len(self.commands) else "?"
        prefix = Text(f"[{rank} {host}] ", style=COLORS[rank % len(COLORS)])
        style = "red" if stream == "stderr" else ""
        # a rank's ANSI colours are parsed, so rich closes each one at its line's end
        block = Text("\n").join(prefix + Text.from_ansi(text, style=style) for text in texts)
        self.console.print(block, soft_wrap=True, highlight=False, markup=False)

    def state(self, rank: int, state: RankState, exit_code: int | None) -> None:
        self.states[rank] = state
        self.codes[rank] = exit_code
        now = self.clock()
        if state == RankState.RUNNING:
            self.started[rank] = now
        elif state not in (RankState.PENDING,):
            self.ended[rank] = now

    def notice(self, text: str) -> None:
        from rich.text import Text

        self.console.print(Text("dlrun: " + text, style="bold"))

    def flush(self) -> None:
        pass

    def finish(self, result: RunResult) -> None:
        from rich.console import Group
        from rich.text import Text

        if self.live is not None:
            self.live.stop()
        root = root_cause_lines(result, self.commands)
        if root:
            self.console.print(Text("\n".join(root), style="red"))
        self.console.print(Group(*(Text(t) for t in summary_lines(result))))


def make_view(ranks: Collection[int] | None = None, *, force_plain: bool = False) -> PlainView | LiveView:
    """A LiveView on a terminal, a PlainView otherwise."""
    if force_plain or not sys.stdout.isatty():
        return PlainView(sys.stdout, ranks)
    from rich.console import Console

    console = Console()
    if console.is_terminal:
        return LiveView(console, ranks)
    return PlainView(sys.stdout, ranks)
