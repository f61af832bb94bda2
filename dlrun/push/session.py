"""Pushing code and data subsets to hosts: only what changed, one shard per host, atomic and verified.

What this module owns, in three layers:

* **Pure planning** over frozen dataclasses, no I/O: ignore rules (``.gitignore`` and
  ``.dlrunignore`` patterns, plus ``.git/`` and ``__pycache__/`` always), manifest diffing
  (``diff_manifests``), shard policies (``shard_files``: ``files``, ``contiguous``, ``size``,
  ``replicate``), ``--split-lines`` cut points (``split_points``), ``shard.json``
  (``shard_document``), the free-space check (``check_space``), remote paths and the worker env
  (``remote_code_dir``, ``remote_data_dir``, ``shard_env``).
* **The local manifest walk** (``scan_tree``): relative path, size, permission bits and sha256
  of every file; symlinks stay links; executable bits are kept. Hashes are cached by stat
  (``HashCache``, ``$XDG_CACHE_HOME/dlrun/push/``) so an unchanged tree is not read again.
* **The mechanism** (``push``): per host, one channel runs ``HELPER_SOURCE`` — a small
  standard-library-only program started as ``python -c`` (like ``dlrun.remote.agent``). Protocol, all on
  that one channel:

  1. dlrun sends one JSON line: per target (code, data) its remote root and the local paths.
     The helper answers one JSON line: the remote state of those paths and of the paths an
     earlier push wrote (size, mode, sha256 — cached by stat on the host in
     ``<parent>/.dlrun-cache/<root name>.json``), free space, and a permission problem if any.
  2. dlrun diffs, checks free space and permissions (a problem: ``{"abort": true}``, nothing is
     written; the same when there is nothing to send, delete or record), then sends the plan
     (deletions; expected sha256 and mode per file) and one tar stream with only new or
     changed files, one SSH packet per write, while a thread reads the replies.
  3. The helper deletes files that an earlier push wrote and that are gone locally (never files
     a job created), writes each file under a temporary name (``.dlrun-part-*``) in its final
     directory, verifies its sha256, renames it into place and reports per file. EOF in the
     middle (dlrun killed, Ctrl-C, dropped connection) removes the partial temporary file;
     the next push sends only what is missing or different.

  A file counts as pushed (and so may be deleted) only while it is the file the push wrote:
  the same inode, as recorded. A job's own file of the same name, written after, is not.
  Nothing is read, written or deleted through a symlink below the root: a path under a
  linked directory is absent to the survey, a deletion there is skipped, and a link where
  the pushed tree has a directory is replaced by the directory (as ``rsync -a`` does). A
  write that fails keeps the record of the file it would have replaced.

  ``dlrun launch`` asks step 1 of each host's agent instead, with the preflight probe (the
  agent runs this helper's ``survey`` in-process). When the answer says there is nothing to
  send, delete or record (``settled_push``), that host gets no helper session at all.
"""

from __future__ import annotations

import codecs
import contextlib
import hashlib
import io
import json
import os
import posixpath
import queue
import re
import shlex
import stat
import tarfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

from dlrun.errors import DlrunError, HostUnreachable, RemoteCommandError, SyncError, UsageError
from dlrun.inventory import Host
from dlrun.transport.base import Channel, Transport, default_python

SHARD_POLICIES = ("files", "contiguous", "size", "replicate")
SHARD_FILE = "shard.json"
DATA_DIR_NAME = "data"
CODE_IGNORE_FILES = (".gitignore", ".dlrunignore")
# Data directories often carry a ``.gitignore`` of ``*`` (to keep the data out of git): only
# ``.dlrunignore`` applies to them.
DATA_IGNORE_FILES = (".dlrunignore",)
ALWAYS_IGNORED = (".git/", "__pycache__/")
HEADER_SUFFIXES = (".csv", ".tsv")  # --split-lines repeats their first line in every part
# One SSH packet: OpenSSH's 32 KiB maximum less the 64 bytes paramiko keeps for the header. A
# 64 KiB write went out as 32704 + 32704 + 128 bytes, three packets where two would do.
SEND_CHUNK = 32 * 1024 - 64
READ_CHUNKS = 8  # SEND_CHUNKs per read of a local file
HASH_BLOCK = 1 << 20
RACY_NS = 100_000_000  # a file modified this close to its hashing is hashed again next time

ProgressHook = Callable[[str, int, int], None]


# =============================================================================== ignore rules


@dataclass(frozen=True)
class IgnoreRule:
    """One gitignore-style pattern, relative to the directory of the file it came from."""

    pattern: str
    regex: str
    base: str = ""  # directory of the ignore file, relative to the walked root ("" = the root)
    negate: bool = False
    dir_only: bool = False
    _compiled: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_compiled", re.compile(self.regex, re.DOTALL))

    def matches(self, path: str, is_dir: bool) -> bool:
        if self.dir_only and not is_dir:
            return False
        if self.base:
            if not path.startswith(self.base + "/"):
                return False
            path = path[len(self.base) + 1 :]
        return self._compiled.fullmatch(path) is not None


@dataclass(frozen=True)
class IgnoreRules:
    """Patterns in precedence order: a later match wins, as in git."""

    rules: tuple[IgnoreRule, ...] = ()

    def __add__(self, other: Iterable[IgnoreRule]) -> IgnoreRules:
        return IgnoreRules(self.rules + tuple(other))

    def matches(self, path: str, is_dir: bool) -> bool:
        """Whether ``path`` itself is excluded (its parents are not looked at)."""
        for rule in reversed(self.rules):
            if rule.matches(path, is_dir):
                return not rule.negate
        return False

    def ignored(self, path: str, is_dir: bool = False) -> bool:
        """Whether ``path`` is excluded, itself or through an excluded parent directory."""
        parts = path.split("/")
        for depth in range(1, len(parts)):
            if self.matches("/".join(parts[:depth]), True):
                return True
        return self.matches(path, is_dir)


def parse_ignore(text: str, base: str = "") -> tuple[IgnoreRule, ...]:
    """Rules of one ``.gitignore``/``.dlrunignore`` file found in directory ``base``.

    Supported: comments, blank lines, ``!`` negation, a trailing ``/`` (directories only), a
    leading or inner ``/`` (anchored to ``base``), ``*``, ``?``, ``[...]``, ``**`` and ``\\``
    escapes. A pattern without an inner slash matches a name at any depth.
    """
    rules = []
    for raw in text.splitlines():
        line = raw.rstrip("\r")
        if not line or line.startswith("#"):
            continue
        while line.endswith(" ") and not line.endswith("\\ "):
            line = line[:-1]
        negate = line.startswith("!")
        if negate or line.startswith(("\\!", "\\#")):  # a backslash escapes a literal ! or #
            line = line[1:]
        dir_only = line.endswith("/")
        line = line.rstrip("/")
        if not line:
            continue
        anchored = "/" in line
        regex = glob_regex(line.lstrip("/"))
        if not anchored:
            regex = "(?:.*/)?" + regex
        rules.append(IgnoreRule(pattern=raw, regex=regex, base=base, negate=negate, dir_only=dir_only))
    return tuple(rules)


def glob_regex(pattern: str) -> str:
    """Translate one gitignore glob (no leading ``!``, no trailing ``/``) into a regex."""
    out: list[str] = []
    i, n = 0, len(pattern)
    while i < n:
        at_segment_start = i == 0 or pattern[i - 1] == "/"
        if at_segment_start and pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
            continue
        if at_segment_start and pattern.startswith("**", i) and i + 2 == n:
            out.append(".*")
            i += 2
            continue
        char = pattern[i]
        if char == "*":
            out.append("[^/]*")
        elif char == "?":
            out.append("[^/]")
        elif char == "\\" and i + 1 < n:
            out.append(re.escape(pattern[i + 1]))
            i += 2
            continue
        elif char == "[":
            end = pattern.find("]", i + 2)
            if end < 0:
                out.append(re.escape(char))
            else:
                body = pattern[i + 1 : end]
                negate = body[:1] in ("!", "^")
                if negate:
                    body = body[1:]
                body = "".join("\\" + c if c in "\\[]^" else c for c in body)
                out.append(f"[^/{body}]" if negate else f"[{body}]")
                i = end + 1
                continue
        else:
            out.append(re.escape(char))
        i += 1
    return "".join(out)


def default_rules() -> tuple[IgnoreRule, ...]:
    """``.git/`` and ``__pycache__/`` at any depth; placed last, so no ``!`` re-includes them."""
    return parse_ignore("\n".join(ALWAYS_IGNORED))


# =============================================================================== manifests


@dataclass(frozen=True)
class Source:
    """Where an entry's bytes come from: a range of a local file after ``prefix``, or ``content``."""

    file: str | None = None
    offset: int = 0
    prefix: bytes = b""
    content: bytes | None = None
    mtime: int = 0


@dataclass(frozen=True)
class FileEntry:
    """A file or symlink to push: relative POSIX path, size, permission bits, sha256 or link target."""

    path: str
    size: int
    mode: int
    sha256: str
    link: str | None = None
    source: Source | None = field(default=None, compare=False, repr=False)

    @property
    def is_link(self) -> bool:
        return self.link is not None


@dataclass(frozen=True)
class Manifest:
    """Entries sorted by path."""

    entries: tuple[FileEntry, ...] = ()

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.entries)

    def paths(self) -> tuple[str, ...]:
        return tuple(e.path for e in self.entries)


@dataclass(frozen=True)
class RemoteEntry:
    """What a host has at a path. ``sha256`` is "" when unknown; ``pushed``: an earlier push wrote it."""

    path: str
    kind: str  # "file", "link" or "other" (a directory, a fifo…)
    size: int = 0
    mode: int = 0
    sha256: str = ""
    link: str | None = None
    pushed: bool = False


@dataclass(frozen=True)
class RemoteTree:
    """A target directory as the helper saw it, resolved on the host (``~`` and relative: from $HOME)."""

    root: str
    entries: Mapping[str, RemoteEntry]
    free_bytes: int
    block_size: int = 4096
    device: int = 0
    error: str | None = None
    error_path: str | None = None


@dataclass(frozen=True)
class TransferPlan:
    """What one target needs: files to send, files to delete, and the paths already in place."""

    send: tuple[FileEntry, ...]
    delete: tuple[str, ...]
    unchanged: tuple[str, ...]

    @property
    def bytes_to_send(self) -> int:
        return sum(e.size for e in self.send)


def same_content(local: FileEntry, remote: RemoteEntry) -> bool:
    if local.link is not None:
        return remote.kind == "link" and remote.link == local.link
    return (
        remote.kind == "file"
        and remote.size == local.size
        and remote.mode == local.mode
        and remote.sha256 == local.sha256
    )


def diff_manifests(local: Manifest, remote: Mapping[str, RemoteEntry], *, delete: bool) -> TransferPlan:
    """New or changed entries go; with ``delete``, files an earlier push wrote and that are gone
    locally are removed. Files the host has that no push wrote (a job's outputs) are left alone."""
    send: list[FileEntry] = []
    unchanged: list[str] = []
    for entry in local.entries:
        there = remote.get(entry.path)
        if there is not None and same_content(entry, there):
            unchanged.append(entry.path)
        else:
            send.append(entry)
    wanted = set(local.paths())
    gone = sorted(p for p, r in remote.items() if r.pushed and p not in wanted) if delete else []
    return TransferPlan(send=tuple(send), delete=tuple(gone), unchanged=tuple(unchanged))


def bytes_needed(sizes: Iterable[int], block_size: int) -> int:
    """Disk space the files take once written: each rounded up to whole blocks."""
    block = max(block_size, 1)
    return sum(-(-size // block) * block for size in sizes)


def check_space(host: str, trees: Sequence[RemoteTree], plans: Sequence[TransferPlan]) -> None:
    """Raise ``SyncError`` (naming host and bytes needed) if a filesystem cannot hold the new files."""
    need: dict[int, int] = {}
    tree_of: dict[int, RemoteTree] = {}
    for tree, plan in zip(trees, plans, strict=True):
        need[tree.device] = need.get(tree.device, 0) + bytes_needed(
            (e.size for e in plan.send if not e.is_link), tree.block_size
        )
        tree_of.setdefault(tree.device, tree)
    for device, needed in need.items():
        tree = tree_of[device]
        if needed > tree.free_bytes:
            raise SyncError(
                f"not enough space for {tree.root}: {needed} bytes needed ({human_bytes(needed)}), "
                f"{tree.free_bytes} free ({human_bytes(tree.free_bytes)}); nothing was written",
                host=host,
                hint="free space on the host, push less (.dlrunignore) or use another workdir",
            )


def human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"  # pragma: no cover


# =============================================================================== shards


def shard_files(files: Sequence[tuple[str, int]], count: int, policy: str) -> tuple[tuple[str, ...], ...]:
    """Assign ``(path, size)`` files to ``count`` hosts; each host's paths come back sorted.

    ``files``: sorted files dealt round-robin. ``contiguous``: sorted files cut into ``count``
    ranges whose lengths differ by at most one. ``size``: largest first, each to the host with
    the fewest bytes so far (greedy balancing). ``replicate``: every host gets every file.
    Except for ``replicate`` the shards are pairwise disjoint and their union is ``files``.
    """
    if count < 1:
        raise UsageError("a push needs at least one host")
    if policy not in SHARD_POLICIES:
        raise UsageError(f"unknown shard policy {policy!r} (expected one of {', '.join(SHARD_POLICIES)})")
    ordered = sorted(files)
    paths = [p for p, _ in ordered]
    if policy == "replicate":
        return tuple(tuple(paths) for _ in range(count))
    if policy == "files":
        return tuple(tuple(paths[i::count]) for i in range(count))
    if policy == "contiguous":
        base, extra = divmod(len(paths), count)
        shards, start = [], 0
        for i in range(count):
            end = start + base + (1 if i < extra else 0)
            shards.append(tuple(paths[start:end]))
            start = end
        return tuple(shards)
    loads = [0] * count
    groups: list[list[str]] = [[] for _ in range(count)]
    for path, size in sorted(ordered, key=lambda item: (-item[1], item[0])):
        target = min(range(count), key=lambda i: (loads[i], i))
        loads[target] += size
        groups[target].append(path)
    return tuple(tuple(sorted(g)) for g in groups)


def split_points(read: Callable[[int, int], bytes], size: int, start: int, parts: int, *,
                 quoted: bool = False) -> tuple[int, ...]:
    """Byte offsets that cut ``[start, size)`` into ``parts`` ranges of whole lines, near-equal in bytes.

    ``read(offset, n)`` returns up to ``n`` bytes at ``offset``. Returns ``parts + 1`` offsets,
    from ``start`` to ``size``; a cut lands just after a ``\\n``, so no line is split (parts may
    be empty when there are fewer lines than parts). With ``quoted`` (CSV), a ``\\n`` inside a
    ``"…"`` field is no line end: a record with a line break in a field stays whole.
    """
    cuts = [start]
    body = size - start
    scanned, inside = start, False  # quoted: how far the quotes are counted, and the state there
    for k in range(1, parts):
        target = max(start + body * k // parts, cuts[-1])
        if quoted:
            cut, scanned, inside = _next_record_start(read, target, size, scanned, inside)
            cuts.append(cut)
        else:
            cuts.append(_next_line_start(read, target, size))
    cuts.append(size)
    return tuple(cuts)


def _next_record_start(read: Callable[[int, int], bytes], target: int, size: int, position: int,
                       inside: bool) -> tuple[int, int, bool]:
    """The smallest offset >= target that starts a line outside a quoted field (or ``size``),
    counting quotes from ``position``, where a field is open if ``inside``; returns that offset
    and the scan's position and state there. A doubled ``""`` toggles twice: no change."""
    while position < size:
        block = read(position, 65536)
        if not block:
            break
        lead = min(len(block), max(0, target - 1 - position))  # bytes before the search starts
        inside ^= bool(block.count(b'"', 0, lead) & 1)
        i = lead
        while i < len(block):
            quote, newline = block.find(b'"', i), block.find(b"\n", i)
            if newline >= 0 and (quote < 0 or newline < quote):
                if not inside:
                    end = position + newline + 1
                    return end, end, False
                i = newline + 1
            elif quote >= 0:
                inside, i = not inside, quote + 1
            else:
                break
        position += len(block)
    return size, size, inside


def _next_line_start(read: Callable[[int, int], bytes], target: int, size: int) -> int:
    """The smallest offset >= target that starts a line (or ``size``)."""
    if target <= 0:
        return 0
    position = target - 1
    while position < size:
        block = read(position, 65536)
        if not block:
            break
        found = block.find(b"\n")
        if found >= 0:
            return position + found + 1
        position += len(block)
    return size


def looks_like_text(sample: bytes) -> bool:
    """No NUL byte, and valid UTF-8 (a multi-byte character cut at the end is fine)."""
    if b"\0" in sample:
        return False
    try:
        codecs.getincrementaldecoder("utf-8")().decode(sample, final=False)
    except UnicodeDecodeError:
        return False
    return True


def part_name(path: str, index: int, count: int) -> str:
    """``train.csv`` → ``train.part-0-of-3.csv`` (0-based, like DLRUN_SHARD_INDEX)."""
    folder, name = posixpath.split(path)
    stem, dot, suffix = name.rpartition(".")
    if not dot or not stem:
        stem, suffix = name, ""
    else:
        suffix = "." + suffix
    return posixpath.join(folder, f"{stem}.part-{index}-of-{count}{suffix}")


def shard_document(
    policy: str,
    index: int,
    count: int,
    entries: Sequence[FileEntry],
    split_from: str | None = None,
    header: bool = False,
) -> bytes:
    """``shard.json``: policy, this host's index, host count and its files with sizes and hashes.

    Deterministic (sorted keys, no timestamp), so an unchanged shard is not sent again.
    """
    doc: dict[str, Any] = {
        "policy": policy,
        "index": index,
        "count": count,
        "files": [{"path": e.path, "size": e.size, "sha256": e.sha256} for e in entries if not e.is_link]
        + [{"path": e.path, "link": e.link} for e in entries if e.is_link],
    }
    if split_from is not None:
        doc["split_lines"] = {"source": split_from, "header_repeated": header}
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


def generated_entry(path: str, content: bytes, mode: int = 0o644) -> FileEntry:
    return FileEntry(
        path=path,
        size=len(content),
        mode=mode,
        sha256=hashlib.sha256(content).hexdigest(),
        source=Source(content=content),
    )


# =============================================================================== remote paths, env


def check_project(project: str) -> str:
    if not project or project in (".", "..") or "/" in project or "\0" in project:
        raise UsageError(f"project name {project!r} must be one directory name (no '/')")
    return project


def remote_code_dir(host: Host, project: str) -> str:
    """``<workdir>/<project>`` as written (``~`` and relative paths resolve from $HOME on the host)."""
    return posixpath.join(host.workdir or "", check_project(project))


def remote_data_dir(host: Host) -> str:
    """``<workdir>/data/<host>`` as written (``~`` and relative paths resolve from $HOME on the
    host). A directory per host: hosts that share a workdir (an NFS home) keep their shards
    apart instead of overwriting each other's."""
    return posixpath.join(host.workdir or "", DATA_DIR_NAME, host_dir_name(host.name))


def host_dir_name(name: str) -> str:
    """A host name as one safe path component: kept where it is one, else made one and told
    apart by a hash of the name (``gpu 1`` → ``gpu_1-<8 hex>``)."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".")
    if safe == name:
        return name
    return f"{safe or 'host'}-{hashlib.sha1(name.encode('utf-8', 'surrogateescape')).hexdigest()[:8]}"


def shard_env(index: int, count: int, host: Host, data_dir: str | None = None) -> dict[str, str]:
    """What a worker needs to find its shard.

    ``data_dir``: the absolute directory the push resolved on the host
    (``HostPushSummary.data_dir``); by default ``remote_data_dir(host)`` as written, which is
    only usable as is when the workdir is absolute.
    """
    return {
        "DLRUN_DATA_DIR": data_dir or remote_data_dir(host),
        "DLRUN_SHARD_INDEX": str(index),
        "DLRUN_SHARD_COUNT": str(count),
    }


# =============================================================================== local walk


class HashCache:
    """sha256 of local files keyed by (size, mtime, ctime, inode), kept in one JSON file per root.

    A missing or unreadable cache file is an empty cache; a write that fails is ignored.
    """

    def __init__(self, path: Path | None, *, now_ns: int | None = None) -> None:
        self.path = path
        self._old: dict[str, list[Any]] = {}
        self._new: dict[str, list[Any]] = {}
        self._started_ns = time.time_ns() if now_ns is None else now_ns
        self._lock = threading.Lock()
        if path is not None:
            try:
                loaded = json.loads(path.read_text(encoding="utf-8"))
                if isinstance(loaded, dict):
                    self._old = loaded
            except (OSError, ValueError):
                pass

    @staticmethod
    def _stamp(st: os.stat_result) -> list[int]:
        return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]

    def digest(self, key: str, st: os.stat_result, compute: Callable[[], str]) -> str:
        stamp = self._stamp(st)
        old = self._old.get(key)
        if isinstance(old, list) and old[:4] == stamp and isinstance(old[4], str):
            value: str = old[4]
        else:
            value = compute()
        if max(st.st_mtime_ns, st.st_ctime_ns) < self._started_ns - RACY_NS:
            with self._lock:
                self._new[key] = [*stamp, value]
        return value

    def save(self) -> None:
        if self.path is None or self._new == self._old:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            temp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            temp.write_text(json.dumps(self._new), encoding="utf-8")
            os.replace(temp, self.path)
        except OSError:
            pass


def default_cache_path(root: Path) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    name = hashlib.sha256(str(root).encode("utf-8", "surrogateescape")).hexdigest()[:24]
    return Path(base) / "dlrun" / "push" / f"{name}.json"


def sha256_file(path: str, offset: int = 0, length: int | None = None, prefix: bytes = b"") -> str:
    digest = hashlib.sha256(prefix)
    with open(path, "rb") as fh:
        fh.seek(offset)
        left = length
        while left is None or left > 0:
            block = fh.read(HASH_BLOCK if left is None else min(HASH_BLOCK, left))
            if not block:
                break
            digest.update(block)
            if left is not None:
                left -= len(block)
    return digest.hexdigest()


def scan_tree(
    root: Path,
    *,
    ignore_files: Sequence[str] = CODE_IGNORE_FILES,
    extra_rules: Sequence[IgnoreRule] = (),
    cache: HashCache | None = None,
    follow_links: bool = False,
) -> Manifest:
    """Walk ``root``: every file not ignored, with size, permission bits and sha256; links as links.

    Ignore files are read in every directory (deeper ones win); ``.git/`` and ``__pycache__/``
    are always skipped, and so are sockets, fifos and devices. Symlinks are not followed, unless
    ``follow_links`` (a dataset: what the ranks read is the target's bytes, and a linked folder
    of files must be dealt out like the others); then a dangling link or a loop is an error.
    """
    root = Path(root)
    entries: list[FileEntry] = []
    walked = {os.path.realpath(root)}  # with follow_links: the folders under way, against loops
    always = default_rules()
    stack: list[tuple[str, IgnoreRules]] = [("", IgnoreRules())]
    while stack:
        rel_dir, inherited = stack.pop()
        folder = os.path.join(root, rel_dir) if rel_dir else str(root)
        rules = inherited
        for name in ignore_files:
            text = _read_text(os.path.join(folder, name))
            if text is not None:
                rules = rules + parse_ignore(text, rel_dir)
        effective = rules + always + extra_rules
        try:
            with os.scandir(folder) as it:
                children = sorted(it, key=lambda e: e.name)
        except OSError as exc:
            raise SyncError(f"cannot read directory {folder}: {exc.strerror or exc}") from exc
        for child in children:
            rel = f"{rel_dir}/{child.name}" if rel_dir else child.name
            try:
                if child.is_symlink() and follow_links:
                    if not os.path.exists(child.path):
                        raise SyncError(f"{child.path} is a link to nothing ({os.readlink(child.path)})",
                                        hint="fix or remove the link, or list it in .dlrunignore")
                    if child.is_dir() and not effective.matches(rel, True):
                        real = os.path.realpath(child.path)
                        if any(real == w or w.startswith(real + os.sep) for w in walked):
                            raise SyncError(f"{child.path} links back to a folder above it (a loop)")
                        walked.add(real)
                        stack.append((rel, rules))
                    elif child.is_file() and not effective.matches(rel, False):
                        st = child.stat()
                        path = child.path
                        digest = cache.digest(rel, st, partial(sha256_file, path)) if cache else sha256_file(path)
                        entries.append(FileEntry(rel, st.st_size, stat.S_IMODE(st.st_mode), digest,
                                                 source=Source(file=path, mtime=int(st.st_mtime))))
                elif child.is_symlink():
                    if not effective.matches(rel, False):
                        target = os.readlink(child.path)
                        st = child.stat(follow_symlinks=False)
                        entries.append(FileEntry(rel, 0, 0o777, "", link=target,
                                                 source=Source(mtime=int(st.st_mtime))))
                elif child.is_dir(follow_symlinks=False):
                    if not effective.matches(rel, True):
                        stack.append((rel, rules))
                elif child.is_file(follow_symlinks=False) and not effective.matches(rel, False):
                    st = child.stat(follow_symlinks=False)
                    path = child.path
                    digest = cache.digest(rel, st, partial(sha256_file, path)) if cache else sha256_file(path)
                    entries.append(FileEntry(rel, st.st_size, stat.S_IMODE(st.st_mode), digest,
                                             source=Source(file=path, mtime=int(st.st_mtime))))
            except OSError as exc:
                raise SyncError(f"cannot read {child.path}: {exc.strerror or exc}") from exc
    return Manifest(tuple(sorted(entries, key=lambda e: e.path)))


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return None


# =============================================================================== data planning


def plan_data(
    data: Path,
    count: int,
    policy: str,
    *,
    split_lines: bool = False,
    cache: HashCache | None = None,
) -> tuple[Manifest, ...]:
    """One manifest per host: its shard of ``data`` (a directory or one file) plus ``shard.json``."""
    if policy not in SHARD_POLICIES:
        raise UsageError(f"unknown shard policy {policy!r} (expected one of {', '.join(SHARD_POLICIES)})")
    data = Path(data)
    if data.is_dir():
        scanned = scan_tree(data, ignore_files=DATA_IGNORE_FILES, cache=cache, follow_links=True).entries
        # .gitignore and .dlrunignore are rules for git and dlrun, not data
        entries = tuple(e for e in scanned if posixpath.basename(e.path) not in CODE_IGNORE_FILES)
        if not entries:  # an unmounted disk or a wrong path: pushing nothing would delete every shard
            raise SyncError(f"{data} holds no files to shard",
                            hint="check the path (a mount point that is not mounted looks like this)")
    elif data.is_file():
        st = data.stat()
        path = str(data)
        digest = cache.digest(data.name, st, lambda: sha256_file(path)) if cache else sha256_file(path)
        entries = (FileEntry(data.name, st.st_size, stat.S_IMODE(st.st_mode), digest,
                             source=Source(file=path, mtime=int(st.st_mtime))),)
    else:
        raise UsageError(f"data path not found: {data}")
    if any(e.path == SHARD_FILE for e in entries):
        raise SyncError(f"{data} has its own {SHARD_FILE}; dlrun writes that file on every host",
                        hint=f"rename it, or list it in {data / '.dlrunignore'}")
    single = len(entries) == 1 and not entries[0].is_link
    if split_lines:
        if policy == "replicate":
            raise UsageError("--split-lines gives every host a different part; it cannot go with --shard replicate")
        if not single:
            raise SyncError(f"--split-lines splits a dataset that is one text file; {data} has {len(entries)} files",
                            hint=f"drop --split-lines and shard the files with --shard {policy}")
        parts = split_file(entries[0], count, cache=cache)
        header = entries[0].path.lower().endswith(HEADER_SUFFIXES)
        return tuple(
            Manifest(tuple(sorted((part, generated_entry(SHARD_FILE, shard_document(
                policy, i, count, (part,), split_from=entries[0].path, header=header))), key=lambda e: e.path)))
            for i, part in enumerate(parts)
        )
    if single and count > 1 and policy != "replicate":
        only = entries[0]
        raise SyncError(
            f"{data} is one file ({only.path}, {human_bytes(only.size)}): it cannot be divided among {count} "
            f"hosts by files",
            hint="for a text/CSV file pass --split-lines (one part per host, split at line ends); "
            "--shard replicate copies it to every host; otherwise split it into several files yourself",
        )
    by_path = {e.path: e for e in entries}
    groups = shard_files([(e.path, e.size) for e in entries], count, policy)
    manifests = []
    for i, group in enumerate(groups):
        chosen = tuple(by_path[p] for p in group)
        doc = generated_entry(SHARD_FILE, shard_document(policy, i, count, chosen))
        manifests.append(Manifest(tuple(sorted((*chosen, doc), key=lambda e: e.path))))
    return tuple(manifests)


def split_file(entry: FileEntry, parts: int, *, cache: HashCache | None = None) -> tuple[FileEntry, ...]:
    """Cut one local text file into ``parts`` entries by lines; ``.csv``/``.tsv`` repeat the header line."""
    assert entry.source is not None and entry.source.file is not None
    path = entry.source.file
    with open(path, "rb") as fh:
        sample = fh.read(65536)

        def read(offset: int, n: int) -> bytes:
            fh.seek(offset)
            return fh.read(n)

        if not looks_like_text(sample):
            raise SyncError(
                f"{path} is not a text file (binary or not UTF-8): --split-lines cuts text/CSV files at line ends",
                hint="split it into several files with the tool that wrote it, or use --shard replicate",
            )
        header = b""
        if entry.path.lower().endswith(HEADER_SUFFIXES):
            header = read(0, _next_line_start(read, 1, entry.size))
        cuts = split_points(read, entry.size, len(header), parts, quoted=entry.path.lower().endswith(".csv"))
    st = os.stat(path)
    out = []
    for i in range(parts):
        start, end = cuts[i], cuts[i + 1]

        def compute(start: int = start, end: int = end) -> str:
            return sha256_file(path, start, end - start, header)

        key = f"{entry.path}#{start}:{end}:{len(header)}"
        digest = cache.digest(key, st, compute) if cache else compute()
        out.append(FileEntry(part_name(entry.path, i, parts), len(header) + end - start, entry.mode, digest,
                             source=Source(file=path, offset=start, prefix=header, mtime=int(st.st_mtime))))
    return tuple(out)


# =============================================================================== the helper

# Runs on each host as ``python -c HELPER_SOURCE``: standard library only, Python >= 3.6.
HELPER_SOURCE = r'''
import hashlib, json, os, signal, stat, sys

IN = sys.stdin.buffer
PART = ".dlrun-part-"
TEMPS = []
IDLE = [0]  # seconds without a byte from dlrun after which the helper gives up (0: never)


def heard():
    # re-arm the idle alarm: a helper whose dlrun vanished (host cut off, no EOF ever comes)
    # ends, and its partial file goes with it
    if IDLE[0]:
        signal.alarm(IDLE[0])


def say(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def resolve(root):
    return os.path.normpath(os.path.join(os.path.expanduser("~"), os.path.expanduser(root)))


def record_file(root):
    parent, name = os.path.split(root)
    return os.path.join(parent, ".dlrun-cache", name + ".json")


def temp_for(final):
    # per helper process: two hosts that share a workdir (one machine under two names, an NFS
    # home) may write the same file at once, and each must rename its own temporary file
    folder, name = os.path.split(final)
    tag = hashlib.sha1(name.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return os.path.join(folder, "%s%s-%d" % (PART, tag, os.getpid()))


def stamp(st):
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def sha256_of(path):
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def nearest_existing(path):
    while not os.path.lexists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def under_link(root, rel, seen):
    # True when a directory between root and rel is a symlink (or not a directory): nothing
    # there is read, written or deleted through it. ``seen`` caches the answer per directory.
    folder = os.path.dirname(rel)
    if not folder:
        return False
    if folder not in seen:
        linked = under_link(root, folder, seen)
        if not linked:
            try:
                linked = not stat.S_ISDIR(os.lstat(os.path.join(root, folder)).st_mode)
            except OSError:
                linked = False  # missing: nothing below it exists either
        seen[folder] = linked
    return seen[folder]


def survey(spec):
    root = resolve(spec["root"])
    try:
        with open(record_file(root)) as fh:
            record = json.load(fh)
    except (OSError, ValueError):
        record = {}
    wanted = set(spec["paths"])
    entries, fresh, seen = {}, {}, {}
    for rel in wanted.union(record):
        path = os.path.join(root, rel)
        if under_link(root, rel, seen):
            continue
        old = record.get(rel)
        try:
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                # ours: the record says a push made a link here
                entries[rel] = ["link", 0, 0, os.readlink(path), old == ["link"]]
                fresh[rel] = ["link"]
            elif stat.S_ISREG(st.st_mode):
                if old and old[:4] == stamp(st):
                    digest = old[4]
                elif rel in wanted:
                    digest = sha256_of(path)
                else:
                    digest = ""
                # ours: the very file a push wrote (same inode), even if changed in place since
                ours = bool(old) and len(old) == 5 and old[3] == st.st_ino
                entries[rel] = ["file", st.st_size, stat.S_IMODE(st.st_mode), digest, ours]
                fresh[rel] = stamp(st) + [digest]
            else:
                entries[rel] = ["other", 0, 0, "", False]
        except OSError:
            continue
    base = nearest_existing(root)
    error = None
    if not os.path.isdir(base):
        error = "not a directory"
    elif not os.access(base, os.W_OK | os.X_OK):
        error = "permission denied" if base == root else "permission denied (cannot create %s)" % root
    try:
        vfs = os.statvfs(base)
        free, block, device = vfs.f_bavail * vfs.f_frsize, vfs.f_frsize, os.stat(base).st_dev
    except OSError:
        free, block, device = 0, 4096, 0
    # settled: a push that sends and deletes nothing would leave the record as it is, so
    # nothing needs writing at all (dlrun.remote.agent answers this survey in-process)
    # (and no record of a path that is gone or is no longer the file the push wrote)
    # (and a root that exists: an empty tree's push still makes its directory)
    settled = (os.path.isdir(root)
               and all(record.get(rel) == value for rel, value in fresh.items() if rel in wanted)
               and all(rel in entries and entries[rel][4] for rel in record))
    reply = {"root": root, "entries": entries, "free": free, "block": block, "device": device,
             "error": error, "path": base if error else None, "settled": settled}
    return reply, record, fresh


def read_exact(n):
    data = IN.read(n)
    heard()
    if len(data) != n:
        raise EOFError
    return data


def number(field):
    if field[:1] and ord(field[:1]) & 0x80:
        return int.from_bytes(field[1:], "big")
    return int(field.strip(b"\0 ") or b"0", 8)


def pax(data):
    out, pos = {}, 0
    while pos < len(data):
        space = data.index(b" ", pos)
        length = int(data[pos:space])
        key, _, value = data[space + 1:pos + length - 1].partition(b"=")
        out[key.decode()] = value
        pos += length
    return out


class Receiver:
    def __init__(self, roots, plan, records):
        self.roots, self.records = roots, records
        self.expect = {}
        for t, rel, digest, mode, mtime in plan["files"]:
            self.expect["%d/%s" % (t, rel)] = (t, rel, digest, mode, mtime)
        self.made = set()
        self.pycs = {}  # __pycache__ folder -> its entries
        self.buf = bytearray(1 << 20)
        self.view = memoryview(self.buf)
        self.written = self.deleted = self.failed = 0

    def fail(self, name, path, exc):
        self.failed += 1
        what = exc if isinstance(exc, str) else (exc.strerror or str(exc))
        where = getattr(exc, "filename", None) or path
        if isinstance(where, str) and os.path.basename(where).startswith(PART):
            where = path
        say({"err": name, "path": where, "msg": what})

    def makedirs(self, t, rel):
        # the directories of rel below the root; a symlink where one belongs is replaced by the
        # directory, never followed (as rsync -a does)
        root, folder = self.roots[t], os.path.dirname(rel)
        full = os.path.join(root, folder)
        if full in self.made:
            return
        path = root
        for part in folder.split("/") if folder else ():
            path = os.path.join(path, part)
            try:
                if stat.S_ISLNK(os.lstat(path).st_mode):
                    os.unlink(path)
            except FileNotFoundError:
                break
        os.makedirs(full, exist_ok=True)
        self.made.add(full)

    def drop_bytecode(self, final):
        # Python trusts a cached .pyc whose source has the same size and mtime second: a module
        # rewritten within a second of its last import would otherwise run as the old code
        folder, name = os.path.split(final)
        if not name.endswith(".py"):
            return
        cache = os.path.join(folder, "__pycache__")
        if cache not in self.pycs:
            try:
                self.pycs[cache] = os.listdir(cache)
            except OSError:
                self.pycs[cache] = []
        prefix = name[:-3] + "."
        for entry in self.pycs[cache]:
            if entry.startswith(prefix) and entry.endswith(".pyc"):
                try:
                    os.unlink(os.path.join(cache, entry))
                except OSError:
                    pass

    def delete(self, t, rel):
        root = self.roots[t]
        path = os.path.join(root, rel)
        if under_link(root, rel, {}):  # not ours to delete through a link
            self.records[t].pop(rel, None)
            return
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            self.fail("%d/%s" % (t, rel), path, exc)
            return
        self.records[t].pop(rel, None)
        self.deleted += 1
        folder = os.path.dirname(path)
        while folder != root and folder.startswith(root + os.sep):
            try:
                os.rmdir(folder)
            except OSError:
                break
            folder = os.path.dirname(folder)
        say({"deleted": "%d/%s" % (t, rel)})

    def run(self):
        extra = {}
        while True:
            header = read_exact(512)
            if not header.strip(b"\0"):
                return
            kind = header[156:157]
            size = number(header[124:136])
            name = header[0:100].split(b"\0", 1)[0]
            prefix = header[345:500].split(b"\0", 1)[0] if header[257:262] == b"ustar" else b""
            if prefix:
                name = prefix + b"/" + name
            linkname = header[157:257].split(b"\0", 1)[0]
            if "size" in extra:
                size = int(extra["size"])
            padded = size + (-size % 512)
            if kind in (b"x", b"g"):
                data = read_exact(padded)[:size]
                if kind == b"x":
                    extra = pax(data)
                continue
            name = extra.get("path", name).decode("utf-8", "surrogateescape")
            linkname = extra.get("linkpath", linkname).decode("utf-8", "surrogateescape")
            extra = {}
            item = self.expect.get(name)
            if item is None:
                self.skip(padded)
                self.fail(name, name, "not in the plan")
            elif kind == b"2":
                self.skip(padded)
                self.link(name, item, linkname)
            else:
                self.file(name, item, size)
                self.skip(padded - size)

    def skip(self, n):
        while n > 0:
            got = IN.readinto(self.view[:min(n, len(self.buf))])
            heard()
            if not got:
                raise EOFError
            n -= got

    def link(self, name, item, target):
        t, rel = item[0], item[1]
        final = os.path.join(self.roots[t], rel)
        temp = temp_for(final)
        try:
            self.makedirs(t, rel)
            if os.path.lexists(temp):
                os.unlink(temp)
            os.symlink(target, temp)
            os.replace(temp, final)
        except OSError as exc:
            if os.path.lexists(temp):
                os.unlink(temp)
            self.fail(name, final, exc)
            return
        self.records[t][rel] = ["link"]
        self.written += 1
        say({"ok": name})

    def file(self, name, item, size):
        t, rel, digest, mode, mtime = item
        final = os.path.join(self.roots[t], rel)
        temp = temp_for(final)
        fd, problem = None, None
        try:
            self.makedirs(t, rel)
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            TEMPS.append(temp)
        except OSError as exc:
            problem = exc
        hasher = hashlib.sha256()
        left = size
        while left > 0:
            got = IN.readinto(self.view[:min(left, len(self.buf))])
            heard()
            if not got:
                raise EOFError
            chunk = self.view[:got]
            hasher.update(chunk)
            left -= got
            while fd is not None and chunk:
                try:
                    chunk = chunk[os.write(fd, chunk):]
                except OSError as exc:
                    problem = exc
                    os.close(fd)
                    fd = None
        try:
            if fd is not None:
                os.fchmod(fd, mode)
                os.close(fd)
                fd = None
                if problem is None and hasher.hexdigest() != digest:
                    problem = "content does not match its sha256 (changed while pushing?)"
                if problem is None:
                    os.utime(temp, (mtime, mtime))
                    os.replace(temp, final)
                    self.records[t][rel] = stamp(os.lstat(final)) + [digest]
                    self.drop_bytecode(final)
        except OSError as exc:
            problem = exc
        if temp in TEMPS:
            TEMPS.remove(temp)
            if problem is not None and os.path.lexists(temp):
                os.unlink(temp)
        if problem is not None:
            self.fail(name, final, problem)
            return
        self.written += 1
        say({"ok": name})


def save_record(root, record):
    path = record_file(root)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temp = path + ".%d.tmp" % os.getpid()
        with open(temp, "w") as fh:
            json.dump(record, fh)
        os.replace(temp, path)
    except OSError:
        pass


def widen_stdin():
    # sshd writes what it decrypts into this pipe; at 1 MiB (Linux's default limit for a user)
    # instead of 64 KiB it blocks less often and each read takes more (host CPU -15 %).
    if sys.platform.startswith("linux"):
        try:
            import fcntl
            fcntl.fcntl(IN.fileno(), getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
        except (ImportError, OSError, ValueError):
            pass


def main():
    widen_stdin()
    request = json.loads(IN.readline())
    IDLE[0] = int(request.get("idle") or 0)
    heard()
    roots, records, freshes, replies = [], [], [], []
    for spec in request["targets"]:
        reply, record, fresh = survey(spec)
        replies.append(reply)
        roots.append(reply["root"])
        records.append(record)
        freshes.append(fresh)
    say({"targets": replies})
    line = IN.readline()
    heard()
    if not line:
        return 0
    plan = json.loads(line)
    if plan.get("abort"):
        return 0
    before = [dict(r) for r in records]
    new, ours = [], []
    for t, keep in enumerate(plan["keep"]):
        wanted = set(request["targets"][t]["paths"])
        # the files a push wrote that are still there as written; a gone or replaced one drops out
        ours.append(set(rel for rel, e in replies[t]["entries"].items() if e[4]))
        merged = dict((rel, v) for rel, v in records[t].items() if rel not in wanted and rel in ours[t])
        for rel in keep:
            if rel in freshes[t]:
                merged[rel] = freshes[t][rel]
        new.append(merged)
    receiver = Receiver(roots, plan, new)
    try:
        for t, root in enumerate(roots):  # the root itself, even for a tree with no files
            try:
                receiver.makedirs(t, "")
            except OSError as exc:
                receiver.fail("%d/" % t, root, exc)
        for t, rel in plan["delete"]:
            receiver.delete(t, rel)
        receiver.run()
    finally:
        deleted = set((t, rel) for t, rel in plan["delete"])
        for t, root in enumerate(roots):
            for rel in ours[t]:  # a write that failed or never came left the old file: still ours
                if rel not in new[t] and rel in before[t] and (t, rel) not in deleted:
                    new[t][rel] = before[t][rel]
            if new[t] != before[t]:
                save_record(root, new[t])
    say({"done": {"written": receiver.written, "deleted": receiver.deleted, "failed": receiver.failed}})
    return 0


def stop(signum, frame):
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGALRM):
        signal.signal(sig, stop)
    try:
        code = main()
    except (EOFError, BrokenPipeError, SystemExit, KeyboardInterrupt):
        code = 3
    finally:
        for temp in TEMPS:
            try:
                os.unlink(temp)
            except OSError:
                pass
    sys.exit(code)
'''

HELPER_NAME = "<dlrun push helper>"
# The helper needs the standard library only: without ``site`` a virtual environment's .pth
# files are not processed at start (47 -> 26 ms of host CPU per push in the dev venv).
HELPER_FLAGS = ("-S",)
# A helper that hears nothing from dlrun for this long ends and removes its partial file. dlrun
# talks to it without pauses (survey, plan, stream), so only a vanished dlrun trips it.
HELPER_IDLE_S = 300


# =============================================================================== the mechanism


@dataclass(frozen=True)
class HostPushSummary:
    """What a push did on one host (code and data together).

    ``code_dir`` and ``data_dir``: the directories as resolved on the host (absolute), or None
    when that part was not pushed.
    """

    host: str
    files_sent: int
    bytes_sent: int
    files_unchanged: int
    files_deleted: int
    seconds: float
    code_dir: str | None = None
    data_dir: str | None = None


@dataclass(frozen=True)
class PushTarget:
    """One directory to bring up to date on one host."""

    label: str  # "code" or "data"
    root: str  # as written: remote_code_dir / remote_data_dir
    manifest: Manifest


class _Cancelled(Exception):
    pass


class _Replies:
    """Reads the helper's JSON lines on a thread, so its stdout never blocks while we send."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.queue: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.bad_line: bytes | None = None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        pending = b""
        try:
            while True:
                data = self.channel.recv(65536)
                if not data:
                    return
                pending += data
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    try:
                        self.queue.put(json.loads(line))
                    except ValueError:
                        self.bad_line = line[:200]
        finally:
            self.queue.put(None)

    def get(self) -> dict[str, Any] | None:
        return self.queue.get()


def _parse_tree(raw: Mapping[str, Any]) -> RemoteTree:
    entries = {}
    for path, (kind, size, mode, value, pushed) in raw["entries"].items():
        entries[path] = RemoteEntry(
            path=path,
            kind=kind,
            size=int(size),
            mode=int(mode),
            sha256=value if kind == "file" else "",
            link=value if kind == "link" else None,
            pushed=bool(pushed),
        )
    return RemoteTree(
        root=str(raw["root"]),
        entries=entries,
        free_bytes=int(raw["free"]),
        block_size=int(raw["block"]),
        device=int(raw["device"]),
        error=raw.get("error"),
        error_path=raw.get("path"),
    )


class _Pieces:
    """The tar stream in SEND_CHUNK pieces, sent as the buffer of READ_CHUNKS pieces fills.

    File bytes are read straight into that buffer (``readinto``, one read for several packets:
    each blocking call lets another host's thread take the GIL), so a byte is copied once here
    and once into the ``bytes`` of its piece.
    """

    def __init__(self, send: Callable[[bytes], None]) -> None:
        self.send = send
        self.size = SEND_CHUNK * READ_CHUNKS
        self.buf = bytearray(self.size)
        self.view = memoryview(self.buf)
        self.fill = 0

    def add(self, data: bytes) -> None:
        source = memoryview(data)
        while source:
            n = min(len(source), self.size - self.fill)
            self.view[self.fill : self.fill + n] = source[:n]
            source = source[n:]
            self._advance(n)

    def read(self, fh: io.FileIO, limit: int) -> int:
        """Read up to ``limit`` bytes of ``fh`` into the buffer; 0 at the end of the file."""
        n = fh.readinto(self.view[self.fill : self.fill + min(limit, self.size - self.fill)]) or 0
        self._advance(n)
        return n

    def zeros(self, count: int) -> None:
        while count > 0:
            n = min(count, self.size - self.fill)
            self.view[self.fill : self.fill + n] = bytes(n)
            count -= n
            self._advance(n)

    def _advance(self, n: int) -> None:
        self.fill += n
        if self.fill == self.size:
            self.flush()

    def flush(self) -> None:
        fill, self.fill = self.fill, 0
        for start in range(0, fill, SEND_CHUNK):
            self.send(bytes(self.view[start : min(start + SEND_CHUNK, fill)]))


def _file_body(entry: FileEntry, pieces: _Pieces, step: Callable[[int], None]) -> None:
    """Exactly ``entry.size`` bytes (zero-padded if the file shrank: the host's check fails then);
    ``step(n)`` after each read."""
    source = entry.source
    assert source is not None
    if source.content is not None:
        pieces.add(source.content)
        step(len(source.content))
        return
    left = entry.size
    if source.prefix:
        pieces.add(source.prefix)
        left -= len(source.prefix)
        step(len(source.prefix))
    assert source.file is not None
    with open(source.file, "rb", buffering=0) as fh:
        if source.offset:
            fh.seek(source.offset)
        while left > 0:
            n = pieces.read(fh, left)
            if not n:
                pieces.zeros(left)
                step(left)
                return
            left -= n
            step(n)


def _tar_header(name: str, entry: FileEntry) -> bytes:
    info = tarfile.TarInfo(name)
    info.mtime = entry.source.mtime if entry.source else 0
    if entry.link is not None:
        info.type = tarfile.SYMTYPE
        info.linkname = entry.link
        info.mode = 0o777
    else:
        info.size = entry.size
        info.mode = entry.mode
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


class _HostPush:
    """One host's push over one channel (see the module docstring for the protocol)."""

    def __init__(self, transport: Transport, host: Host, targets: Sequence[PushTarget], *, delete: bool,
                 progress: ProgressHook | None, file_progress: ProgressHook | None,
                 cancel: threading.Event) -> None:
        self.transport = transport
        self.host = host
        self.targets = targets
        self.delete = delete
        self.progress = progress
        self.file_progress = file_progress
        self.cancel = cancel
        self.channel: Channel | None = None
        self.python = default_python(host)
        self.command = shlex.join([*self.python, *HELPER_FLAGS, "-c", HELPER_NAME])

    def run(self) -> HostPushSummary:
        started = time.monotonic()
        argv = [*self.python, *HELPER_FLAGS, "-c", HELPER_SOURCE]
        channel = self.channel = self.transport.open(self.host, argv)
        try:
            replies = _Replies(channel)
            self._send_line(survey_request(self.targets), replies)
            first = replies.get()
            if first is None or "targets" not in first:
                raise self._helper_failed("the push helper did not report the host's files", replies)
            trees = [_parse_tree(raw) for raw in first["targets"]]
            # a data shard always drops what left it: kept, it would overlap another host's shard
            plans = [diff_manifests(t.manifest, tree.entries, delete=self.delete or t.label == "data")
                     for t, tree in zip(self.targets, trees, strict=True)]
            settled = all(raw.get("settled") is True for raw in first["targets"])
            nothing = _summary_if_settled(self.host.name, self.targets, trees, plans, settled)
            if nothing is not None:  # nothing to send, delete or record: the helper may end now
                self._send_line({"abort": True}, replies)
                return replace(nothing, seconds=time.monotonic() - started)
            try:
                self._check(trees, plans)
            except SyncError:
                self._send_line({"abort": True}, replies)
                channel.close_stdin()
                channel.wait(10)
                raise
            sent, failures, deleted = self._transfer(trees, plans, replies)
            if failures:
                raise self._write_failed(failures)
            return HostPushSummary(
                host=self.host.name,
                files_sent=sum(len(p.send) for p in plans),
                bytes_sent=sent,
                files_unchanged=sum(len(p.unchanged) for p in plans),
                files_deleted=deleted,
                seconds=time.monotonic() - started,
                code_dir=next((tree.root for t, tree in zip(self.targets, trees, strict=True) if t.label == "code"),
                              None),
                data_dir=next((tree.root for t, tree in zip(self.targets, trees, strict=True) if t.label == "data"),
                              None),
            )
        finally:
            channel.close()

    def _send_line(self, message: Mapping[str, Any], replies: _Replies) -> None:
        self._send(json.dumps(message).encode() + b"\n", replies)

    def _send(self, data: bytes, replies: _Replies) -> None:
        assert self.channel is not None
        try:
            self.channel.send(data)
        except HostUnreachable as exc:
            code = self.channel.wait(2)
            if code not in (None, 0):
                raise self._helper_failed("the push helper stopped", replies) from exc
            raise

    def _check(self, trees: Sequence[RemoteTree], plans: Sequence[TransferPlan]) -> None:
        for tree in trees:
            if tree.error:
                raise SyncError(f"{tree.error}: {tree.error_path or tree.root}", host=self.host.name,
                                hint=f"dlrun writes to {tree.root}: check the workdir in the inventory and the "
                                "directory's owner and mode")
        check_space(self.host.name, trees, plans)

    def _transfer(self, trees: Sequence[RemoteTree], plans: Sequence[TransferPlan],
                  replies: _Replies) -> tuple[int, list[dict[str, Any]], int]:
        assert self.channel is not None
        items = [(f"{index}/{entry.path}", entry) for index, plan in enumerate(plans) for entry in plan.send]
        plan_message = {
            "files": [[index, e.path, e.sha256, e.mode, e.source.mtime if e.source else 0]
                      for index, plan in enumerate(plans) for e in plan.send],
            "delete": [[index, path] for index, plan in enumerate(plans) for path in plan.delete],
            "keep": [list(plan.unchanged) for plan in plans],
        }
        self._send_line(plan_message, replies)
        outcome: dict[str, Any] = {"failures": [], "deleted": 0, "done": None}
        collector = threading.Thread(target=self._collect, args=(replies, len(items), outcome), daemon=True)
        collector.start()
        sent = self._stream(items, replies)
        self.channel.close_stdin()
        collector.join()
        if outcome["done"] is None:
            raise self._helper_failed("the push helper stopped before reporting every file", replies)
        self.channel.wait(30)
        return sent, outcome["failures"], int(outcome["deleted"])

    def _collect(self, replies: _Replies, total: int, outcome: dict[str, Any]) -> None:
        done = 0
        if self.file_progress is not None:
            self.file_progress(self.host.name, 0, total)
        while True:
            message = replies.get()
            if message is None:
                return
            if "ok" in message:
                done += 1
                if self.file_progress is not None:
                    self.file_progress(self.host.name, done, total)
            elif "deleted" in message:
                outcome["deleted"] += 1
            elif "err" in message:
                outcome["failures"].append(message)
            elif "done" in message:
                outcome["done"] = message["done"]
                return

    def _stream(self, items: Sequence[tuple[str, FileEntry]], replies: _Replies) -> int:
        """Send one tar stream in SEND_CHUNK pieces; returns the payload bytes sent."""
        total = sum(e.size for _, e in items)
        done = 0
        if self.progress is not None:
            self.progress(self.host.name, 0, total)
        pieces = _Pieces(partial(self._send, replies=replies))

        def step(n: int) -> None:
            nonlocal done
            done += n
            if self.progress is not None:
                self.progress(self.host.name, done, total)
            if self.cancel.is_set():
                raise _Cancelled

        for name, entry in items:
            if self.cancel.is_set():
                raise _Cancelled
            pieces.add(_tar_header(name, entry))
            if entry.link is None:
                try:
                    _file_body(entry, pieces, step)
                except OSError as exc:
                    path = entry.source.file if entry.source else entry.path
                    raise SyncError(f"cannot read {path}: {exc.strerror or exc}", host=self.host.name) from exc
                pieces.zeros(-entry.size % 512)
        pieces.zeros(1024)
        pieces.flush()
        if self.progress is not None and total == 0:
            self.progress(self.host.name, 0, 0)
        return done

    def _helper_failed(self, what: str, replies: _Replies) -> DlrunError:
        assert self.channel is not None
        code = self.channel.wait(10)
        stderr = self.channel.stderr_text()
        if replies.bad_line is not None:
            stderr += "\nunexpected output: " + replies.bad_line.decode(errors="replace")
        if code is None and not stderr:
            return HostUnreachable(f"{what}: the connection was lost", host=self.host.name)
        return RemoteCommandError(
            what,
            host=self.host.name,
            command=self.command,
            exit_code=255 if code is None else code,
            stderr=stderr,
            hint="the host needs python >= 3.6 as the inventory's 'python' (default python3)",
        )

    def _write_failed(self, failures: Sequence[Mapping[str, Any]]) -> SyncError:
        shown = "\n".join(f"  {f.get('path')}: {f.get('msg')}" for f in failures[:5])
        more = f"\n  … and {len(failures) - 5} more" if len(failures) > 5 else ""
        first = failures[0]
        return SyncError(
            f"{len(failures)} file(s) could not be written, first {first.get('path')}: {first.get('msg')}\n"
            f"{shown}{more}",
            host=self.host.name,
            hint="check the owner and mode of those directories on the host; files already in place stay",
        )

    def abort(self) -> None:
        self.cancel.set()
        if self.channel is not None:
            self.channel.close()


def push(
    transport: Transport,
    hosts: Sequence[Host],
    *,
    code_dir: Path | None,
    data_dir: Path | None = None,
    shard: str = "files",
    split_lines: bool = False,
    project: str | None = None,
    delete: bool = True,
    progress: ProgressHook | None = None,
    file_progress: ProgressHook | None = None,
    leave_out: Path | None = None,
) -> tuple[HostPushSummary, ...]:
    """Bring ``code_dir`` (to ``remote_code_dir``) and each host's shard of ``data_dir`` (to
    ``remote_data_dir``) up to date on every host, in parallel; one summary per host, in order.

    ``project`` defaults to the code directory's name. ``delete`` removes files an earlier push
    wrote that are gone locally (or, for data, no longer in the host's shard). ``progress(host,
    bytes_done, bytes_total)`` and ``file_progress(host, files_done, files_total)`` are called
    from the hosts' threads. ``leave_out``: a directory inside ``code_dir`` not to send with
    the code (the dataset, pushed as shards on its own). Raises ``SyncError`` (space, permissions, verification),
    ``TransportError`` (unreachable, helper failed) or ``UsageError``; with several hosts
    failing, one ``SyncError`` lists them all. Hosts that succeeded keep what they received.
    """
    hosts = tuple(hosts)
    if not hosts:
        return ()
    if code_dir is None and data_dir is None:
        raise UsageError("nothing to push: give a code directory, a data directory or both")
    if shard not in SHARD_POLICIES:
        raise UsageError(f"unknown shard policy {shard!r} (expected one of {', '.join(SHARD_POLICIES)})")
    code_root = Path(code_dir).resolve() if code_dir is not None else None
    data_root = Path(data_dir).resolve() if data_dir is not None else None
    leave_root = Path(leave_out).resolve() if leave_out is not None else None
    for other in (data_root, leave_root):
        if code_root is not None and other is not None and code_root.is_relative_to(other):
            raise UsageError(f"the data directory {other} holds the code directory {code_root}: every file would"
                             " go twice, whole as code and dealt out as data",
                             hint="keep the dataset in a directory of its own (it may lie inside the code's)")
    if code_root is not None:
        if not code_root.is_dir():
            raise UsageError(f"code directory not found: {code_dir}")
        project = check_project(project or code_root.name)
        if data_root is not None and project == DATA_DIR_NAME:
            raise UsageError(f"project name {project!r} is the data directory's name on the hosts",
                             hint="pass another project name")

    with ThreadPoolExecutor(max_workers=1) as connector:
        connected = connector.submit(transport.connect, hosts)  # overlaps with hashing
        code_manifest, data_manifests = _plan_local(code_root, data_root, len(hosts), shard, split_lines,
                                                    leave_root)
        connected.result()

    host_targets = []
    for index, host in enumerate(hosts):
        targets = []
        if code_root is not None:
            assert project is not None and code_manifest is not None
            targets.append(PushTarget("code", remote_code_dir(host, project), code_manifest))
        if data_manifests is not None:
            targets.append(PushTarget("data", remote_data_dir(host), data_manifests[index]))
        host_targets.append(targets)

    cancel = threading.Event()
    jobs = [_HostPush(transport, host, targets, delete=delete, progress=progress, file_progress=file_progress,
                      cancel=cancel) for host, targets in zip(hosts, host_targets, strict=True)]
    pool = ThreadPoolExecutor(max_workers=min(32, len(jobs)), thread_name_prefix="dlrun-push")
    futures: list[Future[HostPushSummary]] = [pool.submit(job.run) for job in jobs]
    try:
        for future in futures:
            with contextlib.suppress(Exception):
                future.result()
    except BaseException:  # Ctrl-C: stop sending; each helper removes its partial file on EOF
        for job in jobs:
            job.abort()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    failures = [exc for exc in (f.exception() for f in futures) if exc is not None]
    if not failures:
        return tuple(f.result() for f in futures)
    if len(failures) == 1:
        raise failures[0]
    lines = "\n".join(f"  {exc}" for exc in failures)
    raise SyncError(f"push failed on {len(failures)} of {len(hosts)} hosts:\n{lines}",
                    hint="hosts not listed are up to date")


def _plan_local(code_root: Path | None, data_root: Path | None, count: int, shard: str, split_lines: bool,
                leave_out: Path | None = None) -> tuple[Manifest | None, tuple[Manifest, ...] | None]:
    """The code manifest (without the dataset, which goes in shards, when it lies inside the
    code: ``data_root``, or ``leave_out`` when the data is pushed on its own) and the shards."""
    code_manifest = data_manifests = None
    if code_root is not None:
        extra: tuple[IgnoreRule, ...] = ()
        inside = leave_out or data_root
        if inside is not None and inside.is_relative_to(code_root) and inside != code_root:
            nested = inside.relative_to(code_root).as_posix()
            extra = (IgnoreRule(pattern=f"/{nested}", regex=re.escape(nested)),)
        cache = HashCache(default_cache_path(code_root))
        code_manifest = scan_tree(code_root, extra_rules=extra, cache=cache)
        cache.save()
    if data_root is not None:
        cache = HashCache(default_cache_path(data_root))
        data_manifests = plan_data(data_root, count, shard, split_lines=split_lines, cache=cache)
        cache.save()
    return code_manifest, data_manifests


# =============================================================================== a push with nothing to do


def survey_request(targets: Sequence[PushTarget]) -> dict[str, Any]:
    """The survey message of the protocol: per target its remote root and the local paths.

    The helper reads it first; ``dlrun.remote.agent`` answers it too (op ``survey``, running
    ``HELPER_SOURCE``'s ``survey`` in-process), so that a launch learns whether its code is
    already on a host without a second session and interpreter there.
    """
    return {"targets": [{"root": t.root, "paths": list(t.manifest.paths())} for t in targets],
            "idle": HELPER_IDLE_S}


def scan_code(code_root: Path, leave_out: Path | None = None) -> Manifest:
    """The code manifest ``push(code_dir=code_root, leave_out=…)`` sends (hashes cached by stat)."""
    manifest, _ = _plan_local(code_root.resolve(), None, 1, "files", False,
                              leave_out.resolve() if leave_out is not None else None)
    assert manifest is not None
    return manifest


def code_target(host: Host, code_root: Path, manifest: Manifest) -> PushTarget:
    """What ``push`` sends of ``code_root`` to ``host``, and where (``code_dir_on``)."""
    return PushTarget("code", code_dir_on(host, code_root), manifest)


def code_dir_on(host: Host, code_root: Path) -> str:
    """Where ``push`` puts the code of ``code_root`` on ``host`` (project = the directory's name)."""
    return remote_code_dir(host, check_project(code_root.resolve().name))


def settled_push(host: str, targets: Sequence[PushTarget], answer: Mapping[str, Any], *,
                 delete: bool = True) -> HostPushSummary | None:
    """The summary of a push that would send, delete and record nothing, from the survey's
    ``answer`` (the helper's first reply); None when the push has work to do or the answer is
    not a clean survey, so the helper must run (and report any problem itself)."""
    try:
        raws = list(answer["targets"])
        trees = [_parse_tree(raw) for raw in raws]
        settled = all(raw["settled"] is True for raw in raws)
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    if len(trees) != len(targets):
        return None
    plans = [diff_manifests(t.manifest, tree.entries, delete=delete or t.label == "data")
             for t, tree in zip(targets, trees, strict=True)]
    return _summary_if_settled(host, targets, trees, plans, settled)


def _summary_if_settled(host: str, targets: Sequence[PushTarget], trees: Sequence[RemoteTree],
                        plans: Sequence[TransferPlan], settled: bool) -> HostPushSummary | None:
    """The summary of a push with nothing to send, delete or record; None when there is work."""
    if not settled or any(tree.error for tree in trees) or any(plan.send or plan.delete for plan in plans):
        return None
    roots = {t.label: tree.root for t, tree in zip(targets, trees, strict=True)}
    return HostPushSummary(host=host, files_sent=0, bytes_sent=0,
                           files_unchanged=sum(len(plan.unchanged) for plan in plans), files_deleted=0,
                           seconds=0.0, code_dir=roots.get("code"), data_dir=roots.get("data"))
