"""``--checkpoint-dir``: one folder made the same on every host before each attempt.

Which copy wins is ``choose_copies`` (pure, documented in ``docs/checkpoints.md``): per file,
across the hosts, a copy written before the attempt failed beats one written as or after it
failed (a writer killed mid-write), then the newest (host clocks put on dlrun's clock), then
the largest. Nothing is ever deleted: a file some host has reaches every host, so one writer,
per-rank shards and ``latest`` files or links all end up complete everywhere.

The bytes go through this machine: each winning file is fetched once from the host that has
it (``dlrun.push.pull.HostSender``) and pushed to the hosts that lack it (the push session,
``dlrun.push.session``), both verified by sha256; files already the same move nowhere.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from dlrun.errors import SyncError, UsageError
from dlrun.inventory import Host
from dlrun.push.pull import HostSender, Listing, RemoteFile
from dlrun.push.tree import FileEntry, Manifest, Source, human_bytes
from dlrun.transport.base import Transport

#: A copy modified less than this long before dlrun saw the attempt fail (or later) may be
#: half written: it loses to any copy written before that. Covers the few milliseconds between
#: a rank's last write and dlrun's stop, and what is left of the hosts' clock offsets.
SUSPECT_MARGIN_S = 1.0


@dataclass(frozen=True)
class Choice:
    """The copy of ``path`` every host gets: ``host``'s. ``suspect``: written around the
    failure, taken only because no host has a copy written before it."""

    path: str
    host: str
    entry: RemoteFile
    suspect: bool = False
    passed_over: tuple[str, ...] = ()  # hosts whose newer copy was written around the failure


def written_at(listing: Listing, entry: RemoteFile) -> float:
    """When ``entry`` was last modified, on this machine's clock."""
    return entry.mtime_ns / 1e9 - listing.offset


def choose_copies(listings: Sequence[Listing], failed_at: float | None,
                  margin: float = SUSPECT_MARGIN_S) -> dict[str, Choice]:
    """Per path any host has, the copy that wins: complete first (not modified at or after
    ``failed_at - margin``; with no failure time, every copy is), then newest, then largest,
    then the first host in order."""
    order = {li.host: i for i, li in enumerate(listings)}
    paths = sorted({p for li in listings for p in li.entries})
    choices: dict[str, Choice] = {}
    for path in paths:
        copies = [(li, li.entries[path]) for li in listings if path in li.entries]

        def suspect(li: Listing, entry: RemoteFile) -> bool:
            return failed_at is not None and written_at(li, entry) >= failed_at - margin

        def rank(copy: tuple[Listing, RemoteFile]) -> tuple[bool, float, int, int]:
            li, entry = copy
            return (not suspect(li, entry), written_at(li, entry), entry.size, -order[li.host])

        best, entry = max(copies, key=rank)
        passed = tuple(li.host for li, e in copies
                       if suspect(li, e) and not e.same_content(entry) and written_at(li, e) > written_at(best, entry))
        choices[path] = Choice(path, best.host, entry, suspect(best, entry), passed)
    return choices


def needs(listings: Sequence[Listing], choices: Mapping[str, Choice]) -> dict[str, list[Choice]]:
    """Per host, the chosen copies it does not have already (same content: nothing moves)."""
    out: dict[str, list[Choice]] = {}
    for li in listings:
        out[li.host] = [c for p, c in choices.items()
                        if (li.entries.get(p) is None or not li.entries[p].same_content(c.entry))]
    return out


@dataclass(frozen=True)
class CheckpointSync:
    """What making one folder the same did: files written on hosts, their bytes, how long."""

    folder: str
    files: int  # copies written, over all hosts
    bytes: int
    seconds: float
    paths: int  # files in the folder once done
    sources: tuple[str, ...] = ()
    targets: tuple[str, ...] = ()
    suspect: tuple[str, ...] = ()  # paths whose only copies were written around the failure
    passed_over: tuple[str, ...] = ()  # "host:path" copies written around the failure that lost

    def line(self) -> str:
        """``checkpoint ckpt: 3 files (1.2 MiB) from host0 to host1 in 0.4 s`` and what lost."""
        if not self.files:
            text = (f"checkpoint {self.folder}: the same on every host ({self.paths} files) in {self.seconds:.1f} s"
                    if self.paths else f"checkpoint {self.folder}: empty on every host ({self.seconds:.1f} s)")
        else:
            text = (f"checkpoint {self.folder}: {self.files} file{'s' if self.files != 1 else ''}"
                    f" ({human_bytes(self.bytes)}) from {', '.join(self.sources)} to {', '.join(self.targets)}"
                    f" in {self.seconds:.1f} s")
        if self.passed_over:
            text += f"; written as the job failed, not taken: {', '.join(self.passed_over[:5])}"
        if self.suspect:
            text += f"; only copy written as the job failed: {', '.join(self.suspect[:5])}"
        return text


def check_folder(folder: str) -> str:
    """A ``--checkpoint-dir``: relative to the job's working folder, inside it."""
    parts = [p for p in folder.replace("\\", "/").split("/") if p not in ("", ".")]
    if not parts or ".." in parts or folder.startswith(("/", "~")):
        raise UsageError(f"--checkpoint-dir {folder!r}: expected a folder inside the job's working folder"
                         " (relative, without ..)")
    return "/".join(parts)


def sync_folder(transport: Transport, hosts: Sequence[Host], roots: Mapping[str, str], folder: str, *,
                failed_at: float | None = None, margin: float = SUSPECT_MARGIN_S) -> CheckpointSync:
    """Make ``roots[host]`` (one folder, as each host sees it) the same on every host: the
    winners of ``choose_copies`` go where they are missing or differ. Raises ``SyncError``
    (naming host and file) when a host cannot be read or written."""
    started = time.monotonic()
    senders = {h.name: HostSender(transport, h, roots[h.name]) for h in hosts}
    staging = Path(tempfile.mkdtemp(prefix="dlrun-ckpt-"))
    pool = ThreadPoolExecutor(max_workers=max(1, min(32, len(hosts))), thread_name_prefix="dlrun-ckpt")
    try:
        listings = list(pool.map(lambda s: s.listing(), senders.values()))
        for li in listings:
            if li.error and not li.missing:
                raise SyncError(f"cannot read checkpoint folder {li.root}: {li.error}", host=li.host)
            if not li.is_dir:
                raise SyncError(f"checkpoint folder {li.root} is a file", host=li.host)
        choices = choose_copies(listings, failed_at, margin)
        wanted = needs(listings, choices)
        moving = {c.path: c for cs in wanted.values() for c in cs}
        staged_bytes = sum(c.entry.size for c in moving.values())
        free = shutil.disk_usage(staging).free
        if staged_bytes > free:
            raise SyncError(f"checkpoint folder {folder}: {human_bytes(staged_bytes)} must pass through {staging}"
                            f" on this machine, which has {human_bytes(free)} free",
                            hint="point TMPDIR at a filesystem with room for the files that differ")
        by_source: dict[str, list[Choice]] = {h.name: [] for h in hosts}
        for choice in moving.values():
            by_source[choice.host].append(choice)

        def fetch(name: str) -> None:
            items = [(c.entry, staging / str(idx) / c.path) for idx, c in enumerate(by_source[name])]
            _, failures = senders[name].fetch(items, staging)
            if failures:
                first = failures[0]
                raise SyncError(f"checkpoint file {first.path} could not be fetched: {first.message}", host=name)

        list(pool.map(fetch, senders))
        staged = {c.path: staging / str(idx) / c.path for cs in by_source.values() for idx, c in enumerate(cs)}
        targets = [h for h in hosts if wanted[h.name]]
        list(pool.map(lambda h: _push_copies(transport, h, roots[h.name], wanted[h.name], staged), targets))
    finally:
        for sender in senders.values():
            sender.close()
        pool.shutdown(wait=True)
        shutil.rmtree(staging, ignore_errors=True)
    return CheckpointSync(
        folder=folder,
        files=sum(len(cs) for cs in wanted.values()),
        bytes=sum(c.entry.size for cs in wanted.values() for c in cs),
        seconds=time.monotonic() - started,
        paths=len(choices),
        sources=tuple(sorted({c.host for c in moving.values()}, key=[h.name for h in hosts].index)),
        targets=tuple(h.name for h in targets),
        suspect=tuple(c.path for c in choices.values() if c.suspect and c.path in moving),
        passed_over=tuple(f"{h}:{c.path}" for c in choices.values() for h in c.passed_over),
    )


def _push_copies(transport: Transport, host: Host, root: str, choices: Sequence[Choice],
                 staged: Mapping[str, Path]) -> None:
    from dlrun.push.session import PushTarget, _HostPush

    entries = []
    for c in sorted(choices, key=lambda c: c.path):
        mtime = int(c.entry.mtime_ns // 1_000_000_000)
        if c.entry.kind == "link":
            entries.append(FileEntry(c.path, 0, 0, "", link=c.entry.link, source=Source(mtime=mtime)))
        else:
            entries.append(FileEntry(c.path, c.entry.size, c.entry.mode, c.entry.sha256,
                                     source=Source(file=os.fspath(staged[c.path]), mtime=mtime)))
    target = PushTarget("checkpoint", root, Manifest(tuple(entries)))
    _HostPush(transport, host, [target], delete=False, progress=None, file_progress=None,
              cancel=threading.Event()).run()


def sync_folders(transport: Transport, hosts: Sequence[Host], cwd_of: Callable[[Host], str],
                 folders: Sequence[str], *, failed_at: float | None = None) -> list[CheckpointSync]:
    """``sync_folder`` for each of ``folders`` (relative to each host's ``cwd_of(host)``)."""
    import posixpath

    return [sync_folder(transport, hosts, {h.name: posixpath.join(cwd_of(h), folder) for h in hosts}, folder,
                        failed_at=failed_at) for folder in folders]
