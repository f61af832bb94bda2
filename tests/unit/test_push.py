"""The pure parts of dlrun.push (tree: ignore rules, manifest diff; shard: policies, split-lines; the
stream's pieces), and dlrun.push.view. The helper as a process: tests/integration/test_push_local.py."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import posixpath
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

import dlrun.push.tree as tree_module
from dlrun.errors import SyncError, UsageError
from dlrun.inventory import Host
from dlrun.push.session import (
    SEND_CHUNK,
    HostPushSummary,
    _file_body,
    _Pieces,
    code_target,
    settled_push,
)
from dlrun.push.shard import (
    SHARD_FILE,
    SHARD_POLICIES,
    part_name,
    plan_data,
    remote_data_dir,
    shard_document,
    shard_env,
    shard_files,
    split_file,
    split_points,
)
from dlrun.push.tree import (
    NO_LIMIT,
    FileEntry,
    HashCache,
    IgnoreRules,
    Manifest,
    PushLimit,
    RemoteEntry,
    RemoteTree,
    Source,
    TransferPlan,
    bytes_needed,
    check_push_size,
    check_space,
    diff_manifests,
    hash_all,
    parse_ignore,
    parse_size,
    push_root_for,
    remote_code_dir,
    scan_tree,
    system_folders,
)
from dlrun.push.view import PushView, summary_json, summary_line

from support.trees import make_tree

# --------------------------------------------------------------------------- shards

FILE_SETS = {
    "none": [],
    "one": [("a", 5)],
    "three": [("a", 1), ("b", 2), ("c", 3)],
    "ten": [(f"d/f{i:02d}.bin", (i * 37) % 11 + 1) for i in range(10)],
    "uneven": [("big", 1000), *[(f"small{i}", 10) for i in range(7)], ("mid", 300)],
}


@pytest.mark.parametrize("policy", SHARD_POLICIES)
@pytest.mark.parametrize("name", sorted(FILE_SETS))
def test_shards_are_disjoint_and_complete_for_three_hosts(policy: str, name: str) -> None:
    files = FILE_SETS[name]
    shards = shard_files(files, 3, policy)
    assert len(shards) == 3
    every = sorted(p for p, _ in files)
    for shard in shards:
        assert list(shard) == sorted(shard)
    if policy == "replicate":
        assert all(list(s) == every for s in shards)
        return
    flat = [p for s in shards for p in s]
    assert sorted(flat) == every  # complete
    assert len(flat) == len(set(flat))  # pairwise disjoint


def test_files_policy_deals_sorted_files_round_robin() -> None:
    files = [("c", 1), ("a", 1), ("e", 1), ("b", 1), ("d", 1)]
    assert shard_files(files, 3, "files") == (("a", "d"), ("b", "e"), ("c",))


def test_contiguous_policy_gives_ranges_that_differ_by_at_most_one() -> None:
    files = [(f"f{i}", 1) for i in range(8)]
    assert shard_files(files, 3, "contiguous") == (("f0", "f1", "f2"), ("f3", "f4", "f5"), ("f6", "f7"))


def test_size_policy_balances_bytes_greedily() -> None:
    shards = shard_files(FILE_SETS["uneven"], 3, "size")
    sizes = dict(FILE_SETS["uneven"])
    loads = sorted(sum(sizes[p] for p in s) for s in shards)
    assert loads == [70, 300, 1000]  # largest first, each to the lightest host
    assert ("big",) in shards and ("mid",) in shards
    # x→0, y→1, w→1 (4 < 5), z→0 (5 < 7): loads 8 and 7
    assert shard_files([("x", 5), ("y", 4), ("z", 3), ("w", 3)], 2, "size") == (("x", "z"), ("w", "y"))


def test_unknown_policy_and_no_hosts_are_usage_errors() -> None:
    with pytest.raises(UsageError, match="unknown shard policy"):
        shard_files([("a", 1)], 2, "random")
    with pytest.raises(UsageError):
        shard_files([("a", 1)], 0, "files")


# --------------------------------------------------------------------------- ignore rules


def rules(text: str, base: str = "") -> IgnoreRules:
    return IgnoreRules(parse_ignore(text, base))


@pytest.mark.parametrize(
    ("pattern", "path", "is_dir", "expected"),
    [
        ("*.log", "x.log", False, True),
        ("*.log", "deep/er/x.log", False, True),
        ("*.log", "x.log.txt", False, False),
        ("/build", "build", True, True),
        ("/build", "src/build", True, False),
        ("build/", "src/build", True, True),
        ("build/", "build", False, False),  # a file named build is not a directory
        ("doc/*.txt", "doc/a.txt", False, True),
        ("doc/*.txt", "doc/sub/a.txt", False, False),
        ("doc/*.txt", "x/doc/a.txt", False, False),  # an inner slash anchors
        ("**/tmp", "a/b/tmp", True, True),
        ("**/tmp", "tmp", True, True),
        ("a/**/b", "a/b", False, True),
        ("a/**/b", "a/x/y/b", False, True),
        ("out/**", "out/x/y", False, True),
        ("out/**", "out", True, False),
        ("fil?.py", "file.py", False, True),
        ("fil?.py", "fil/.py", False, False),
        ("[ab].py", "b.py", False, True),
        ("[!ab].py", "c.py", False, True),
        ("[!ab].py", "a.py", False, False),
        ("\\#notes", "#notes", False, True),
        ("# a comment", "# a comment", False, False),
        ("trailing   ", "trailing", False, True),
    ],
)
def test_gitignore_patterns(pattern: str, path: str, is_dir: bool, expected: bool) -> None:
    assert rules(pattern).ignored(path, is_dir) is expected


def test_negation_last_match_wins_but_not_inside_an_ignored_directory() -> None:
    r = rules("*.log\n!keep.log\nlogs/\n!logs/x.txt\n")
    assert r.ignored("a.log")
    assert not r.ignored("keep.log")
    assert r.ignored("logs", True)
    assert r.ignored("logs/x.txt")  # git cannot re-include a file of an excluded directory


def test_rules_of_a_nested_ignore_file_apply_below_it_only() -> None:
    r = rules("/gen\n*.tmp\n", base="pkg")
    assert r.ignored("pkg/gen", True)
    assert r.ignored("pkg/sub/x.tmp")
    assert not r.ignored("gen", True)
    assert not r.ignored("x.tmp")


def test_scan_tree_applies_gitignore_dlrunignore_and_the_defaults(tmp_path: Path) -> None:
    make_tree(tmp_path, {
        "train.py": "print(1)\n",
        ".gitignore": "*.log\n/outputs/\n",
        ".dlrunignore": "big.bin\n!important.log\n",
        "important.log": "keep\n",
        "x.log": "drop\n",
        "big.bin": "drop\n",
        "outputs/ckpt": "drop\n",
        "pkg/mod.py": "x = 1\n",
        "pkg/.gitignore": "local.txt\n",
        "pkg/local.txt": "drop\n",
        "local.txt": "keep\n",
        ".git/HEAD": "drop\n",
        "pkg/__pycache__/mod.cpython-311.pyc": "drop\n",
    })
    (tmp_path / "run.sh").write_text("#!/bin/sh\n")
    (tmp_path / "run.sh").chmod(0o755)
    (tmp_path / "alias.py").symlink_to("train.py")
    manifest = scan_tree(tmp_path)
    assert manifest.paths() == (".dlrunignore", ".gitignore", "alias.py", "important.log", "local.txt",
                                "pkg/.gitignore", "pkg/mod.py", "run.sh", "train.py")
    by_path = {e.path: e for e in manifest.entries}
    assert by_path["run.sh"].mode == 0o755
    assert by_path["train.py"].mode == 0o644
    assert by_path["alias.py"].link == "train.py" and by_path["alias.py"].is_link
    assert by_path["train.py"].sha256 == hashlib.sha256(b"print(1)\n").hexdigest()
    assert by_path["train.py"].size == 9


def test_hash_cache_skips_unchanged_files_and_rehashes_changed_ones(tmp_path: Path) -> None:
    target = tmp_path / "f"
    target.write_text("one")
    old = 1_600_000_000
    os.utime(target, (old, old))
    cache_file = tmp_path / "cache.json"
    calls: list[str] = []

    def compute(value: str) -> str:
        calls.append(value)
        return value

    later = time.time_ns() + 10**10  # a file changed just before it is hashed is not cached ("racy")
    cache = HashCache(cache_file, now_ns=later)
    assert cache.digest("f", target.stat(), lambda: compute("h1")) == "h1"
    cache.save()
    cache = HashCache(cache_file, now_ns=later)
    assert cache.digest("f", target.stat(), lambda: compute("h2")) == "h1"  # from the cache
    target.write_text("two")
    os.utime(target, (old, old))  # same mtime, but ctime and size moved
    assert cache.digest("f", target.stat(), lambda: compute("h3")) == "h3"
    assert calls == ["h1", "h3"]


def test_files_are_hashed_on_several_threads_and_listed_in_order(tmp_path: Path) -> None:
    contents = {f"d{i % 3}/f{i:02d}": os.urandom(1000 * i + 1) for i in range(40)}
    for rel, data in contents.items():
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_bytes(data)
    manifest = scan_tree(tmp_path)
    assert [(e.path, e.sha256) for e in manifest.entries] == [
        (rel, hashlib.sha256(data).hexdigest()) for rel, data in sorted(contents.items())]
    names: set[str] = set()

    def digest(item: int) -> str:
        names.add(threading.current_thread().name)
        return str(item)

    seen = hash_all(digest, list(range(50)))
    assert seen == [str(i) for i in range(50)]
    if (os.cpu_count() or 1) > 1:
        assert all(name.startswith("dlrun-hash") for name in names)


def test_a_file_that_cannot_be_read_while_hashing_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for i in range(5):
        (tmp_path / f"f{i}").write_text(str(i))
    real = tree_module.sha256_file

    def sha256_file(path: str, *args: int) -> str:
        if path.endswith("f3"):
            raise PermissionError(13, "Permission denied")
        return real(path)

    monkeypatch.setattr(tree_module, "sha256_file", sha256_file)
    with pytest.raises(SyncError, match=r"cannot read .*f3: Permission denied"):
        scan_tree(tmp_path)


def test_hashing_stops_at_the_first_error_without_hashing_the_rest() -> None:
    done: list[int] = []

    def digest(item: int) -> str:
        if item == 0:
            raise SyncError("cannot read 0")
        time.sleep(0.01)
        done.append(item)
        return str(item)

    with pytest.raises(SyncError, match="cannot read 0"):
        hash_all(digest, list(range(200)))
    assert len(done) <= tree_module.HASH_THREADS  # only those already started, not 199


# --------------------------------------------------------------------------- manifest diff


def entry(path: str, content: bytes = b"x", mode: int = 0o644, link: str | None = None) -> FileEntry:
    if link is not None:
        return FileEntry(path, 0, 0o777, "", link=link)
    return FileEntry(path, len(content), mode, hashlib.sha256(content).hexdigest())


def remote(e: FileEntry, pushed: bool = True, **changes: Any) -> RemoteEntry:
    found = RemoteEntry(path=e.path, kind="link" if e.is_link else "file", size=e.size, mode=e.mode,
                        sha256=e.sha256, link=e.link, pushed=pushed)
    return dataclasses.replace(found, **changes)


def test_diff_sends_new_and_changed_files_only() -> None:
    same, changed, new, mode, link = (entry("same"), entry("changed", b"new"), entry("new"),
                                      entry("mode", mode=0o755), entry("link", link="same"))
    local = Manifest((changed, link, mode, new, same))
    there = {
        "same": remote(same),
        "changed": remote(entry("changed", b"old")),
        "mode": remote(entry("mode", mode=0o644)),
        "link": remote(entry("link", link="elsewhere")),
    }
    plan = diff_manifests(local, there, delete=True)
    assert [e.path for e in plan.send] == ["changed", "link", "mode", "new"]
    assert plan.unchanged == ("same",)
    assert plan.delete == ()
    assert plan.bytes_to_send == 3 + 0 + 1 + 1


def test_diff_deletes_only_files_a_push_wrote() -> None:
    kept = entry("kept")
    there = {
        "kept": remote(kept),
        "gone.py": remote(entry("gone.py")),  # pushed before, deleted locally since
        "checkpoint.pt": remote(entry("checkpoint.pt"), pushed=False),  # written by the job
    }
    assert diff_manifests(Manifest((kept,)), there, delete=True).delete == ("gone.py",)
    assert diff_manifests(Manifest((kept,)), there, delete=False).delete == ()


def test_unknown_remote_hash_or_other_kind_means_send() -> None:
    e = entry("a")
    assert diff_manifests(Manifest((e,)), {"a": remote(e, sha256="")}, delete=True).send == (e,)
    assert diff_manifests(Manifest((e,)), {"a": remote(e, kind="other")}, delete=True).send == (e,)


def test_space_check_names_host_and_bytes_needed() -> None:
    assert bytes_needed([1, 4096, 4097, 0], 4096) == 4096 + 4096 + 8192
    tree = RemoteTree(root="/w/proj", entries={}, free_bytes=10_000, block_size=4096, device=7)
    small = TransferPlan(send=(entry("a", b"x" * 100),), delete=(), unchanged=())
    check_space("h1", [tree], [small])
    big = TransferPlan(send=tuple(entry(f"f{i}", b"x" * 4000) for i in range(3)), delete=(), unchanged=())
    with pytest.raises(SyncError) as info:
        check_space("h1", [tree], [big])
    assert info.value.host == "h1"
    assert "12288 bytes needed" in str(info.value) and "10000 free" in str(info.value)
    # code and data on the same filesystem add up
    with pytest.raises(SyncError):
        check_space("h1", [tree, tree], [small, TransferPlan(send=(entry("b", b"y" * 6000),), delete=(),
                                                             unchanged=())])


# --------------------------------------------------------------------------- split-lines and data plans


def reader(data: bytes) -> Callable[[int, int], bytes]:
    return lambda offset, n: data[offset : offset + n]


@pytest.mark.parametrize("parts", [1, 2, 3, 7])
@pytest.mark.parametrize("data", [b"", b"one\n", b"a\nbb\nccc\ndddd\n" * 50, b"no newline at end\nlast",
                                  b"x" * 1000 + b"\n" + b"y\n" * 3])
def test_split_points_cut_at_line_ends_and_cover_everything(data: bytes, parts: int) -> None:
    cuts = split_points(reader(data), len(data), 0, parts)
    assert len(cuts) == parts + 1 and cuts[0] == 0 and cuts[-1] == len(data)
    assert list(cuts) == sorted(cuts)
    pieces = [data[a:b] for a, b in pairwise(cuts)]
    assert b"".join(pieces) == data
    for piece in pieces[:-1]:
        assert piece == b"" or piece.endswith(b"\n")


def test_split_points_balance_bytes() -> None:
    data = b"".join(b"%05d\n" % i for i in range(3000))
    cuts = split_points(reader(data), len(data), 0, 3)
    sizes = [b - a for a, b in pairwise(cuts)]
    assert max(sizes) - min(sizes) <= 6


def test_split_lines_repeats_the_csv_header_in_every_part(tmp_path: Path) -> None:
    body = b"".join(b"%d,%d\n" % (i, i * i) for i in range(100))
    (tmp_path / "train.csv").write_bytes(b"x,y\n" + body)
    shards = plan_data(tmp_path / "train.csv", 3, "files", split_lines=True)
    parts = []
    for index, manifest in enumerate(shards):
        assert manifest.paths() == (SHARD_FILE, f"train.part-{index}-of-3.csv")
        part = by_name(manifest, f"train.part-{index}-of-3.csv")
        content = read_entry(part)
        assert content.startswith(b"x,y\n")
        assert part.sha256 == hashlib.sha256(content).hexdigest() and part.size == len(content)
        parts.append(content[4:])
        doc = json.loads(read_entry(by_name(manifest, SHARD_FILE)))
        assert doc["index"] == index and doc["count"] == 3
        assert doc["split_lines"] == {"source": "train.csv", "header_repeated": True}
        assert doc["files"] == [{"path": part.path, "size": part.size, "sha256": part.sha256}]
    assert b"".join(parts) == body


def by_name(manifest: Manifest, path: str) -> FileEntry:
    return next(e for e in manifest.entries if e.path == path)


def read_entry(e: FileEntry) -> bytes:
    assert e.source is not None
    if e.source.content is not None:
        return e.source.content
    assert e.source.file is not None
    with open(e.source.file, "rb") as fh:
        fh.seek(e.source.offset)
        return e.source.prefix + fh.read(e.size - len(e.source.prefix))


def test_split_lines_of_a_text_file_in_a_directory_keeps_no_header(tmp_path: Path) -> None:
    (tmp_path / "corpus.txt").write_text("".join(f"line {i}\n" for i in range(10)))
    shards = plan_data(tmp_path, 2, "contiguous", split_lines=True)
    assert [m.paths() for m in shards] == [("corpus.part-0-of-2.txt", SHARD_FILE),
                                           ("corpus.part-1-of-2.txt", SHARD_FILE)]
    texts = [read_entry(m.entries[0]) for m in shards]
    assert b"".join(texts) == (tmp_path / "corpus.txt").read_bytes()


def test_one_big_file_is_an_error_with_advice(tmp_path: Path) -> None:
    (tmp_path / "images.bin").write_bytes(b"\0\1\2" * 1000)
    with pytest.raises(SyncError, match="is one file") as info:
        plan_data(tmp_path, 3, "files")
    assert "--split-lines" in str(info.value) and "replicate" in str(info.value)
    with pytest.raises(SyncError, match="not a text file"):
        plan_data(tmp_path, 3, "files", split_lines=True)
    assert len(plan_data(tmp_path, 3, "replicate")) == 3  # copying it everywhere is fine
    assert len(plan_data(tmp_path, 1, "files")) == 1  # so is one host


def test_split_lines_needs_one_file_and_no_replicate(tmp_path: Path) -> None:
    make_tree(tmp_path, {"a.txt": "1\n", "b.txt": "2\n"})
    with pytest.raises(SyncError, match="has 2 files"):
        plan_data(tmp_path, 2, "files", split_lines=True)
    with pytest.raises(UsageError, match="replicate"):
        plan_data(tmp_path / "a.txt", 2, "replicate", split_lines=True)


def test_data_plan_ignores_gitignore_but_honours_dlrunignore(tmp_path: Path) -> None:
    make_tree(tmp_path, {".gitignore": "*\n", ".dlrunignore": "*.tmp\n.gitignore\n.dlrunignore\n",
                         "a.npy": "a", "b.npy": "b", "c.tmp": "c"})
    shards = plan_data(tmp_path, 2, "files")
    assert [m.paths() for m in shards] == [("a.npy", SHARD_FILE), ("b.npy", SHARD_FILE)]
    doc = json.loads(read_entry(shards[1].entries[1]))
    assert doc == {"policy": "files", "index": 1, "count": 2,
                   "files": [{"path": "b.npy", "size": 1, "sha256": hashlib.sha256(b"b").hexdigest()}]}


def test_shard_document_is_deterministic() -> None:
    e = entry("a")
    assert shard_document("size", 0, 2, [e]) == shard_document("size", 0, 2, [e])


def test_part_names() -> None:
    assert part_name("train.csv", 0, 3) == "train.part-0-of-3.csv"
    assert part_name("dir/corpus", 2, 4) == "dir/corpus.part-2-of-4"
    assert part_name(".hidden", 1, 2) == ".hidden.part-1-of-2"


# --------------------------------------------------------------------------- paths and env


def test_remote_dirs_and_worker_env() -> None:
    host = Host(address="h", name="h", workdir="/srv/jobs")
    assert remote_code_dir(host, "proj") == "/srv/jobs/proj"
    assert remote_data_dir(host) == "/srv/jobs/data/h"
    assert remote_data_dir(Host(address="h", name="node-1.lab")) == "data/node-1.lab"
    odd = [remote_data_dir(Host(address="h", name=n)) for n in ("gpu 1", "gpu_1", "..", "a/b", "'; rm -rf ~'")]
    assert odd[0].startswith("data/gpu_1-") and odd[1] == "data/gpu_1" and len(set(odd)) == 5
    assert all(posixpath.dirname(d) == "data" and not d.endswith("/.") for d in odd)
    assert remote_code_dir(Host(address="h", name="h", workdir="~/dlrun"), "p") == "~/dlrun/p"
    assert remote_code_dir(Host(address="h", name="h"), "p") == "p"  # from $HOME
    assert shard_env(1, 3, host) == {"DLRUN_DATA_DIR": "/srv/jobs/data/h", "DLRUN_SHARD_INDEX": "1",
                                     "DLRUN_SHARD_COUNT": "3"}
    assert shard_env(0, 1, host, data_dir="/home/u/x/data")["DLRUN_DATA_DIR"] == "/home/u/x/data"
    for bad in ("", "..", "a/b"):
        with pytest.raises(UsageError):
            remote_code_dir(host, bad)


# --------------------------------------------------------------------------- the stream


def body(entry: FileEntry) -> tuple[bytes, list[int]]:
    """What the tar stream carries for ``entry`` (sent in pieces) and the progress steps."""
    sent: list[bytes] = []
    steps: list[int] = []
    pieces = _Pieces(lambda piece: sent.append(bytes(piece)))
    _file_body(entry, pieces, steps.append)
    pieces.flush()
    return b"".join(sent), steps


def test_stream_goes_out_in_whole_ssh_packets_and_carries_every_byte(tmp_path: Path) -> None:
    data = os.urandom(SEND_CHUNK * 19 + 1234)
    (tmp_path / "f").write_bytes(data)
    entry = FileEntry("f", len(data), 0o644, hashlib.sha256(data).hexdigest(), source=Source(file=str(tmp_path / "f")))
    sent: list[bytes] = []
    steps: list[int] = []
    # each piece is a view of the reused read buffer: a Channel copies it before send returns
    pieces = _Pieces(lambda piece: sent.append(bytes(piece)))
    pieces.add(b"H" * 512)
    _file_body(entry, pieces, steps.append)
    pieces.zeros(-len(data) % 512 + 1024)
    pieces.flush()
    assert b"".join(sent) == b"H" * 512 + data + bytes(-len(data) % 512 + 1024)
    assert [len(p) for p in sent[:-1]] == [SEND_CHUNK] * (len(sent) - 1)  # one SSH packet each
    assert 0 < len(sent[-1]) <= SEND_CHUNK
    assert sum(steps) == len(data)


def test_stream_sends_a_range_after_its_prefix_and_zero_fills_a_file_that_shrank(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"0123456789")
    part = FileEntry("p", 7, 0o644, "", source=Source(file=str(tmp_path / "f"), offset=2, prefix=b"HDR"))
    assert body(part) == (b"HDR2345", [3, 4])
    shrunk = FileEntry("s", 25, 0o644, "", source=Source(file=str(tmp_path / "f")))
    assert body(shrunk) == (b"0123456789" + bytes(15), [10, 15])
    generated = FileEntry("g", 3, 0o644, "", source=Source(content=b"abc"))
    assert body(generated) == (b"abc", [3])


# --------------------------------------------------------------------------- the view

SUMMARIES = (
    HostPushSummary("host0", 3, 3 * 1024 * 1024, 10, 1, 1.25, "/w/p", None),
    HostPushSummary("host1", 0, 0, 13, 0, 0.5),
)


def test_summary_json_and_lines() -> None:
    doc = summary_json(SUMMARIES)
    assert doc["hosts"][0] == {"host": "host0", "files_sent": 3, "bytes_sent": 3145728, "files_unchanged": 10,
                               "files_deleted": 1, "seconds": 1.25, "code_dir": "/w/p", "data_dir": None}
    assert doc["total"] == {"files_sent": 3, "bytes_sent": 3145728, "files_unchanged": 23, "files_deleted": 1,
                            "seconds": 1.25}
    json.dumps(doc)
    assert summary_line(SUMMARIES[0]) == "host0: 3 files sent (3.0 MiB), 10 unchanged, 1 deleted in 1.2 s"


def test_view_prints_one_line_per_host_when_not_a_terminal() -> None:
    out = io.StringIO()
    console = Console(file=out, width=100, color_system=None, force_terminal=False)
    with PushView(["host0", "host1"], console=console) as view:
        view.progress("host0", 10, 100)
        view.files("host0", 1, 3)
        view.finish(SUMMARIES)
    assert out.getvalue().splitlines() == [summary_line(s) for s in SUMMARIES]


def test_view_off_a_terminal_prints_plain_lines_without_importing_rich() -> None:
    program = ("import sys\nfrom dlrun.push.view import PushView\nfrom dlrun.push.session import HostPushSummary\n"
               "s = HostPushSummary('h0', 0, 0, 2, 0, 0.0)\n"
               "with PushView(['h0']) as view:\n    view.progress('h0', 0, 0)\n    view.finish([s])\n"
               "print('rich' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "False\n"
    assert out.stderr == "h0: 0 files sent (0 B), 2 unchanged, 0 deleted in 0.0 s\n"


def test_view_renders_bars_per_host_on_a_terminal() -> None:
    out = io.StringIO()
    console = Console(file=out, width=120, color_system=None, force_terminal=True)
    clock = iter(float(t) for t in range(1000))
    view = PushView(["host0", "host1"], console=console, get_time=lambda: next(clock), auto_refresh=False)
    view.progress("host0", 512 * 1024, 1024 * 1024)
    view.files("host0", 2, 5)
    render = Console(file=io.StringIO(), width=120, color_system=None)
    with render.capture() as captured:
        render.print(view.renderable())
    text = captured.get()
    assert "host0" in text and "host1" in text
    assert "0.5/1.0 MiB" in text and "2/5 files" in text


# --------------------------------------------------------------------------- a push with nothing to do


@pytest.mark.parametrize("answer", [{}, {"error": "boom"}, {"targets": [{"root": "/x"}]}, {"targets": "no"}])
def test_settled_push_is_none_for_an_answer_that_is_not_a_clean_survey(answer: dict[str, object]) -> None:
    target = code_target(Host(address="h", name="h"), Path("/tmp/proj"), Manifest(entries=()))
    assert settled_push("h", [target], answer) is None


# ------------------------------------------- the helper never reaches through links or takes
# a job's file for its own (the real helper, run by the local transport for a localhost host)


# --------------------------------------------------------------------------- datasets as users keep them


def test_data_links_are_followed_and_ignore_files_are_not_data(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    for name in ("img1", "img2"):
        (outside / name).write_text(name)
    data = tmp_path / "ds"
    data.mkdir()
    (data / "x.txt").write_text("x")
    (data / "y.txt").symlink_to("x.txt")  # its host reads x's bytes, wherever x.txt goes
    (data / "images").symlink_to(outside)  # a linked folder's files are dealt out like the others
    (data / ".gitignore").write_text("*\n")  # keeps the data out of git: not data itself
    shards = plan_data(data, 2, "files")
    dealt = sorted(e.path for m in shards for e in m.entries if e.path != SHARD_FILE)
    assert dealt == ["images/img1", "images/img2", "x.txt", "y.txt"]
    assert all(not e.is_link for m in shards for e in m.entries)
    (data / "gone").symlink_to(tmp_path / "nowhere")
    with pytest.raises(SyncError, match="is a link to nothing"):
        plan_data(data, 2, "files")


def test_split_lines_keeps_a_csv_record_with_line_breaks_in_its_fields_whole(tmp_path: Path) -> None:
    import csv
    import random

    rng = random.Random(7)
    rows = [["id", "text"]] + [[str(i), rng.choice(["plain", 'say "hi"', "two\nlines", "a,b\nc\n\nd"])]
                               for i in range(200)]
    path = tmp_path / "table.csv"
    with open(path, "w", newline="") as fh:
        csv.writer(fh).writerows(rows)
    st = path.stat()
    entry = FileEntry("table.csv", st.st_size, 0o644, "", source=Source(file=str(path)))
    for parts in (2, 3, 7):
        got = []
        for part in split_file(entry, parts):
            assert part.source is not None
            with open(path, "rb") as fh:
                fh.seek(part.source.offset)
                body = part.source.prefix + fh.read(part.size - len(part.source.prefix))
            records = list(csv.reader(io.StringIO(body.decode(), newline="")))
            assert records[0] == ["id", "text"]  # the header in every part, then whole records only
            got += records[1:]
        assert got == rows[1:], parts


# --------------------------------------------------------------------------- what a code push leaves out (issue 19)


def test_environments_caches_and_logs_are_left_out_unless_brought_back(tmp_path: Path) -> None:
    root = tmp_path / "proj"
    for rel in ("train.py", "node_modules/a/index.js", "sub/.tox/py311/x", ".mypy_cache/x", ".ruff_cache/x",
                ".ipynb_checkpoints/n.ipynb", "lightning_logs/v0/x", "wandb/x", "deep/mlruns/x",
                "dlrun-logs/old/rank-0.log", "sub/dlrun-logs/kept.txt", "out/logs/rank-0.log",
                "anyname/pyvenv.cfg", "anyname/lib/site.py", "conda/conda-meta/history", "conda/bin/python",
                "notenv/conda-meta.txt"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x\n")
    manifest = scan_tree(root, leave_out_defaults=True, left_out_folders=["out/logs"])
    assert manifest.paths() == ("notenv/conda-meta.txt", "sub/dlrun-logs/kept.txt", "train.py")
    assert set(manifest.left_out) == {"node_modules/", "sub/.tox/", ".mypy_cache/", ".ruff_cache/",
                                      ".ipynb_checkpoints/", "lightning_logs/", "wandb/", "deep/mlruns/",
                                      "dlrun-logs/", "out/logs/", "anyname/", "conda/"}
    assert scan_tree(root).paths() != manifest.paths()  # a data scan keeps everything
    (root / ".dlrunignore").write_text("!anyname/\n!wandb/\n")
    again = scan_tree(root, leave_out_defaults=True)
    assert {"anyname/pyvenv.cfg", "anyname/lib/site.py", "wandb/x"} <= set(again.paths())


def test_the_size_guard_names_the_largest_folders_and_the_ways_out(tmp_path: Path) -> None:
    sizes = [("data/a.bin", 150 << 20), ("data/b.bin", 100 << 20), ("src/m.py", 10), ("ckpt/x.pt", 1 << 20),
             ("README.md", 5)]
    with pytest.raises(UsageError) as info:
        check_push_size(tmp_path, sizes, PushLimit())
    text = str(info.value)
    assert "251.0 MiB in 5 files, over the 200.0 MiB limit" in text
    lines = text.split("Largest:\n", 1)[1].splitlines()
    assert [line.split()[0] for line in lines[:4]] == ["data/", "ckpt/", "src/", "README.md"]
    assert all(way in text for way in (".dlrunignore", "--max-push-size", "--no-push", "--data"))
    check_push_size(tmp_path, sizes, parse_size("1G"))
    check_push_size(tmp_path, sizes, NO_LIMIT)
    with pytest.raises(UsageError, match="over the 20000 files limit"):
        check_push_size(tmp_path, [(f"f{i}", 1) for i in range(20_001)], PushLimit())
    assert parse_size("500M").max_bytes == 500 << 20 and parse_size("1.5GiB").max_bytes == 3 << 29
    assert parse_size("none") == NO_LIMIT and parse_size("300000").max_bytes == 300000
    with pytest.raises(UsageError):
        parse_size("lots")


def test_the_push_root_is_a_project_never_a_system_folder_or_the_home(tmp_path: Path) -> None:
    home = tmp_path / "home"
    system = (Path("/usr"), Path("/opt"), tmp_path / "prefix")
    (home / "proj").mkdir(parents=True)
    for rel in ("proj/train.py", "train.py"):
        (home / rel).write_text("x\n")
    assert push_root_for(home / "proj" / "train.py", home=home, system=system) == (home / "proj").resolve()
    assert push_root_for(Path("/usr/bin/python3"), home=home, system=system) is None
    assert push_root_for(tmp_path / "prefix" / "bin" / "tool", home=home, system=system) is None
    assert push_root_for(tmp_path / "lib" / "site-packages" / "pkg" / "cli.py", home=home, system=system) is None
    with pytest.raises(UsageError, match="directly in the home folder") as info:
        push_root_for(home / "train.py", home=home, system=system)
    assert "--code DIR" in str(info.value) and "--no-push" in str(info.value)
    with pytest.raises(UsageError, match="directly in /"):
        push_root_for(Path("/train.py"), home=home, system=system)
    assert Path(sys.prefix) in system_folders() and Path("/usr") in system_folders()


