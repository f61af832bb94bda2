"""A push swaps the whole code tree in at once (issue 34, item 4), over real sshd hosts: a push
killed mid-way leaves every host's previous tree whole, a job already running keeps its tree
while a new push lands, and the next push resumes what the killed one sent."""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dlrun.inventory import Host
from dlrun.push.session import push
from dlrun.transport.local import HostRouter

from support.cli import REPO, run_dlrun
from support.ssh_jobs import hosts_toml
from support.sshd_cluster import SshdCluster
from support.wait import wait_until

PART = ".dlrun-part-"

STALLED_PUSH = """
import sys, time
sys.path.insert(0, {repo!r})
from pathlib import Path
from dlrun.inventory import Host
from dlrun.transport.ssh import SSHTransport
from dlrun.push.session import push
from dlrun.transport.local import HostRouter

stalled = set()
def stall(host, done, total):
    if done >= {threshold}:
        stalled.add(host)
        if len(stalled) == {hosts}:
            print("stalled", flush=True)
        time.sleep(600)

hosts = [Host(address=n, name=n, workdir=w, python={python!r}) for n, w in {hosts_and_workdirs!r}]
push(HostRouter(remote=SSHTransport(config_file={config!r})), hosts, code_dir=Path({src!r}), progress=stall)
"""


@pytest.fixture(autouse=True)
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


CHECK = """
import hashlib, os
os.chdir(os.path.dirname(os.path.realpath(__file__)))  # the tree the project folder names now
digest = hashlib.sha256()
for name in sorted(n for n in os.listdir(".") if n.startswith("m")):
    digest.update(open(name, "rb").read())
print("TREE", digest.hexdigest())
"""


def tree_digest(files: dict[str, bytes]) -> str:
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(files[name])
    return digest.hexdigest()


def files_of(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.ssh
def test_a_push_killed_midway_leaves_every_host_the_old_tree_whole(
        cluster: SshdCluster, transport: HostRouter, tmp_path: Path) -> None:
    src = tmp_path / "proj"
    src.mkdir()
    size = 256 * 1024
    old = {f"m{i:02d}.py": os.urandom(size) for i in range(40)}
    for name, data in old.items():
        (src / name).write_bytes(data)
    (src / "check.py").write_text(CHECK)
    hosts = [Host(address=h.name, name=h.name, workdir=str(h.workdir / "atomic"), python=cluster.python)
             for h in cluster.hosts[:2]]
    push(transport, hosts, code_dir=src)
    remotes = [h.workdir / "atomic" / "proj" for h in cluster.hosts[:2]]
    # a job's own output in the pushed folder (a checkpoint): it survives every push below
    for i, remote in enumerate(remotes):
        assert cluster.run(i, f"mkdir -p {remote}/ckpt && echo weights > {remote}/ckpt/model.pt").returncode == 0

    new = {name: os.urandom(size) for name in old}
    for name, data in new.items():
        (src / name).write_bytes(data)
    script = STALLED_PUSH.format(repo=str(REPO), threshold=20 * size, hosts=2, python=cluster.python,
                                 hosts_and_workdirs=[(h.name, h.workdir) for h in hosts],
                                 config=str(cluster.ssh_config), src=str(src))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stages = [r.parent / ".dlrun-versions" / "proj" / "next" for r in remotes]
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "stalled", proc.stderr.read() if proc.stderr else ""
        # each host has new files in the tree being built beside the old one
        assert wait_until(lambda: all(len([p for p in s.glob("m*.py") if p.read_bytes() == new[p.name]]) >= 10
                                      for s in stages), 30)
        # a --no-push launch meanwhile runs the old tree, whole
        inventory = tmp_path / "hosts.toml"
        inventory.write_text(f'[defaults]\npython = "{cluster.python}"\n[[hosts]]\naddress = "{hosts[0].name}"\n'
                             f'slots = 1\nworkdir = "{hosts[0].workdir}"\n')
        out = run_dlrun("launch", "--no-push", "--plain", "--framework", "none", "--hosts", str(inventory),
                        "--ssh-config", str(cluster.ssh_config), str(remotes[0] / "check.py"), cwd=tmp_path,
                        timeout=180)
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"TREE {tree_digest(old)}" in out.stdout, out.stdout
    finally:
        proc.send_signal(signal.SIGKILL)  # kill -9: no cleanup of any kind on the client
        proc.wait()
    assert wait_until(lambda: not any(list(s.glob(PART + "*")) for s in stages), 30), "a partial file stayed"
    staged = []
    for remote, stage in zip(remotes, stages, strict=True):
        landed = files_of(remote)
        assert landed == {**old, "check.py": CHECK.encode(), "ckpt/model.pt": b"weights\n"}  # 40 old, none new
        staged.append(sum(1 for name, data in files_of(stage).items() if new.get(name) == data))
        assert staged[-1] >= 10

    summaries = push(transport, hosts, code_dir=src)  # resumes: what the killed push sent stays sent
    for summary, remote, sent_before in zip(summaries, remotes, staged, strict=True):
        assert (summary.files_sent, summary.files_unchanged) == (40 - sent_before, sent_before + 1)
        assert files_of(remote) == {**new, "check.py": CHECK.encode(), "ckpt/model.pt": b"weights\n"}
        versions = remote.parent / ".dlrun-versions" / "proj"
        assert remote.is_symlink() and not (versions / "next").exists()
        # no job runs in the old tree and all its files live on or were the push's: removed
        assert sorted(p.name for p in versions.iterdir() if p.is_dir()) == [os.readlink(remote).rsplit("/", 1)[1]]


def in_use(folder: Path) -> bool:
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            if os.readlink(f"/proc/{pid}/cwd").startswith(str(folder)):
                return True
        except OSError:
            continue
    return False


JOB = """
import os, sys, time
print("start", os.getcwd() == os.path.realpath(os.getcwd()), flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.1)
import lib  # imported only after the next push landed
print("lib", lib.V, open("data.txt").read().strip(), sorted(n for n in os.listdir(".") if n[:2] != "__"), flush=True)
open("result.txt", "w").write("written after the next push")
"""


@pytest.mark.ssh
def test_a_running_detached_job_keeps_its_tree_while_a_new_push_lands(
        cluster: SshdCluster, tmp_path: Path) -> None:
    project = tmp_path / f"keep-{os.getpid()}"
    project.mkdir()
    os.chmod(tmp_path, 0o755)
    (project / "job.py").write_text(JOB)
    (project / "lib.py").write_text("V = 1\n")
    (project / "data.txt").write_text("old\n")
    go = cluster.hosts[0].workdir / f"go-{project.name}"
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 1)
    common = ["--hosts", str(hosts), "--ssh-config", str(cluster.ssh_config)]
    out = run_dlrun("launch", "--detach", "--framework", "none", "--grace", "2", *common, str(project / "job.py"),
                    str(go), cwd=tmp_path, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    job = re.fullmatch(r"dlrun: detached job ([\w-]+)", out.stdout.strip().splitlines()[-1])
    assert job, out.stdout + out.stderr
    remote = cluster.hosts[0].workdir / project.name
    first = remote.resolve()

    (project / "lib.py").write_text("V = 2\n")
    (project / "data.txt").write_text("new\n")
    (project / "extra.py").write_text("")
    pushed = run_dlrun("push", *common, "--code", str(project), cwd=tmp_path, timeout=120)
    assert pushed.returncode == 0, pushed.stdout + pushed.stderr
    assert remote.resolve() != first and (remote / "lib.py").read_text() == "V = 2\n"
    assert first.is_dir()  # the job runs there: not removed
    # and its keeper and agent marked it, for pushes from hosts that share the folder but not the processes
    assert list(first.parent.glob(first.name + ".pin-*")), sorted(p.name for p in first.parent.iterdir())
    assert cluster.run(0, f"touch {go}").returncode == 0

    attached = run_dlrun("attach", job[1], *common, cwd=tmp_path, timeout=120)
    assert attached.returncode == 0, attached.stdout + attached.stderr
    assert "] start True" in attached.stdout, attached.stdout
    assert "] lib 1 old ['data.txt', 'job.py', 'lib.py']" in attached.stdout, attached.stdout
    # the job wrote result.txt into its own tree after the new one was swapped in: the next push
    # keeps that tree (the file is nowhere else) instead of losing the file
    assert wait_until(lambda: not in_use(first), 60), "the job's processes did not end"
    (project / "lib.py").write_text("V = 3\n")
    again = run_dlrun("push", *common, "--code", str(project), cwd=tmp_path, timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    assert (first / "result.txt").read_text() == "written after the next push"
    assert f"host0: kept {first}: a job wrote files there after a later push" in again.stderr, again.stderr
    assert not list(first.parent.glob(first.name + ".pin-*"))  # the job's marks went with it
    assert (remote / "lib.py").read_text() == "V = 3\n"


@pytest.mark.ssh
def test_pull_of_a_pushed_project_folder_reads_its_current_tree(cluster: SshdCluster, tmp_path: Path) -> None:
    project = tmp_path / f"pulled-{os.getpid()}"
    project.mkdir()
    (project / "train.py").write_text("print('hi')\n")
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 1)
    common = ["--hosts", str(hosts), "--ssh-config", str(cluster.ssh_config)]
    pushed = run_dlrun("push", *common, "--code", str(project), cwd=tmp_path, timeout=120)
    assert pushed.returncode == 0, pushed.stdout + pushed.stderr
    remote = cluster.hosts[0].workdir / project.name
    assert remote.is_symlink()
    assert cluster.run(0, f"echo 0.9 > {remote}/metrics.txt").returncode == 0
    dest = tmp_path / "home"
    dest.mkdir()
    got = run_dlrun("pull", *common, "--project", project.name, ".", str(dest), cwd=tmp_path, timeout=120)
    assert got.returncode == 0, got.stdout + got.stderr
    assert {p.name: p.read_text() for p in dest.rglob("*") if p.is_file()} == \
        {"train.py": "print('hi')\n", "metrics.txt": "0.9\n"}


def test_old_trees_go_once_unused_and_a_jobs_files_move_on(tmp_path: Path) -> None:
    """On this machine (the helper as a local process): the versions a push leaves behind."""
    src = tmp_path / "proj"
    src.mkdir()
    (src / "a.py").write_text("A = 1\n")
    host = Host(address="localhost", name="localhost", workdir=str(tmp_path / "host"), python=sys.executable)
    router = HostRouter(remote=None)
    remote = tmp_path / "host" / "proj"
    versions = tmp_path / "host" / ".dlrun-versions" / "proj"

    def trees() -> list[str]:
        return sorted(p.name for p in versions.iterdir() if p.is_dir())

    push(router, [host], code_dir=src)
    (remote / "out").mkdir()
    (remote / "out" / "result.txt").write_text("job output\n")
    inode = (remote / "out" / "result.txt").stat().st_ino
    (src / "a.py").write_text("A = 2\n")
    push(router, [host], code_dir=src)
    # the job's file moved on (the same inode: a link, not a copy); the old tree went
    assert (remote / "out" / "result.txt").stat().st_ino == inode
    assert trees() == [os.path.basename(os.readlink(remote))]

    running = subprocess.Popen(["sleep", "600"], cwd=remote)  # a job that runs in the current tree
    try:
        held = remote.resolve()
        (src / "a.py").write_text("A = 3\n")
        push(router, [host], code_dir=src)
        assert held.is_dir() and len(trees()) == 2 and (held / "a.py").read_text() == "A = 2\n"
    finally:
        running.kill()
        running.wait()
    (src / "a.py").write_text("A = 4\n")
    push(router, [host], code_dir=src)
    assert not held.exists() and trees() == [os.path.basename(os.readlink(remote))]
    assert (remote / "a.py").read_text() == "A = 4\n" and (remote / "out" / "result.txt").read_text() == "job output\n"


def test_a_project_folder_the_user_linked_elsewhere_is_written_in_place(tmp_path: Path) -> None:
    src = tmp_path / "proj"
    src.mkdir()
    (src / "a.py").write_text("A = 1\n")
    elsewhere = tmp_path / "big-disk" / "proj"
    elsewhere.mkdir(parents=True)
    (tmp_path / "host").mkdir()
    (tmp_path / "host" / "proj").symlink_to(elsewhere)
    host = Host(address="localhost", name="localhost", workdir=str(tmp_path / "host"), python=sys.executable)
    push(HostRouter(remote=None), [host], code_dir=src)
    assert (tmp_path / "host" / "proj").readlink() == elsewhere  # the user's link stays
    assert (elsewhere / "a.py").read_text() == "A = 1\n" and not (tmp_path / "host" / ".dlrun-versions").exists()


def test_a_launchs_claim_left_in_a_tree_does_not_keep_it(tmp_path: Path) -> None:
    from dlrun.remote.push_helper import CLAIM_PREFIX

    src = tmp_path / "proj"
    src.mkdir()
    (src / "a.py").write_text("A = 1\n")
    host = Host(address="localhost", name="localhost", workdir=str(tmp_path / "host"), python=sys.executable)
    router = HostRouter(remote=None)
    push(router, [host], code_dir=src)
    remote = tmp_path / "host" / "proj"
    old = remote.resolve()
    (remote / f"{CLAIM_PREFIX}launch-1").write_text("host0")  # a settled launch's claim, never pushed over
    (src / "a.py").write_text("A = 2\n")
    (summary,) = push(router, [host], code_dir=src)
    assert summary.kept == () and not old.exists()
    assert not list(remote.glob(CLAIM_PREFIX + "*"))


@pytest.mark.ssh
def test_a_file_the_login_may_not_link_is_copied_into_the_new_tree(
        cluster: SshdCluster, transport: HostRouter, tmp_path: Path) -> None:
    if not cluster.is_root or Path("/proc/sys/fs/protected_hardlinks").read_text().strip() != "1":
        pytest.skip("needs root to give a file away, and protected hard links")
    src = tmp_path / "proj"
    src.mkdir()
    (src / "a.py").write_text("A = 1\n")
    hosts = [Host(address=cluster.hosts[0].name, name=cluster.hosts[0].name,
                  workdir=str(cluster.hosts[0].workdir / "clone"), python=cluster.python)]
    push(transport, hosts, code_dir=src)
    remote = cluster.hosts[0].workdir / "clone" / "proj"
    made = remote.resolve() / "made-by-sudo.txt"  # a `sudo` setup step's file: the login may read it, not link it
    made.write_text("built\n")
    made.chmod(0o644)
    (src / "a.py").write_text("A = 2\n")
    (summary,) = push(transport, hosts, code_dir=src)
    assert summary.files_sent == 1
    assert (remote / "a.py").read_text() == "A = 2\n" and (remote / "made-by-sudo.txt").read_text() == "built\n"
    assert (remote / "made-by-sudo.txt").stat().st_uid != 0  # a copy of the login's own
