"""What a push sends: ignore rules, manifests, their diff against a host, and the local walk.

Pure planning over frozen dataclasses plus reading the local tree (no process, no network):

* ignore rules: ``.gitignore`` and ``.dlrunignore`` patterns, ``.git/`` and ``__pycache__/``
  always, and the folders a project never means to push (virtual environments, caches, run
  logs: ``DEFAULT_LEFT_OUT``), which a ``!pattern`` in ``.dlrunignore`` brings back;
* manifests (``scan_tree``: path, size, permission bits, sha256 of every file, links kept as
  links, hashes cached by stat in ``HashCache``) and their diff with what a host reported
  (``diff_manifests``), the free-space check (``check_space``);
* the push's policies: which directory a launch pushes (``push_root_for``), and the size
  guard that stops an oversized code push before anything is sent (``check_push_size``).
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from dlrun.errors import SyncError, UsageError
from dlrun.inventory import Host

T = TypeVar("T")

DATA_DIR_NAME = "data"
CODE_IGNORE_FILES = (".gitignore", ".dlrunignore")
# Data directories often carry a ``.gitignore`` of ``*`` (to keep the data out of git): only
# ``.dlrunignore`` applies to them.
DATA_IGNORE_FILES = (".dlrunignore",)
ALWAYS_IGNORED = (".git/", "__pycache__/")
HASH_BLOCK = 1 << 20
HASH_THREADS = 8  # hashing threads at most, whatever the number of cores
#: Left out of a code push unless a ``!pattern`` in ``.dlrunignore`` brings them back; so is
#: any folder holding ``pyvenv.cfg`` or ``conda-meta/`` (an environment), and the job's logs.
DEFAULT_LEFT_OUT = ("node_modules/", ".tox/", ".nox/", ".mypy_cache/", ".pytest_cache/", ".ruff_cache/",
                    ".ipynb_checkpoints/", "wandb/", "mlruns/", "lightning_logs/", "/dlrun-logs/",
                    ".dlrun-claim-*")  # a launch's claim of a shared folder (dlrun.remote.push_helper.claim)
DEFAULT_LOG_DIR = "dlrun-logs"  # at the root: earlier runs' logs, even when this job's go elsewhere
DEFAULT_MAX_PUSH_BYTES = 200 * 1024 * 1024
DEFAULT_MAX_PUSH_FILES = 20_000
RACY_NS = 100_000_000  # a file modified this close to its hashing is hashed again next time


# =============================================================================== ignore rules


@dataclass(frozen=True)
class IgnoreRule:
    """One gitignore-style pattern, relative to the directory of the file it came from."""

    pattern: str
    regex: str
    base: str = ""  # directory of the ignore file, relative to the walked root ("" = the root)
    negate: bool = False
    dir_only: bool = False
    origin: str = ""  # "default": one of the folders a push leaves out unless told otherwise
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

    def deciding(self, path: str, is_dir: bool) -> IgnoreRule | None:
        """The rule that decides about ``path`` itself (the last that matches), or None."""
        for rule in reversed(self.rules):
            if rule.matches(path, is_dir):
                return rule
        return None

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


def left_out_rules(folders: Sequence[str] = ()) -> tuple[IgnoreRule, ...]:
    """``DEFAULT_LEFT_OUT`` at any depth, and ``folders`` (paths relative to the root, such as
    the job's log folder), anchored; placed first, so a ``!pattern`` brings any back."""
    named = parse_ignore("\n".join(DEFAULT_LEFT_OUT))
    anchored = tuple(IgnoreRule(pattern=f"/{f}/", regex=re.escape(f), dir_only=True) for f in folders if f)
    return tuple(replace(rule, origin="default") for rule in (*named, *anchored))


def is_environment(folder: str) -> bool:
    """A Python virtual environment or a conda environment, whatever its name."""
    return os.path.isfile(os.path.join(folder, "pyvenv.cfg")) or os.path.isdir(os.path.join(folder, "conda-meta"))


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
    left_out: tuple[str, ...] = field(default=(), compare=False)  # folders the defaults left out
    # (relative path, mode) of every folder walked, "" for the root: pushed as ``folder_mode`` says
    folders: tuple[tuple[str, int], ...] = field(default=(), compare=False)

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
    unsafe: tuple[tuple[str, str, str], ...] = ()  # (folder, what is wrong, fix): others could plant code


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


# =============================================================================== remote paths


def check_project(project: str) -> str:
    if not project or project in (".", "..") or "/" in project or "\0" in project:
        raise UsageError(f"project name {project!r} must be one directory name (no '/')")
    return project


def remote_code_dir(host: Host, project: str) -> str:
    """``<workdir>/<project>`` as written (``~`` and relative paths resolve from $HOME on the host)."""
    return posixpath.join(host.workdir or "", check_project(project))


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
        try:  # private: the sha256 of a short secret (.env) lets a reader test guesses offline
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            temp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            with os.fdopen(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600), "w",
                           encoding="utf-8") as fh:
                fh.write(json.dumps(self._new))
            os.replace(temp, self.path)
        except OSError:
            pass


def default_cache_path(root: Path) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    name = hashlib.sha256(str(root).encode("utf-8", "surrogateescape")).hexdigest()[:24]
    return Path(base) / "dlrun" / "push" / f"{name}.json"


_HASH_BUFFERS = threading.local()  # each hashing thread reads into its own buffer, reused


def sha256_file(path: str, offset: int = 0, length: int | None = None, prefix: bytes = b"") -> str:
    digest = hashlib.sha256(prefix)
    buf: memoryview | None = getattr(_HASH_BUFFERS, "buf", None)
    if buf is None:  # a fresh block per read would cost its page faults every time
        buf = _HASH_BUFFERS.buf = memoryview(bytearray(HASH_BLOCK))
    with open(path, "rb", buffering=0) as fh:
        fh.seek(offset)
        left = length
        while left is None or left > 0:
            n = fh.readinto(buf if left is None else buf[:min(HASH_BLOCK, left)])
            if not n:
                break
            digest.update(buf[:n])
            if left is not None:
                left -= n
    return digest.hexdigest()


@dataclass(frozen=True)
class PushLimit:
    """The most a code push may send before it stops with a usage error (None: no limit)."""

    max_bytes: int | None = DEFAULT_MAX_PUSH_BYTES
    max_files: int | None = DEFAULT_MAX_PUSH_FILES


NO_LIMIT = PushLimit(None, None)


def parse_size(text: str) -> PushLimit:
    """``--max-push-size``: ``500M``, ``2G``, ``1.5GiB``, ``300000000`` (bytes) keep the file limit;
    ``none`` (or ``0``) lifts both limits."""
    value = text.strip().lower()
    if value in ("none", "0", "off", "unlimited"):
        return NO_LIMIT
    match = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?)(?:i?b)?", value)
    if match is None:
        raise UsageError(f"--max-push-size {text!r}: expected a size like 500M, 2G or 1.5GiB, or none")
    number, unit = match.groups()
    size = int(float(number) * 1024 ** " kmgt".index(unit or " "))
    return PushLimit(max_bytes=size)


def largest_items(sizes: Iterable[tuple[str, int]], count: int = 5) -> tuple[tuple[str, int, int], ...]:
    """The ``count`` largest top-level items of a tree, as ``(name, bytes, files)``; a folder's
    name ends with ``/``."""
    totals: dict[str, list[int]] = {}
    for path, size in sizes:
        head, sep, _ = path.partition("/")
        key = head + sep
        total = totals.setdefault(key, [0, 0])
        total[0] += size
        total[1] += 1
    ranked = sorted(totals.items(), key=lambda item: (-item[1][0], item[0]))
    return tuple((name, size, files) for name, (size, files) in ranked[:count])


def check_push_size(root: Path, sizes: Sequence[tuple[str, int]], limit: PushLimit) -> None:
    """Raise ``UsageError`` (exit 2) when a code push of ``sizes`` (path, bytes) from ``root``
    is over ``limit``, naming the five largest folders and the ways out."""
    total = sum(size for _, size in sizes)
    over_bytes = limit.max_bytes is not None and total > limit.max_bytes
    over_files = limit.max_files is not None and len(sizes) > limit.max_files
    if not (over_bytes or over_files):
        return
    what = (f"over the {human_bytes(limit.max_bytes or 0)} limit" if over_bytes
            else f"over the {limit.max_files} files limit")
    lines = "\n".join(f"    {name:<40} {human_bytes(size):>10}  {files} file{'s' if files != 1 else ''}"
                      for name, size, files in largest_items(sizes))
    raise UsageError(
        f"the code push from {root} is {human_bytes(total)} in {len(sizes)} files, {what}; nothing was sent."
        f" Largest:\n{lines}",
        hint=f"leave folders out in {root / '.dlrunignore'} (one pattern a line, e.g. 'checkpoints/'); "
        "pass a dataset with --data DIR (sharded, not limited); raise the limit with --max-push-size 1G "
        "(none: no limit); or run what is on the hosts with --no-push",
    )


def scan_tree(
    root: Path,
    *,
    ignore_files: Sequence[str] = CODE_IGNORE_FILES,
    extra_rules: Sequence[IgnoreRule] = (),
    cache: HashCache | None = None,
    follow_links: bool = False,
    leave_out_defaults: bool = False,
    left_out_folders: Sequence[str] = (),
    limit: PushLimit | None = None,
) -> Manifest:
    """Walk ``root``: every file not ignored, with size, permission bits and sha256; links as links.

    Ignore files are read in every directory (deeper ones win); ``.git/`` and ``__pycache__/``
    are always skipped, and so are sockets, fifos and devices. Symlinks are not followed, unless
    ``follow_links`` (a dataset: what the ranks read is the target's bytes, and a linked folder
    of files must be dealt out like the others); then a dangling link or a loop is an error.
    ``leave_out_defaults`` (code): ``DEFAULT_LEFT_OUT``, environments and ``left_out_folders``
    (relative paths) are left out unless a ``!pattern`` brings them back; the manifest names
    them in ``left_out``. ``limit``: checked after the walk, before any file is read.
    """
    root = Path(root)
    found: list[tuple[str, str, os.stat_result, str | None]] = []  # rel, path, stat, link target
    left_out: list[str] = []
    walked = {os.path.realpath(root)}  # with follow_links: the folders under way, against loops
    always = default_rules()
    defaults = left_out_rules(left_out_folders) if leave_out_defaults else ()
    stack: list[tuple[str, IgnoreRules]] = [("", IgnoreRules(defaults))]
    folders: list[tuple[str, int]] = []
    while stack:
        rel_dir, inherited = stack.pop()
        folder = os.path.join(root, rel_dir) if rel_dir else str(root)
        try:
            folders.append((rel_dir, folder_mode(os.stat(folder).st_mode)))
        except OSError as exc:
            raise SyncError(f"cannot read directory {folder}: {exc.strerror or exc}") from exc
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

        def wanted_dir(rel: str, path: str, effective: IgnoreRules = effective) -> bool:
            rule = effective.deciding(rel, True)
            if rule is not None and not rule.negate:
                if rule.origin == "default":
                    left_out.append(rel + "/")
                return False
            if leave_out_defaults and rule is None and is_environment(path):
                left_out.append(rel + "/")
                return False
            return True

        for child in children:
            rel = f"{rel_dir}/{child.name}" if rel_dir else child.name
            try:
                if child.is_symlink() and follow_links:
                    if not os.path.exists(child.path):
                        raise SyncError(f"{child.path} is a link to nothing ({os.readlink(child.path)})",
                                        hint="fix or remove the link, or list it in .dlrunignore")
                    if child.is_dir() and wanted_dir(rel, child.path):
                        real = os.path.realpath(child.path)
                        if any(real == w or w.startswith(real + os.sep) for w in walked):
                            raise SyncError(f"{child.path} links back to a folder above it (a loop)")
                        walked.add(real)
                        stack.append((rel, rules))
                    elif child.is_file() and not effective.matches(rel, False):
                        found.append((rel, child.path, child.stat(), None))
                elif child.is_symlink():
                    if not effective.matches(rel, False):
                        found.append((rel, child.path, child.stat(follow_symlinks=False), os.readlink(child.path)))
                elif child.is_dir(follow_symlinks=False):
                    if wanted_dir(rel, child.path):
                        stack.append((rel, rules))
                elif child.is_file(follow_symlinks=False) and not effective.matches(rel, False):
                    found.append((rel, child.path, child.stat(follow_symlinks=False), None))
            except OSError as exc:
                raise SyncError(f"cannot read {child.path}: {exc.strerror or exc}") from exc
    if limit is not None:
        check_push_size(root, [(rel, st.st_size if link is None else 0) for rel, _, st, link in found], limit)
    files = [(rel, path, st) for rel, path, st, link in found if link is None]

    def digest(item: tuple[str, str, os.stat_result]) -> str:
        rel, path, st = item
        try:
            return cache.digest(rel, st, partial(sha256_file, path)) if cache else sha256_file(path)
        except OSError as exc:
            raise SyncError(f"cannot read {path}: {exc.strerror or exc}") from exc

    entries = [FileEntry(rel, st.st_size, stat.S_IMODE(st.st_mode), value,
                         source=Source(file=path, mtime=int(st.st_mtime)))
               for (rel, path, st), value in zip(files, hash_all(digest, files), strict=True)]
    entries += [FileEntry(rel, 0, 0o777, "", link=link, source=Source(mtime=int(st.st_mtime)))
                for rel, _, st, link in found if link is not None]
    return Manifest(tuple(sorted(entries, key=lambda e: e.path)), left_out=tuple(sorted(left_out)),
                    folders=tuple(sorted(folders)))


def folder_mode(mode: int) -> int:
    """A pushed folder's mode on the host: the local one, but the owner may always write (the
    next push must) and no one else may (they could plant code the job runs)."""
    return (stat.S_IMODE(mode) & 0o755) | 0o700


def hash_all(digest: Callable[[T], str], items: Sequence[T]) -> list[str]:
    """``digest`` of every item, in order, on as many threads as there are cores (hashlib
    hashes without the GIL; docs/benchmarks.md "Push after parallel hashing"). The first
    exception, Ctrl-C included, cancels the items not yet started (``Executor.map`` does)."""
    workers = min(len(items), os.cpu_count() or 1, HASH_THREADS)
    if workers < 2:
        return [digest(item) for item in items]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dlrun-hash") as pool:
        return list(pool.map(digest, items))


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return None



# =============================================================================== which folder a launch pushes


def system_folders() -> tuple[Path, ...]:
    """Folders that hold installed programs, never a user's project: ``/bin``, ``/sbin``,
    ``/usr``, ``/opt`` and this Python's installation (``sys.prefix``, ``sys.base_prefix``)."""
    return tuple(dict.fromkeys(Path(p) for p in ("/bin", "/sbin", "/usr", "/opt", sys.prefix, sys.base_prefix)))


def push_root_for(script: Path, *, home: Path, system: Sequence[Path]) -> Path | None:
    """The folder a launch pushes for ``script`` (an absolute path to a file): its directory
    (resolved), or None when the script is an installed program (under one of ``system``,
    or in a ``site-packages``/``dist-packages`` folder: run as given, nothing pushed).

    A script directly in ``home`` or in ``/`` is refused (``UsageError``): its directory is
    not a project, and pushing it would send the whole home folder.
    """
    for path in dict.fromkeys((script, Path(os.path.realpath(script)))):
        if any(path.is_relative_to(folder) for folder in system):
            return None
        if any(part in ("site-packages", "dist-packages") for part in path.parts):
            return None
    root = Path(os.path.realpath(script)).parent
    if root == Path(root.anchor) or root == Path(os.path.realpath(home)):
        where = "the home folder" if root != Path(root.anchor) else "/"
        raise UsageError(
            f"{script} is directly in {where} ({root}): dlrun pushes the script's folder, and that would be "
            f"all of {root}; nothing was pushed",
            hint="move the script into a project folder, name the folder to push with --code DIR, "
            "or run what is already on the hosts with --no-push",
        )
    return root
