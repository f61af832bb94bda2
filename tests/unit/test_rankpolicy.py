"""The rank policy (``dlrun.remote.rankpolicy``), tested once for the attached supervisor and the
detached keeper: lines, a failed rank's root cause (the exception it raised, torch's error file,
the signal), a rank's state, the job's exit code and the restart decision. The keeper's use of
it is tested on a ``Keeper`` below, with the module loaded from source as on a host."""

from __future__ import annotations

import random
import signal
from pathlib import Path
from typing import Any

from dlrun.remote import keeper, rankpolicy, source_of
from dlrun.remote.rankpolicy import (
    LineSplitter,
    TracebackCatcher,
    attempt_job_id,
    error_file_lines,
    job_exit_code,
    rank_state,
    restart,
    restart_notice,
    signal_text,
)


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
                 "Traceback (most recent call last):", *frames(2), "RuntimeError: " + "x" * 1000 + " got (3, 5)"]:
        catcher.feed(line)
    # the one it was raised while handling comes first, named (its frames are the earlier traceback's)
    assert catcher.last[:-1] == ("while handling: KeyError: 'x'", *frames(2))
    assert catcher.last[-1].startswith("RuntimeError: xxx")
    assert len(catcher.last[-1]) == 400 and "x…x" in catcher.last[-1]
    assert catcher.last[-1].endswith("xx got (3, 5)")  # a message's end often says what is wrong


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
    splitter = LineSplitter(max_line=10)
    assert splitter.feed(b"a" * 25) == ["a" * 10, "a" * 10]
    assert splitter.feed(b"\n") == ["a" * 5]
    assert splitter.feed("é".encode() * 6) == ["ééééé"]  # never a character cut in two
    assert splitter.flush() == ["é"]


def test_peers_that_left_early_are_the_hint() -> None:
    from dlrun.remote.rankpolicy import early_exit_hint

    gloo = ["RuntimeError: [pair.cc:553] Connection closed by peer [10.0.0.2]:4711"]
    hint = early_exit_hint(2, gloo, [(0, "h1"), (1, "h1")])
    assert hint[0].startswith("ranks 0 (h1), 1 (h1) exited 0 while the others still ran, and rank 2 then lost")
    assert early_exit_hint(2, gloo, []) == []  # nobody left early: no hint
    assert early_exit_hint(2, ["ValueError: bad batch"], [(0, "h1")]) == []  # not a peer's end


def test_line_splitter_gives_the_same_lines_however_the_stream_is_cut() -> None:
    rng = random.Random(7)
    pieces = [b"ab", b"\n", b"\r", b"\r\n", "\u00e9".encode(), b"x" * 5]
    for _ in range(300):
        data = b"".join(rng.choice(pieces if rng.random() < 0.5 else pieces[:2] + pieces[4:]) for _ in range(40))
        whole = LineSplitter()
        expected = whole.feed(data) + whole.flush()
        cut = LineSplitter()
        got: list[str] = []
        pos = 0
        while pos < len(data):
            step = rng.randint(1, 9)
            got += cut.feed(data[pos : pos + step])
            pos += step
        assert got + cut.flush() == expected, data
        if b"\r" not in data:  # plain newlines: exactly str.split, without the empty piece after a last \n
            reference = data.decode().split("\n")
            if reference[-1] == "":
                reference.pop()
            assert expected == reference


def test_line_splitter_handles_cr_crlf_and_chunks() -> None:
    s = LineSplitter()
    assert s.feed(b"a\nb") == ["a"]
    assert s.feed(b"c\r") == []
    assert s.feed(b"\nprogress 1\rprogress 2\r") == ["bc", "progress 1"]
    assert s.feed(b"progress 3\n\n") == ["progress 2", "progress 3", ""]
    assert s.feed("é".encode()[:1]) == []
    assert s.feed("é\n".encode()[1:]) == ["é"]
    assert s.feed(b"tail") == [] and s.flush() == ["tail"]


def test_an_over_long_line_is_cut_between_characters() -> None:
    splitter = LineSplitter()
    data = ("中" * 700_000 + "\n").encode()  # 2.1 MB: cut at the 1 MiB limit, mid-character unless careful
    pieces = [text for i in range(0, len(data), 65536) for text in splitter.feed(data[i:i + 65536])]
    assert "".join(pieces) == "中" * 700_000 and len(pieces) >= 2


def test_a_ranks_state_from_how_it_exited() -> None:
    assert rank_state(0, stopping=True) == "succeeded"
    assert rank_state(143, stopping=True) == "stopped"
    assert rank_state(3, stopping=False) == "failed"
    assert rank_state(1, stopping=True) == "failed"  # crashed by itself while the job stopped: not "stopped"
    assert rank_state(1, stopping=True, signalled=True) == "stopped"
    assert rank_state(-15, stopping=True) == "stopped" and rank_state(None, stopping=True) == "stopped"
    assert rank_state(0, stopping=True, signalled=True) == "stopped"  # Lightning exits 0 on SIGTERM


def test_the_jobs_exit_code() -> None:
    assert job_exit_code(3, None, [143, 3]) == 3  # the first failure's, even after a stop
    assert job_exit_code(255, 15, [255, 143]) == 255  # a lost host is the root cause
    assert job_exit_code(None, 2, [130, 130]) == 130  # Ctrl-C
    assert job_exit_code(None, None, [0, 0]) == 0
    assert job_exit_code(None, None, [0, 143], ender_codes=[0]) == 0  # tf-ps: the chief's end is the job's


def test_a_failed_attempt_runs_again_while_restarts_are_left() -> None:
    assert attempt_job_id("j", 0) == "j" and attempt_job_id("j", 2) == "j-r2"
    assert restart(0, 2, 3, None) == (True, "attempt 1 failed (exit code 3)")
    assert restart(1, 2, 124, None).again  # a hang is a failure too
    assert restart(1, 2, 255, None, ["h2"]).again  # attached: a lost host is reconnected (or left out)
    assert restart(2, 2, 3, None) == (False, "no restart left (2 of 2 used)")
    assert restart(0, 0, 3, None) == (False, "no restarts (--max-restarts 0)")
    assert restart(0, 2, 0, None) == (False, "succeeded")
    assert restart(0, 2, 130, 2) == (False, "interrupted by signal 2")  # Ctrl-C or dlrun stop: never again
    detached = restart(0, 2, 255, None, ["h2"], lost_hosts_return=False)  # its keeper went with the host
    assert not detached.again and detached.why.startswith("host h2 lost")
    assert restart_notice(0, 2, 3, "the job", " without h2 (lost)") == (
        "attempt 1 failed (exit code 3): relaunching the job without h2 (lost) (1 of 2 restarts)")


def leader(tmp_path: Path, attempts: int, enders: list[int] | None = None) -> Any:
    """A leader keeper of one host with two ranks, its policy loaded from source as on a host."""
    specs = [{"job_id": attempt_job_id("j", k), "ranks": [{"rank": 0}, {"rank": 1}]} for k in range(attempts)]
    config = {"job_id": "j", "host": "h", "leader": True, "specs": specs, "world": {"0": "h", "1": "h"},
              "rankpolicy_source": source_of("rankpolicy"), "enders": enders or []}
    return keeper.Keeper(config, str(tmp_path), None, None)


def end(ranks: Any, *codes: int) -> None:
    for rank, code in enumerate(codes):
        ranks.on_rank("h", rank, "exited", code, {"stopped": False})


def test_the_keeper_drives_the_same_restart_decision(tmp_path: Path, monkeypatch: Any) -> None:
    restarted: list[int] = []
    one = leader(tmp_path, attempts=2)
    monkeypatch.setattr(one, "restart", restarted.append)
    monkeypatch.setattr(one, "stop_own", lambda: setattr(one, "stopping", True))
    end(one, 3, 143)
    assert not one.decide() and restarted == [1]  # attempt 1 of 2 failed: again
    one.attempt = 1
    assert one.decide() and one.exit_code == 3  # the last attempt failed: the job ends with its code
    assert one.policy.RESTART_PAUSE == rankpolicy.RESTART_PAUSE and one.policy.STOP_MARGIN == rankpolicy.STOP_MARGIN


def test_the_keeper_never_restarts_after_an_interrupt_or_a_lost_host(tmp_path: Path, monkeypatch: Any) -> None:
    for lose in (False, True):
        one = leader(tmp_path / str(lose), attempts=3)
        monkeypatch.setattr(one, "restart", lambda attempt: pytest_fail(f"restarted to {attempt}"))
        monkeypatch.setattr(one, "stop_own", lambda one=one: setattr(one, "stopping", True))
        if lose:
            one.lose_host("h", "silent for 30 s")
            assert one.decide() and one.exit_code == 255 and one.job_state() == "failed"
        else:
            one.interrupted_by = signal.SIGTERM
            one.stop_all()
            end(one, 143, 143)
            assert one.decide() and one.exit_code == 143 and one.job_state() == "stopped"


def pytest_fail(text: str) -> None:
    raise AssertionError(text)


def test_a_chained_tracebacks_cause_is_named_above_the_last_one_also_behind_a_prefix() -> None:
    catcher = TracebackCatcher()
    for line in ["Traceback (most recent call last):", *frames(1), "ValueError: loss is nan", "",
                 "The above exception was the direct cause of the following exception:", "",
                 "Traceback (most recent call last):", *frames(1), "RuntimeError: step failed"]:
        catcher.feed("[rank3]: " + line if line else line)
    assert catcher.last == ("caused by: ValueError: loss is nan", *frames(1), "RuntimeError: step failed")
    assert catcher.final  # the markers are not lines after it
    catcher.feed("Traceback (most recent call last):")  # an unrelated one later: no cause
    for line in [*frames(1), "KeyError: 'k'"]:
        catcher.feed(line)
    assert catcher.last == (*frames(1), "KeyError: 'k'")


def test_the_line_between_chained_tracebacks_counts_when_it_comes_alone_and_a_chain_names_its_first() -> None:
    from dlrun.remote.rankpolicy import RankLines

    lines = RankLines()
    chain = []
    for error in ("OSError: disk gone", "ValueError: loss is nan", "RuntimeError: step failed"):
        chain += ["Traceback (most recent call last):", *frames(1), error, "",
                  "The above exception was the direct cause of the following exception:", ""]
    for line in chain[:-3]:  # Python writes a traceback in many writes: each line a chunk of its own
        lines.seen([line])
    assert lines.traceback.last == ("caused by: OSError: disk gone", *frames(1), "RuntimeError: step failed")
