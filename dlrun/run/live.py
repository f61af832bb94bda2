"""The live view of a job on a terminal: rich's ``Live`` owns the screen; a status table (rank,
host, state, runtime, last line; then a line per host with each GPU's utilization and memory)
stays at the bottom while log lines scroll above it, each rank's prefix in its own color. Its
texts are ``dlrun.run.view``'s and ``dlrun.run.gpus``'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from dlrun.render import WorkerCommand
from dlrun.run.gpus import GpuSample, live_cell
from dlrun.run.result import RankState, RunResult
from dlrun.run.view import duration_text, root_cause_lines, summary_lines

if TYPE_CHECKING:
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
        self.gpu_samples: dict[str, Sequence[GpuSample]] = {}  # host -> its latest sample

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
                Text(duration_text(runtime)),
                # a rank's colours as colours, closed where the cell ends (not left on after exit)
                Text.from_ansi(self.last.get(c.rank, "")[:200]),
            ))
        for host, samples in self.gpu_samples.items():
            rows.append((Text("gpu", style="dim"), Text(host), Text(""), Text(""), Text(live_cell(samples))))
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

    def gpus(self, host: str, samples: Sequence[GpuSample]) -> None:
        self.gpu_samples[host] = samples

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

