"""dlrun.push with its helper as a real process on this machine (the local transport, or the helper
run directly): shared workdirs, links on the host, partial files, datasets, Python 3.8. The pure
parts (ignore rules, manifests, shards, the stream, the view) are tests/unit/test_push.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest

from dlrun.errors import SyncError, UsageError
from dlrun.inventory import Host
from dlrun.push.session import (
    HostPushSummary,
    code_target,
    helper_source,
    push,
    scan_code,
    settled_push,
    survey_request,
)
from dlrun.push.shard import SHARD_FILE
from dlrun.transport.local import HostRouter

from support.trees import make_tree
from support.wait import wait_until


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="F_SETPIPE_SZ is Linux's")
def test_helper_widens_the_pipe_sshd_writes_into() -> None:
    import fcntl

    limit = int(Path("/proc/sys/fs/pipe-max-size").read_text())
    if limit < 1 << 20 and os.geteuid() != 0:
        pytest.skip("pipe-max-size is below 1 MiB here")
    proc = subprocess.Popen([sys.executable, "-c", helper_source()], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        before = fcntl.fcntl(proc.stdin.fileno(), fcntl.F_GETPIPE_SZ)
        proc.stdin.write(b'{"targets": []}\n')
        proc.stdin.flush()
        assert json.loads(proc.stdout.readline()) == {"targets": []}
        assert fcntl.fcntl(proc.stdin.fileno(), fcntl.F_GETPIPE_SZ) == 1 << 20 != before
    finally:
        proc.stdin.close()
        proc.wait(10)
        proc.stdout.close()


def test_a_helper_whose_dlrun_vanished_ends_and_removes_its_partial_file(tmp_path: Path) -> None:
    # stdin stays open (no EOF: the host is cut off from dlrun) in the middle of a file
    import tarfile

    root = tmp_path / "proj"
    proc = subprocess.Popen([sys.executable, "-c", helper_source()], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(json.dumps({"targets": [{"root": str(root), "paths": ["a.bin"]}], "idle": 1}).encode()
                         + b"\n")
        proc.stdin.flush()
        assert json.loads(proc.stdout.readline())["targets"][0]["entries"] == {}
        plan = {"files": [[0, "a.bin", "0" * 64, 0o644, 0]], "delete": [], "keep": [[]]}
        info = tarfile.TarInfo("0/a.bin")
        info.size = 1 << 20
        proc.stdin.write(json.dumps(plan).encode() + b"\n" + info.tobuf(tarfile.PAX_FORMAT) + b"x" * 1000)
        proc.stdin.flush()
        assert wait_until(lambda: any(p.name.startswith(".dlrun-part-") for p in root.glob("*")))
        assert proc.wait(30) == 3  # gave up after a second of silence
        assert list(root.iterdir()) == []  # the partial file went with it
    finally:
        proc.kill()
        proc.stdin.close()
        proc.stdout.close()


def test_settled_push_only_when_there_is_nothing_to_send_delete_or_record(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dlrun.transport.local import HostRouter

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    code = tmp_path / "proj"
    code.mkdir()
    (code / "a.py").write_text("A = 1\n")
    (code / "lib").mkdir()
    (code / "lib" / "b.py").write_text("B = 2\n")
    host = Host(address="localhost", name="localhost", workdir=str(tmp_path / "host"))
    helper: dict[str, object] = {"__name__": "survey-only"}
    exec(compile(helper_source(), "<helper>", "exec"), helper)  # what the agent runs for op "survey"
    survey = cast(Callable[[object], list[object]], helper["survey"])

    def settled() -> HostPushSummary | None:
        target = code_target(host, code, scan_code(code))
        answer = {"targets": [survey(spec)[0]
                              for spec in survey_request([target])["targets"]]}
        return settled_push(host.name, [target], answer)

    assert settled() is None  # nothing there yet
    push(HostRouter(remote=None), [host], code_dir=code)
    summary = settled()
    assert summary == HostPushSummary(host="localhost", files_sent=0, bytes_sent=0, files_unchanged=2,
                                      files_deleted=0, seconds=0.0, code_dir=str(tmp_path / "host" / "proj"))
    os.utime(tmp_path / "host" / "proj" / "a.py", (1, 1))  # same content, new stamp: the record needs writing
    assert settled() is None
    push(HostRouter(remote=None), [host], code_dir=code)
    assert settled() is not None
    (code / "lib" / "b.py").unlink()  # a file the push wrote must go
    assert settled() is None
    push(HostRouter(remote=None), [host], code_dir=code)
    assert settled() is not None
    (code / "a.py").write_text("A = 3\n")
    assert settled() is None


def test_two_hosts_sharing_one_workdir_push_into_it_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # one machine under two names, or an NFS home: both helpers write the same files at once
    from dlrun.transport.local import HostRouter

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    code = tmp_path / "proj"
    code.mkdir()
    for i in range(1000):
        (code / f"m{i:04d}.py").write_bytes(os.urandom(2000))
    hosts = [Host(address="localhost", name=name, workdir=str(tmp_path / "shared")) for name in ("a", "b")]
    summaries = push(HostRouter(remote=None), hosts, code_dir=code)
    # each helper may find some files the other one already wrote: they count as unchanged
    assert [s.files_sent + s.files_unchanged for s in summaries] == [1000, 1000]
    landed = sorted(p.name for p in (tmp_path / "shared" / "proj").iterdir())
    assert landed == sorted(p.name for p in code.iterdir())
    assert all((tmp_path / "shared" / "proj" / n).read_bytes() == (code / n).read_bytes() for n in landed)


class LinkedTrees:
    """A local project ``src``, its pushed copy under ``remote`` and a directory ``outside``
    that no push may touch."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
        self.src, self.workdir, self.outside = tmp_path / "proj", tmp_path / "remote", tmp_path / "outside"
        for d in (self.src, self.workdir, self.outside):
            d.mkdir()
        self.remote = self.workdir / "proj"

    def push(self, **kw: Any) -> tuple[int, int, int]:
        from dlrun.transport.local import HostRouter

        host = Host(address="localhost", name="localhost", workdir=str(self.workdir))
        (s,) = push(HostRouter(remote=None), [host], code_dir=self.src, **kw)
        return s.files_sent, s.files_unchanged, s.files_deleted


@pytest.fixture
def trees(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> LinkedTrees:
    return LinkedTrees(tmp_path, monkeypatch)


def test_a_record_of_a_vanished_file_cannot_delete_through_a_later_link(trees: LinkedTrees) -> None:
    make_tree(trees.src, {"d/x": "v1", "keep": "k"})
    trees.push()
    for p in (trees.remote / "d" / "x", trees.remote / "d"):  # a job cleans d/ up on the host
        p.unlink() if p.is_file() else p.rmdir()
    (trees.outside / "x").write_text("not dlrun's")
    (trees.src / "d" / "x").unlink()
    (trees.src / "d").rmdir()
    (trees.src / "d").symlink_to(trees.outside)  # d is now a link, pushed as a link
    trees.push()
    trees.push()
    assert (trees.outside / "x").read_text() == "not dlrun's"


def test_a_jobs_file_where_a_pushed_one_was_is_never_deleted(trees: LinkedTrees) -> None:
    make_tree(trees.src, {"report.csv": "template", "train.py": "t"})
    trees.push()
    (trees.remote / "report.csv").unlink()  # the job removes the template, the user drops it too
    (trees.src / "report.csv").unlink()
    trees.push()
    (trees.remote / "report.csv").write_text("job results")  # the job's own file, same name
    trees.push()
    assert (trees.remote / "report.csv").read_text() == "job results"
    # and a pushed file the job replaced (new inode) is the job's now, even when deleted locally
    make_tree(trees.src, {"out.txt": "pushed"})
    trees.push()
    (trees.remote / "out.txt.new").write_text("job's")
    (trees.remote / "out.txt.new").replace(trees.remote / "out.txt")
    (trees.src / "out.txt").unlink()
    assert trees.push() == (0, 1, 0)
    assert (trees.remote / "out.txt").read_text() == "job's"


def test_a_pushed_link_replaced_by_a_directory_gets_its_files(trees: LinkedTrees) -> None:
    make_tree(trees.outside, {"f": "same"})
    (trees.src / "d").symlink_to(trees.outside)
    trees.push()
    (trees.src / "d").unlink()
    make_tree(trees.src, {"d/f": "same"})  # the same content, now a real directory
    assert trees.push() == (1, 0, 1)  # not judged unchanged through the old link
    assert not (trees.remote / "d").is_symlink() and (trees.remote / "d" / "f").read_text() == "same"
    assert sorted(p.name for p in trees.outside.iterdir()) == ["f"]


@pytest.mark.parametrize("delete", [True, False])
def test_no_write_goes_through_a_link_on_the_host(trees: LinkedTrees, delete: bool) -> None:
    # a link dlrun pushed, or one a user made on the host: replaced by the directory, never followed
    make_tree(trees.src, {"main.py": "m"})
    trees.push()
    (trees.remote / "cfg").symlink_to(trees.outside)
    make_tree(trees.src, {"cfg/a.yaml": "a"})
    trees.push(delete=delete)
    assert list(trees.outside.iterdir()) == []
    assert not (trees.remote / "cfg").is_symlink() and (trees.remote / "cfg" / "a.yaml").read_text() == "a"


def test_a_failed_write_keeps_the_old_copy_pushed(trees: LinkedTrees, monkeypatch: pytest.MonkeyPatch) -> None:
    from dlrun.push import session as sync

    make_tree(trees.src, {"helpers.py": "OLD = 1\n", "main.py": "import helpers\n"})
    trees.push()
    (trees.src / "helpers.py").write_text("NEW = 2\n")
    planned = sync._plan_local

    def edited_mid_push(*args: Any, **kw: Any) -> object:
        out = planned(*args, **kw)
        (trees.src / "helpers.py").write_text("NEW = 3\n")  # changed after it was hashed
        return out

    monkeypatch.setattr(sync, "_plan_local", edited_mid_push)
    with pytest.raises(SyncError, match="does not match its sha256"):
        trees.push()
    monkeypatch.setattr(sync, "_plan_local", planned)
    (trees.src / "helpers.py").unlink()  # the user removes the module: the host's copy must go too
    assert trees.push() == (0, 1, 1)
    assert not (trees.remote / "helpers.py").exists()


def test_a_pushed_module_never_runs_from_stale_bytecode(trees: LinkedTrees) -> None:
    # same size, same mtime second: Python would trust the old .pyc
    make_tree(trees.src, {"util.py": "V = 1\n", "other.py": "W = 1\n"})
    trees.push()
    cache = trees.remote / "__pycache__"
    make_tree(cache, {"util.cpython-311.pyc": "old", "util.cpython-311.opt-1.pyc": "old",
                      "other.cpython-311.pyc": "kept", "utility.cpython-311.pyc": "kept"})
    (trees.src / "util.py").write_text("V = 2\n")
    assert trees.push() == (1, 1, 0)
    assert sorted(p.name for p in cache.iterdir()) == ["other.cpython-311.pyc", "utility.cpython-311.pyc"]


def test_hosts_sharing_a_workdir_keep_their_shards_apart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # one NFS home seen by two hosts: each shard lands in the host's own data directory
    from dlrun.transport.local import HostRouter

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    data = tmp_path / "dataset"
    make_tree(data, {f"part-{i}.csv": f"{i}\n" for i in range(6)})
    shared = tmp_path / "nfs-home"
    hosts = [Host(address="localhost", name="a", workdir=str(shared)),
             Host(address="127.0.0.1", name="b", workdir=str(shared))]
    for _ in range(2):  # and again: neither push deletes the other host's files
        summaries = push(HostRouter(remote=None), hosts, code_dir=None, data_dir=data, shard="files")
    got = {s.host: sorted(p.name for p in Path(s.data_dir or "").iterdir()) for s in summaries}
    assert got == {"a": ["part-0.csv", "part-2.csv", "part-4.csv", "shard.json"],
                   "b": ["part-1.csv", "part-3.csv", "part-5.csv", "shard.json"]}
    assert {s.data_dir for s in summaries} == {str(shared / "data" / "a"), str(shared / "data" / "b")}


def test_an_empty_code_directory_is_made_on_the_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dlrun.transport.local import HostRouter

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "empty").mkdir()
    host = Host(address="localhost", name="localhost", workdir=str(tmp_path / "host"))
    (summary,) = push(HostRouter(remote=None), [host], code_dir=tmp_path / "empty")
    assert summary.code_dir == str(tmp_path / "host" / "empty")
    assert (tmp_path / "host" / "empty").is_dir()  # ranks may run there (launch --no-push)
    (summary,) = push(HostRouter(remote=None), [host], code_dir=tmp_path / "empty")
    assert (summary.files_sent, summary.files_deleted) == (0, 0)


def _local_hosts(count: int, workdir: Path) -> list[Host]:
    return [Host(address="localhost", name=f"h{i}", workdir=str(workdir)) for i in range(count)]


def _dataset(root: Path, count: int) -> Path:
    data = root / "ds"
    data.mkdir()
    for i in range(count):
        (data / f"f{i}").write_text(str(i))
    return data


def _files_under(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def test_a_dataset_with_no_files_deletes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    data = _dataset(tmp_path, 4)
    push(HostRouter(remote=None), _local_hosts(2, tmp_path / "wd"), code_dir=None, data_dir=data)
    for f in data.iterdir():
        f.unlink()  # as an unmounted mount point looks
    with pytest.raises(SyncError, match="holds no files to shard"):
        push(HostRouter(remote=None), _local_hosts(2, tmp_path / "wd"), code_dir=None, data_dir=data)
    assert _files_under(tmp_path / "wd" / "data" / "h0") == ["f0", "f2", "shard.json"]


def test_code_and_data_go_once_each(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    project = tmp_path / "proj"
    (project / "dataset").mkdir(parents=True)
    (project / "train.py").write_text("print(1)\n")
    for i in range(4):
        (project / "dataset" / f"f{i}.bin").write_text(str(i))
    hosts = _local_hosts(2, tmp_path / "wd")
    # launch pushes the data as shards first, then the code without it
    push(HostRouter(remote=None), hosts, code_dir=None, data_dir=project / "dataset")
    push(HostRouter(remote=None), hosts, code_dir=project, leave_out=project / "dataset")
    assert _files_under(tmp_path / "wd" / "proj") == ["train.py"]
    for data_dir in (project, tmp_path):  # a dataset that holds the code: every file twice
        with pytest.raises(UsageError, match="holds the code directory"):
            push(HostRouter(remote=None), hosts, code_dir=project, data_dir=data_dir)


def test_no_delete_keeps_code_files_but_data_shards_stay_disjoint(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    data = _dataset(tmp_path, 6)
    push(HostRouter(remote=None), _local_hosts(3, tmp_path / "wd"), code_dir=None, data_dir=data)
    push(HostRouter(remote=None), _local_hosts(2, tmp_path / "wd"), code_dir=None, data_dir=data, delete=False)
    shards = [set(_files_under(tmp_path / "wd" / "data" / f"h{i}")) - {SHARD_FILE} for i in range(2)]
    assert shards[0].isdisjoint(shards[1]) and shards[0] | shards[1] == {f"f{i}" for i in range(6)}


def oldest_python() -> str | None:
    """A Python 3.8 here (PATH or pyenv), the oldest the host programs support."""
    import glob

    for found in (*sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.8*/bin/python"))),
                  shutil.which("python3.8")):
        if found and subprocess.run([found, "-c", ""], capture_output=True).returncode == 0:  # not a bare shim
            return found
    return None


def test_the_push_helper_runs_on_python_3_8(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    python = oldest_python()
    if python is None:
        pytest.skip("no Python 3.8 on this machine")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    code = tmp_path / "code"
    (code / "sub").mkdir(parents=True)
    (code / "a.py").write_text("A = 1\n")
    (code / "sub" / "b.txt").write_text("b\n")
    (code / "link.py").symlink_to("a.py")
    host = Host(address="localhost", name="localhost", workdir=str(tmp_path / "host"), python=python)
    router = HostRouter(remote=None)
    (first,) = push(router, [host], code_dir=code)
    assert (first.files_sent, first.code_dir) == (3, str(tmp_path / "host" / "code"))
    (code / "a.py").write_text("A = 2\n")
    (code / "sub" / "b.txt").unlink()
    (planned,) = push(router, [host], code_dir=code, dry_run=True)
    assert (planned.files_sent, planned.files_deleted, planned.deleting) == (1, 1, ("sub/b.txt",))
    (again,) = push(router, [host], code_dir=code)
    assert (again.files_sent, again.files_deleted) == (1, 1)
    assert (tmp_path / "host" / "code" / "a.py").read_text() == "A = 2\n"
    assert not (tmp_path / "host" / "code" / "sub").exists()


def test_local_host_goes_through_the_local_transport(tmp_path: Path) -> None:
    src = tmp_path / "app"
    (src / "data").mkdir(parents=True)
    (src / "main.py").write_text("print(1)\n")
    (src / "data" / "readme.txt").write_text("x\n")
    host = Host(address="localhost", name="localhost", workdir=str(tmp_path / "dst"))
    (summary,) = push(HostRouter(remote=None), [host], code_dir=src, project="renamed")
    assert summary.files_sent == 2
    dst = tmp_path / "dst" / "renamed"
    assert sorted(p.relative_to(dst).as_posix() for p in dst.rglob("*") if p.is_file()) == ["data/readme.txt",
                                                                                            "main.py"]
    assert (dst / "main.py").read_text() == "print(1)\n" and (dst / "data" / "readme.txt").read_text() == "x\n"
