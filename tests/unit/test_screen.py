"""The screen's own clock (``dlrun.run.screen.ScreenFeed``): nothing waits for the view, what is
dropped is counted, notices keep their place, a restart draws again, a broken pipe ends a
lossless feed instead of hanging it."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from dlrun.render import WorkerCommand
from dlrun.run.gpus import GpuSample
from dlrun.run.result import RankState, RunResult
from dlrun.run.screen import ScreenFeed


class Recorder:
    """A view that records what it is told; ``slow`` seconds per call of ``lines``."""

    def __init__(self, slow: float = 0.0, broken: bool = False) -> None:
        self.said: list[tuple[str, object]] = []
        self.slow = slow
        self.broken = broken
        self.lock = threading.Lock()

    def start(self, commands: Sequence[WorkerCommand], log_dir: Path | None) -> None:
        self.said.append(("start", None))

    def line(self, rank: int, text: str, stream: str) -> None:
        self.lines(rank, [text], stream)

    def lines(self, rank: int, texts: Sequence[str], stream: str) -> None:
        if self.broken:
            raise BrokenPipeError("the reader went away")
        time.sleep(self.slow)
        with self.lock:
            self.said.extend(("line", (rank, t)) for t in texts)

    def state(self, rank: int, state: RankState, exit_code: int | None) -> None:
        self.said.append(("state", (rank, state)))

    def notice(self, text: str) -> None:
        self.said.append(("notice", text))

    def gpus(self, host: str, samples: Sequence[GpuSample]) -> None:
        pass

    def flush(self) -> None:
        pass

    def finish(self, result: RunResult) -> None:
        self.said.append(("finish", result.exit_code))

    def texts(self, kind: str) -> list[object]:
        return [what for k, what in self.said if k == kind]


def test_a_burst_on_a_quiet_screen_is_drawn_whole_and_in_order() -> None:
    view = Recorder()
    feed = ScreenFeed(view, rate=2000, max_lines=2000)
    feed.start([], None)
    feed.lines(0, [f"a{i}" for i in range(500)], "stdout")
    feed.notice("rank 1 exited")
    feed.lines(1, ["b0"], "stdout")
    feed.finish(RunResult(ranks=(), exit_code=0))
    drawn = [what for kind, what in view.said if kind in ("line", "notice")]
    assert drawn == [*((0, f"a{i}") for i in range(500)), "rank 1 exited", (1, "b0")]
    assert not view.texts("notice")[1:]  # nothing dropped, nothing to say about it


def test_a_flood_is_thinned_counted_and_never_holds_the_writer() -> None:
    view = Recorder(slow=0.01)  # a slow terminal
    feed = ScreenFeed(view, rate=2000, max_lines=2000)
    feed.start([], Path("dlrun-logs/job"))
    started = time.monotonic()
    for chunk in range(200):  # 200,000 lines of rank 0, a few of rank 1
        feed.lines(0, [f"{chunk}-{i}" for i in range(1000)], "stdout")
        if chunk % 50 == 0:
            feed.lines(1, [f"quiet {chunk}"], "stdout")
            feed.state(1, RankState.FAILED, 3)
    handed_over = time.monotonic() - started
    feed.finish(RunResult(ranks=(), exit_code=3))
    assert handed_over < 30  # generous: the point is that the writer never waits for the view
    shown = [what for what in view.texts("line") if isinstance(what, tuple) and what[0] == 0]
    notes = [str(t) for t in view.texts("notice") if "fell behind" in str(t)]
    dropped = sum(int(t.split(" lines of rank 0")[0].rsplit(" ", 1)[-1]) for t in notes
                  if " lines of rank 0" in t)
    assert len(shown) + dropped == 200_000 and dropped > 0
    assert "every line is in dlrun-logs/job/" in notes[-1]
    assert [what for what in view.texts("line") if isinstance(what, tuple) and what[0] == 1] == [
        (1, f"quiet {c}") for c in (0, 50, 100, 150)]  # the quiet rank's lines survive the flood
    assert len(view.texts("state")) == 4  # states are never dropped


def test_a_restarted_job_is_drawn_again() -> None:
    view = Recorder()
    feed = ScreenFeed(view)
    for attempt in range(2):
        feed.start([], None)
        feed.lines(0, [f"attempt {attempt}"], "stdout")
        deadline = time.monotonic() + 10
        while (0, f"attempt {attempt}") not in view.texts("line") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (0, f"attempt {attempt}") in view.texts("line")  # drawn while the attempt runs
        feed.finish(RunResult(ranks=(), exit_code=1))


def test_a_lossless_feed_whose_reader_went_away_raises_instead_of_hanging() -> None:
    feed = ScreenFeed(Recorder(broken=True), lossless=True, max_lines=10)
    feed.start([], None)
    with pytest.raises(BrokenPipeError):
        for _ in range(1000):
            feed.lines(0, [f"{i}" for i in range(100)], "stdout")
    with pytest.raises(BrokenPipeError):
        feed.finish(RunResult(ranks=(), exit_code=0))


def test_a_lossless_feed_waits_and_loses_nothing() -> None:
    view = Recorder(slow=0.001)
    feed = ScreenFeed(view, lossless=True, max_lines=100)
    feed.start([], None)
    for chunk in range(100):
        feed.lines(0, [f"{chunk}-{i}" for i in range(70)], "stdout")
    feed.finish(RunResult(ranks=(), exit_code=0))
    assert len(view.texts("line")) == 7000


def test_a_restart_while_the_summary_is_held_back_keeps_one_drawing_thread() -> None:
    # the pipeline shows each attempt's summary itself, once the engine cleaned up: start comes again while drawing
    view = Recorder()
    feed = ScreenFeed(view)
    feed.start([], None)
    feed.lines(0, ["attempt 0"], "stdout")
    feed.start([], None)
    feed.lines(0, ["attempt 1"], "stdout")
    assert sum(t.name == "dlrun-screen" for t in threading.enumerate()) == 1
    feed.finish(RunResult(ranks=(), exit_code=0))
    assert [k for k, _ in view.said] == ["start", "line", "start", "line", "finish"]
