"""``dlrun stack`` and ``--hang-timeout`` on a real gloo deadlock: rank 0 waits in
``all_reduce`` while rank 1 sleeps in ``stuck_in_data_loading``; over two sshd hosts (attached
and detached) and on localhost. The stacks are py-spy's, taken by each host's agent."""

from __future__ import annotations

import os
import pickle
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from support.cli import REPO, dlrun_argv, run_dlrun
from support.scripts import RAISES_AND_LINGERS
from support.ssh_jobs import hosts_toml, shared_script
from support.sshd_cluster import SshdCluster, wait_job_processes_gone

DEADLOCK = """
import datetime, os, sys, threading, time

starting = True


def say_starting():  # quiet only once in place: a loaded machine's slow import is not the hang
    while starting:
        print("starting", flush=True)
        time.sleep(1)


threading.Thread(target=say_starting, daemon=True).start()
import torch
import torch.distributed as dist


def stuck_in_data_loading():
    while True:
        time.sleep(1)


def train_step(t):
    dist.all_reduce(t)


dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
starting = False
time.sleep(1.5)  # the thread has ended
print("ready", flush=True)
t = torch.ones(4)
if dist.get_rank() == 1:
    stuck_in_data_loading()
train_step(t)
"""

# prints every second for 25 s: quiet for less than --hang-timeout at every moment
CHATTY = """
import os, time
for i in range(25):
    print("rank", os.environ["DLRUN_RANK"], "step", i, flush=True)
    time.sleep(1)
"""

STACK_LINES = (r"^rank 1 \(\S+\): .*stuck_in_data_loading \(deadlock\.py:\d+\)\s+\[same in both samples\]$",
               r"^rank 0 \(\S+\): all_reduce ← train_step \(deadlock\.py:\d+\)\s+\[same in both samples\]$")


def found(pattern: str, text: str) -> str:
    """The first group of ``pattern``'s first match in ``text`` (which must have one)."""
    match = re.search(pattern, text)
    assert match, text
    return match.group(1)


def start(argv: list[str], cwd: Path) -> tuple[subprocess.Popen[str], str, list[str]]:
    """A ``dlrun launch`` left running once both ranks printed ``ready``: the process, its
    job id (from its log folder) and its lines so far."""
    proc = subprocess.Popen(argv, cwd=cwd, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 120
    while sum("] ready" in line for line in lines) < 2 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
    assert sum("] ready" in line for line in lines) == 2, "".join(lines)
    match = re.search(r"logs in dlrun-logs/([\w-]+)/", "".join(lines))
    assert match, "".join(lines)
    return proc, match.group(1), lines


def assert_stacks(text: str) -> None:
    for pattern in STACK_LINES:
        assert re.search(pattern, text, re.M), text
    assert "taken by py-spy" in text, text


def stack_from_another_process(job: str, cwd: Path, *args: str) -> str:
    out = run_dlrun("stack", job, *args, cwd=cwd, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert_stacks(out.stdout)
    return out.stdout


def stop(proc: subprocess.Popen[str], job: str) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert wait_job_processes_gone(job, timeout=30) == []


def files_of(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in folder.iterdir()}


# --------------------------------------------------------------------------- localhost


@pytest.mark.slow
def test_stack_of_a_local_attached_job_from_another_process(tmp_path: Path) -> None:
    (tmp_path / "deadlock.py").write_text(DEADLOCK)
    proc, job, _ = start(dlrun_argv("launch", "--plain", "--grace", "2", "--np", "2", "--framework", "torch",
                                    "deadlock.py"), tmp_path)
    try:
        out = stack_from_another_process(job, tmp_path)
        folder = tmp_path / found(r"(?m)full stacks in (\S+)/$", out)
        files = files_of(folder)
        assert "stuck_in_data_loading (deadlock.py:" in files["rank-1.txt"], files
        assert "all_reduce (torch/distributed/" in files["rank-0.txt"], files
        assert proc.poll() is None, "dlrun stack must leave the job running"
        time.sleep(1)
        assert proc.poll() is None
    finally:
        stop(proc, job)


# rank 0 stands in for NCCL's RAS thread at the address dlrun gave the job (no NCCL here)
RAS_STANDIN = f"""
import os, sys
sys.path.insert(0, {str(REPO / "tests")!r})
print("ras", os.environ.get("NCCL_RAS_ADDR"), flush=True)
if os.environ["RANK"] == "0":
    from support.nccl_ras import FIXTURES, serve
    serve(os.environ["NCCL_RAS_ADDR"], open(FIXTURES + "/mismatch-operation-counts.txt", "rb").read())
"""


@pytest.mark.slow
def test_stack_asks_nccl_ras_at_the_jobs_own_address_once(tmp_path: Path) -> None:
    (tmp_path / "deadlock.py").write_text(RAS_STANDIN + DEADLOCK)
    proc, job, lines = start(dlrun_argv("launch", "--plain", "--grace", "2", "--np", "2", "--framework", "torch",
                                        "deadlock.py"), tmp_path)
    try:
        addresses = set(re.findall(r"\] ras (\S+)$", "".join(lines), re.M))
        assert len(addresses) == 1 and re.fullmatch(r"127\.0\.0\.1:\d+", addresses.pop()), lines  # one per host
        out = stack_from_another_process(job, tmp_path)
        assert re.search(r"^NCCL RAS \(\S+\): warning: #0-0 \(27a079b828ff1a75\) MISMATCH .* 6 ranks have launched up "
                         r"to operation 6649: ranks 0,2-5,7 \(on 172\.16\.64\.210\)$", out, re.M), out
        assert re.search(r"^dlrun: taken by .*NCCL RAS", out, re.M), out
        folder = tmp_path / re.search(r"full stacks in (\S+)/$", out, re.M).group(1)  # type: ignore[union-attr]
        assert "Communicator ranks have different collective operation counts" in files_of(folder)["nccl-ras.txt"]
    finally:
        stop(proc, job)


@pytest.mark.slow
def test_hang_timeout_stops_a_local_deadlock_and_names_the_odd_rank(tmp_path: Path) -> None:
    (tmp_path / "deadlock.py").write_text(DEADLOCK)
    out = run_dlrun("launch", "--plain", "--grace", "2", "--np", "2", "--framework", "torch", "--hang-timeout", "15",
                    "deadlock.py", cwd=tmp_path, timeout=240)
    assert out.returncode == 124, out.stdout + out.stderr
    assert re.search(r"^dlrun: root cause: job hung \(no output for 15 s\): "
                     r"rank 1 on localhost is in stuck_in_data_loading "
                     r"\(deadlock\.py:\d+\) while rank 0 waits in all_reduce$", out.stdout, re.M), out.stdout
    assert re.search(r"^dlrun: no output for \d+ s; --hang-timeout 15 s", out.stdout, re.M), out.stdout
    assert "dlrun: job hung; every rank stopped (--hang-timeout); exit code 124" in out.stdout, out.stdout
    job = found(r"logs in dlrun-logs/([\w-]+)/", out.stdout)
    assert wait_job_processes_gone(job, timeout=30) == []


@pytest.mark.slow
def test_a_rank_that_prints_regularly_is_never_taken_for_hung(tmp_path: Path) -> None:
    (tmp_path / "chatty.py").write_text(CHATTY)
    out = run_dlrun("launch", "--plain", "--np", "2", "--framework", "none", "--hang-timeout", "6", "chatty.py",
                    cwd=tmp_path, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "rank 0 step 24" in out.stdout and "rank 1 step 24" in out.stdout, out.stdout
    assert "hung" not in out.stdout and "no output for" not in out.stdout, out.stdout


def test_stack_of_a_job_that_is_not_there_says_so(tmp_path: Path) -> None:
    out = run_dlrun("stack", "no-such-job", cwd=tmp_path, timeout=120)
    assert out.returncode != 0
    assert "no job no-such-job" in out.stderr, out.stdout + out.stderr


# --------------------------------------------------------------------------- two sshd hosts


@pytest.mark.slow
@pytest.mark.ssh
def test_stack_of_a_two_host_deadlock_from_another_process(cluster: SshdCluster, tmp_path: Path) -> None:
    script = shared_script(cluster, "deadlock.py", DEADLOCK)
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 2)
    proc, job, _ = start(dlrun_argv("launch", "--plain", "--grace", "2", "--hosts", str(hosts), "--ssh-config",
                                    str(cluster.ssh_config), "--framework", "torch", str(script)), tmp_path)
    try:
        began = time.monotonic()
        out = stack_from_another_process(job, tmp_path)
        assert time.monotonic() - began < 60, out  # generous: the issue asks for 30 s on a quiet machine
        assert re.search(r"^rank 1 \(host1\): ", out, re.M) and re.search(r"^rank 0 \(host0\): ", out, re.M), out
        assert proc.poll() is None, "dlrun stack must leave the job running"
    finally:
        stop(proc, job)


@pytest.mark.slow
@pytest.mark.ssh
def test_hang_timeout_ends_a_two_host_deadlock_by_itself(cluster: SshdCluster, tmp_path: Path) -> None:
    script = shared_script(cluster, "deadlock.py", DEADLOCK)
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 2)
    out = run_dlrun("launch", "--plain", "--grace", "2", "--hosts", str(hosts), "--ssh-config", str(cluster.ssh_config),
                    "--framework", "torch", "--hang-timeout", "15", str(script), cwd=tmp_path, timeout=240)
    assert out.returncode == 124, out.stdout + out.stderr
    assert re.search(r"^dlrun: root cause: job hung \(no output for 15 s\): "
                     r"rank 1 on host1 is in stuck_in_data_loading "
                     r"\(deadlock\.py:\d+\) while rank 0 waits in all_reduce$", out.stdout, re.M), out.stdout
    job = found(r"logs in dlrun-logs/([\w-]+)/", out.stdout)
    assert wait_job_processes_gone(job, timeout=30) == []
    folders = list((tmp_path / "dlrun-logs" / job).glob("stacks-*"))
    assert len(folders) == 1 and {"rank-0.txt", "rank-1.txt", "summary.txt"} <= set(files_of(folders[0]))


def detached_torch_job(cluster: SshdCluster, tmp_path: Path, name: str, source: str, *options: str,
                       env: dict[str, str] | None = None) -> tuple[str, list[str]]:
    """``source`` as a detached torch job on two sshd hosts (``--grace 2``): its id, and the options
    that reach its hosts (for ``attach``, ``logs``, ``stop``)."""
    script = shared_script(cluster, name, source)
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 2)
    common = ["--hosts", str(hosts), "--ssh-config", str(cluster.ssh_config)]
    out = run_dlrun("launch", "--detach", "--framework", "torch", "--grace", "2", *options, *common, str(script),
                    cwd=tmp_path, timeout=180, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.strip().splitlines()[-1].split()[-1], common


@pytest.mark.slow
@pytest.mark.ssh
def test_stack_of_a_detached_two_host_deadlock(cluster: SshdCluster, tmp_path: Path) -> None:
    job, common = detached_torch_job(cluster, tmp_path, "deadlock.py", DEADLOCK)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # both ranks past init_process_group
            logs = run_dlrun("logs", job, *common, cwd=tmp_path, timeout=60).stdout
            if logs.count("] ready") == 2:
                break
            time.sleep(1)
        stacks = stack_from_another_process(job, tmp_path, *common)
        assert re.search(r"^rank 1 \(host1\): ", stacks, re.M), stacks
        assert re.search(r"^dlrun: full stacks in host1:\S+/stacks-\S+/$", stacks, re.M), stacks
        ps = run_dlrun("ps", *common, cwd=tmp_path, timeout=60)
        assert re.search(rf"^{job}\s+running\s", ps.stdout, re.M), ps.stdout
    finally:
        run_dlrun("stop", job, *common, cwd=tmp_path, timeout=120)
    assert wait_job_processes_gone(job, timeout=30) == []


# --------------------------------------------------------------------------- py-spy to the hosts


def test_py_spy_is_shipped_once_into_the_hosts_cache_by_hash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dlrun.inventory import Host
    from dlrun.run import tools
    from dlrun.transport.local import LocalTransport

    tool = tools.pyspy()
    assert tool is not None, "py-spy is a dependency of dlrun"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the host program's user cache
    monkeypatch.setattr(tools, "_ready", set())
    host = Host(address="localhost", name="localhost")
    sha256, notes = tools.ship_pyspy(LocalTransport(), [host])
    assert (sha256, notes) == (tool.sha256, {})
    shipped = tmp_path / "cache" / "dlrun" / "tools" / f"py-spy-{tool.sha256}"
    assert shipped.read_bytes() == tool.path.read_bytes()
    assert shipped.stat().st_mode & 0o777 == 0o700
    shipped.unlink()
    assert tools.ship_pyspy(LocalTransport(), [host]) == (tool.sha256, {})  # known to be there: not asked again
    assert not shipped.exists()


def test_a_host_without_py_spy_says_so_for_each_rank(tmp_path: Path) -> None:
    import json
    import sys

    from dlrun.remote import boot_argv, boot_payload

    request = {"op": "take", "pids": {"0": os.getpid()}, "sha256": "0" * 64, "samples": 1}
    env = {"PATH": str(tmp_path), "HOME": str(tmp_path)}  # no py-spy on PATH, none cached
    out = subprocess.run(boot_argv([sys.executable], "stacks"), input=boot_payload("stacks") + json.dumps(request)
                         .encode() + b"\n", capture_output=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    assert answer["ranks"]["0"]["error"] == "no py-spy on this host (none shipped for its machine, none on PATH)"


@pytest.mark.slow
@pytest.mark.ssh
def test_hang_timeout_ends_a_detached_two_host_deadlock_by_itself(cluster: SshdCluster, tmp_path: Path) -> None:
    job, common = detached_torch_job(cluster, tmp_path, "deadlock.py", DEADLOCK, "--hang-timeout", "15")
    # no client: the keepers find the hang, take the stacks and stop the job
    attached = run_dlrun("attach", job, *common, cwd=tmp_path, timeout=240)
    assert attached.returncode == 124, attached.stdout + attached.stderr
    assert re.search(r"^dlrun: root cause: job hung \(no output for 15 s\): "
                     r"rank 1 on host1 is in stuck_in_data_loading "
                     r"\(deadlock\.py:\d+\) while rank 0 waits in all_reduce$", attached.stdout, re.M), attached.stdout
    # the groups under it and the closing line, as an attached launch shows them
    assert re.search(r"^  rank 1 \(host1\): .*stuck_in_data_loading", attached.stdout, re.M), attached.stdout
    assert re.search(rf"^  flight recorder dumps: ~/\.dlrun/jobs/{job}/host-<host>/attempt-0/flight-recorder/"
                     " on each host", attached.stdout, re.M), attached.stdout
    assert "dlrun: job hung; every rank stopped (--hang-timeout); exit code 124" in attached.stdout, attached.stdout
    assert wait_job_processes_gone(job, timeout=30) == []


@pytest.mark.slow
def test_without_py_spy_the_hang_stop_takes_faulthandler_dumps_into_the_logs(tmp_path: Path) -> None:
    (tmp_path / "deadlock.py").write_text(DEADLOCK)
    env = {"DLRUN_PY_SPY": "", "PATH": "/usr/bin:/bin"}  # none shipped, none on the host's PATH
    out = run_dlrun("launch", "--plain", "--grace", "2", "--np", "2", "--framework", "torch", "--hang-timeout", "10",
                    "deadlock.py", cwd=tmp_path, timeout=240, env=env)
    assert out.returncode == 124, out.stdout + out.stderr
    assert "ranks 0-1 (localhost): no stack: no py-spy on this host" in out.stdout, out.stdout
    assert "dlrun: localhost: SIGABRT to ranks [0, 1]: faulthandler prints their stacks to their logs" in out.stdout
    job = found(r"logs in dlrun-logs/([\w-]+)/", out.stdout)
    logs = tmp_path / "dlrun-logs" / job
    assert re.search(r'File ".*deadlock\.py", line \d+ in stuck_in_data_loading', (logs / "rank-1.log").read_text())
    assert re.search(r'File ".*deadlock\.py", line \d+ in train_step', (logs / "rank-0.log").read_text())
    assert wait_job_processes_gone(job, timeout=30) == []


def test_the_control_socket_is_the_users_alone_and_stale_ones_go(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import socket
    import stat

    from dlrun.run.control import ControlServer, ask, socket_path

    monkeypatch.setenv("HOME", str(tmp_path))
    socket_path("old").parent.mkdir(parents=True)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(socket_path("old")))  # a client killed with SIGKILL leaves its socket behind
    stale.close()
    assert ask("old", {"op": "stacks"}) is None
    server = ControlServer("job-1", lambda request: {"echo": request["op"]})
    assert server.start()
    try:
        assert not socket_path("old").exists()
        assert ask("job-1", {"op": "stacks"}) == {"echo": "stacks"}
        assert ask("job-2", {"op": "stacks"}) is None
        assert stat.S_IMODE(socket_path("job-1").stat().st_mode) == 0o700  # the owner alone may connect
        assert stat.S_IMODE(socket_path("job-1").parent.stat().st_mode) == 0o700
    finally:
        server.close()
    assert ask("job-1", {"op": "stacks"}) is None
    assert not ControlServer("", lambda request: {}).start()  # no job id: no door


# every rank writes its flight recorder dump where torch's NCCL watchdog writes it on a timeout
# (TORCH_FR_DUMP_TEMP_FILE<rank>); rank 1 never entered the third collective and then fails
RECORDED = """
import datetime, os, sys, time
import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
t = torch.ones(4)
dist.all_reduce(t)
dist.all_reduce(t)
if rank != 1:
    dist.broadcast(t, 0, async_op=True)
with open(os.environ["TORCH_FR_DUMP_TEMP_FILE"] + str(rank), "wb") as fh:
    fh.write(c10d._dump_fr_trace())
open(f"dumped-{rank}", "w").close()
print("dumped", flush=True)
if rank == 1:  # fails once the others' dumps are whole (a fixed wait can be too short on a busy machine)
    deadline = time.monotonic() + 120
    while not all(os.path.exists(f"dumped-{r}") for r in (0, 2)) and time.monotonic() < deadline:
        time.sleep(0.1)
time.sleep(0.5 if rank == 1 else 60)
sys.exit(3)
"""


@pytest.mark.slow
def test_flight_recorder_dumps_come_back_and_name_the_rank_behind(tmp_path: Path) -> None:
    (tmp_path / "recorded.py").write_text(RECORDED)
    out = run_dlrun("launch", "--plain", "--grace", "2", "--np", "3", "--framework", "torch", "recorded.py",
                    cwd=tmp_path, timeout=240)
    assert out.returncode == 3, out.stdout + out.stderr
    assert ("  flight recorder: rank 1 is behind in process group 0: last collective #2 gloo:all_reduce, while ranks"
            " 0,2 entered #3 gloo:broadcast\n") in out.stdout, out.stdout
    job = found(r"logs in dlrun-logs/([\w-]+)/", out.stdout)
    folder = tmp_path / "dlrun-logs" / job / "flight-recorder"
    assert sorted(p.name for p in folder.iterdir()) == ["trace_rank_0", "trace_rank_1", "trace_rank_2"]
    assert not Path(f"/tmp/dlrun-{job}").exists()  # the host's copies went with the job


def hang_with_dumps(tmp_path: Path, name: str, source: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    """``source`` as 2 torch ranks that hang (``--hang-timeout 5``, exit 124): the launch's output,
    and the job's ``flight-recorder/`` folder in its logs."""
    (tmp_path / name).write_text(source)
    out = run_dlrun("launch", "--plain", "--grace", "2", "--np", "2", "--framework", "torch", "--hang-timeout", "5",
                    name, cwd=tmp_path, timeout=240)
    assert out.returncode == 124, out.stdout + out.stderr
    job = found(r"logs in dlrun-logs/([\w-]+)/", out.stdout)
    return out, tmp_path / "dlrun-logs" / job / "flight-recorder"


#: A rank that does what ProcessGroupNCCL does with TORCH_NCCL_DEBUG_INFO_PIPE_FILE (no NCCL here):
#: make the pipe ``<stem><rank>.pipe`` and, once a byte comes, run THEN in a thread of its own.
DUMPS_WHEN_ASKED = """
import os, pickle, threading, time

rank = int(os.environ["RANK"])
pipe = os.environ["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"] + str(rank) + ".pipe"
os.mkfifo(pipe)


def monitor():
    with open(pipe, "rb") as fh:
        fh.read(1)
THEN

threading.Thread(target=monitor, daemon=True).start()
print("ready", flush=True)
while True:
    time.sleep(1)
"""


def dumps_when_asked(then: str) -> str:
    """``DUMPS_WHEN_ASKED`` with ``then`` (indented code, what the rank does once asked)."""
    return DUMPS_WHEN_ASKED.replace("THEN", then)


# what ProcessGroupNCCL does with TORCH_NCCL_DEBUG_INFO_PIPE_FILE (no NCCL here): make the pipe
# <stem><rank>.pipe, and on a byte write the dump to TORCH_FR_DUMP_TEMP_FILE<rank> from a thread of
# its own. Rank 0's dump takes 4 s (on a lent H100, torch's own came later than dlrun's stop);
# rank 1 reads the byte and never writes one.
SLOW_DUMP = dumps_when_asked("""    if rank == 0:
        time.sleep(4)
        data = pickle.dumps({"version": "2.10", "pg_status": {"0": {"last_enqueued_collective": 7}}, "entries": []})
        with open(os.environ["TORCH_FR_DUMP_TEMP_FILE"] + str(rank), "wb") as out:
            out.write(data[:10])  # written in two parts, as a big dump is
            out.flush()
            time.sleep(0.05)
            out.write(data[10:])
""")


@pytest.mark.slow
def test_a_hangs_stop_waits_for_the_flight_recorder_dumps_it_asked_for(tmp_path: Path) -> None:
    out, folder = hang_with_dumps(tmp_path, "slow_dump.py", SLOW_DUMP)
    # rank 1 wrote none: the stop did not wait for it for ever
    assert sorted(p.name for p in folder.iterdir()) == ["trace_rank_0"], out.stdout
    assert pickle.loads((folder / "trace_rank_0").read_bytes())["pg_status"]["0"]["last_enqueued_collective"] == 7
    assert "flight recorder dumps: " in out.stdout and "flight-recorder/ (rank 0)" in out.stdout, out.stdout
    # the rank that was asked and sent nothing back is named: often the one that is stuck
    assert ("  flight recorder: rank 1 sent no dump back when asked (rank 0 did): no NCCL process group there"
            " yet, or stuck where torch's dump thread cannot run\n") in out.stdout, out.stdout
    assert not Path(f"/tmp/dlrun-{folder.parent.name}").exists()  # the pipes and the folder went with the job


EXITS_EARLY = """
import os, time
if os.environ["DLRUN_RANK"] == "1":
    time.sleep(0.5)
    os._exit(0)
print("waiting", flush=True)
time.sleep(120)
"""


@pytest.mark.slow
def test_a_hang_says_a_rank_exited_early_instead_of_no_such_rank(tmp_path: Path) -> None:
    (tmp_path / "early.py").write_text(EXITS_EARLY)
    out = run_dlrun("launch", "--plain", "--grace", "2", "--np", "2", "--framework", "none", "--hang-timeout", "5",
                    "early.py", cwd=tmp_path, timeout=240)
    assert out.returncode == 124, out.stdout + out.stderr
    # before: "no stack: the host's agent had no such rank running", and a SIGABRT notice for it
    assert re.search(r"rank 1 \(localhost\): no stack: it exited 0 after \d+\.\d s, before the stacks were asked",
                     out.stdout), out.stdout
    assert "SIGABRT" not in out.stdout and "no such rank" not in out.stdout, out.stdout
    folder = tmp_path / found(r"full stacks: (dlrun-logs/\S+)", out.stdout)
    assert "it exited 0 after" in (folder / "rank-1.txt").read_text()  # the files say it too
    # a detached job's keepers say the same
    home = {"HOME": str(tmp_path / "home")}
    launched = run_dlrun("launch", "--detach", "--grace", "2", "--np", "2", "--framework", "none", "--hang-timeout",
                         "5", "early.py", cwd=tmp_path, timeout=240, env=home)
    job = found(r"detached job ([\w-]+)", launched.stdout + launched.stderr)
    attached = run_dlrun("attach", job, cwd=tmp_path, timeout=240, env=home)
    assert attached.returncode == 124, attached.stdout + attached.stderr
    assert re.search(r"rank 1 \(localhost\): no stack: it exited 0 after \d+\.\d s, before the stacks were asked",
                     attached.stdout), attached.stdout
    assert "SIGABRT" not in attached.stdout, attached.stdout


@pytest.mark.slow
@pytest.mark.ssh
def test_a_follower_hosts_rank_that_raised_first_is_named_by_the_leader(cluster: SshdCluster, tmp_path: Path) -> None:
    marks = Path(tempfile.mkdtemp(prefix="dlrun-marks-"))  # the login user writes its marker there
    marks.chmod(0o777)
    try:
        job, common = detached_torch_job(cluster, tmp_path, "linger.py", RAISES_AND_LINGERS, "-e", f"MARKS={marks}")
        attached = run_dlrun("attach", job, *common, cwd=tmp_path, timeout=240)
    finally:
        shutil.rmtree(marks, ignore_errors=True)
    assert attached.returncode == 1, attached.stdout + attached.stderr
    # rank 1 runs on host1, whose keeper tells the leader's (host0) that its last words were a traceback
    assert re.search(r"\n  rank 1 on host1 raised first, \d+\.\d s before, and printed little since",
                     attached.stdout), attached.stdout
    assert wait_job_processes_gone(job, timeout=30) == []


# rank 0's dump is larger than a host sends back (agent.FILE_LIMIT, 16 MiB); rank 1's is small
BIG_DUMP = dumps_when_asked("""    pad = b"x" * (17 << 20) if rank == 0 else b""
    data = pickle.dumps({"version": "2.10", "pg_status": {"0": {"last_enqueued_collective": 7}}, "entries": [],
                         "pad": pad})
    with open(os.environ["TORCH_FR_DUMP_TEMP_FILE"] + str(rank), "wb") as out:
        out.write(data)
""")


@pytest.mark.slow
def test_a_dump_too_large_to_send_back_is_named_where_it_stayed(tmp_path: Path) -> None:
    out, folder = hang_with_dumps(tmp_path, "big_dump.py", BIG_DUMP)
    assert sorted(p.name for p in folder.iterdir()) == ["trace_rank_1"], out.stdout
    stayed = found(r"flight recorder: rank 0's dump \(17\.0 MiB, over the 16 MiB a host sends back\) stayed on"
                   r" localhost: (\S+)\n", out.stdout)
    try:
        assert pickle.loads(Path(stayed).read_bytes())["pg_status"]["0"]["last_enqueued_collective"] == 7
        assert "rank 0 sent no dump back" not in out.stdout, out.stdout  # it did: too large to send
    finally:
        Path(stayed).unlink(missing_ok=True)
        os.removedirs(Path(stayed).parent)


@pytest.mark.slow
@pytest.mark.ssh
def test_a_detached_hang_names_the_rank_that_sent_no_dump_back(cluster: SshdCluster, tmp_path: Path) -> None:
    job, common = detached_torch_job(cluster, tmp_path, "slow_dump.py", SLOW_DUMP, "--hang-timeout", "5")
    attached = run_dlrun("attach", job, *common, cwd=tmp_path, timeout=240)
    assert attached.returncode == 124, attached.stdout + attached.stderr
    # rank 0 (host0) wrote its dump 4 s after the byte; rank 1 (host1) read the byte and wrote none
    assert ("  flight recorder: rank 1 sent no dump back when asked (rank 0 did): no NCCL process group there"
            " yet, or stuck where torch's dump thread cannot run\n") in attached.stdout, attached.stdout
    assert wait_job_processes_gone(job, timeout=30) == []


@pytest.mark.slow
@pytest.mark.ssh
def test_a_detached_jobs_flight_recorder_dumps_stay_with_its_logs(cluster: SshdCluster, tmp_path: Path) -> None:
    from support.sshd_cluster import TEST_USER_HOME

    job, common = detached_torch_job(cluster, tmp_path, "recorded.py", RECORDED)
    attached = run_dlrun("attach", job, *common, cwd=tmp_path, timeout=240)
    assert attached.returncode == 3, attached.stdout + attached.stderr
    for rank, host in ((0, "host0"), (1, "host1")):
        dump = TEST_USER_HOME / ".dlrun" / "jobs" / job / f"host-{host}" / "attempt-0" / "flight-recorder"
        assert (dump / f"trace_rank_{rank}").stat().st_size > 0
    # the leader read every host's dumps (each keeper's digest) before the result: as attached
    assert ("  flight recorder: rank 1 is behind in process group 0: last collective #2 gloo:all_reduce, while rank"
            " 0 entered #3 gloo:broadcast\n") in attached.stdout, attached.stdout
    assert (f"  flight recorder dumps: ~/.dlrun/jobs/{job}/host-<host>/attempt-0/flight-recorder/ on each host"
            " (ranks 0-1)\n") in attached.stdout, attached.stdout
    assert wait_job_processes_gone(job, timeout=30) == []


@pytest.mark.slow
@pytest.mark.ssh
def test_a_detached_hang_without_py_spy_leaves_faulthandler_dumps(cluster: SshdCluster, tmp_path: Path) -> None:
    job, common = detached_torch_job(cluster, tmp_path, "deadlock.py", DEADLOCK, "--hang-timeout", "10",
                                     env={"DLRUN_PY_SPY": ""})  # none shipped
    attached = run_dlrun("attach", job, *common, cwd=tmp_path, timeout=240)
    assert attached.returncode == 124, attached.stdout + attached.stderr
    assert "root cause: job hung (no output for 10 s): no rank's stack could be taken" in attached.stdout, \
        attached.stdout
    assert re.search(r"\[1 host1\]   File \".*deadlock\.py\", line \d+ in stuck_in_data_loading", attached.stdout)
    assert re.search(r"\[0 host0\]   File \".*deadlock\.py\", line \d+ in train_step", attached.stdout)
    assert wait_job_processes_gone(job, timeout=30) == []
