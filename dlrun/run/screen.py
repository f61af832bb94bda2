"""The screen on its own clock: ``ScreenFeed`` stands between the supervisor and a view, so that
output never delays control.

The supervisor hands every line over without waiting (a lock and a deque); a drawing thread
passes them to the view (``PlainView`` or ``LiveView``) as fast as the terminal takes them. When
the screen falls behind by more than ``max_lines`` lines (or ``max_chars`` characters), the
oldest waiting lines of the rank with the most waiting are dropped from the screen, never from
the log files, and the screen says how many (``dlrun: the screen fell behind: 1204 lines of rank 0
not shown; every line is in <log dir>/``). Notices, states and GPU samples are never dropped and
keep their order with the lines. So a rank writing 50 MB/s cannot hold back a failure's stop, and
dlrun's memory stays bounded. Mechanism and numbers: ``docs/architecture.md`` (The screen).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dlrun.render import WorkerCommand
from dlrun.run.gpus import GpuSample
from dlrun.run.result import RankState, RunResult
from dlrun.run.supervisor import View

MAX_LINES = 20_000  # lines waiting for the screen before the oldest are dropped
LIVE_RATE = 2_000  # lines a second the live view draws at most (rich: ~20-50 µs of CPU a line)
PLAIN_RATE = 1_000_000  # plain lines are cheap: only a terminal or pipe that blocks holds them back
MAX_CHARS = 16 << 20  # characters waiting (a few very long lines count as many)
EVERY = 0.05  # seconds between two looks of the drawing thread when nothing wakes it
DROP_NOTE_EVERY = 2.0  # seconds between two "fell behind" notices


class ScreenFeed:
    """A ``View`` that queues what the supervisor says and draws it on a thread of its own."""

    def __init__(self, inner: View, *, max_lines: int = MAX_LINES, max_chars: int = MAX_CHARS,
                 rate: float = PLAIN_RATE, lossless: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.inner = inner
        self.lossless = lossless  # wait for the screen instead of dropping (attach and logs into a pipe)
        self.rate = rate  # lines a second drawn at most: the drawing thread's CPU (and GIL) stays bounded
        self.drawn_at = clock()
        self.max_lines = max_lines
        self.max_chars = max_chars
        self.clock = clock
        self.cond = threading.Condition()
        self.seq = 0
        self.ranks: dict[int, deque[tuple[int, list[str], str]]] = {}  # rank -> (seq, lines, stream)
        self.events: deque[tuple[int, str, tuple[Any, ...]]] = deque()  # (seq, method, args): never dropped
        self.waiting_lines = 0
        self.waiting_chars = 0
        self.waiting: dict[int, int] = {}  # rank -> lines waiting
        self.dropped: dict[int, int] = {}  # rank -> lines dropped since the last notice
        self.dropped_total = 0
        self.noted = 0.0
        self.log_dir: Path | None = None
        self.closing = False
        self.thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the supervisor's side
    def start(self, commands: Sequence[WorkerCommand], log_dir: Path | None) -> None:
        self.log_dir = log_dir
        self.inner.start(commands, log_dir)
        self.thread = threading.Thread(target=self._draw_loop, name="dlrun-screen", daemon=True)
        self.thread.start()

    def line(self, rank: int, text: str, stream: str) -> None:
        self.lines(rank, (text,), stream)

    def lines(self, rank: int, texts: Sequence[str], stream: str) -> None:
        if not texts:
            return
        chars = sum(len(t) for t in texts)
        with self.cond:
            self.seq += 1
            self.ranks.setdefault(rank, deque()).append((self.seq, list(texts), stream))
            self.waiting[rank] = self.waiting.get(rank, 0) + len(texts)
            self.waiting_lines += len(texts)
            self.waiting_chars += chars
            self.cond.notify()
            while self.waiting_lines > self.max_lines or self.waiting_chars > self.max_chars:
                if self.lossless and self.thread is not None:
                    self.cond.wait(EVERY)
                else:
                    self._drop_oldest()

    def _drop_oldest(self) -> None:
        """The oldest waiting lines of the rank with the most waiting: off the screen."""
        rank = max(self.waiting, key=lambda r: self.waiting[r])
        _seq, texts, _stream = self.ranks[rank].popleft()
        self.waiting[rank] -= len(texts)
        self.waiting_lines -= len(texts)
        self.waiting_chars -= sum(len(t) for t in texts)
        self.dropped[rank] = self.dropped.get(rank, 0) + len(texts)
        self.dropped_total += len(texts)

    def _event(self, method: str, *args: Any) -> None:
        if self.closing and self.thread is None:  # drained: nothing draws later
            getattr(self.inner, method)(*args)
            self.inner.flush()
            return
        with self.cond:
            self.seq += 1
            self.events.append((self.seq, method, args))
            self.cond.notify()

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
        self.inner.finish(result)

    def drain(self) -> None:
        """Draw what still waits (bounded) and end the drawing thread; what comes after is drawn
        at once (``attach`` detaching on Ctrl-C)."""
        with self.cond:
            self.closing = True
            self.cond.notify()
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        self._note_dropped(force=True)
        with self.cond:
            batch = self._take()
        for _seq, method, args in batch:
            getattr(self.inner, method)(*args)
        self.inner.flush()

    # ------------------------------------------------------------------ the drawing thread
    def _take(self, budget: float | None = None) -> list[tuple[int, str, tuple[Any, ...]]]:
        """Everything waiting, in the order it was said, but lines past ``budget`` (dropped, oldest
        of the chattiest rank first); the queues emptied."""
        while budget is not None and self.waiting_lines > max(budget, 1):
            self._drop_oldest()
        batch: list[tuple[int, str, tuple[Any, ...]]] = list(self.events)
        self.events.clear()
        for rank, entries in self.ranks.items():
            batch.extend((seq, "lines", (rank, texts, stream)) for seq, texts, stream in entries)
            entries.clear()
        self.waiting = dict.fromkeys(self.waiting, 0)
        self.waiting_lines = self.waiting_chars = 0
        batch.sort(key=lambda item: item[0])
        return batch

    def _draw_loop(self) -> None:
        while True:
            with self.cond:
                if not self.closing and not self.events and not self.waiting_lines:
                    self.cond.wait(EVERY)
                now = self.clock()
                budget = self.rate * max(now - self.drawn_at, EVERY)
                self.drawn_at = now
                batch = self._take(None if self.closing or self.lossless else budget)
                closing = self.closing
                self.cond.notify_all()  # room again: a lossless feed's writer goes on
            for _seq, method, args in batch:
                getattr(self.inner, method)(*args)
            self._note_dropped()
            self.inner.flush()
            if closing:
                with self.cond:
                    if not self.events and not self.waiting_lines:
                        return

    def _note_dropped(self, force: bool = False) -> None:
        with self.cond:
            if not self.dropped or (not force and self.clock() - self.noted < DROP_NOTE_EVERY):
                return
            dropped, self.dropped = self.dropped, {}
            self.noted = self.clock()
        counts = ", ".join(f"{n} of rank {r}" for r, n in sorted(dropped.items()))
        where = f"{self.log_dir}/" if self.log_dir is not None else "the log files"
        self.inner.notice(f"the screen fell behind: {counts} lines not shown; every line is in {where}")
