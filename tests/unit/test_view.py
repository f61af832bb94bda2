from __future__ import annotations

import io
from dataclasses import replace
from typing import Any

import pytest
from rich.console import Console

from dlrun.inventory import parse_inline, parse_toml_inventory
from dlrun.plan import make_plan
from dlrun.render import WorkerCommand, worker_commands
from dlrun.run.live import LiveView
from dlrun.run.result import RankResult, RankState, RunResult
from dlrun.run.view import PlainView, root_cause_lines, summary_lines


def cmds() -> tuple[WorkerCommand, ...]:
    plan = make_plan(parse_inline("gpu-a:1,gpu-b:1"), job_id="j")
    return worker_commands(plan, "train.py", ["--lr", "0.1"], python_for={"gpu-a": ["python3"], "gpu-b": ["python3"]})


FAILED = RunResult(
    ranks=(RankResult(0, "gpu-a", RankState.STOPPED, 143, 3.0),
           RankResult(1, "gpu-b", RankState.FAILED, 7, 2.5, tail=("step 1", "Traceback: boom"))),
    exit_code=7,
    root_cause=RankResult(1, "gpu-b", RankState.FAILED, 7, 2.5, tail=("step 1", "Traceback: boom")),
)


def test_root_cause_and_summary_text() -> None:
    lines = root_cause_lines(FAILED, cmds())
    assert lines[0] == "dlrun: root cause: rank 1 on host gpu-b exited with code 7"
    assert lines[1] == "  command: python3 train.py --lr 0.1"
    assert lines[-1] == "    | Traceback: boom"
    summary = summary_lines(FAILED)
    assert summary[0].split() == ["rank", "host", "exit", "state", "duration"]
    assert summary[2].split() == ["1", "gpu-b", "7", "failed", "2.5s"]
    assert summary[-1] == "dlrun: job failed (0/2 ranks succeeded); exit code 7"


def test_a_tf_ps_success_says_the_servers_were_stopped() -> None:
    done = RunResult(ranks=(RankResult(0, "c", RankState.SUCCEEDED, 0, 9.0),
                            RankResult(1, "w", RankState.STOPPED, 143, 9.1),
                            RankResult(2, "p", RankState.STOPPED, 143, 9.1)), exit_code=0)
    assert summary_lines(done)[-1] == "dlrun: job succeeded (1 ranks finished, 2 servers stopped by dlrun); exit code 0"


def test_root_cause_shortens_an_inline_program() -> None:
    plan = make_plan(parse_inline("gpu-a:1,gpu-b:1"), job_id="j")
    program = "import sys\n" * 30  # a tf-ps server rank runs dlrun's server as python -c
    python = {"gpu-a": ["python3"], "gpu-b": ["python3"]}
    commands = worker_commands(plan, "train.py", ["-c", program], python_for=python)
    lines = root_cause_lines(FAILED, commands)
    assert lines[1] == f"  command: python3 train.py -c '<inline program, {len(program)} bytes>'"


def test_plain_view_prefixes_every_line() -> None:
    out = io.StringIO()
    view = PlainView(out)
    view.start(cmds(), None)
    view.line(1, "hello world", "stdout")
    view.finish(FAILED)
    text = out.getvalue()
    assert "[1 gpu-b] hello world\n" in text
    assert "dlrun: root cause: rank 1 on host gpu-b" in text


def test_live_view_renders_status_table_and_colored_prefixes() -> None:
    buf = io.StringIO()
    console = Console(file=buf, width=100, force_terminal=True, color_system="standard")
    now = [100.0]
    view = LiveView(console, clock=lambda: now[0])
    view.start(cmds(), None)
    view.state(0, RankState.RUNNING, None)
    view.line(0, "epoch 1/3: loss 0.5", "stdout")
    now[0] = 112.0
    plain = Console(file=io.StringIO(), width=100, color_system=None)
    with plain.capture() as cap:
        plain.print(view.status_table())
    table = cap.get()
    assert "running" in table and "12.0s" in table and "epoch 1/3: loss 0.5" in table and "pending" in table
    view.finish(FAILED)
    out = buf.getvalue()
    assert "[0 gpu-a] " in out and "\x1b[" in out  # colored prefix
    assert "root cause" in out


def test_live_view_prints_a_chunk_of_lines_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # each print redraws the status table: one per line held dlrun to ~1000 lines/s on a terminal
    console = Console(file=io.StringIO(), width=100, force_terminal=True, color_system="standard")
    view = LiveView(console)
    view.start(cmds(), None)
    prints: list[tuple[Any, ...]] = []
    real = console.print

    def counted(*a: Any, **k: Any) -> None:
        prints.append(a)
        real(*a, **k)

    monkeypatch.setattr(console, "print", counted)
    view.lines(1, ["step 1", "step 2", "step 3"], "stdout")
    view.finish(FAILED)
    assert len(prints[0]) == 1 and prints[0][0].plain.splitlines() == [
        "[1 gpu-b] step 1", "[1 gpu-b] step 2", "[1 gpu-b] step 3"]
    assert view.last[1] == "step 3"


def test_live_table_keeps_rank_host_and_state_whole_and_rank_colors_closed() -> None:
    for width in (40, 80):
        out = io.StringIO()
        console = Console(file=out, width=width, color_system=None)
        view = LiveView(console)
        view.start(cmds(), None)
        view.state(0, RankState.RUNNING, None)
        view.lines(0, ["\x1b[33mWARNING " + "x" * 150 + "\x1b[0m"], "stdout")
        with console.capture() as cap:
            console.print(view.status_table())
        view.finish(FAILED)
        table = cap.get().splitlines()
        assert table[0].startswith("rank  host   state") and table[1].startswith("0     gpu-a  running")
        assert all(len(line) <= width for line in table) and "\x1b" not in cap.get()
        assert "[0 gpu-a] WARNING xxx" in out.getvalue()


def test_names_that_look_like_markup_are_shown_as_written(tmp_path: object) -> None:
    # rich would read "a[/]b" as markup (and raise): host names and paths are plain text
    from pathlib import Path

    from dlrun.push.view import PushView

    plan = make_plan(parse_toml_inventory('[[hosts]]\naddress = "h"\nname = "a[/]b"\n'), job_id="j")
    commands = worker_commands(plan, "t.py", [], python_for={"a[/]b": ["python3"]})
    console = Console(file=io.StringIO(), width=100, force_terminal=True, color_system=None, record=True)
    view = LiveView(console)
    view.start(commands, Path("logs[/]x"))
    view.line(0, "[bold]not markup[/]", "stdout")
    view.finish(RunResult(ranks=(RankResult(0, "a[/]b", RankState.SUCCEEDED, 0, 1.0),), exit_code=0))
    out = console.export_text()
    assert "logs in logs[/]x/" in out and "a[/]b" in out and "[bold]not markup[/]" in out
    push = Console(file=io.StringIO(), width=100, force_terminal=True, color_system=None, record=True)
    with PushView(["h[/]1"], live=True, console=push) as pv:
        pv.progress("h[/]1", 10, 100)
    assert "h[/]1" in push.export_text()


def test_result_json_names_each_way_a_job_ends() -> None:
    from dlrun.run.result import RankResult, RankState, RunResult, result_document

    ok = RankResult(0, "h1", RankState.SUCCEEDED, 0, 1.0)
    lost = RankResult(1, "h2", RankState.LOST, 255, 2.0, error="silent for 30 s")
    aborted = RankResult(1, "h2", RankState.FAILED, 134, 2.0, exception=("x", "RuntimeError: boom"))
    stopped = RankResult(0, "h1", RankState.STOPPED, 143, 1.0)
    ends = {
        "succeeded": RunResult(ranks=(ok,), exit_code=0),
        "lost": RunResult(ranks=(ok, lost), exit_code=255, root_cause=lost),
        "failed": RunResult(ranks=(ok, aborted), exit_code=134, root_cause=aborted),
        "hung": RunResult(ranks=(stopped,), exit_code=124, hang=("hung (no output for 5 s): …",)),
        "interrupted": RunResult(ranks=(stopped,), exit_code=130, interrupted_by=2),
    }
    for outcome, result in ends.items():
        assert result_document(result)["outcome"] == outcome
    failed = result_document(ends["failed"])["root_cause"]
    assert failed["signal"] == "SIGABRT" and failed["exception"] == "RuntimeError: boom"
    assert result_document(ends["lost"])["root_cause"]["signal"] is None


def test_an_attempt_that_is_run_again_does_not_say_the_job_failed() -> None:
    from dlrun.run.result import RankResult, RankState, RunResult
    from dlrun.run.view import summary_lines

    failed = RankResult(0, "h1", RankState.FAILED, 3, 1.0)
    result = RunResult(ranks=(failed,), exit_code=3, root_cause=failed)
    assert summary_lines(result)[-1] == "dlrun: job failed (0/1 ranks succeeded); exit code 3"
    # a CI that greps for "job failed" stopped at the first of --max-restarts' attempts
    assert not any("job failed" in line or "exit code" in line
                   for line in summary_lines(replace(result, restarting=True)))
