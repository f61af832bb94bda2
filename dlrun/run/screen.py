"""The screen on its own clock: ``ScreenFeed`` stands between the supervisor and a view, so that
output never delays control.

The supervisor hands every line over without waiting (a lock and per-rank deques); a drawing
thread passes them to the view (``PlainView`` or ``LiveView``) at most ``rate`` lines a second
(a token bucket: a quiet terminal shows bursts whole, a flood is thinned). When more than
``max_lines`` lines (or ``max_chars`` characters) wait, the oldest waiting lines of the rank with
the most waiting are dropped from the screen, never from the log files, and the screen says how
many (``dlrun: the screen fell behind: 1204 lines of rank 0 not shown; every line is in <log
dir>/``). Notices, states and GPU samples are never dropped and keep their order with the lines.
A ``lossless`` feed (``attach`` into a pipe) waits for the screen instead of dropping. So a rank
writing 50 MB/s cannot hold back a failure's stop, and dlrun's memory stays bounded. Mechanism and
numbers: ``docs/architecture.md`` (The screen).
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

from dlrun.render import WorkerCommand
from dlrun.run.gpus import GpuSample
from dlrun.run.result import RankState, RunResult
from dlrun.run.supervisor import View
from dlrun.run.view import PlainView

MAX_LINES = 20_000  # lines waiting for the screen before the oldest are dropped
MAX_CHARS = 16 << 20  # characters waiting (a few very long lines count as many)
LIVE_RATE = 2_000  # lines a second the live view draws at most (rich: ~20-50 µs of CPU a line)
LIVE_WAITING = 2_000  # lines the live view lets wait: about a second behind at most
PLAIN_RATE = 1_000_000  # plain lines are cheap: only a terminal or pipe that blocks holds them back
EVERY = 0.05  # seconds between two looks of the drawing thread when nothing wakes it
DROP_NOTE_EVERY = 2.0  # seconds between two "fell behind" notices

Entry = tuple[int, list[str], str]  # (order, lines, stream)


class ScreenFeed:
    """A ``View`` that queues what the supervisor says and draws it on a thread of its own."""

    def __init__(self, inner: View, *, max_lines: int = MAX_LINES, max_chars: int = MAX_CHARS,
                 rate: float = PLAIN_RATE, lossless: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.inner = inner
        self.rate = rate  # lines a second drawn at most: the drawing thread's CPU (and GIL) stays bounded
        self.burst = max(100.0, rate / 2)  # what a quiet screen may draw at once
        self.max_lines = max_lines
        self.max_chars = max_chars
        self.lossless = lossless  # wait for the screen instead of dropping (attach into a pipe)
        self.clock = clock
        self.cond = threading.Condition()
        self.seq = 0
        self.ranks: dict[int, deque[Entry]] = {}
        self.events: deque[tuple[int, str, tuple[Any, ...]]] = deque()  # (order, method, args): never dropped
        self.waiting: dict[int, int] = {}  # rank -> lines waiting
        self.waiting_lines = 0
        self.waiting_chars = 0
        self.dropped: dict[int, int] = {}  # rank -> lines dropped since the last notice
        self.dropped_total = 0
        self.noted = 0.0
        self.tokens = self.burst
        self.filled_at = clock()
        self.log_dir: Path | None = None
        self.closing = False
        self.error: BaseException | None = None  # what ended the drawing thread (a closed pipe)
        self.thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the supervisor's side
    def start(self, commands: Sequence[WorkerCommand], log_dir: Path | None) -> None:
        """Start (again: every attempt of ``--max-restarts`` starts the view anew)."""
        self.log_dir = log_dir
        self.inner.start(commands, log_dir)
        with self.cond:
            self.closing = False
            self.tokens, self.filled_at = self.burst, self.clock()
        self.thread = threading.Thread(target=self._draw_loop, name="dlrun-screen", daemon=True)
        self.thread.start()

    def line(self, rank: int, text: str, stream: str) -> None:
        self.lines(rank, (text,), stream)

    def lines(self, rank: int, texts: Sequence[str], stream: str) -> None:
        if not texts:
            return
        with self.cond:
            if self.error is not None:
                if self.lossless:
                    raise self.error
                return  # nothing draws any more; the log files have every line
            self.seq += 1
            self.ranks.setdefault(rank, deque()).append((self.seq, list(texts), stream))
            self.waiting[rank] = self.waiting.get(rank, 0) + len(texts)
            self.waiting_lines += len(texts)
            self.waiting_chars += sum(len(t) for t in texts)
            self.cond.notify_all()
            while self.waiting_lines > self.max_lines or self.waiting_chars > self.max_chars:
                if self.lossless and self._drawing():
                    self.cond.wait(EVERY)
                    if self.error is not None:
                        raise self.error
                else:
                    self._drop(self.waiting_lines - self.max_lines)

    def _drawing(self) -> bool:
        return self.thread is not None and self.thread.is_alive() and self.error is None

    def _drop(self, lines: int) -> None:
        """Drop at least ``lines`` waiting lines (one at the least), the oldest of the rank with the
        most waiting first, off the screen."""
        lines = max(1, lines)
        while lines > 0 and self.waiting_lines > 0:
            rank = max(self.waiting, key=lambda r: self.waiting[r])
            seq, texts, stream = self.ranks[rank][0]
            cut = min(lines, len(texts))
            if cut == len(texts):
                self.ranks[rank].popleft()
            else:
                self.ranks[rank][0] = (seq, texts[cut:], stream)
            self.waiting[rank] -= cut
            self.waiting_lines -= cut
            self.waiting_chars -= sum(len(t) for t in texts[:cut])
            self.dropped[rank] = self.dropped.get(rank, 0) + cut
            self.dropped_total += cut
            lines -= cut
        if self.waiting_lines == 0:
            self.waiting_chars = 0

    def _event(self, method: str, *args: Any) -> None:
        with self.cond:
            if not self._drawing():
                if self.error is not None:
                    return
                drawn_now = True  # not started yet, or drained: nothing draws later
            else:
                drawn_now = False
                self.seq += 1
                self.events.append((self.seq, method, args))
                self.cond.notify_all()
        if drawn_now:
            getattr(self.inner, method)(*args)
            self.inner.flush()

    def state(self, rank: int, state: RankState, exit_code: int | None) -> None:
        self._event("state", rank, state, exit_code)

    def notice(self, text: str) -> None:
        self._event("notice", text)

    def gpus(self, host: str, samples: Sequence[GpuSample]) -> None:
        self._event("gpus", host, samples)

    def flush(self) -> None:
        pass  # the drawing thread flushes after each batch

    def finish(self, result: RunResult) -> None:
        """Draw what still waits (bounded), then the summary."""
        self.drain()
        if self.error is not None and self.lossless:
            raise self.error
        self.inner.finish(result)

    def drain(self) -> None:
        """Draw what still waits (bounded) and end the drawing thread; what comes after is drawn
        at once (``attach`` detaching on Ctrl-C)."""
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            return
        self._note_dropped(force=True)
        with self.cond:
            batch = self._take(None)
        self._draw(batch)

    # ------------------------------------------------------------------ the drawing thread
    def _take(self, budget: int | None) -> list[tuple[int, str, tuple[Any, ...]]]:
        """Every event waiting, and the waiting lines in their order up to ``budget`` lines (None:
        all), as (order, method, args); what is taken leaves the queues."""
        batch: list[tuple[int, str, tuple[Any, ...]]] = list(self.events)
        self.events.clear()
        heads = sorted((entries[0][0], rank) for rank, entries in self.ranks.items() if entries)
        left = self.waiting_lines if budget is None else budget
        while heads and left > 0:
            _seq, rank = heads.pop(0)
            entries = self.ranks[rank]
            seq, texts, stream = entries[0]
            if len(texts) <= left:
                entries.popleft()
                taken = texts
                if entries:
                    heads.append((entries[0][0], rank))
                    heads.sort()
            else:
                taken = texts[:left]
                entries[0] = (seq, texts[left:], stream)
            left -= len(taken)
            self.waiting[rank] -= len(taken)
            self.waiting_lines -= len(taken)
            self.waiting_chars -= sum(len(t) for t in taken)
            batch.append((seq, "lines", (rank, taken, stream)))
        if self.waiting_lines == 0:
            self.waiting_chars = 0
        else:  # lines wait for the next turn: the events said after them wait too, in their order
            first = min(entries[0][0] for entries in self.ranks.values() if entries)
            later = [item for item in batch if item[1] != "lines" and item[0] > first]
            self.events.extend(later)
            batch = [item for item in batch if item[1] == "lines" or item[0] < first]
        batch.sort(key=lambda item: item[0])
        return batch

    def _refill(self) -> None:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.filled_at) * self.rate)
        self.filled_at = now

    def _draw(self, batch: Sequence[tuple[int, str, tuple[Any, ...]]]) -> None:
        for _seq, method, args in batch:
            getattr(self.inner, method)(*args)
        self.inner.flush()

    def _draw_loop(self) -> None:
        try:
            while True:
                with self.cond:
                    self._refill()
                    if not self.closing and not self.events and (not self.waiting_lines or self.tokens < 1):
                        self.cond.wait(EVERY)
                        self._refill()
                    budget = None if self.closing or self.lossless else int(self.tokens)
                    batch = self._take(budget)
                    self.tokens -= sum(len(args[1]) for _seq, method, args in batch if method == "lines")
                    closing = self.closing
                    self.cond.notify_all()  # room again: a lossless feed's writer goes on
                self._draw(batch)
                self._note_dropped()
                if closing:
                    with self.cond:
                        if not self.events and not self.waiting_lines:
                            return
        except BaseException as exc:  # a closed pipe (attach | head), a broken view: nothing draws any more
            with self.cond:
                self.error = exc
                self.cond.notify_all()

    def _note_dropped(self, force: bool = False) -> None:
        with self.cond:
            if not self.dropped or (not force and self.clock() - self.noted < DROP_NOTE_EVERY):
                return
            dropped, self.dropped = self.dropped, {}
            self.noted = self.clock()
        counts = ", ".join(f"{n} lines of rank {r}" for r, n in sorted(dropped.items()))
        where = f"{self.log_dir}/" if self.log_dir is not None else "the log files"
        self.inner.notice(f"the screen fell behind: {counts} not shown; every line is in {where}")


def make_view(ranks: Collection[int] | None = None, *, force_plain: bool = False) -> ScreenFeed:
    """A LiveView on a terminal, a PlainView otherwise, each drawn on its own clock
    (``dlrun.run.screen``). On a terminal (live or ``--plain``) lines a screen cannot keep up with
    are dropped (counted; the log files keep them), so output never holds back the job's control.
    Into a pipe or a file (CI logs, ``| less``, ``attach > out``) every line is the record: the
    feed waits for its reader instead."""
    if not sys.stdout.isatty():
        return ScreenFeed(PlainView(sys.stdout, ranks), lossless=True)
    if force_plain:
        return ScreenFeed(PlainView(sys.stdout, ranks))
    from rich.console import Console

    from dlrun.run.live import LiveView

    console = Console()
    if console.is_terminal:
        return ScreenFeed(LiveView(console, ranks), rate=LIVE_RATE, max_lines=LIVE_WAITING)
    return ScreenFeed(PlainView(sys.stdout, ranks), lossless=True)
