"""Grouping ranks by their stacks (pure), on py-spy dumps recorded from a real gloo deadlock
(rank 0 in ``all_reduce``, rank 1 in ``stuck_in_data_loading``), and the hang watch's clock."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dlrun.remote.stack_groups import group_ranks, hang_cause, rank_list, rank_stacks, summary_lines
from dlrun.run.events import StackAnswer
from dlrun.run.hang import HangWatch, hang_lines

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "stacks"
REDUCE = "gloo-rank0-all_reduce.json"
REDUCE_NATIVE = "gloo-rank0-all_reduce-native.json"
SLEEP = "gloo-rank1-sleep.json"
SLEEP_NATIVE = "gloo-rank1-sleep-native.json"


def dump(name: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = json.loads((FIXTURES / name).read_text())
    return found


def answer(ranks: dict[int, tuple[str, ...]], method: str = "py-spy") -> dict[str, Any]:
    """A host's answer: each rank's samples, one recorded dump each."""
    return {"ranks": {str(rank): {"pid": 100 + rank, "method": method, "samples": [
        {"time": float(i), "threads": dump(name)} for i, name in enumerate(names)]} for rank, names in ranks.items()}}


def test_the_odd_rank_comes_first_and_is_the_root_cause() -> None:
    stacks = rank_stacks("h1", answer({0: (REDUCE, REDUCE), 2: (REDUCE, REDUCE), 3: (REDUCE, REDUCE)}))
    stacks += rank_stacks("h2", answer({1: (SLEEP, SLEEP)}))
    groups = group_ranks(stacks)
    assert summary_lines(groups) == [
        "rank 1 (h2): stuck_in_data_loading (train.py:6)           [same in both samples]",
        "ranks 0,2-3 (h1): all_reduce ← train_step (train.py:9)    [same in both samples]",
    ]
    assert hang_cause(groups) == ("rank 1 on h2 is in stuck_in_data_loading (train.py:6) while ranks 0,2-3 wait in"
                                  " all_reduce")


def test_of_two_single_ranks_the_one_not_in_a_collective_is_odd() -> None:
    groups = group_ranks(rank_stacks("h1", answer({0: (REDUCE_NATIVE, REDUCE_NATIVE), 1: (SLEEP_NATIVE, SLEEP_NATIVE)},
                                                  "py-spy --native")))
    assert [g.ranks for g in groups] == [(1,), (0,)]
    # native frames name the C function the user's frame is in
    assert groups[0].where == "time_sleep ← stuck_in_data_loading (train.py:6)"
    assert groups[1].where == "all_reduce ← train_step (train.py:9)"
    assert hang_cause(groups) == ("rank 1 on h1 is in stuck_in_data_loading (train.py:6) while rank 0 waits in"
                                  " all_reduce")


def test_two_ranks_in_two_places_and_neither_waiting_blame_neither() -> None:
    barrier = json.loads(json.dumps(dump(SLEEP)).replace("stuck_in_data_loading", "wait_barrier"))
    stacks = rank_stacks("h1", answer({1: (SLEEP, SLEEP)}))
    stacks += rank_stacks("h1", {"ranks": {"0": {"pid": 100, "method": "py-spy", "samples": [
        {"time": float(i), "threads": barrier} for i in range(2)]}}})
    # before: "rank 0 on h1 is in wait_barrier … while rank 1 is in stuck_in_data_loading", a guess
    assert hang_cause(group_ranks(stacks)) == (
        "the ranks disagree, none is the odd one: rank 0 on h1 is in wait_barrier (train.py:6); rank 1 on h1 is in"
        " stuck_in_data_loading (train.py:6)")


def test_a_rank_that_moved_between_samples_is_marked_changed() -> None:
    groups = group_ranks(rank_stacks("h1", answer({0: (REDUCE, REDUCE), 1: (REDUCE, SLEEP)})))
    lines = summary_lines(groups)
    assert lines[0].startswith("rank 1 (h1): stuck_in_data_loading (train.py:6)") and lines[0].endswith("[changed]")
    assert lines[1].endswith("[same in both samples]")


def test_a_rank_without_a_stack_is_named_with_the_reason_last() -> None:
    stacks = rank_stacks("h1", answer({0: (REDUCE, REDUCE)}))
    stacks += rank_stacks("h2", {"ranks": {"1": {"pid": 7, "method": "py-spy", "samples": [
        {"time": 0, "error": "Permission denied (os error 13) (kernel.yama.ptrace_scope=1)"}]}}})
    groups = group_ranks(stacks)
    assert [g.ranks for g in groups] == [(0,), (1,)]
    assert summary_lines(groups)[1] == ("rank 1 (h2): no stack: Permission denied (os error 13)"
                                        " (kernel.yama.ptrace_scope=1)")
    assert hang_cause(groups) == "the rank is in all_reduce ← train_step (train.py:9)"


def test_every_rank_in_one_place() -> None:
    groups = group_ranks(rank_stacks("h1", answer({r: (REDUCE,) for r in range(8)})))
    assert summary_lines(groups) == ["ranks 0-7 (h1): all_reduce ← train_step (train.py:9)"]  # one sample: no mark
    assert hang_cause(groups) == "every rank is in all_reduce ← train_step (train.py:9)"


def test_rank_lists() -> None:
    assert rank_list([0, 2, 3, 4, 5, 6, 7]) == "0,2-7"
    assert rank_list([5]) == "5"
    assert rank_list([3, 1, 2, 9]) == "1-3,9"


def test_the_hang_lines_name_the_folder_and_the_hosts_notes() -> None:
    stacks = tuple(rank_stacks("h1", answer({0: (REDUCE, REDUCE), 1: (SLEEP, SLEEP)})))
    lines = hang_lines(StackAnswer(stacks, Path("logs/stacks-1"), {"h3": "py-spy not shipped: no answer"}), 30)
    assert lines[0] == ("hung (no output for 30 s): rank 1 on h1 is in stuck_in_data_loading (train.py:6)"
                        " while rank 0 waits in all_reduce")
    assert lines[-2:] == ["  h3: py-spy not shipped: no answer", "  full stacks: logs/stacks-1"]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_hang_watch_fires_once_after_silence_and_no_busy_gpu() -> None:
    clock = Clock()
    watch = HangWatch(30, clock)
    clock.now += 14
    assert watch.notice() is None and not watch.hung()
    clock.now += 1
    assert watch.notice() == "no output for 15 s; --hang-timeout 30 s takes every rank's stack and stops the job"
    assert watch.notice() is None  # once per half of the limit
    clock.now += 10
    watch.output()  # a rank printed: the clock starts again
    clock.now += 29
    assert not watch.hung()
    watch.gpu([None, 80.0])  # a busy GPU: still working
    clock.now += 2
    assert not watch.hung()
    clock.now += 27
    assert not watch.hung()  # the GPU was busy 29 s ago
    clock.now += 1
    assert watch.hung() and not watch.hung()


def test_the_notice_says_a_busy_gpu_holds_the_hang_off() -> None:
    """Seen on a lent H100: a kernel spinning 40 s with no output; the notice said the stop was
    coming while the busy GPU kept it off."""
    clock = Clock()
    watch = HangWatch(10, clock)
    for _ in range(2):  # a sample every 5 s, each at 100 %
        clock.now += 5
        watch.gpu([100.0])
    assert not watch.hung()
    assert watch.notice() == ("no output for 10 s, but a GPU is busy: not a hang while one is"
                              " (--hang-timeout 10 s counts once every GPU is idle)")


def test_a_hang_timeout_of_zero_never_fires() -> None:
    clock = Clock()
    watch = HangWatch(0, clock)
    clock.now += 1e6
    assert watch.notice() is None and not watch.hung()
