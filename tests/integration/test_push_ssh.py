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
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from dlrun.errors import DlrunError, SyncError
from dlrun.inventory import Host
from dlrun.push.session import push
from dlrun.push.shard import SHARD_FILE, SHARD_POLICIES, shard_env
from dlrun.transport.base import Channel
from dlrun.transport.local import HostRouter
from dlrun.transport.ssh import SSHChannel, SSHTransport

from support.cli import REPO, run_dlrun
from support.ssh_jobs import hosts_toml, shared_script
from support.sshd_cluster import SshdCluster
from support.wait import wait_until

pytestmark = pytest.mark.ssh

PART = ".dlrun-part-"


@pytest.fixture(autouse=True)
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def hosts_in(cluster: SshdCluster, n: int, sub: str) -> list[Host]:
    """The first n cluster hosts, each with its own fresh workdir ``<host workdir>/<sub>``."""
    return [Host(address=h.name, name=h.name, workdir=str(h.workdir / sub), python=cluster.python)
            for h in cluster.hosts[:n]]


def login_ids(cluster: SshdCluster) -> tuple[int, int]:
    pw = pwd.getpwnam(cluster.user)
    return pw.pw_uid, pw.pw_gid


def write(root: Path, files: Mapping[str, bytes | str]) -> None:
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


def sha(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


# --------------------------------------------------------------------------- code sync


def test_push_then_change_one_file_then_delete_one(cluster: SshdCluster, transport: HostRouter, tmp_path: Path) -> None:
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


def test_push_channels_use_aes_gcm(cluster: SshdCluster, transport: HostRouter) -> None:
    """paramiko encrypts per packet in Python: AES-GCM (one OpenSSL call, no separate HMAC) is what
    keeps a push's client CPU near rsync's (docs/benchmarks.md); OpenSSH offers it by default."""
    channel = transport.open(hosts_in(cluster, 1, "cipher")[0], ["true"])
    try:
        assert isinstance(channel, SSHChannel)
        session = channel.channel.get_transport()
        remote_cipher = session.remote_cipher  # type: ignore[attr-defined]  # paramiko sets it; its stubs lack it
        assert (session.local_cipher, remote_cipher) == ("aes128-gcm@openssh.com",) * 2
    finally:
        channel.close()


# --------------------------------------------------------------------------- data shards


def test_shards_for_every_policy_land_disjoint_and_complete_on_three_hosts(
    cluster: SshdCluster, transport: HostRouter, tmp_path: Path
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
                assert item["sha256"] == sha(got[item["path"]]) == sha(files[item["path"]])
            seen += list(got)
            env = shard_env(index, 3, hosts[index], data_dir=summary.data_dir)
            assert env == {"DLRUN_DATA_DIR": str(remote), "DLRUN_SHARD_INDEX": str(index),
                           "DLRUN_SHARD_COUNT": "3"}
        if policy == "replicate":
            assert sorted(seen) == sorted(list(files) * 3)
        else:
            assert sorted(seen) == sorted(files)  # complete and pairwise disjoint


def test_split_lines_with_code_in_one_push(cluster: SshdCluster, transport: HostRouter, tmp_path: Path) -> None:
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


def test_killed_push_leaves_no_partial_file_and_the_next_push_resumes(
    cluster: SshdCluster, transport: HostRouter, tmp_path: Path
) -> None:
    src = tmp_path / "big"
    size = 512 * 1024
    files = {f"f{i}.bin": os.urandom(size) for i in range(8)}
    write(src, files)
    h = cluster.hosts[0]
    remote = h.workdir / "killed" / "big"
    stage = h.workdir / "killed" / ".dlrun-versions" / "big" / "next"
    script = KILLED_PUSH.format(repo=str(REPO), threshold=3 * size + 200 * 1024, name=h.name,
                                workdir=str(h.workdir / "killed"), python=cluster.python,
                                config=str(cluster.ssh_config), src=str(src))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "stalled", proc.stderr.read() if proc.stderr else ""
        # three files are in the tree being built and the fourth is being written under a temporary name
        assert wait_until(lambda: len([p for p in stage.glob("f*.bin")]) == 3 and list(stage.glob(PART + "*")), 15)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert wait_until(lambda: not list(stage.glob(PART + "*")), 15), "the helper left its partial file behind"
    landed = tree(stage)
    assert landed == {f"f{i}.bin": files[f"f{i}.bin"] for i in range(3)}  # nothing partial under a final name
    assert not os.path.lexists(remote)  # the tree is swapped in whole, or not at all

    (summary,) = push(transport, hosts_in(cluster, 1, "killed"), code_dir=src)
    assert (summary.files_sent, summary.files_unchanged, summary.bytes_sent) == (5, 3, 5 * size)
    assert tree(remote) == files
    assert remote.is_symlink() and not stage.exists()


# --------------------------------------------------------------------------- space and permissions


@pytest.mark.parametrize("when", ["after connecting", "while sending"])
def test_a_host_that_goes_silent_fails_the_push_within_the_host_timeout(
        cluster: SshdCluster, tmp_path: Path, when: str) -> None:
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
    stage = remote.parent / ".dlrun-versions" / "proj" / "next"  # where the new tree was being built
    assert wait_until(lambda: not list(remote.parent.rglob(PART + "*")), 15), "the helper left its partial file behind"
    assert all(path.read_bytes() == (src / path.name).read_bytes() for path in stage.glob("f*.bin"))
    assert not os.path.lexists(remote)  # never swapped in half-built


def test_not_enough_space_is_refused_before_anything_is_written(
    cluster: SshdCluster, transport: HostRouter, tmp_path: Path
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


def test_permission_denied_names_host_and_path(cluster: SshdCluster, transport: HostRouter, tmp_path: Path) -> None:
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

    # a read-only directory inside the tree on the host (an older dlrun's folder) stops nothing:
    # the new tree is built beside it, with the pushed folder modes, and swapped in
    locked = cluster.hosts[0].workdir / "partly" / "proj" / "pkg"
    locked.mkdir(parents=True)
    for path in (locked, locked.parent, locked.parent.parent):
        os.chown(path, uid, gid)
    locked.chmod(0o555)
    (summary,) = push(transport, hosts_in(cluster, 1, "partly"), code_dir=src)
    assert summary.files_sent == 2
    remote = cluster.hosts[0].workdir / "partly" / "proj"
    assert remote.is_symlink() and tree(remote) == {"top.py": b"1\n", "pkg/new.py": b"2\n"}
    assert (remote / "pkg").stat().st_mode & 0o777 == (src / "pkg").stat().st_mode & 0o777


def test_launch_with_data_gives_each_rank_its_shard(cluster: SshdCluster, tmp_path: Path) -> None:
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


def test_launch_opens_a_push_session_only_where_the_code_changed(
        cluster: SshdCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    from dlrun.run.config import LaunchConfig
    from dlrun.run.pipeline import launch
    from dlrun.transport.factory import SSHOptions

    code = tmp_path / f"proj-{os.getpid()}-{time.monotonic_ns()}"
    write(code, {"job.py": "import util\nprint('VERSION', util.V)\n", "util.py": "V = 1\n"})
    os.chmod(tmp_path, 0o755)
    opened: list[str] = []

    class Counting(SSHTransport):
        def open(self, host: Host, argv: Sequence[str]) -> Channel:
            opened.append("push" if "dlrun-push_helper" in argv else "agent")
            return super().open(host, argv)

    monkeypatch.setattr("dlrun.run.hosts.make_transport",
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


# --------------------------------------------------------------------------- a real project, pushed safely (issue 19)


def project_hosts(cluster: SshdCluster, path: Path, n: int, *, defaults: str = "",
                  per_host: dict[int, str] | None = None) -> Path:
    """An inventory of the first n hosts; ``defaults`` and ``per_host[i]`` are extra TOML lines."""
    lines = [f'[defaults]\npython = "{cluster.python}"\n{defaults}']
    for i, h in enumerate(cluster.hosts[:n]):
        lines.append(f'[[hosts]]\naddress = "{h.name}"\nslots = 1\nworkdir = {json.dumps(str(h.workdir))}\n'
                     f'{(per_host or {}).get(i, "")}\n')
    path.write_text("\n".join(lines))
    return path


def new_project(tmp_path: Path, files: dict[str, bytes | str]) -> Path:
    code = tmp_path / f"proj-{os.getpid()}-{time.monotonic_ns()}"  # the hosts' workdirs are shared by tests
    write(code, files)
    os.chmod(tmp_path, 0o755)
    return code


def pushed_tree(cluster: SshdCluster, code: Path, n: int) -> list[dict[str, bytes | str]]:
    return [tree(h.workdir / code.name) for h in cluster.hosts[:n]]


def test_a_project_with_a_venv_caches_and_logs_sends_only_its_code(
        cluster: SshdCluster, tmp_path: Path) -> None:
    code = new_project(tmp_path, {
        "train.py": "import os\nprint('CWD', sorted(os.listdir('.')))\n",
        "lib/util.py": "V = 1\n",
        "node_modules/left-pad/index.js": "x\n",
        ".pytest_cache/v/cache/lastfailed": "{}\n",
        "wandb/run-1/files/output.log": "old run\n",
        "mlruns/0/meta.yaml": "x\n",
        "dlrun-logs/20260101-000000-abcdef/rank-0.log": "old log\n",
        "runs/out.log": "this job's --log-dir\n",
        ".dlrunignore": "!mlruns/\n",  # a !pattern brings a default back
    })
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(code / ".venv")], check=True)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(code / "lib" / "py-env")], check=True)
    (code / "conda-env" / "conda-meta").mkdir(parents=True)
    (code / "conda-env" / "bin").mkdir()
    (code / "conda-env" / "bin" / "python").write_text("not really\n")
    hosts = project_hosts(cluster, tmp_path / "hosts.toml", 2)
    out = run_dlrun("launch", "--plain", "--hosts", str(hosts), "--ssh-config", str(cluster.ssh_config),
                    "--log-dir", "runs", "--framework", "torch", "train.py", cwd=code, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    # the default log folder is left out too (a project's earlier runs), and so is --log-dir
    expected = {"train.py", "lib/util.py", ".dlrunignore", "mlruns/0/meta.yaml"}
    for remote in pushed_tree(cluster, code, 2):
        assert set(remote) == expected
    assert out.stdout.count("CWD ['.dlrunignore', 'lib', 'mlruns', 'train.py']") == 2, out.stdout


def test_an_installed_program_is_run_as_given_and_nothing_is_pushed(
        cluster: SshdCluster, tmp_path: Path) -> None:
    hosts = project_hosts(cluster, tmp_path / "hosts.toml", 2)
    before = [sorted(p.name for p in h.workdir.iterdir()) for h in cluster.hosts[:2]]
    out = run_dlrun("launch", "--plain", "--hosts", str(hosts), "--ssh-config", str(cluster.ssh_config),
                    "--framework", "torch", "/bin/true", cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert [sorted(p.name for p in h.workdir.iterdir()) for h in cluster.hosts[:2]] == before
    assert "sent" not in out.stderr  # no push summary at all


def test_a_script_directly_in_the_home_folder_is_refused(cluster: SshdCluster, tmp_path: Path) -> None:
    home = tmp_path / "home"
    write(home, {"train.py": "print('RAN')\n", "big-download.bin": b"x" * 1000})
    hosts = project_hosts(cluster, tmp_path / "hosts.toml", 2)
    before = [sorted(p.name for p in h.workdir.iterdir()) for h in cluster.hosts[:2]]
    out = run_dlrun("launch", "--plain", "--hosts", str(hosts), "--ssh-config", str(cluster.ssh_config),
                    "--framework", "torch", str(home / "train.py"), cwd=home, timeout=120,
                    env={"HOME": str(home), "XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert out.returncode == 2, out.stdout + out.stderr
    assert "directly in the home folder" in out.stderr and "--code DIR" in out.stderr and "--no-push" in out.stderr
    assert "RAN" not in out.stdout
    assert [sorted(p.name for p in h.workdir.iterdir()) for h in cluster.hosts[:2]] == before


def test_an_oversized_code_push_stops_before_anything_is_read_or_written(
        cluster: SshdCluster, tmp_path: Path) -> None:
    code = new_project(tmp_path, {"train.py": "print('RAN')\n", "src/model.py": "M = 1\n"})
    (code / "checkpoints").mkdir()
    for i in range(3):
        with open(code / "checkpoints" / f"epoch-{i}.pt", "wb") as fh:
            fh.truncate(100 * 1024 * 1024)  # sparse: 300 MiB in one folder, no disk used
    hosts = project_hosts(cluster, tmp_path / "hosts.toml", 2)
    cache = tmp_path / "cache"
    env = {"XDG_CACHE_HOME": str(cache)}
    ssh = ("--hosts", str(hosts), "--ssh-config", str(cluster.ssh_config))
    for argv in (("launch", "--plain", *ssh, "--framework", "torch", "train.py"), ("push", *ssh, "--code", ".")):
        out = run_dlrun(*argv, cwd=code, timeout=120, env=env)
        assert out.returncode == 2, out.stdout + out.stderr
        assert "300.0 MiB" in out.stderr and "over the 200.0 MiB limit" in out.stderr
        assert "checkpoints/" in out.stderr.split("Largest:", 1)[1].splitlines()[1]  # the largest folder first
        for way_out in (".dlrunignore", "--max-push-size", "--no-push", "--data"):
            assert way_out in out.stderr
        assert "RAN" not in out.stdout
        assert not any((h.workdir / code.name).exists() for h in cluster.hosts[:2])
        assert not (cache / "dlrun" / "push").exists()  # no file was hashed (ssh -G's answers may be kept)
    out = run_dlrun("push", *ssh, "--code", ".", "--max-push-size", "none", "--dry-run", "--json", cwd=code,
                    timeout=120, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(out.stdout)["total"]["bytes_sent"] == 2 * (300 * 1024 * 1024 + 19)


def test_a_dry_run_writes_nothing_and_lists_what_the_push_then_sends(
        cluster: SshdCluster, tmp_path: Path) -> None:
    code = new_project(tmp_path, {"train.py": "print('TRAINED')\n", "keep.py": "K = 1\n", "gone.py": "G = 1\n",
                                  "change.py": "C = 1\n"})
    hosts = project_hosts(cluster, tmp_path / "hosts.toml", 2)
    ssh = ("--hosts", str(hosts), "--ssh-config", str(cluster.ssh_config))
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    # a first dry run: the project is on no host, and stays so
    out = run_dlrun("launch", "--dry-run", *ssh, "--framework", "torch", "train.py", cwd=code, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "would send 4 files" in out.stderr and "TRAINED" not in out.stdout
    assert not any((h.workdir / code.name).exists() for h in cluster.hosts[:2])
    assert not (tmp_path / "cache" / "dlrun" / "push").exists()  # nothing written here either: not even the hash cache
    assert run_dlrun("push", *ssh, "--code", ".", cwd=code, env=env).returncode == 0
    (code / "gone.py").unlink()
    (code / "change.py").write_text("C = 2\n")
    (code / "new.py").write_text("N = 1\n")
    remote_before = pushed_tree(cluster, code, 2)
    records = [h.workdir / ".dlrun-cache" / f"{code.name}.json" for h in cluster.hosts[:2]]
    stamps = [p.stat().st_mtime_ns for p in records]
    out = run_dlrun("push", *ssh, "--code", ".", "--dry-run", "--json", cwd=code, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    planned = json.loads(out.stdout)
    assert planned["dry_run"] is True
    for host in planned["hosts"]:
        assert (host["files_sent"], host["files_deleted"], host["files_unchanged"]) == (2, 1, 2)
        assert host["deleting"] == ["gone.py"]
        assert sorted(item["name"] for item in host["largest"]) == ["change.py", "new.py"]
    assert pushed_tree(cluster, code, 2) == remote_before
    assert [p.stat().st_mtime_ns for p in records] == stamps
    text = run_dlrun("launch", "--dry-run", *ssh, "--framework", "torch", "train.py", cwd=code, env=env)
    assert "would send 2 files (12 B), delete 1" in text.stderr and "delete gone.py" in text.stderr
    from_launch = json.loads(run_dlrun("launch", "--dry-run", "--json", *ssh, "--framework", "torch", "train.py",
                                       cwd=code, env=env).stdout)["push"]["hosts"]
    for host in (*from_launch, *planned["hosts"]):
        host.pop("seconds")
    assert from_launch == planned["hosts"]
    out = run_dlrun("push", *ssh, "--code", ".", "--json", cwd=code, env=env)
    done = json.loads(out.stdout)
    assert [(h["files_sent"], h["bytes_sent"], h["files_deleted"]) for h in done["hosts"]] == \
        [(h["files_sent"], h["bytes_sent"], h["files_deleted"]) for h in planned["hosts"]]


def test_the_setup_runs_once_then_only_when_the_pushed_files_change(
        cluster: SshdCluster, tmp_path: Path) -> None:
    code = new_project(tmp_path, {"requirements.txt": "numpy\n",
                                  "train.py": "print('SETUP-BEFORE-RANK', open('setup-runs.txt').read().split())\n"})
    setup = 'setup = "echo run-$(cat requirements.txt) >> setup-runs.txt; echo installing"'
    hosts = project_hosts(cluster, tmp_path / "hosts.toml", 2, defaults=setup)
    argv = ("launch", "--plain", "--hosts", str(hosts), "--ssh-config", str(cluster.ssh_config), "--framework",
            "torch", "--log-dir", str(tmp_path / "logs"), "train.py")
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}

    def launch() -> str:
        out = run_dlrun(*argv, cwd=code, timeout=120, env=env)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout

    first = launch()
    assert first.count("[setup host0] installing") == 1 and first.count("[setup host1] installing") == 1
    assert first.count("SETUP-BEFORE-RANK ['run-numpy']") == 2
    logs = sorted((tmp_path / "logs").glob("*/setup-host0.log"))
    assert len(logs) == 1 and "installing" in logs[0].read_text()
    second = launch()
    assert "installing" not in second and second.count("skipped") == 2
    assert second.count("SETUP-BEFORE-RANK ['run-numpy']") == 2
    (code / "requirements.txt").write_text("torch\n")
    third = launch()
    assert third.count("SETUP-BEFORE-RANK ['run-numpy', 'run-torch']") == 2
    forced = run_dlrun(*argv[:-1], "--setup-always", argv[-1], cwd=code, timeout=120, env=env)
    assert forced.stdout.count("installing") == 2, forced.stdout + forced.stderr


def test_a_failing_setup_starts_no_rank_and_names_the_host(
        cluster: SshdCluster, tmp_path: Path) -> None:
    code = new_project(tmp_path, {"train.py": "open('rank-ran.txt', 'w').write('yes')\n"})
    hosts = project_hosts(cluster, tmp_path / "hosts.toml", 2, per_host={
        0: 'setup = "echo fine"', 1: 'setup = "echo pip says no >&2; echo last words; exit 3"'})
    out = run_dlrun("launch", "--plain", "--hosts", str(hosts), "--ssh-config", str(cluster.ssh_config),
                    "--framework", "torch", "--log-dir", str(tmp_path / "logs"), "train.py", cwd=code, timeout=120,
                    env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert out.returncode == 1, out.stdout + out.stderr
    assert "host1: setup" in out.stderr and "exited 3" in out.stderr
    assert "pip says no" in out.stderr and "last words" in out.stderr
    assert "host0: setup" not in out.stderr
    assert not any((h.workdir / code.name / "rank-ran.txt").exists() for h in cluster.hosts[:2])
