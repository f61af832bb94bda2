"""The sshd test cluster itself, checked with the real OpenSSH client."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from support import sshd_cluster as sc
from support.wait import wait_until

pytestmark = pytest.mark.skipif(
    sc.find_sshd() is None,
    reason="no OpenSSH server here (no sshd on PATH, /usr/sbin/sshd missing): "
    "install openssh-server",
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[sc.SshdCluster]:
    c = sc.start_cluster(3, tmp_path_factory.mktemp("sshd"), bastion=True)
    try:
        yield c
    finally:
        c.stop(remove=True)


def _ssh(
    cluster: sc.SshdCluster, alias: str, cmd: str, *options: str
) -> subprocess.CompletedProcess[str]:
    """Plain OpenSSH client with the cluster's ssh_config: nothing but -F and the options given."""
    argv = ["ssh", "-F", str(cluster.ssh_config), "-o", "BatchMode=yes", *options, alias, cmd]
    return subprocess.run(
        argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30, check=False
    )


def _expected_home(cluster: sc.SshdCluster) -> str:
    import pwd

    return pwd.getpwnam(cluster.user).pw_dir


def test_three_hosts_up(cluster: sc.SshdCluster) -> None:
    assert [h.name for h in cluster.hosts] == ["host0", "host1", "host2"]
    assert cluster.bastion is not None and cluster.bastion.name == "bastion"
    endpoints = {(h.address, h.port) for h in cluster.all_hosts}
    assert len(endpoints) == 4
    for h in cluster.all_hosts:
        assert h.pid is not None
        os.kill(h.pid, 0)  # alive
        assert h.workdir.is_dir() and h.host_key_path.is_file()
        if cluster.is_root:
            assert h.address == f"127.0.0.{h.index + 2}"
            assert h.port == sc.ROOT_PORT or any(h.name in note for note in cluster.notes)
        else:
            assert h.address == "127.0.0.1"
    assert len({h.public_key for h in cluster.all_hosts}) == 4  # one host key each
    if cluster.is_root:
        assert cluster.user in (sc.TEST_USER, "root")


@pytest.mark.parametrize("i", [0, 1, 2])
def test_echo_user_pwd_through_ssh_config(cluster: sc.SshdCluster, i: int) -> None:
    proc = _ssh(cluster, f"host{i}", "echo $USER; pwd")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == [cluster.user, _expected_home(cluster)]


def test_workdirs_are_writable_by_login_user(cluster: sc.SshdCluster) -> None:
    for h in cluster.hosts:
        proc = cluster.run(h.index, f"cd {shlex.quote(str(h.workdir))} && echo ok > f && cat f")
        assert (proc.returncode, proc.stdout) == (0, "ok\n"), proc.stderr


def test_known_hosts_in_openssh_format(cluster: sc.SshdCluster) -> None:
    lines = cluster.known_hosts.read_text().splitlines()
    assert lines == [h.known_hosts_line for h in cluster.all_hosts]
    for line, h in zip(lines, cluster.all_hosts, strict=True):
        assert re.fullmatch(r"\[127\.0\.0\.\d+\]:\d+ ssh-ed25519 AAAA[A-Za-z0-9+/=]+", line)
        assert line.startswith(f"[{h.address}]:{h.port} ")


def test_strict_host_key_checking_passes_with_cluster_known_hosts(cluster: sc.SshdCluster) -> None:
    proc = _ssh(
        cluster,
        "host1",
        "echo fine",
        "-o",
        "StrictHostKeyChecking=yes",
        "-o",
        f"UserKnownHostsFile={cluster.known_hosts}",
    )
    assert (proc.returncode, proc.stdout) == (0, "fine\n"), proc.stderr


def test_unknown_host_key_is_refused(cluster: sc.SshdCluster, tmp_path: Path) -> None:
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    proc = _ssh(cluster, "host0", "echo ran", "-o", f"UserKnownHostsFile={empty}")
    assert proc.returncode == 255
    assert "ran" not in proc.stdout
    assert "Host key verification failed" in proc.stderr


def test_changed_host_key_is_refused(cluster: sc.SshdCluster, tmp_path: Path) -> None:
    wrong = tmp_path / "known_hosts"
    h0, h1 = cluster.hosts[0], cluster.hosts[1]
    wrong.write_text(f"{h0.known_hosts_name} {h1.public_key}\n")  # host1's key for host0
    proc = _ssh(cluster, "host0", "echo ran", "-o", f"UserKnownHostsFile={wrong}")
    assert proc.returncode == 255
    assert "ran" not in proc.stdout
    assert "REMOTE HOST IDENTIFICATION HAS CHANGED" in proc.stderr
    assert "Host key verification failed" in proc.stderr


def test_login_user_runs_the_test_python(cluster: sc.SshdCluster) -> None:
    code = "import sys; print(sys.prefix)"
    proc = cluster.run(2, shlex.join([cluster.python, "-c", code]))
    assert proc.returncode == 0, (proc.stderr, cluster.notes)
    assert proc.stdout.strip() == sys.prefix


def test_ssh_argv_and_remote_words(cluster: sc.SshdCluster) -> None:
    argv = cluster.ssh_argv(0, "printf", "%s,", "a b")
    assert argv[:6] == [
        cluster.ssh_path,
        "-F",
        str(cluster.ssh_config),
        "-o",
        "BatchMode=yes",
        "--",
    ]
    proc = subprocess.run(
        argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False
    )
    assert proc.stdout == "a,b,"  # OpenSSH semantics: words joined, split again remotely


def test_proxyjump_through_bastion(cluster: sc.SshdCluster) -> None:
    assert cluster.bastion is not None
    assert not cluster.session_pids("bastion")
    client = subprocess.Popen(
        cluster.ssh_argv(cluster.jump_alias(1), "cat"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert wait_until(lambda: cluster.session_pids("bastion") and cluster.session_pids(1))
        out, err = client.communicate("through the bastion\n", timeout=30)
    finally:
        client.kill()
        client.wait()
    assert client.returncode == 0, err
    assert out == "through the bastion\n"


def test_kill_sessions_leaves_listener_and_orphans_the_command(cluster: sc.SshdCluster) -> None:
    job = f"t-{uuid.uuid4().hex}"
    client = subprocess.Popen(
        cluster.ssh_argv(2, f"exec env {sc.JOB_ID_VAR}={job} sleep 60"),
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert wait_until(lambda: len(sc.count_job_processes(job)) == 1)
        (orphan,) = sc.count_job_processes(job)
        killed = cluster.kill_sessions(2)
        assert killed and cluster.hosts[2].pid not in killed
        assert client.wait(timeout=10) == 255  # the client lost its connection
        # Nothing on the host side reaps a command whose session died: the known orphan trap.
        assert sc.count_job_processes(job) == [orphan]
        assert cluster.run(2, "echo again").stdout == "again\n"  # listener still serves
    finally:
        client.kill()
        client.wait()
        for pid in sc.count_job_processes(job):
            os.kill(pid, 9)
    assert sc.wait_job_processes_gone(job) == []


def test_count_job_processes_matches_exactly() -> None:
    job = f"t-{uuid.uuid4().hex}"
    procs = [
        subprocess.Popen(["sleep", "60"], env={**os.environ, sc.JOB_ID_VAR: value})
        for value in (job, job + "x")
    ]
    try:
        assert sc.count_job_processes(job) == [procs[0].pid]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert sc.count_job_processes(job) == []


def test_stop_kills_listener_and_sessions(tmp_path: Path) -> None:
    job = f"t-{uuid.uuid4().hex}"
    c = sc.start_cluster(1, tmp_path)
    client = subprocess.Popen(
        c.ssh_argv(0, f"exec env {sc.JOB_ID_VAR}={job} sleep 60"),
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert wait_until(lambda: len(sc.count_job_processes(job)) == 1)
        listener = c.hosts[0].process
        c.stop(remove=True)
        assert listener is not None and listener.poll() is not None
        assert sc.wait_job_processes_gone(job) == []
        assert client.wait(timeout=10) == 255
        c.stop()  # twice is fine
    finally:
        client.kill()
        client.wait()
        c.stop()


def test_failed_start_reports_sshd_stderr_and_leaves_nothing(tmp_path: Path) -> None:
    c = sc.SshdCluster(2, tmp_path, extra_sshd_config="NoSuchKeyword yes")
    with pytest.raises(sc.SshdClusterError, match="NoSuchKeyword"):
        c.start()
    assert c.hosts and all(h.process is not None for h in c.hosts)
    assert all(h.process.poll() is not None for h in c.hosts if h.process)
    assert not c.started
    c.stop(remove=True)


def test_extra_config_and_new_host_key(tmp_path: Path) -> None:
    extra = "MaxSessions 20\nMatch User nobody-at-all\n    PermitTTY no"
    with sc.start_cluster(1, tmp_path, extra_sshd_config=extra) as c:
        text = c.hosts[0].config_path.read_text()
        assert text.index("MaxSessions 20") < text.index("ListenAddress")  # first value wins
        assert text.rstrip().endswith("PermitTTY no")  # Match block last
        effective = subprocess.run(
            [c.sshd_path, "-T", "-f", str(c.hosts[0].config_path)],
            capture_output=True,
            text=True,
            check=False,
        )
        assert "maxsessions 20" in effective.stdout.splitlines(), effective.stderr
        assert c.run(0, "true").returncode == 0

        old_key = c.hosts[0].public_key
        c.restart_host(0, new_host_key=True)
        assert c.hosts[0].public_key != old_key
        proc = c.run(0, "echo ran")
        assert proc.returncode == 255 and "Host key verification failed" in proc.stderr
        c.stop(remove=True)  # __exit__ stops again: harmless
