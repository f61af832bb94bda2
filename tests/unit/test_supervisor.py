"""Policy tests of the supervisor over the scripted FakeTransport (real processes: test_launch_local)."""

from __future__ import annotations

import io
import json
import os
import stat
import threading
import time
from pathlib import Path
from typing import Any, cast

import pytest

from dlrun.inventory import parse_inline
from dlrun.plan import make_plan
from dlrun.remote import source_of
from dlrun.render import WorkerCommand, worker_commands
from dlrun.run.agents import source_messages
from dlrun.run.result import RankState, RunResult
from dlrun.run.supervisor import Supervisor
from dlrun.run.view import PlainView
from dlrun.testing import FakeRank, FakeTransport

from support.wait import wait_until


def commands(spec: str = "a:2,b:2", framework: str = "tf") -> tuple[WorkerCommand, ...]:
    plan = make_plan(parse_inline(spec), job_id="job", framework=framework)
    return worker_commands(plan, "t.py", [], python_for={h.name: ["python3"] for h in plan.hosts})


def run(transport: FakeTransport, tmp_path: Path, spec: str = "a:2,b:2", **kw: Any,
        ) -> tuple[Supervisor, RunResult, str]:
    out = io.StringIO()
    sup = Supervisor(transport, commands(spec), PlainView(out), log_dir=tmp_path / "logs", grace=0.2, **kw)
    return sup, sup.run(), out.getvalue()


def test_all_succeed(tmp_path: Path) -> None:
    _, result, out = run(FakeTransport({0: FakeRank(["hello"]), 3: FakeRank(["bye"])}), tmp_path)
    assert result.exit_code == 0 and result.root_cause is None
    assert [r.state for r in result.ranks] == [RankState.SUCCEEDED] * 4
    assert "[0 a] hello" in out and "[3 b] bye" in out
    assert (tmp_path / "logs" / "rank-3.log").read_text() == "bye\n"
    assert "all 4 ranks succeeded" in out


def test_first_failure_is_root_cause_and_stops_everyone(tmp_path: Path) -> None:
    transport = FakeTransport({0: FakeRank(code=None), 1: FakeRank(code=None), 2: FakeRank(["boom"], code=7),
                               3: FakeRank(code=None)})
    _, result, out = run(transport, tmp_path)
    assert result.exit_code == 7
    assert result.root_cause is not None and result.root_cause.rank == 2 and result.root_cause.host == "b"
    assert result.root_cause.tail == ("boom",)
    assert {r.rank: r.state for r in result.ranks} == {0: RankState.STOPPED, 1: RankState.STOPPED,
                                                       2: RankState.FAILED, 3: RankState.STOPPED}
    assert all(any(m.get("op") == "stop" for m in ch.sent) for ch in transport.channels.values())
    assert out.index("root cause: rank 2 on host b exited with code 7") < out.index("rank  host")


def test_rank_ignoring_term_is_killed_after_grace(tmp_path: Path) -> None:
    transport = FakeTransport({0: FakeRank(code=3), 1: FakeRank(code=None, ignores_term=True)})
    _, result, _ = run(transport, tmp_path, spec="a:2", stop_margin=0.3)
    assert result.exit_code == 3
    # the supervisor drops the channel after grace + margin; the agent then kills
    assert result.ranks[1].state == RankState.STOPPED


def test_lost_host_is_root_cause_with_255(tmp_path: Path) -> None:
    transport = FakeTransport({r: FakeRank(code=None) for r in range(4)}, drop={"b": 0.05})
    _, result, out = run(transport, tmp_path)
    assert result.exit_code == 255
    assert result.root_cause is not None and result.root_cause.host == "b"
    assert result.root_cause.state == RankState.LOST
    assert "connection to the host was lost" in out


def test_silent_host_is_lost_after_the_host_timeout(tmp_path: Path) -> None:
    # host b stops answering (no output, no PONG, no EOF), as a host that lost power
    transport = FakeTransport({r: FakeRank(code=None) for r in range(4)}, silent={"b": 0.05})
    _, result, out = run(transport, tmp_path, host_timeout=0.5)
    assert result.exit_code == 255
    assert result.root_cause is not None and result.root_cause.host == "b"
    assert result.root_cause.state == RankState.LOST
    assert "b: no word from the host for" in out and "host timeout 0.5 s" in out
    assert any(m.get("op") == "stop" for m in transport.channels["a"].sent)  # fail fast on the rest
    assert all(m.get("host_timeout") == 0.5 for ch in transport.channels.values() for m in ch.sent if "ranks" in m)


def test_pings_keep_a_quiet_host_alive(tmp_path: Path) -> None:
    # nothing printed for 1.2 s, timeout 0.4 s: the PONGs are what keeps the job going
    transport = FakeTransport({0: FakeRank(["late"], delay=1.2), 1: FakeRank(["late"], delay=1.2)})
    _, result, out = run(transport, tmp_path, spec="a:2", host_timeout=0.4)
    assert result.exit_code == 0, out
    assert sum(m.get("op") == "ping" for m in transport.channels["a"].sent) >= 3


def test_no_heartbeat_with_host_timeout_0(tmp_path: Path) -> None:
    transport = FakeTransport({0: FakeRank(["x"], delay=0.3)})
    _, result, _ = run(transport, tmp_path, spec="a:1", host_timeout=0)
    assert result.exit_code == 0
    assert not any(m.get("op") == "ping" for m in transport.channels["a"].sent)


def test_unreachable_host_at_start(tmp_path: Path) -> None:
    _, result, out = run(FakeTransport({0: FakeRank(code=None)}, unreachable=["b"]), tmp_path)
    assert result.exit_code == 255 and result.root_cause is not None and result.root_cause.host == "b"
    assert "b: connection refused" in out


def test_interrupt_stops_all_and_exits_130(tmp_path: Path) -> None:
    transport = FakeTransport({r: FakeRank(code=None, delay=0.01) for r in range(4)})
    out = io.StringIO()
    sup = Supervisor(transport, commands(), PlainView(out), log_dir=None, grace=0.2)
    threading.Timer(0.2, sup.interrupt, args=(2,)).start()
    result = sup.run()
    assert result.exit_code == 130 and result.interrupted_by == 2 and result.root_cause is None
    assert all(r.state == RankState.STOPPED for r in result.ranks)


def test_chief_exit_ends_tf_ps_job(tmp_path: Path) -> None:
    transport = FakeTransport({0: FakeRank(["done"], code=0), 1: FakeRank(code=None)})
    _, result, _ = run(transport, tmp_path, spec="a:2", ends_job=lambda c: c.rank == 0)
    assert result.exit_code == 0
    assert result.ranks[1].state == RankState.STOPPED


def test_ranks_filter_hides_lines_but_files_keep_them(tmp_path: Path) -> None:
    out = io.StringIO()
    sup = Supervisor(FakeTransport({0: FakeRank(["zero"]), 1: FakeRank(["one"])}), commands("a:2"),
                     PlainView(out, ranks=[1]), log_dir=tmp_path)
    sup.run()
    assert "[1 a] one" in out.getvalue() and "zero" not in out.getvalue()
    assert (tmp_path / "rank-0.log").read_text() == "zero\n"


def test_rank_never_started_is_not_started_not_stopped(tmp_path: Path) -> None:
    # host b's agent was told to stop before it started its rank: nothing of b's was lost
    transport = FakeTransport({0: FakeRank(["boom"], code=5), 1: FakeRank(code=None)}, start_after={"b": 5.0})
    _, result, out = run(transport, tmp_path, spec="a:1,b:1")
    assert result.exit_code == 5 and result.root_cause is not None and result.root_cause.rank == 0
    assert result.ranks[1].state == RankState.NOT_STARTED and result.ranks[1].exit_code is None
    assert "   1  b        -  not started  -" in out
    assert "connection to the host was lost" not in out
    assert "last 1 line of rank 0:" in out
    assert out.count("exited with code 5") == 2  # the notice and the root cause, no third line


def test_agents_started_early_are_watched_and_pinged_before_the_spec() -> None:
    from dlrun.run.agents import HostAgents

    transport = FakeTransport()
    hosts = parse_inline("a:1,b:1").hosts
    agents = HostAgents(transport, hosts, host_timeout=0.6)  # pings every 0.2 s
    agents.start(probe="print(1)")
    try:
        assert wait_until(lambda: all(sum(m.get("op") == "ping" for m in transport.channels[h.name].sent) >= 2
                                 for h in hosts), 10)
        for h in hosts:
            # the bootstrap's payload first (the agent's source), then the messages
            assert transport.channels[h.name].program == source_of("agent").encode()  # after the stage
            assert transport.channels[h.name].sent[0] == {"op": "watch", "host_timeout": 0.6}
    finally:
        agents.close()
    sent = {h.name: len(transport.channels[h.name].sent) for h in hosts}
    time.sleep(0.5)
    assert {h.name: len(transport.channels[h.name].sent) for h in hosts} == sent  # closed: no more pings


def test_the_loops_events_are_typed_records(tmp_path: Path) -> None:
    from typing import get_args

    from dlrun.run.events import Closed, Event, Frames, Notice

    out = io.StringIO()
    sup = Supervisor(FakeTransport({0: FakeRank(["hello"]), 1: FakeRank(["bye"], code=3)}), commands("a:2"),
                     PlainView(out), log_dir=tmp_path / "logs", grace=0.2)
    seen: list[object] = []
    put = sup.events.put

    def record(event: Event, block: bool = True, timeout: float | None = None) -> None:
        seen.append(event)
        put(event)

    setattr(sup.events, "put", record)  # noqa: B010 (a test spy on the queue)
    sup.notify("between the lines")
    result = sup.run()
    assert result.exit_code == 3 and "between the lines" in out.getvalue()
    assert seen and all(isinstance(event, get_args(Event)) for event in seen), seen
    assert {type(e) for e in seen} >= {Frames, Closed, Notice}
    assert {e.host for e in seen if isinstance(e, Closed)} == {"a"}


@pytest.mark.parametrize("rest", [{}, {"request": {"targets": [{"root": "~/code", "paths": ["a \" b\\n.py"]}]}}])
def test_a_message_with_a_source_encoded_once_is_the_message(rest: dict[str, object]) -> None:
    """The survey's source is encoded once per launch and joined to each host's request: what
    each agent reads is the same JSON as encoding the whole message."""
    source = 'print("é\\t\\u2028")\n' * 3
    line = source_messages("survey", source)(rest)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert json.loads(line) == {"op": "survey", "source": source, **rest}


def test_a_log_file_is_private_new_and_never_reached_through_a_link(tmp_path: Path) -> None:
    from dlrun.run.supervisor import private_file

    with private_file(tmp_path / "rank-0.log") as fh:
        fh.write("secret\n")
    assert stat.S_IMODE((tmp_path / "rank-0.log").stat().st_mode) == 0o600
    (tmp_path / "theirs").write_text("")
    (tmp_path / "rank-1.log").symlink_to(tmp_path / "theirs")  # a folder swapped for another user's
    for name in ("rank-0.log", "rank-1.log"):
        with pytest.raises(OSError):
            private_file(tmp_path / name)
    assert (tmp_path / "theirs").read_text() == ""


def test_the_jobs_log_folder_is_made_private_or_taken_only_when_it_is_the_users(tmp_path: Path) -> None:
    from dlrun.errors import UsageError
    from dlrun.logdir import private_folder

    private_folder(tmp_path / "logs" / "j1")  # made
    private_folder(tmp_path / "logs" / "j1")  # the setup made it first: taken
    assert stat.S_IMODE((tmp_path / "logs" / "j1").stat().st_mode) == 0o700
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "logs" / "j2").symlink_to(tmp_path / "elsewhere")
    theirs = tmp_path / "logs" / "j3"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    for path in (tmp_path / "logs" / "j2", theirs):
        with pytest.raises(UsageError, match="is there already and is not a folder of yours"):
            private_folder(path)


def test_a_full_disk_counts_the_lines_its_buffer_held_too() -> None:
    from types import SimpleNamespace

    from dlrun.run.supervisor import _Rank

    notices: list[str] = []
    rank = _Rank(command=cast(Any, None), log=open("/dev/full", "w", encoding="utf-8"))  # noqa: SIM115
    this = cast(Any, SimpleNamespace(log_dir=Path("logs"), view=SimpleNamespace(notice=notices.append)))
    for i in range(100):  # buffered: the writes work, the flush does not
        Supervisor._log(this, 0, rank, f"line {i}", 1)
    Supervisor._log(this, 0, rank, None, 0)
    assert rank.log is None and rank.unlogged == 100  # before the review: 0
    Supervisor._log(this, 0, rank, "later", 1)
    assert rank.unlogged == 101 and len(notices) == 1 and "No space left on device" in notices[0]
