"""A failed rank's root cause: the exception it raised, torch's error file, the signal."""

from __future__ import annotations

import signal

from dlrun.run.rootcause import TracebackCatcher, error_file_lines, signal_text


def frames(n: int) -> list[str]:
    out = []
    for i in range(n):
        out += [f'  File "train.py", line {i + 1}, in f{i}', f"    f{i + 1}()"]
    return out


def test_the_exception_is_found_far_above_the_last_lines() -> None:
    catcher = TracebackCatcher()
    lines = ["epoch 1", "Traceback (most recent call last):", *frames(6),
             "ValueError: Attempt to convert a value (PerReplica:{", *[f"  tensor row {i}" for i in range(87)]]
    for line in lines:
        catcher.feed(line)
    assert catcher.last == (*frames(6)[-6:], "ValueError: Attempt to convert a value (PerReplica:{")


def test_the_last_of_chained_tracebacks_wins_and_a_long_line_is_cut() -> None:
    catcher = TracebackCatcher()
    for line in ["Traceback (most recent call last):", *frames(1), "KeyError: 'x'", "",
                 "During handling of the above exception, another exception occurred:", "",
                 "Traceback (most recent call last):", *frames(2), "RuntimeError: " + "x" * 1000]:
        catcher.feed(line)
    assert catcher.last[:-1] == tuple(frames(2)) and catcher.last[-1].startswith("RuntimeError: xxx")
    assert len(catcher.last[-1]) == 400 and catcher.last[-1].endswith("…")


def test_signals_are_named() -> None:
    assert signal_text(128 + signal.SIGABRT) == "killed by SIGABRT (134)"
    assert signal_text(137) == "killed by SIGKILL (137)"
    assert signal_text(1) is None and signal_text(None) is None and signal_text(255) is None


def test_torch_record_error_file() -> None:
    recorded = {"message": {"message": "ValueError: bad batch", "extraInfo": {
        "py_callstack": "Traceback (most recent call last):\n" + "\n".join(frames(4)) + "\nValueError: bad batch\n",
        "timestamp": "1"}}}
    assert error_file_lines(recorded) == [*frames(4)[-6:], "ValueError: bad batch"]
    assert error_file_lines("plain text\n") == ["plain text"]
    assert error_file_lines(None) == []


def test_a_traceback_behind_a_frameworks_prefix_is_found() -> None:
    # torch >= 2.2 ([rank0]: ), torchrun --tee ([default0]:), horovodrun ([1,0]<stderr>:)
    for prefix in ("[rank0]: ", "[default0]:", "[1,0]<stderr>:"):
        catcher = TracebackCatcher()
        lines = ["epoch 1", f"{prefix}Traceback (most recent call last):",
                 *(prefix + f for f in frames(2)), "another writer's line in between",
                 f"{prefix}ValueError: labels out of range: tensor([[1, 2],",
                 *(f"{prefix}        [3, 4]]," for _ in range(40))]
        for line in lines:
            catcher.feed(line)
        assert catcher.last == (*frames(2), "ValueError: labels out of range: tensor([[1, 2],"), prefix


def test_a_line_that_only_mentions_a_traceback_late_is_no_start() -> None:
    catcher = TracebackCatcher()
    catcher.feed("x" * 200 + "Traceback (most recent call last):")  # quoted in a long log line
    assert not catcher.reading


def test_an_endless_line_comes_out_in_capped_pieces() -> None:
    from dlrun.remote.rankpolicy import LineSplitter

    splitter = LineSplitter(max_line=10)
    assert splitter.feed(b"a" * 25) == ["a" * 10, "a" * 10]
    assert splitter.feed(b"\n") == ["a" * 5]
    assert splitter.feed("é".encode() * 6) == ["ééééé"]  # never a character cut in two
    assert splitter.flush() == ["é"]


def test_peers_that_left_early_are_the_hint() -> None:
    from dlrun.run.rootcause import early_exit_hint

    gloo = ["RuntimeError: [pair.cc:553] Connection closed by peer [10.0.0.2]:4711"]
    hint = early_exit_hint(2, gloo, [(0, "h1"), (1, "h1")])
    assert hint[0].startswith("ranks 0 (h1), 1 (h1) exited 0 while the others still ran, and rank 2 then lost")
    assert early_exit_hint(2, gloo, []) == []  # nobody left early: no hint
    assert early_exit_hint(2, ["ValueError: bad batch"], [(0, "h1")]) == []  # not a peer's end
