"""The pure pieces of detached jobs: keeper configs, merged records, the ps table, the jobs
program's records from a job folder, and the keeper's copy of the agent's frame kinds."""

from __future__ import annotations

import ast
import io
import json
import os
import socket
import time
from dataclasses import replace
from pathlib import Path

import pytest

from dlrun.errors import UsageError
from dlrun.inventory import load_inventory
from dlrun.remote import agent, jobs, keeper, source_of
from dlrun.run.config import LaunchConfig
from dlrun.run.detach import (
    check_detach,
    keeper_configs,
    merge_records,
    parse_duration,
    ps_lines,
    rank_of,
    record_of,
    run_result,
    summary_lines,
    view_commands,
)
from dlrun.run.hosts import render_commands
from dlrun.run.result import RankState


def configs() -> dict[str, dict[str, object]]:
    inventory = load_inventory("a:1,b:2")
    attempts = []
    for k, job in enumerate(("job1", "job1-r1")):
        config = LaunchConfig(script="train.py", hosts="a:1,b:2", framework="torch", max_restarts=1, attempt=k)
        attempts.append((job, render_commands(config, inventory, job)[1]))
    return keeper_configs("job1", attempts, agent_argv_of=lambda h: ["agent", h.name], token="t", cert_pem="CERT",
                          key_pem="KEY", grace=3.0, host_timeout=30.0, script="train.py", pidns_source="SRC")


def test_host_0_leads_and_alone_gets_the_key_and_the_world() -> None:
    found = configs()
    assert list(found) == ["a", "b"]
    leader, follower = found["a"], found["b"]
    assert leader["leader"] is True and leader["key_pem"] == "KEY" and leader["followers"] == ["b"]
    assert leader["world"] == {"0": "a", "1": "b", "2": "b"}
    assert follower["leader"] is False and "key_pem" not in follower and "world" not in follower
    assert follower["leader_host"] == "a" and follower["cert_pem"] == "CERT"
    assert follower["agent_argv"] == ["agent", "b"]
    specs = follower["specs"]
    assert isinstance(specs, list)
    assert [spec["job_id"] for spec in specs] == ["job1", "job1-r1"]  # one per attempt, rendered ahead
    assert [r["rank"] for r in specs[1]["ranks"]] == [1, 2]
    assert [r["env"]["TORCHELASTIC_RESTART_COUNT"] for spec in specs for r in spec["ranks"]] == ["0", "0", "1", "1"]
    assert specs[0]["host_timeout"] == 30.0  # the keeper pings its agent: a frozen keeper's ranks stop too


def test_the_reading_of_dumps_and_stacks_goes_where_it_is_read() -> None:
    def configs_of(framework: str, hang: dict[str, object] | None) -> dict[str, dict[str, object]]:
        inventory = load_inventory("a:1,b:2")
        config = LaunchConfig(script="train.py", hosts="a:1,b:2", framework=framework)
        commands = render_commands(config, inventory, "job1")[1]
        return keeper_configs("job1", [("job1", commands)], agent_argv_of=lambda h: ["agent"], token="t",
                              cert_pem="C", key_pem="K", grace=3.0, host_timeout=30.0, script="train.py",
                              pidns_source="SRC", hang=hang, groups_source="GROUPS")

    # torch: every keeper digests its dumps for the leader
    assert [c.get("groups_source") for c in configs_of("torch", None).values()] == ["GROUPS", "GROUPS"]
    # no flight recorder: the leader alone, for the hang's stacks; nobody without a hang
    hang = {"timeout": 5.0, "stacks": {}}
    assert [c.get("groups_source") for c in configs_of("tf", hang).values()] == ["GROUPS", None]
    assert [c.get("groups_source") for c in configs_of("tf", None).values()] == [None, None]


def test_what_detach_does_not_support_is_refused() -> None:
    for framework in ("torch", "horovod", "tf-ps"):
        check_detach(LaunchConfig(script="t.py", framework=framework, detach=True), True)
    for config, hosts_engine in ((LaunchConfig(script="t.py", max_restarts=1, min_hosts=1), True),
                                 (LaunchConfig(script="t.py"), False)):
        with pytest.raises(UsageError):
            check_detach(config, hosts_engine)


def test_a_horovod_leader_gets_the_rendezvous_and_every_rank_its_port() -> None:
    inventory = load_inventory("a:1,b:2")
    config = LaunchConfig(script="train.py", hosts="a:1,b:2", framework="horovod")
    commands = render_commands(config, inventory, "job1", rendezvous=("a", 0))[1]
    found = keeper_configs("job1", [("job1", commands)], agent_argv_of=lambda h: ["agent"], token="t",
                           cert_pem="C", key_pem="K", grace=3.0, host_timeout=30.0, script="train.py",
                           pidns_source="SRC", rendezvous_source=source_of("rendezvous"))
    leader, follower = found["a"], found["b"]
    rendezvous = leader["rendezvous"]
    assert isinstance(rendezvous, dict) and "rendezvous" not in follower
    assert rendezvous["scopes"] == {"global": 3, "local_a": 1, "local_b": 2, "cross_0": 2, "cross_1": 1}
    specs = follower["specs"]
    assert isinstance(specs, list)
    keeper.fill_rendezvous_port(specs, 4242)  # what the follower does with the port the client got
    assert [(r["env"]["HOROVOD_GLOO_RENDEZVOUS_ADDR"], r["env"]["HOROVOD_GLOO_RENDEZVOUS_PORT"])
            for r in specs[0]["ranks"]] == [("a", "4242"), ("a", "4242")]
    assert leader["enders"] == []


def test_the_keepers_rendezvous_is_loaded_from_source_and_a_restart_clears_it() -> None:
    ast.parse(source_of("rendezvous"), feature_version=(3, 8))  # the hosts' Python
    module = keeper.load_rendezvous(source_of("rendezvous"))
    assert module.__name__ == "dlrun_rendezvous" and "dlrun.remote.rendezvous" not in module.__dict__
    server = module.RendezvousServer({"global": 1}, host="127.0.0.1")
    host, port = server.bind()  # before the keeper's fork: the port goes into the ranks' env
    try:
        server.start()
        assert server.address == (host, port)
        with socket.create_connection((host, port)) as sock:
            sock.sendall(b"PUT /global/0 HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi")
            assert sock.recv(100).startswith(b"HTTP/1.0 200")
        assert server.snapshot() == {"global": {"0": b"hi"}}
        server.clear()
        assert server.snapshot() == {}
    finally:
        server.stop()
    with pytest.raises(module.RendezvousServerError):
        module.RendezvousServer({}, host="::1")


def test_a_tf_ps_leader_knows_the_chief(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts.toml"
    hosts.write_text("".join(f'[[hosts]]\naddress = "{name}"\nrole = "{role}"\n'
                             for name, role in (("c", "chief"), ("p", "ps"), ("w", "worker"))))
    inventory = load_inventory(str(hosts))
    config = LaunchConfig(script="train.py", hosts=str(hosts), framework="tf-ps")
    commands = render_commands(config, inventory, "job1")[1]
    found = keeper_configs("job1", [("job1", commands)], agent_argv_of=lambda h: ["agent"], token="t",
                           cert_pem="C", key_pem="K", grace=3.0, host_timeout=30.0, script="train.py",
                           pidns_source="SRC", ends_job=lambda c: c.spec.task_type == "chief")
    chief = [c.rank for c in commands if c.spec.task_type == "chief"]
    assert found["c"]["enders"] == chief and "enders" not in found["p"]


def test_the_leaders_record_wins_and_any_live_keeper_keeps_the_job_alive() -> None:
    follower = {"job_id": "j", "leader": False, "state": "running", "alive": True,
                "ranks": [{"rank": 1, "state": "running"}]}
    leader = {"job_id": "j", "leader": True, "state": "failed", "exit_code": 3, "alive": False,
              "ranks": [{"rank": 0, "state": "stopped"}, {"rank": 1, "state": "failed"}], "started_at": 100.0,
              "script": "t.py"}
    (merged,) = merge_records([follower, leader])
    assert merged.state == "failed" and merged.exit_code == 3 and merged.ranks == 2 and merged.alive
    assert merged.ended
    assert not merge_records([{**leader, "state": "running"}])[0].ended


def test_ps_lines_and_summary() -> None:
    record = record_of({"job_id": "j1", "state": "failed", "exit_code": 3, "started_at": 0.0, "script": "t.py 1",
                        "ranks": [{"rank": 1, "host": "b", "state": "failed", "code": 3},
                                  {"rank": 0, "host": "a", "state": "stopped", "code": 143}],
                        "root_cause": "rank 1 on b exited with code 3", "root_tail": ["ValueError: x"]})
    lines = ps_lines([record], now=7200.0)
    assert lines[1].split() == ["j1", "failed", "2", "2.0h", "3", "t.py", "1"]
    summary = summary_lines(record)  # the attached launch's format (dlrun.run.view), then the job's line
    assert summary[:3] == ["dlrun: root cause: rank 1 on host b exited with code 3", "  last 1 line of rank 1:",
                           "    | ValueError: x"]
    assert summary[4].split() == ["0", "a", "143", "stopped", "-"]
    assert summary[-2:] == ["dlrun: job failed (0/2 ranks succeeded); exit code 3", "dlrun: job j1 failed; exit code 3"]
    assert rank_of("host-a/attempt-0/rank-12.log") == 12


def test_the_keeper_reads_the_agents_frames() -> None:
    # each host program ships alone, so these are copies: they must stay equal
    import inspect

    for name in ("jobs_root", "boot_id"):
        assert inspect.getsource(getattr(keeper, name)).split('"""')[-1] == \
            inspect.getsource(getattr(jobs, name)).split('"""')[-1], name
    assert keeper.HEADER.format == agent.HEADER.format
    # the pushed tree's mark: the agent's (attached ranks) and the keeper's (detached ones)
    assert inspect.getsource(keeper.pin_tree).split('"""')[-1] == inspect.getsource(agent.pin_tree).split('"""')[-1]
    assert keeper.VERSIONS == agent.VERSIONS
    assert (keeper.STARTED, keeper.STDOUT, keeper.STDERR, keeper.EXIT, keeper.ERROR, keeper.DONE) == (
        agent.STARTED, agent.STDOUT, agent.STDERR, agent.EXIT, agent.ERROR, agent.DONE)
    assert keeper.host_folder("user@h:22") == "host-user_h_22"


def write(path: Path, document: dict[str, object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document))


def test_the_jobs_program_reads_records_logs_and_prunes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    root = tmp_path / ".dlrun" / "jobs"
    ended, died, old = root / "ended" / "host-a", root / "died" / "host-a", root / "old" / "host-a"
    write(ended / "result.json", {"job_id": "ended", "state": "succeeded", "leader": True})
    write(died / "state.json", {"job_id": "died", "state": "running", "leader": True})
    (died / "keeper.pid").write_text(f"999999999 {jobs.boot_id()}")  # this machine, no such process
    write(old / "result.json", {"job_id": "old", "state": "failed"})
    log = ended / "attempt-0" / "rank-0.log"
    log.parent.mkdir()
    log.write_bytes(b"one\ntwo\npart")
    week = time.time() - 8 * 86400
    for folder, _dirs, files in os.walk(root / "old"):
        for name in [".", *files]:
            os.utime(Path(folder) / name, (week, week))

    answer = jobs.answer({"op": "ps"})
    assert {(r["job_id"], r["state"], r["alive"]) for r in answer["jobs"]} == {
        ("ended", "succeeded", False), ("died", "lost", False)}  # "old" is pruned
    assert not (root / "old").exists()

    key = "host-a/attempt-0/rank-0.log"
    records, first, ends = streamed("ended", {})
    assert first == {key: b"one\ntwo\n"} and ends == {key: 8}  # whole lines only
    assert [r["job_id"] for r in records] == ["ended"]
    assert streamed("ended", {key: 8})[1:] == ({}, {key: 8})
    assert streamed("ended", {key: 8}, whole=True)[1:] == ({key: b"part"}, {key: 12})  # the job ended: to the end
    assert jobs.answer({"op": "logs", "job": "../x"}) == {"error": "bad job id '../x'"}
    refused = jobs.answer({"op": "delete", "job": "ended", "read": {key: 8}})
    assert refused["deleted"] is False and "not read to its end (8 of 12 bytes)" in refused["error"]
    assert jobs.answer({"op": "delete", "job": "ended", "read": {key: 12}}) == {"deleted": True}
    assert not (root / "ended").exists()


def streamed(job: str, offsets: dict[str, int], since: float | None = None, whole: bool = False,
             ) -> tuple[list[dict[str, object]], dict[str, bytes], dict[str, int]]:
    """The jobs program's streamed logs answer: records, each file's bytes, where each file ended."""
    out = io.BytesIO()
    jobs.stream_logs(job, offsets, since, whole, out)
    data = out.getvalue()
    pieces: dict[str, bytes] = {}
    records: list[dict[str, object]] = []
    while data:
        line, _, data = data.partition(b"\n")
        kind, document = line[:2], json.loads(line[2:])
        if kind == b"R ":
            records = document["jobs"]
        elif kind == b"P ":
            pieces[document["key"]] = pieces.get(document["key"], b"") + data[: document["length"]]
            data = data[document["length"]:]
        else:
            assert kind == b"J " and not data
            return records, pieces, document["ends"]
    raise AssertionError("no closing line")


def test_a_log_is_streamed_whole_in_pieces_that_end_at_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(jobs, "CHUNK", 64)
    folder = tmp_path / ".dlrun" / "jobs" / "j" / "host-a" / "attempt-0"
    folder.mkdir(parents=True)
    text = b"".join(b"line %d\n" % i for i in range(70_000)) + b"x" * 200 + b"\nend"
    (folder / "rank-0.log").write_bytes(text)
    out = io.BytesIO()
    jobs.stream_logs("j", {}, None, True, out)
    headers = [json.loads(line[2:]) for line in out.getvalue().split(b"\n") if line.startswith(b"P {")]
    assert len(headers) > 1000  # no cap: many pieces
    assert streamed("j", {}, whole=True)[1]["host-a/attempt-0/rank-0.log"] == text  # every byte, to the end


def test_since_starts_each_log_where_its_time_index_says(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    folder = tmp_path / ".dlrun" / "jobs" / "j" / "host-a" / "attempt-0"
    folder.mkdir(parents=True)
    (folder / "rank-0.log").write_bytes(b"old\nnew\n")
    now = time.time()
    (folder / "rank-0.idx").write_text(f"{now - 100:.3f} 0\n{now - 10:.3f} 4\n")
    key = "host-a/attempt-0/rank-0.log"
    now = time.time()
    assert streamed("j", {}, now - 50)[1] == {key: b"new\n"}
    assert streamed("j", {}, now - 500)[1] == {key: b"old\nnew\n"}
    assert streamed("j", {}, now - 1)[1:] == ({}, {key: 8})  # nothing that recent
    assert streamed("j", {key: 0}, now - 1)[2] == {key: 8}


def test_durations() -> None:
    assert [parse_duration(t) for t in ("90", "30s", "10m", "2h", "1d")] == [90, 30, 600, 7200, 86400]
    for bad in ("", "x", "-5m"):
        with pytest.raises(UsageError):
            parse_duration(bad)


def test_the_record_feeds_the_launch_views_summary() -> None:
    record = record_of({"job_id": "j", "state": "failed", "exit_code": 3,
                        "root_cause": "rank 1 on b exited with code 3",
                        "root_tail": ["boom"], "ranks": [
                            {"rank": 1, "host": "b", "state": "failed", "code": 3, "argv": ["python", "t.py"],
                             "started": 10.0, "ended": 15.0},
                            {"rank": 0, "host": "a", "state": "stopped", "code": 143}]})
    assert [(c.rank, c.host_name, c.argv) for c in view_commands(record)] == [
        (0, "a", ()), (1, "b", ("python", "t.py"))]
    result = run_result(record)
    assert result.exit_code == 3 and result.interrupted_by is None
    assert result.root_cause is not None and result.root_cause.rank == 1 and result.root_cause.tail == ("boom",)
    assert result.ranks[1].duration == 5.0 and result.ranks[0].state == RankState.STOPPED
    stopped = run_result(replace(record, state="stopped", exit_code=143, root_cause="stopped by signal 15"))
    assert stopped.interrupted_by == 15 and stopped.root_cause is None


def test_a_keepers_json_record_is_read_into_typed_records_in_one_place() -> None:
    import json

    from dlrun.run.detach import FailedAttempt, RankEntry, RootEvidence

    document = json.loads(json.dumps({
        "job_id": "j", "host": "a", "leader": True, "state": "failed", "exit_code": 3, "started_at": 5,
        "script": "t.py", "hosts": ["a", "b"], "alive": False, "notes": ["disk full on b"],
        "root_cause": "rank 1 on b exited with code 3", "root_tail": ["boom"],
        "root": {"rank": 1, "host": "b", "exception": ["ValueError: x"], "error_file": ["{}"], "hint": ["h"]},
        "history": [{"attempt": 0, "job_id": "j", "exit_code": 7, "root_cause": "rank 0 on a exited with code 7"}],
        "ranks": [{"rank": 0, "host": "a", "state": "stopped", "code": 143, "started": 1, "ended": 2},
                  {"rank": 1, "host": "b", "state": "failed", "code": 3, "argv": ["python", "t.py"]}]}))
    record = record_of(document)
    assert record.rank_states == (RankEntry(0, "a", "stopped", 143, 1.0, 2.0),
                                  RankEntry(1, "b", "failed", 3, argv=("python", "t.py")))
    assert record.history == (FailedAttempt(0, "j", 7, "rank 0 on a exited with code 7"),)
    assert record.root == RootEvidence(1, "b", ("ValueError: x",), ("{}",), ("h",))
    assert (record.host, record.leader, record.hosts, record.notes, record.ranks) == (
        "a", True, ("a", "b"), ("disk full on b",), 2)
    assert record_of({"job_id": "k"}).root == RootEvidence() and record_of({}).rank_states == ()
    summary = summary_lines(record)
    assert summary[:2] == ["dlrun: attempt 1 (job j) failed: rank 0 on a exited with code 7",
                           "dlrun: disk full on b"]
    assert "    | ValueError: x" in summary and "  hint: h" in summary
    root = run_result(record).root_cause
    assert root is not None and (root.rank, root.exception, root.error_file, root.hint) == (
        1, ("ValueError: x",), ("{}",), ("h",))


def test_gpu_rows_have_the_attached_supervisors_columns() -> None:
    assert keeper.GPU == agent.GPU
    assert keeper.gpu_rows(12.5, "h", "0, GPU-a, 97, 71680, 81559, [N/A], 71\nbroken\n") == (
        "12.500,h,0,97,71680,81559,,71\n")


def test_another_machines_folder_is_left_to_it_and_a_long_line_still_moves(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hosts sharing a home (NFS) see each other's host folders: one without a result may
    belong to a keeper alive on the other machine, so neither ``delete`` nor the 7-day prune
    removes it from here. A line longer than one read is returned as it is, not waited on."""
    monkeypatch.setenv("HOME", str(tmp_path))
    root = tmp_path / ".dlrun" / "jobs"
    mine, theirs = root / "shared" / "host-a", root / "shared" / "host-b"
    write(mine / "result.json", {"job_id": "shared", "state": "succeeded", "leader": True})
    write(theirs / "state.json", {"job_id": "shared", "state": "running"})
    (theirs / "keeper.pid").write_text("4242 another-machines-boot-id")
    week = time.time() - 8 * 86400
    for folder, _dirs, files in os.walk(root / "shared"):
        for name in [".", *files]:
            os.utime(Path(folder) / name, (week, week))
    jobs.answer({"op": "ps"})  # prunes
    assert theirs.is_dir() and not mine.exists()
    assert jobs.answer({"op": "delete", "job": "shared"}) == {"deleted": False}
    assert theirs.is_dir()

    log = root / "long" / "host-a" / "attempt-0" / "rank-0.log"
    log.parent.mkdir(parents=True)
    log.write_bytes(b"x" * (jobs.CHUNK + 10) + b"\n")
    assert streamed("long", {})[2] == {"host-a/attempt-0/rank-0.log": jobs.CHUNK + 11}  # a piece, then the rest


def test_detach_needs_a_host_timeout_and_the_leaders_key_loads_from_memory() -> None:
    import socket
    import threading

    from dlrun.tls import make_job_tls
    from dlrun.transport.factory import SSHOptions

    with pytest.raises(UsageError, match="--host-timeout"):
        check_detach(LaunchConfig(script="t.py", framework="torch", ssh=SSHOptions(host_timeout=0)), True)
    job = make_job_tls("j")
    server = keeper.server_context(job.cert_pem, job.key_pem)  # the key never goes to a file
    a, b = socket.socketpair()
    got: list[bytes] = []

    def serve() -> None:
        with server.wrap_socket(a, server_side=True) as tls:
            got.append(tls.recv(5))

    thread = threading.Thread(target=serve)
    thread.start()
    with keeper.client_context(job.cert_pem).wrap_socket(b) as tls:
        tls.sendall(b"hello")
    thread.join(10)
    assert got == [b"hello"]


def test_the_leader_greets_only_a_peer_with_the_job_token() -> None:
    """A plain TCP client and a TLS client with a wrong token get nothing and are not peers; the
    right token joins."""
    import socket
    import ssl
    import threading

    from dlrun.tls import make_job_tls

    job = make_job_tls("j")
    config = {"job_id": "j", "host": "a", "leader": True, "hosts": ["a", "b"], "token": "right",
              "rankpolicy_source": source_of("rankpolicy"),
              "specs": [{"job_id": "j", "ranks": []}]}
    leader = keeper.Keeper(config, "/nonexistent", None, keeper.server_context(job.cert_pem, job.key_pem))

    def client() -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE  # a stranger: trusts anything
        return context

    def knock(data: bytes, tls: bool) -> bytes:
        ours, theirs = socket.socketpair()
        thread = threading.Thread(target=leader.welcome, args=(ours,), daemon=True)
        thread.start()
        theirs.settimeout(15)
        try:
            if tls:
                theirs = client().wrap_socket(theirs)
            theirs.sendall(data)
            return theirs.recv(100)
        except (ConnectionResetError, ssl.SSLError):
            return b""
        finally:
            thread.join(15)
            theirs.close()

    assert b"{" not in knock(b'{"token": "right", "host": "b"}\n', tls=False)  # no TLS: a TLS alert at most
    assert knock(b'{"token": "wrong", "host": "b"}\n', tls=True) == b""  # closed without a word
    assert leader.events.empty()
    ours, theirs = socket.socketpair()
    threading.Thread(target=leader.welcome, args=(ours,), daemon=True).start()
    with client().wrap_socket(theirs) as tls:
        tls.sendall(b'{"token": "right", "host": "b"}\n')
        kind, peer = leader.events.get(timeout=15)
        assert (kind, peer.name) == ("joined", "b")
        peer.close()


def tf_ps_leader(tmp_path: Path) -> keeper.Keeper:
    """A leader keeper of a chief (rank 0, its own), a worker and a ps; no agent is started."""
    config = {"job_id": "j", "host": "a", "leader": True, "world": {"0": "a", "1": "b", "2": "c"}, "enders": [0],
              "rankpolicy_source": source_of("rankpolicy"),
              "specs": [{"job_id": "j", "ranks": [{"rank": 0}]}], "followers": ["b", "c"]}
    leader = keeper.Keeper(config, str(tmp_path), None, None)
    for rank, host in ((0, "a"), (1, "b"), (2, "c")):
        leader.on_rank(host, rank, "running", None, {})
    return leader


def test_the_tf_ps_chiefs_end_stops_the_servers_and_is_the_jobs(tmp_path: Path) -> None:
    leader = tf_ps_leader(tmp_path)
    leader.on_rank("a", 0, "exit", 0, {})
    assert leader.stopping  # the servers never end by themselves
    leader.on_rank("b", 1, "exit", 143, {})
    leader.on_rank("c", 2, "exit", -15, {})
    assert leader.decide()
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["state"] == "succeeded" and result["exit_code"] == 0 and result["root_cause"] is None
    assert [r["state"] for r in result["ranks"]] == ["succeeded", "stopped", "stopped"]


def test_a_tf_ps_server_that_fails_first_is_the_root_cause(tmp_path: Path) -> None:
    leader = tf_ps_leader(tmp_path)
    leader.on_rank("c", 2, "exit", 3, {"tail": ["ps died"]})
    leader.on_rank("a", 0, "exit", 143, {})
    leader.on_rank("b", 1, "exit", 143, {})
    assert leader.decide()
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["exit_code"] == 3 and result["root_cause"] == "rank 2 on c exited with code 3"
    assert [r["state"] for r in result["ranks"]] == ["stopped", "stopped", "failed"]


def test_a_keeper_that_cannot_start_is_a_job_start_error_exit_1() -> None:
    from dlrun.errors import JobStartError
    from dlrun.inventory import Host
    from dlrun.run.detach import run_program
    from dlrun.transport.local import LocalTransport

    with pytest.raises(JobStartError) as caught:  # the real keeper program, refusing a bad job id
        run_program(LocalTransport(), Host(address="localhost", name="localhost"), "keeper",
                    {"job_id": "../x", "host": "localhost", "leader": True})
    assert caught.value.exit_code == 1 and "bad job id" in str(caught.value)


def test_a_frozen_leader_is_lost_by_its_followers_word() -> None:
    from dlrun.run.detach import merge_records

    leader = {"job_id": "j", "host": "a", "leader": True, "state": "running", "alive": True, "ranks": [
        {"rank": 0, "host": "a", "state": "running", "code": None},
        {"rank": 1, "host": "b", "state": "running", "code": None}]}
    follower = {"job_id": "j", "host": "b", "leader": False, "state": "lost", "exit_code": 255, "alive": False,
                "root_cause": "lost the leader keeper (a): silent for 5 s",
                "ranks": [{"rank": 1, "host": "b", "state": "stopped", "code": 143}]}
    record = merge_records([leader, follower])[0]
    assert (record.state, record.exit_code) == ("lost", 255)
    assert record.root_cause == "lost the leader keeper (a): silent for 5 s"
    assert [(e.rank, e.state, e.code) for e in record.rank_states] == [(0, "lost", 255), (1, "stopped", 143)]
    assert merge_records([leader])[0].state == "running"  # no follower's word: as the leader says


def test_a_killed_leaders_job_has_no_rank_running() -> None:
    from dlrun.run.detach import merge_records

    dead = {"job_id": "j", "host": "a", "leader": True, "state": "lost", "alive": False,
            "root_cause": "the job's keeper on this host is gone", "ranks": [
                {"rank": 0, "host": "a", "state": "running", "code": None},
                {"rank": 1, "host": "b", "state": "running", "code": None}]}
    record = merge_records([dead])[0]
    assert record.exit_code == 255 and {e.state for e in record.rank_states} == {"lost"}
