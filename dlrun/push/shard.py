"""How data is dealt out to hosts: shard policies, ``--split-lines`` cut points, ``shard.json``,
each host's data directory and the env that tells a rank where its shard is.

Pure planning over ``dlrun.push.tree``'s manifests; it reads local files (to split them at
line ends) but starts no process and opens no connection.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import posixpath
import re
import stat
from collections.abc import Callable, Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

from dlrun.errors import SyncError, UsageError
from dlrun.inventory import Host
from dlrun.push.tree import (
    CODE_IGNORE_FILES,
    DATA_DIR_NAME,
    DATA_IGNORE_FILES,
    FileEntry,
    HashCache,
    Manifest,
    Source,
    hash_all,
    human_bytes,
    scan_tree,
    sha256_file,
)

SHARD_POLICIES = ("files", "contiguous", "size", "replicate")
SHARD_FILE = "shard.json"
HEADER_SUFFIXES = (".csv", ".tsv")  # --split-lines repeats their first line in every part


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


# =============================================================================== remote data paths, env

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
    ranges = list(pairwise(cuts))

    def digest(span: tuple[int, int]) -> str:
        start, end = span

        def compute() -> str:
            return sha256_file(path, start, end - start, header)

        return cache.digest(f"{entry.path}#{start}:{end}:{len(header)}", st, compute) if cache else compute()

    return tuple(
        FileEntry(part_name(entry.path, i, parts), len(header) + end - start, entry.mode, value,
                  source=Source(file=path, offset=start, prefix=header, mtime=int(st.st_mtime)))
        for i, ((start, end), value) in enumerate(zip(ranges, hash_all(digest, ranges), strict=True))
    )

