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
