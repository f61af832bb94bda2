"""dlrun.push over real sshd hosts (tests/support/sshd_cluster.py): sync, shards, kills, space, permissions."""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dlrun.errors import DlrunError, SyncError
from dlrun.inventory import Host
from dlrun.push.session import push
from dlrun.push.shard import SHARD_FILE, SHARD_POLICIES, shard_env
from dlrun.transport.local import HostRouter
from dlrun.transport.ssh import SSHTransport

from conftest import REPO, wait_until

pytestmark = pytest.mark.ssh

PART = ".dlrun-part-"


@pytest.fixture(scope="module")
def transport(cluster) -> Iterator[HostRouter]:  # type: ignore[no-untyped-def]
    router = HostRouter(remote=SSHTransport(config_file=str(cluster.ssh_config)))
    yield router
    router.close()


@pytest.fixture(autouse=True)
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def hosts_in(cluster, n: int, sub: str) -> list[Host]:  # type: ignore[no-untyped-def]
    """The first n cluster hosts, each with its own fresh workdir ``<host workdir>/<sub>``."""
    return [Host(address=h.name, name=h.name, workdir=str(h.workdir / sub), python=cluster.python)
            for h in cluster.hosts[:n]]


def login_ids(cluster) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    pw = pwd.getpwnam(cluster.user)
    return pw.pw_uid, pw.pw_gid


def write(root: Path, files: dict[str, bytes | str]) -> None:
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content.encode() if isinstance(content, str) else content)


def tree(root: Path) -> dict[str, bytes | str]:
    """Relative path → content (or "-> target" for links) of everything under root."""
    out: dict[str, bytes | str] = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            out[rel] = "-> " + os.readlink(path)
        elif path.is_file():
            out[rel] = path.read_bytes()
    return out


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --------------------------------------------------------------------------- code sync


def test_push_then_change_one_file_then_delete_one(cluster, transport, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    src = tmp_path / "proj"
    write(src, {"train.py": "print('hi')\n", "pkg/__init__.py": "", "pkg/model.py": "W = 1\n",
                ".gitignore": "*.log\n", "debug.log": "ignored\n", ".git/HEAD": "ignored\n",
                "pkg/__pycache__/model.cpython-311.pyc": "ignored", "run.sh": "#!/bin/sh\necho run\n"})
    (src / "run.sh").chmod(0o755)
    (src / "latest.py").symlink_to("train.py")
    hosts = hosts_in(cluster, 2, "code")
    first = push(transport, hosts, code_dir=src)
    expected = {".gitignore": b"*.log\n", "latest.py": "-> train.py", "pkg/__init__.py": b"",
                "pkg/model.py": b"W = 1\n", "run.sh": b"#!/bin/sh\necho run\n", "train.py": b"print('hi')\n"}
    for summary, h in zip(first, cluster.hosts[:2], strict=True):
        remote = h.workdir / "code" / "proj"
        assert summary.host == h.name
        assert (summary.files_sent, summary.files_unchanged, summary.files_deleted) == (6, 0, 0)
        assert summary.bytes_sent == sum(len(v) for v in expected.values() if isinstance(v, bytes))
        assert summary.code_dir == str(remote)
        assert {k: v for k, v in tree(remote).items() if k not in ("pkg",)} == expected
        assert (remote / "run.sh").stat().st_mode & 0o777 == 0o755
        assert (remote / "train.py").stat().st_mode & 0o777 == 0o644

    again = push(transport, hosts, code_dir=src)  # settled: the helper answers the survey and ends
    assert [(s.files_sent, s.bytes_sent, s.files_unchanged) for s in again] == [(0, 0, 6)] * 2
    assert [s.code_dir for s in again] == [str(h.workdir / "code" / "proj") for h in cluster.hosts[:2]]

    (src / "pkg" / "model.py").write_text("W = 2\n")
    changed = push(transport, hosts, code_dir=src)
    assert [(s.files_sent, s.bytes_sent, s.files_unchanged) for s in changed] == [(1, 6, 5)] * 2
    assert (cluster.hosts[1].workdir / "code" / "proj" / "pkg" / "model.py").read_text() == "W = 2\n"

    # a job's output in the pushed directory is not ours to delete; a file removed locally is
    output = cluster.hosts[0].workdir / "code" / "proj" / "pkg" / "checkpoint.pt"
    assert cluster.run(0, f"echo weights > {output}").returncode == 0
    (src / "pkg" / "model.py").unlink()
    deleted = push(transport, hosts, code_dir=src)
    assert [(s.files_sent, s.files_unchanged, s.files_deleted) for s in deleted] == [(0, 5, 1)] * 2
    for h in cluster.hosts[:2]:
        assert not (h.workdir / "code" / "proj" / "pkg" / "model.py").exists()
    assert output.read_text() == "weights\n"
    assert not list((cluster.hosts[0].workdir / "code").rglob(PART + "*"))


def test_push_channels_use_aes_gcm(cluster, transport) -> None:  # type: ignore[no-untyped-def]
    """paramiko encrypts per packet in Python: AES-GCM (one OpenSSL call, no separate HMAC) is what
    keeps a push's client CPU near rsync's (docs/benchmarks.md); OpenSSH offers it by default."""
    channel = transport.open(hosts_in(cluster, 1, "cipher")[0], ["true"])
    try:
        session = channel.channel.get_transport()
        assert (session.local_cipher, session.remote_cipher) == ("aes128-gcm@openssh.com",) * 2
    finally:
        channel.close()


def test_local_host_goes_through_the_local_transport(tmp_path: Path) -> None:
    src = tmp_path / "app"
    write(src, {"main.py": "print(1)\n", "data/readme.txt": "x\n"})
    host = Host(address="localhost", name="localhost", workdir=str(tmp_path / "dst"))
    (summary,) = push(HostRouter(remote=None), [host], code_dir=src, project="renamed")
    assert summary.files_sent == 2
    assert tree(tmp_path / "dst" / "renamed") == {"data/readme.txt": b"x\n", "main.py": b"print(1)\n"}


# --------------------------------------------------------------------------- data shards


def test_shards_for_every_policy_land_disjoint_and_complete_on_three_hosts(  # type: ignore[no-untyped-def]
    cluster, transport, tmp_path: Path
) -> None:
    data = tmp_path / "dataset"
    files = {f"part/{i:02d}.npy": os.urandom(100 + 37 * i) for i in range(10)}
    write(data, files)
    hosts = hosts_in(cluster, 3, "shards")
    for policy in SHARD_POLICIES:  # the same data dir each time: stale shard files must go
        summaries = push(transport, hosts, code_dir=None, data_dir=data, shard=policy)
        seen: list[str] = []
        for index, (summary, h) in enumerate(zip(summaries, cluster.hosts[:3], strict=True)):
            remote = h.workdir / "shards" / "data" / h.name
            assert summary.data_dir == str(remote)
            got = tree(remote)
            doc = json.loads(got.pop(SHARD_FILE))
            assert (doc["policy"], doc["index"], doc["count"]) == (policy, index, 3)
            assert [f["path"] for f in doc["files"]] == sorted(got) == [k for k in got if k.startswith("part/")]
            for item in doc["files"]:
                assert item["sha256"] == sha(got[item["path"]]) == sha(files[item["path"]])  # type: ignore[arg-type]
            seen += list(got)
            env = shard_env(index, 3, hosts[index], data_dir=summary.data_dir)
            assert env == {"DLRUN_DATA_DIR": str(remote), "DLRUN_SHARD_INDEX": str(index),
                           "DLRUN_SHARD_COUNT": "3"}
        if policy == "replicate":
            assert sorted(seen) == sorted(list(files) * 3)
        else:
            assert sorted(seen) == sorted(files)  # complete and pairwise disjoint


def test_split_lines_with_code_in_one_push(cluster, transport, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    body = "".join(f"{i},{i % 7}\n" for i in range(2000)).encode()
    write(tmp_path, {"train.csv": b"x,label\n" + body, "code/train.py": "pass\n"})
    hosts = hosts_in(cluster, 3, "split")
    summaries = push(transport, hosts, code_dir=tmp_path / "code", data_dir=tmp_path / "train.csv",
                     split_lines=True)
    parts = []
    for index, (summary, h) in enumerate(zip(summaries, cluster.hosts[:3], strict=True)):
        assert summary.files_sent == 3  # train.py, the part, shard.json
        got = tree(h.workdir / "split" / "data" / h.name)
        part = got[f"train.part-{index}-of-3.csv"]
        assert isinstance(part, bytes) and part.startswith(b"x,label\n")
        parts.append(part[len(b"x,label\n"):])
        assert json.loads(got[SHARD_FILE])["split_lines"]["source"] == "train.csv"
        assert (h.workdir / "split" / "code" / "train.py").read_text() == "pass\n"
    assert b"".join(parts) == body
    assert max(map(len, parts)) - min(map(len, parts)) < 64


# --------------------------------------------------------------------------- interruption

KILLED_PUSH = """
import sys, time
sys.path.insert(0, {repo!r})
from pathlib import Path
from dlrun.inventory import Host
from dlrun.transport.ssh import SSHTransport
from dlrun.push.session import push
from dlrun.transport.local import HostRouter

def stall(host, done, total):
    if done >= {threshold}:
        print("stalled", flush=True)
        time.sleep(600)

host = Host(address={name!r}, name={name!r}, workdir={workdir!r}, python={python!r})
push(HostRouter(remote=SSHTransport(config_file={config!r})), [host], code_dir=Path({src!r}), progress=stall)
"""


def test_killed_push_leaves_no_partial_file_and_the_next_push_resumes(  # type: ignore[no-untyped-def]
    cluster, transport, tmp_path: Path
) -> None:
    src = tmp_path / "big"
    size = 512 * 1024
    files = {f"f{i}.bin": os.urandom(size) for i in range(8)}
    write(src, files)
    h = cluster.hosts[0]
    remote = h.workdir / "killed" / "big"
    script = KILLED_PUSH.format(repo=str(REPO), threshold=3 * size + 200 * 1024, name=h.name,
                                workdir=str(h.workdir / "killed"), python=cluster.python,
                                config=str(cluster.ssh_config), src=str(src))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "stalled", proc.stderr.read() if proc.stderr else ""
        # three files are in place and the fourth is being written under a temporary name
        assert wait_until(lambda: len([p for p in remote.glob("f*.bin")]) == 3 and list(remote.glob(PART + "*")), 15)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert wait_until(lambda: not list(remote.glob(PART + "*")), 15), "the helper left its partial file behind"
    landed = tree(remote)
    assert landed == {f"f{i}.bin": files[f"f{i}.bin"] for i in range(3)}  # nothing partial under a final name

    (summary,) = push(transport, hosts_in(cluster, 1, "killed"), code_dir=src)
    assert (summary.files_sent, summary.files_unchanged, summary.bytes_sent) == (5, 3, 5 * size)
    assert tree(remote) == files


# --------------------------------------------------------------------------- space and permissions


@pytest.mark.parametrize("when", ["after connecting", "while sending"])
def test_a_host_that_goes_silent_fails_the_push_within_the_host_timeout(  # type: ignore[no-untyped-def]
        cluster, tmp_path: Path, when: str) -> None:
    src = tmp_path / "proj"
    write(src, {f"f{i}.bin": os.urandom(1 << 20) for i in range(16)})
    sub = "silent-" + when.replace(" ", "-")
    hosts = hosts_in(cluster, 2, sub)
    router = HostRouter(remote=SSHTransport(config_file=str(cluster.ssh_config), host_timeout=2))
    frozen: list[int] = []

    def freeze(host: str, done: int, total: int) -> None:  # host1's sshd stops moving bytes either way
        if host == "host1" and done > 0 and not frozen:
            frozen.extend(cluster.freeze_sessions(1))

    try:
        router.connect(hosts)
        if when == "after connecting":
            freeze("host1", 1, 1)
        with pytest.raises(DlrunError) as info:  # without the liveness check: TCP's ~15 min, or never
            push(router, hosts, code_dir=src, progress=freeze)
        assert frozen, "host1 was never frozen"
        assert "host1" in str(info.value) and "no answer from the host for" in str(info.value), str(info.value)
    finally:
        cluster.thaw(frozen)
        router.close()
    # once thawed, host1's helper sees its connection gone and removes its partial file; every
    # file under a final name is whole
    remote = cluster.hosts[1].workdir / sub / "proj"
    assert wait_until(lambda: not list(remote.parent.rglob(PART + "*")), 15), "the helper left its partial file behind"
    assert all(path.read_bytes() == (src / path.name).read_bytes() for path in remote.glob("f*.bin"))


def test_not_enough_space_is_refused_before_anything_is_written(  # type: ignore[no-untyped-def]
    cluster, transport, tmp_path: Path
) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (the check itself: test_sync.py)")
    small = cluster.hosts[0].workdir / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0755", "tmpfs", str(small)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        os.chown(small, *login_ids(cluster))
        src = tmp_path / "proj"
        write(src, {f"w{i}.bin": os.urandom(1024 * 1024) for i in range(3)})
        host = Host(address="host0", name="host0", workdir=str(small), python=cluster.python)
        with pytest.raises(SyncError) as info:
            push(transport, [host], code_dir=src)
        assert info.value.host == "host0"
        assert "3145728 bytes needed" in str(info.value) and "nothing was written" in str(info.value)
        assert list(small.iterdir()) == []
        (src / "w1.bin").unlink()
        (src / "w2.bin").unlink()
        (summary,) = push(transport, [host], code_dir=src)
        assert summary.files_sent == 1
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)


def test_permission_denied_names_host_and_path(cluster, transport, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    if cluster.user == "root":
        pytest.skip("the hosts log in as root, who may write anywhere")
    uid, gid = login_ids(cluster)
    src = tmp_path / "proj"
    write(src, {"top.py": "1\n", "pkg/new.py": "2\n"})

    # a workdir the login user cannot write into, on two hosts: one error lists both
    for h in cluster.hosts[:2]:
        ro = h.workdir / "readonly"
        ro.mkdir()
        os.chown(ro, uid, gid)
        ro.chmod(0o555)
    with pytest.raises(SyncError) as info:
        push(transport, hosts_in(cluster, 2, "readonly"), code_dir=src)
    text = str(info.value)
    assert "push failed on 2 of 2 hosts" in text
    for h in cluster.hosts[:2]:
        assert f"{h.name}: permission denied" in text and str(h.workdir / "readonly") in text
    assert list((cluster.hosts[0].workdir / "readonly").iterdir()) == []

    # a read-only directory inside the target: the file there fails by name, the others land
    locked = cluster.hosts[0].workdir / "partly" / "proj" / "pkg"
    locked.mkdir(parents=True)
    for path in (locked, locked.parent, locked.parent.parent):
        os.chown(path, uid, gid)
    locked.chmod(0o555)
    with pytest.raises(SyncError) as info:
        push(transport, hosts_in(cluster, 1, "partly"), code_dir=src)
    assert info.value.host == "host0"
    assert str(locked / "new.py") in str(info.value) and "Permission denied" in str(info.value)
    assert (locked.parent / "top.py").read_text() == "1\n"
    assert list(locked.iterdir()) == []


def test_launch_with_data_gives_each_rank_its_shard(cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from conftest import hosts_toml, run_dlrun, shared_script

    data = tmp_path / "dataset"
    data.mkdir()
    for i in range(6):
        (data / f"part-{i}.csv").write_text(f"row,{i}\n")
    script = shared_script(cluster, "shard.py", "import json, os\nd = os.environ['DLRUN_DATA_DIR']\n"
                           "print('SHARD', os.environ['DLRUN_SHARD_INDEX'], os.environ['DLRUN_SHARD_COUNT'],"
                           " sorted(f for f in os.listdir(d) if f.endswith('.csv')),"
                           " json.load(open(os.path.join(d, 'shard.json')))['policy'])\n")
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 3)
    out = run_dlrun("launch", "--plain", "--hosts", str(hosts), "--ssh-config", str(cluster.ssh_config),
                    "--data", str(data), "--shard", "files", str(script), cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = sorted(line.split("SHARD ", 1)[1] for line in out.stdout.splitlines() if "SHARD " in line)
    assert lines == ["0 3 ['part-0.csv', 'part-3.csv'] files", "1 3 ['part-1.csv', 'part-4.csv'] files",
                     "2 3 ['part-2.csv', 'part-5.csv'] files"]


def test_launch_opens_a_push_session_only_where_the_code_changed(  # type: ignore[no-untyped-def]
        cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    from dlrun.run.launch import LaunchConfig, SSHOptions, launch

    from conftest import hosts_toml

    code = tmp_path / f"proj-{os.getpid()}-{time.monotonic_ns()}"
    write(code, {"job.py": "import util\nprint('VERSION', util.V)\n", "util.py": "V = 1\n"})
    os.chmod(tmp_path, 0o755)
    opened: list[str] = []

    class Counting(SSHTransport):
        def open(self, host: Host, argv):  # type: ignore[no-untyped-def]
            opened.append("push" if "dlrun-push_helper" in argv else "agent")
            return super().open(host, argv)

    monkeypatch.setattr("dlrun.run.launch.make_transport",
                        lambda inventory, ssh: HostRouter(remote=Counting(config_file=str(cluster.ssh_config))))
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 2)
    config = LaunchConfig(script=str(code / "job.py"), hosts=str(hosts), plain=True, framework="torch",
                          log_dir=str(tmp_path / "logs"), ssh=SSHOptions(config_file=str(cluster.ssh_config)))

    def run() -> tuple[int, list[str]]:
        opened.clear()
        capfd.readouterr()
        assert launch(config) == 0
        out = capfd.readouterr().out
        assert sorted(line.split("VERSION ", 1)[1] for line in out.splitlines() if "VERSION " in line) == \
            [str(version)] * 2
        return opened.count("push"), sorted(opened)

    version = 1
    assert run()[0] == 2  # first launch: the code goes to both hosts
    assert run() == (0, ["agent", "agent"])  # unchanged: the agents' survey says so, no push session
    remote = cluster.hosts[0].workdir / code.name / "util.py"
    os.utime(remote, (1, 1))  # same content, another stamp: that host's record is brought up to date
    assert run()[0] == 1
    assert run()[0] == 0
    version = 2
    (code / "util.py").write_text("V = 2\n")
    assert run()[0] == 2
    assert remote.read_text() == "V = 2\n"
