"""``dlrun launch --detach`` over real sshd hosts: the job outlives its client, fails fast on
its own, stops on ``dlrun stop``, is followed by ``dlrun attach``, and leaves no process; Horovod
(the leader keeper's rendezvous) and tf-ps (the chief ends the job) run detached too."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from support.cli import REPO, dlrun_argv, run_dlrun
from support.procs import agents_of
from support.scripts import TORCH_LABELS
from support.ssh_jobs import example, hosts_toml, roles_toml, shared_script
from support.sshd_cluster import TEST_USER_HOME, SshdCluster, wait_job_processes_gone
from support.wait import wait_until

pytestmark = [pytest.mark.ssh, pytest.mark.slow]  # 5-28 s each (2 loaded cores)

STEPS = """
import os, sys, time
rank = os.environ["DLRUN_RANK"]
for i in range(4):
    print("rank", rank, "step", i, flush=True)
    time.sleep(1)
code = int(sys.argv[1]) if len(sys.argv) > 1 and rank == "1" else 0  # rank 1 fails at its end
print("rank", rank, "done", flush=True)
sys.exit(code)
"""

# rank 1 fails after 5 s; rank 0 would sleep for 120 s
FAIL_FAST = """
import os, sys, time
rank = os.environ["DLRUN_RANK"]
print("rank", rank, "up", flush=True)
if rank == "1":
    time.sleep(5)
    print("Traceback (most recent call last):", file=sys.stderr)
    print("RuntimeError: rank 1 gives up", file=sys.stderr, flush=True)
    sys.exit(3)
time.sleep(120)
"""

SLEEPER = "import time\nprint('ready', flush=True)\ntime.sleep(600)\n"


def keepers_of(job_id: str) -> list[int]:
    """Pids of this job's keepers (their command line names the job)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")
        except OSError:
            continue
        if b"dlrun-keeper" in argv and job_id.encode() in argv:
            found.append(int(entry.name))
    return found


def nothing_left(job_id: str, timeout: float = 30) -> None:
    assert wait_job_processes_gone(job_id, timeout=timeout) == []
    deadline = time.monotonic() + timeout
    while keepers_of(job_id) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert keepers_of(job_id) == []


def common(cluster: SshdCluster, tmp_path: Path, n: int = 2) -> list[str]:
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", n)
    return ["--hosts", str(hosts), "--ssh-config", str(cluster.ssh_config)]


def detach(cluster: SshdCluster, tmp_path: Path, script: Path, *args: str) -> str:
    out = run_dlrun("launch", "--detach", "--framework", "none", "--grace", "2", *common(cluster, tmp_path),
                    str(script), *args, cwd=tmp_path, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    last = out.stdout.strip().splitlines()[-1]
    match = re.fullmatch(r"dlrun: detached job ([\w-]+)", last)
    assert match, out.stdout + out.stderr
    return match.group(1)


def test_a_detached_job_outlives_its_killed_clients(cluster: SshdCluster, tmp_path: Path) -> None:
    script = shared_script(cluster, "steps.py", STEPS)
    proc = subprocess.Popen(dlrun_argv("launch", "--detach", "--framework", "none", *common(cluster, tmp_path),
                                       str(script)), cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("dlrun: detached job "):
            break
    job = lines[-1].split()[-1]
    proc.kill()  # SIGKILL, if it has not returned yet
    proc.wait(timeout=30)
    assert keepers_of(job), "".join(lines)
    # an attached client killed mid-job does not end the job either
    attach = subprocess.Popen(dlrun_argv("attach", job, *common(cluster, tmp_path)), cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    assert attach.stdout is not None
    assert attach.stdout.readline() == b"dlrun: starting 2 ranks on 2 hosts\n"
    assert b"step" in attach.stdout.readline()
    attach.send_signal(signal.SIGKILL)
    attach.wait()
    nothing_left(job, timeout=60)
    logs = run_dlrun("logs", job, *common(cluster, tmp_path), cwd=tmp_path, timeout=60)
    assert logs.returncode == 0, logs.stderr
    for rank, host in (("0", "host0"), ("1", "host1")):
        assert f"[{rank} {host}] rank {rank} step 3\n" in logs.stdout, logs.stdout
        assert f"[{rank} {host}] rank {rank} done\n" in logs.stdout, logs.stdout
    ps = run_dlrun("ps", *common(cluster, tmp_path), cwd=tmp_path, timeout=60)
    assert re.search(rf"^{job}\s+succeeded\s+2\s+\S+\s+0\s+.*steps\.py$", ps.stdout, re.M), ps.stdout
    deleted = run_dlrun("logs", job, "--delete", *common(cluster, tmp_path), cwd=tmp_path, timeout=60)
    assert deleted.returncode == 0, deleted.stderr
    assert job not in run_dlrun("ps", *common(cluster, tmp_path), cwd=tmp_path, timeout=60).stdout


def test_a_failed_rank_stops_the_others_and_is_the_root_cause(cluster: SshdCluster, tmp_path: Path) -> None:
    script = shared_script(cluster, "fail_fast.py", FAIL_FAST)
    job = detach(cluster, tmp_path, script)
    # rank 0 would sleep 120 s: the attach ends long before only because the keepers stopped it
    out = run_dlrun("attach", job, *common(cluster, tmp_path), cwd=tmp_path, timeout=60)
    assert out.returncode == 3, out.stdout + out.stderr
    assert "dlrun: root cause: rank 1 on host host1 exited with code 3" in out.stdout, out.stdout
    assert "    | RuntimeError: rank 1 gives up" in out.stdout, out.stdout
    assert re.search(r"^\s+0\s+host0\s+143\s+stopped\s+\S+$", out.stdout, re.M), out.stdout
    nothing_left(job)
    ps = run_dlrun("ps", *common(cluster, tmp_path), cwd=tmp_path, timeout=60)
    assert re.search(rf"^{job}\s+failed\s+2\s+\S+\s+3\s", ps.stdout, re.M), ps.stdout


def test_stop_leaves_no_process_of_the_job(cluster: SshdCluster, tmp_path: Path) -> None:
    script = shared_script(cluster, "sleeper.py", SLEEPER)
    job = detach(cluster, tmp_path, script)
    assert len(wait_job_processes_gone(job, timeout=0)) >= 2  # the ranks (and agents) run
    out = run_dlrun("stop", job, *common(cluster, tmp_path), cwd=tmp_path, timeout=120)
    assert out.returncode == 143, out.stdout + out.stderr
    assert f"dlrun: job {job} stopped; exit code 143" in out.stdout, out.stdout
    nothing_left(job, timeout=15)


def test_attach_shows_the_lines_and_the_exit_code(cluster: SshdCluster, tmp_path: Path) -> None:
    script = shared_script(cluster, "steps.py", STEPS)
    job = detach(cluster, tmp_path, script, "5")
    out = run_dlrun("attach", job, *common(cluster, tmp_path), cwd=tmp_path, timeout=120)
    assert out.returncode == 5, out.stdout + out.stderr
    for rank, host in (("0", "host0"), ("1", "host1")):
        assert f"[{rank} {host}] rank {rank} step 0\n" in out.stdout, out.stdout
        assert f"[{rank} {host}] rank {rank} done\n" in out.stdout, out.stdout
    assert f"dlrun: job {job} failed; exit code 5" in out.stdout, out.stdout
    nothing_left(job)


def host_folder(job: str, host: str) -> Path:
    return TEST_USER_HOME / ".dlrun" / "jobs" / job / f"host-{host}"


def test_a_killed_follower_keeper_is_a_lost_host(cluster: SshdCluster, tmp_path: Path) -> None:
    script = shared_script(cluster, "sleeper.py", SLEEPER)
    job = detach(cluster, tmp_path, script)
    pid = int((host_folder(job, "host1") / "keeper.pid").read_text().split()[0])
    os.kill(pid, signal.SIGKILL)  # its agent sees EOF and stops rank 1; the leader sees the connection end
    out = run_dlrun("attach", job, *common(cluster, tmp_path), cwd=tmp_path, timeout=120)
    assert out.returncode == 255, out.stdout + out.stderr
    assert "dlrun: root cause: host host1 (rank 1): host host1 lost: its keeper's connection closed" in out.stdout, \
        out.stdout
    assert re.search(r"^\s+0\s+host0\s+143\s+stopped\s+\S+$", out.stdout, re.M), out.stdout
    nothing_left(job)


def test_the_leaders_door_closes_once_every_follower_is_in(cluster: SshdCluster, tmp_path: Path) -> None:
    """Nobody else needs the leader's listener after the followers joined (the token check
    before that is tested in tests/unit/test_detach_records.py)."""
    script = shared_script(cluster, "sleeper.py", SLEEPER)
    job = detach(cluster, tmp_path, script)
    try:
        state = json.loads((host_folder(job, "host0") / "state.json").read_text())
        address = (cluster.hosts[0].address, int(state["port"]))
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(address, timeout=10).close()
        assert json.loads((host_folder(job, "host0") / "state.json").read_text())["state"] == "running"
    finally:
        assert run_dlrun("stop", job, *common(cluster, tmp_path), cwd=tmp_path, timeout=120).returncode == 143
    nothing_left(job)


FLAKY = """
import os, sys
restart, rank = os.environ["DLRUN_RESTART_COUNT"], os.environ["DLRUN_RANK"]
print("restart", restart, os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["DLRUN_JOB_ID"], flush=True)
sys.exit(3 if restart == "0" and rank == "1" else 0)
"""


def test_max_restarts_runs_a_failed_detached_job_again(cluster: SshdCluster, tmp_path: Path) -> None:
    script = shared_script(cluster, "flaky.py", FLAKY)
    out = run_dlrun("launch", "--detach", "--framework", "torch", "--max-restarts", "1", *common(cluster, tmp_path),
                    str(script), cwd=tmp_path, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    job = out.stdout.strip().splitlines()[-1].split()[-1]
    attached = run_dlrun("attach", job, *common(cluster, tmp_path), cwd=tmp_path, timeout=120)
    assert attached.returncode == 0, attached.stdout + attached.stderr
    for rank, host in (("0", "host0"), ("1", "host1")):
        assert f"[{rank} {host}] restart 0 0 {job}\n" in attached.stdout, attached.stdout
        assert f"[{rank} {host}] restart 1 1 {job}-r1\n" in attached.stdout, attached.stdout
    assert f"dlrun: attempt 1 (job {job}) failed: rank 1 on host1 exited with code 3" in attached.stdout, \
        attached.stdout
    assert f"dlrun: job {job} succeeded; exit code 0" in attached.stdout, attached.stdout
    nothing_left(job)
    assert wait_job_processes_gone(f"{job}-r1", timeout=15) == []


def test_a_frozen_follower_is_lost_and_stops_its_ranks_when_it_thaws(cluster: SshdCluster, tmp_path: Path) -> None:
    script = shared_script(cluster, "sleeper.py", SLEEPER)
    out = run_dlrun("launch", "--detach", "--framework", "none", "--grace", "2", "--host-timeout", "3",
                    *common(cluster, tmp_path), str(script), cwd=tmp_path, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    job = out.stdout.strip().splitlines()[-1].split()[-1]
    pid = int((host_folder(job, "host1") / "keeper.pid").read_text().split()[0])
    os.kill(pid, signal.SIGSTOP)  # silent, but its connection stays open
    try:
        attached = run_dlrun("attach", job, *common(cluster, tmp_path), cwd=tmp_path, timeout=120)
        # its agent misses the keeper's pings as the leader misses its beats: rank 1 stops anyway
        assert wait_job_processes_gone(job, timeout=30) == []
    finally:
        os.kill(pid, signal.SIGCONT)
    assert attached.returncode == 255, attached.stdout + attached.stderr
    assert "host host1 lost: silent for 3 s" in attached.stdout, attached.stdout
    nothing_left(job)  # the thawed keeper hears the end and stops rank 1


def test_followers_that_lose_their_leader_stop_their_ranks(cluster: SshdCluster, tmp_path: Path) -> None:
    script = shared_script(cluster, "sleeper.py", SLEEPER)
    job = detach(cluster, tmp_path, script)
    pid = int((host_folder(job, "host0") / "keeper.pid").read_text().split()[0])
    os.kill(pid, signal.SIGKILL)  # the leader's agent sees EOF; the follower sees the connection end
    nothing_left(job)
    result = json.loads((host_folder(job, "host1") / "result.json").read_text())
    assert result["exit_code"] == 255 and result["root_cause"].startswith("lost the leader keeper (host0)"), result
    ps = run_dlrun("ps", *common(cluster, tmp_path), cwd=tmp_path, timeout=60)
    assert re.search(rf"^{job}\s+lost\s", ps.stdout, re.M), ps.stdout


# --------------------------------------------------------------------------- Horovod and tf-ps


def launch_detached(cluster: SshdCluster, tmp_path: Path, *args: str) -> str:
    out = run_dlrun("launch", "--detach", "--grace", "3", "--ssh-config", str(cluster.ssh_config), *args,
                    cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1].split()[-1]


@pytest.mark.slow
def test_a_detached_horovod_job_meets_at_the_leaders_rendezvous(
        cluster: SshdCluster, tmp_path: Path, horovod: None) -> None:
    script = example(cluster, "train_horovod.py")
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 2)
    job = launch_detached(cluster, tmp_path, "--framework", "horovod", "--hosts", str(hosts), str(script),
                          "--epochs", "3")
    attached = run_dlrun("attach", job, "--hosts", str(hosts), "--ssh-config", str(cluster.ssh_config),
                         cwd=tmp_path, timeout=300)
    assert attached.returncode == 0, attached.stdout[-3000:] + attached.stderr[-2000:]
    assert "[0 host0] test accuracy:" in attached.stdout, attached.stdout
    assert len(set(re.findall(r"parameter checksum (-?[0-9.]+)", attached.stdout))) == 1, attached.stdout
    ps = run_dlrun("ps", "--hosts", str(hosts), "--ssh-config", str(cluster.ssh_config), cwd=tmp_path, timeout=60)
    assert re.search(rf"^{job}\s+succeeded\s+2\s+\S+\s+0\s+.*train_horovod\.py", ps.stdout, re.M), ps.stdout
    nothing_left(job)


@pytest.mark.slow
def test_a_detached_horovod_restart_gets_a_fresh_rendezvous_and_resumes(
        cluster: SshdCluster, tmp_path: Path, horovod: None) -> None:
    script = example(cluster, "train_horovod.py")
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 2)
    job = launch_detached(cluster, tmp_path, "--framework", "horovod", "--max-restarts", "1", "--hosts", str(hosts),
                          str(script), "--epochs", "3", "--crash-after", "1")
    attached = run_dlrun("attach", job, "--hosts", str(hosts), "--ssh-config", str(cluster.ssh_config),
                         cwd=tmp_path, timeout=300)
    assert attached.returncode == 0, attached.stdout[-3000:] + attached.stderr[-2000:]
    out = attached.stdout
    assert sorted(re.findall(r"^\[(\d) host\d\] restart 1: resuming after epoch 1$", out, re.M)) == ["0", "1"], out
    after = out.split("restart 1: resuming after epoch 1", 1)[1]  # all that follows the first rank's restart line
    assert "epoch 3/3" in after and len(set(re.findall(r"parameter checksum (-?[0-9.]+)", after))) == 1, out
    assert f"dlrun: attempt 1 (job {job}) failed: rank " in out, out
    assert f"dlrun: job {job} succeeded; exit code 0" in out, out
    nothing_left(job)
    assert wait_job_processes_gone(f"{job}-r1", timeout=15) == []


@pytest.mark.slow
def test_a_detached_tf_ps_job_ends_with_its_chief_and_stops_the_servers(cluster: SshdCluster, tmp_path: Path) -> None:
    pytest.importorskip("tf_keras")
    script = example(cluster, "train_ps.py")
    hosts = roles_toml(cluster, tmp_path / "hosts.toml", [("chief", 1), ("worker", 1), ("ps", 1)])
    job = launch_detached(cluster, tmp_path, "--framework", "tf-ps", "--hosts", str(hosts), str(script),
                          "--epochs", "2", "--steps-per-epoch", "10")
    attached = run_dlrun("attach", job, "--hosts", str(hosts), "--ssh-config", str(cluster.ssh_config),
                         cwd=tmp_path, timeout=300)
    assert attached.returncode == 0, attached.stdout[-3000:] + attached.stderr[-2000:]
    assert "[0 host0] epoch 2/2" in attached.stdout, attached.stdout
    assert "dlrun.remote.tf_server: ps 0 serving" in attached.stdout, attached.stdout
    ps = run_dlrun("ps", "--hosts", str(hosts), "--ssh-config", str(cluster.ssh_config), cwd=tmp_path, timeout=60)
    assert re.search(rf"^{job}\s+succeeded\s+3\s+\S+\s+0\s+.*train_ps\.py", ps.stdout, re.M), ps.stdout
    nothing_left(job)
    result = json.loads((host_folder(job, "host0") / "result.json").read_text())
    assert result["exit_code"] == 0 and result["root_cause"] is None, result
    assert {r["host"]: r["state"] for r in result["ranks"]} == {"host0": "succeeded", "host1": "stopped",
                                                                "host2": "stopped"}, result


# --------------------------------------------------------------------------- evidence (issue 28)

# rank 1 writes 70,000 numbered lines, then raises
LONG_LOG = """
import os, sys, time
while not os.path.exists(sys.argv[1]):  # the test says go once the launch has returned
    time.sleep(0.1)
if os.environ["DLRUN_RANK"] == "1":
    out = sys.stdout
    for i in range(70000):
        out.write(f"line {i:05d} of rank 1 {'x' * 40}\\n")
    out.flush()
    raise ValueError("after 70000 lines")
"""


def test_a_detached_torch_failure_names_the_exception_behind_the_rank_prefix(
        cluster: SshdCluster, tmp_path: Path) -> None:
    script = shared_script(cluster, "labels.py", TORCH_LABELS)
    out = run_dlrun("launch", "--detach", "--framework", "torch", "--grace", "2", *common(cluster, tmp_path),
                    str(script), cwd=tmp_path, timeout=180)
    job = re.search(r"detached job ([\w-]+)", out.stdout + out.stderr)
    job_id = job.group(1) if job else ""
    if not job_id:  # it failed before the launch returned: the job id is in the summary
        match = re.search(r"dlrun: job ([\w-]+) failed", out.stdout + out.stderr)
        job_id = match.group(1) if match else ""
    assert job_id, out.stdout + out.stderr
    attached = run_dlrun("attach", job_id, *common(cluster, tmp_path), cwd=tmp_path, timeout=120)
    assert attached.returncode == 1, attached.stdout + attached.stderr
    root = attached.stdout[attached.stdout.index("dlrun: root cause"):]
    assert "ValueError: labels out of range" in root, attached.stdout
    nothing_left(job_id)


def test_every_line_of_a_long_detached_log_is_shown_and_deleted_only_after(
        cluster: SshdCluster, tmp_path: Path) -> None:
    script = shared_script(cluster, "long_log.py", LONG_LOG)
    go = cluster.scripts / f"go-{tmp_path.name}"
    job = detach(cluster, tmp_path, script, str(go))
    go.write_text("")
    attached = run_dlrun("attach", job, *common(cluster, tmp_path), cwd=tmp_path, timeout=180)
    assert attached.returncode == 1, attached.stdout[-3000:] + attached.stderr
    numbers = re.findall(r"^\[1 host1\] line (\d{5}) of rank 1", attached.stdout, re.M)
    assert numbers == [f"{i:05d}" for i in range(70000)]
    assert "ValueError: after 70000 lines" in attached.stdout[attached.stdout.index("dlrun: root cause"):]
    for args in ((), ("--delete",)):
        shown = run_dlrun("logs", job, *args, *common(cluster, tmp_path), cwd=tmp_path, timeout=180)
        assert shown.returncode == 0, shown.stderr
        lines = re.findall(r"^\[1 host1\] line (\d{5}) of rank 1", shown.stdout, re.M)
        assert lines == [f"{i:05d}" for i in range(70000)], (args, len(lines))
        assert "[1 host1] ValueError: after 70000 lines" in shown.stdout
    assert not (TEST_USER_HOME / ".dlrun" / "jobs" / job).exists()


def test_a_rank_that_exits_0_on_sigterm_is_stopped_not_succeeded(cluster: SshdCluster, tmp_path: Path) -> None:
    # Lightning catches SIGTERM and exits 0: dlrun's stop must still call it stopped
    script = shared_script(cluster, "clean_exit.py", (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n"))
    job = detach(cluster, tmp_path, script)
    assert wait_until(lambda: run_dlrun("logs", job, *common(cluster, tmp_path), cwd=tmp_path,
                                        timeout=60).stdout.count("] ready") == 2, timeout=60)  # handlers are set
    stopped = run_dlrun("stop", job, *common(cluster, tmp_path), cwd=tmp_path, timeout=120)
    assert stopped.returncode == 143, stopped.stdout + stopped.stderr
    assert re.search(r"^\s+0\s+host0\s+0\s+stopped\s+\S+$", stopped.stdout, re.M), stopped.stdout
    assert re.search(r"^\s+1\s+host1\s+0\s+stopped\s+\S+$", stopped.stdout, re.M), stopped.stdout
    nothing_left(job)


def test_a_frozen_leader_is_found_lost_from_its_followers_record(cluster: SshdCluster, tmp_path: Path) -> None:
    script = shared_script(cluster, "sleeper.py", SLEEPER)
    job = run_dlrun("launch", "--detach", "--framework", "none", "--grace", "2", "--host-timeout", "5",
                    *common(cluster, tmp_path), str(script), cwd=tmp_path, timeout=180)
    assert job.returncode == 0, job.stdout + job.stderr
    job_id = job.stdout.strip().splitlines()[-1].rsplit(" ", 1)[1]
    leader = int((host_folder(job_id, "host0") / "keeper.pid").read_text().split()[0])
    os.kill(leader, signal.SIGSTOP)
    try:
        # the follower hears nothing for 5 s and ends its part; the leader's agent stops its rank too
        assert wait_job_processes_gone(job_id, timeout=90) == []
        listed = run_dlrun("ps", *common(cluster, tmp_path), cwd=tmp_path, timeout=60)
        assert re.search(rf"^{job_id}\s+lost\s+2\s+\S+\s+255\s", listed.stdout, re.M), listed.stdout
        attached = run_dlrun("attach", job_id, *common(cluster, tmp_path), cwd=tmp_path, timeout=60)
        assert attached.returncode == 255, attached.stdout + attached.stderr
        assert "lost the leader keeper (host0)" in attached.stdout, attached.stdout
    finally:
        os.kill(leader, signal.SIGKILL)
        os.kill(leader, signal.SIGCONT)
    nothing_left(job_id)


def test_a_killed_leader_makes_attach_exit_255(cluster: SshdCluster, tmp_path: Path) -> None:
    script = shared_script(cluster, "sleeper.py", SLEEPER)
    job = detach(cluster, tmp_path, script)
    leader = int((host_folder(job, "host0") / "keeper.pid").read_text().split()[0])
    os.kill(leader, signal.SIGKILL)
    attached = run_dlrun("attach", job, *common(cluster, tmp_path), cwd=tmp_path, timeout=120)
    assert attached.returncode == 255, attached.stdout + attached.stderr
    assert not re.search(r"^\s+\d+\s+host\d\s+\S*\s+running\b", attached.stdout, re.M), attached.stdout
    assert re.search(r"^\s+0\s+host0\s+255\s+lost\b", attached.stdout, re.M), attached.stdout
    nothing_left(job)


def test_ps_and_stop_go_on_without_an_unreachable_host(cluster: SshdCluster, tmp_path: Path) -> None:
    script = shared_script(cluster, "sleeper.py", SLEEPER)
    job = detach(cluster, tmp_path, script)
    with_dead = tmp_path / "with-dead.toml"  # the job's two hosts and one that refuses connections
    with_dead.write_text((tmp_path / "hosts.toml").read_text()
                         + '\n[[hosts]]\naddress = "127.0.0.1"\nname = "dead"\nport = 1\nuser = "nobody"\n')
    args = ["--hosts", str(with_dead), "--ssh-config", str(cluster.ssh_config)]
    listed = run_dlrun("ps", *args, cwd=tmp_path, timeout=60)
    assert listed.returncode == 0, listed.stdout + listed.stderr
    assert re.search(rf"^{job}\s+running\s", listed.stdout, re.M), listed.stdout
    assert "dlrun: warning: dead cannot be reached" in listed.stderr, listed.stderr
    stopped = run_dlrun("stop", job, *args, cwd=tmp_path, timeout=120)
    assert stopped.returncode == 143, stopped.stdout + stopped.stderr
    nothing_left(job)


def test_a_full_disk_drops_log_lines_and_the_job_goes_on(cluster: SshdCluster, tmp_path: Path) -> None:
    if os.geteuid() != 0 or cluster.user == "root":
        pytest.skip("needs root to mount a small tmpfs over the login user's job folders")
    jobs_dir = TEST_USER_HOME / ".dlrun" / "jobs"
    jobs_dir.mkdir(parents=True, exist_ok=True)
    subprocess.run(["chown", "-R", f"{cluster.user}:", str(TEST_USER_HOME / ".dlrun")], check=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size=3m,mode=0700,uid={os.stat(jobs_dir).st_uid}",
                    "tmpfs", str(jobs_dir)], check=True)
    try:
        script = shared_script(cluster, "chatty.py", (
            "import sys, time\n"
            "time.sleep(3)  # every keeper is up before the disk fills\n"
            "for i in range(150000):\n"
            "    sys.stdout.write(f'line {i} ' + 'y' * 60 + '\\n')\n"
            "print('done', flush=True)\n"))
        job = detach(cluster, tmp_path, script)
        attached = run_dlrun("attach", job, *common(cluster, tmp_path), cwd=tmp_path, timeout=180)
        keeper_logs = "".join(f"\n{log}:\n{log.read_text(errors='replace')[-2000:]}"
                              for log in sorted((jobs_dir / job).glob("host-*/*.log")))
        assert attached.returncode == 0, attached.stdout[-3000:] + attached.stderr + keeper_logs
        listed = run_dlrun("ps", *common(cluster, tmp_path), cwd=tmp_path, timeout=60)
        assert re.search(rf"^{job}\s+succeeded\s", listed.stdout, re.M), listed.stdout
        for host in ("host0", "host1"):  # the reserve kept room for every host's result
            result = json.loads((host_folder(job, host) / "result.json").read_text())
            assert result["state"] == "succeeded"
            assert any(note.startswith("disk full on host") for note in result["notes"]), result["notes"]
            assert any("log lines dropped (disk full)" in note for note in result["notes"]), result["notes"]
        for log in (TEST_USER_HOME / ".dlrun" / "jobs" / job).glob("host-*/attempt-0/rank-*.log"):
            lines = log.read_bytes().splitlines()  # what was written is whole lines, none garbled
            assert all(re.fullmatch(rb"line \d+ y{60}|done", line) for line in lines), log
        assert "disk full on host" in attached.stdout, attached.stdout[-2000:]
        nothing_left(job)
    finally:
        subprocess.run(["umount", "-l", str(jobs_dir)], check=False)


def test_a_killed_agent_of_a_detached_job_without_a_pid_namespace_is_a_lost_host(
        cluster: SshdCluster, tmp_path: Path) -> None:
    script = shared_script(cluster, "sleeper.py", SLEEPER)
    out = run_dlrun("launch", "--detach", "--no-pidns", "--framework", "none", "--grace", "2",
                    *common(cluster, tmp_path), str(script), cwd=tmp_path, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    job = out.stdout.strip().splitlines()[-1].rsplit(" ", 1)[1]
    assert wait_until(lambda: len(agents_of(job)) == 2, timeout=30), agents_of(job)
    os.kill(agents_of(job)[0], signal.SIGKILL)
    attached = run_dlrun("attach", job, *common(cluster, tmp_path), cwd=tmp_path, timeout=120)
    assert attached.returncode == 255, attached.stdout + attached.stderr
    assert "was killed by SIGKILL" in attached.stdout, attached.stdout  # the guardian's words, as attached
    assert re.search(r"^\s+\d\s+host\d\s+255\s+lost\b", attached.stdout, re.M), attached.stdout
    nothing_left(job)
