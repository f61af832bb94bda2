"""How a push looks: rich progress bars per host on a terminal, one summary line per host otherwise.

Owns the rendering of ``dlrun.push.session.push`` — it never runs a push itself. ``PushView.progress``
and ``PushView.files`` are the hooks handed to ``push`` (called from the hosts' threads; rich's
``Progress`` locks), and ``PushView.finish`` takes the summaries it returned. ``summary_json``
is the ``--json`` document. The console and the clock are injected, so tests render exactly.
Nothing is printed at import time, and rich is imported only for a terminal or a given console
(a launch whose code is already on every host prints its lines without it).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress, TaskID

from dlrun.push.session import HostPushSummary
from dlrun.push.tree import human_bytes
from dlrun.render import printable


def summary_line(summary: HostPushSummary) -> str:
    """``host0: 12 files sent (3.1 MiB), 40 unchanged, 1 deleted in 0.8 s``; a dry run's lines
    say what would be sent and deleted, with the largest items."""
    if summary.dry_run:
        return dry_run_lines(summary)
    return (
        f"{summary.host}: {summary.files_sent} files sent ({human_bytes(summary.bytes_sent)}), "
        f"{summary.files_unchanged} unchanged, {summary.files_deleted} deleted in {summary.seconds:.1f} s"
    ) + "".join(f"\n{line}" for line in kept_lines(summary))


def kept_lines(summary: HostPushSummary) -> list[str]:
    """A line per older code tree the push left on the host, with why (docs/push.md)."""
    return [f"  {summary.host}: kept {printable(path)}: a job wrote files there after a later push;"
            " remove it once they are saved" for path in summary.kept]


def dry_run_lines(s: HostPushSummary, shown: int = 10) -> str:
    """``host0: would send 12 files (3.1 MiB), delete 1, 40 unchanged (nothing written)`` and
    the largest items to send and the files to delete, one a line."""
    where = ", ".join(d for d in (s.code_dir, s.data_dir) if d)
    lines = [f"{s.host}: would send {s.files_sent} files ({human_bytes(s.bytes_sent)}), delete {s.files_deleted},"
             f" {s.files_unchanged} unchanged{f' in {where}' if where else ''} (dry run: nothing written)"]
    lines += [f"  send   {name:<40} {human_bytes(size):>10}  {files} file{'s' if files != 1 else ''}"
              for name, size, files in s.largest]
    lines += [f"  delete {path}" for path in s.deleting[:shown]]
    if len(s.deleting) > shown:
        lines.append(f"  … and {len(s.deleting) - shown} more to delete")
    return "\n".join(lines)


def summary_json(summaries: Sequence[HostPushSummary]) -> dict[str, Any]:
    """The ``--json`` document: per host (in inventory order) and the totals."""
    hosts = [
        {
            "host": s.host,
            "files_sent": s.files_sent,
            "bytes_sent": s.bytes_sent,
            "files_unchanged": s.files_unchanged,
            "files_deleted": s.files_deleted,
            "seconds": round(s.seconds, 3),
            "code_dir": s.code_dir,
            "data_dir": s.data_dir,
            **({"dry_run": True, "largest": [{"name": n, "bytes": b, "files": f} for n, b, f in s.largest],
                "deleting": list(s.deleting)} if s.dry_run else {}),
        }
        for s in summaries
    ]
    total: dict[str, int | float] = {
        "files_sent": sum(s.files_sent for s in summaries),
        "bytes_sent": sum(s.bytes_sent for s in summaries),
        "files_unchanged": sum(s.files_unchanged for s in summaries),
        "files_deleted": sum(s.files_deleted for s in summaries),
        "seconds": round(max((s.seconds for s in summaries), default=0.0), 3),  # hosts run in parallel
    }
    document: dict[str, Any] = {"hosts": hosts, "total": total}
    if any(s.dry_run for s in summaries):
        document["dry_run"] = True
    return document


class PushView:
    """Per-host bars (bytes, files, rate, ETA) when ``live``; otherwise quiet until ``finish``.

    ``live`` defaults to whether the console is a terminal. Use as a context manager around
    ``push``; give ``progress=view.progress, file_progress=view.files``.
    """

    def __init__(
        self,
        hosts: Sequence[str],
        *,
        console: Console | None = None,
        live: bool | None = None,
        get_time: Callable[[], float] | None = None,
        auto_refresh: bool = True,
    ) -> None:
        if live is None:
            live = console.is_terminal if console is not None else sys.stderr.isatty()
        self.console = console
        self._progress: Progress | None = None
        self._tasks: dict[str, TaskID] = {}
        self._started = False
        if not live:
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self.console = console or Console(stderr=True)
        self._progress = Progress(
            TextColumn("{task.description}", style="bold", markup=False),  # host names are not markup
            BarColumn(),
            DownloadColumn(binary_units=True),
            TextColumn("{task.fields[files]}"),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=self.console,
            get_time=get_time,
            auto_refresh=auto_refresh,
            transient=False,
        )
        self._tasks = {host: self._progress.add_task(host, total=None, files="", start=True) for host in hosts}

    def __enter__(self) -> PushView:
        if self._progress is not None:
            self._progress.start()
            self._started = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def stop(self) -> None:
        if self._started and self._progress is not None:
            self._progress.stop()
            self._started = False

    def progress(self, host: str, bytes_done: int, bytes_total: int) -> None:
        """The ``progress`` hook of ``push``."""
        if self._progress is not None and host in self._tasks:
            self._progress.update(self._tasks[host], completed=bytes_done, total=bytes_total)

    def files(self, host: str, files_done: int, files_total: int) -> None:
        """The ``file_progress`` hook of ``push``."""
        if self._progress is not None and host in self._tasks:
            self._progress.update(self._tasks[host], files=f"{files_done}/{files_total} files")

    def finish(self, summaries: Sequence[HostPushSummary]) -> None:
        """Complete the bars (live) or print one summary line per host (not live)."""
        if self._progress is not None:
            for s in summaries:
                if s.host in self._tasks:
                    self._progress.update(
                        self._tasks[s.host],
                        completed=s.bytes_sent,
                        total=s.bytes_sent,
                        files=f"{s.files_sent} sent, {s.files_unchanged} unchanged, {s.files_deleted} deleted",
                    )
            self._progress.refresh()
            self.stop()
            for line in (line for s in summaries for line in kept_lines(s)):
                print(line, file=sys.stderr, flush=True)
            return
        for s in summaries:
            if self.console is None:
                print(summary_line(s), file=sys.stderr, flush=True)
            else:
                self.console.print(summary_line(s), highlight=False, markup=False, soft_wrap=True)

    def renderable(self) -> Any:
        """What the live display shows now (for tests)."""
        assert self._progress is not None, "not live"
        return self._progress.get_renderable()
