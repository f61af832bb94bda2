"""``--checkpoint-dir``: one folder made the same on every host before each attempt.

Which copy wins is ``choose_copies`` (pure, documented in ``docs/checkpoints.md``): per file,
across the hosts, a copy written before the attempt failed beats one written as or after it
failed (a writer killed mid-write), then the newest (host clocks put on dlrun's clock), then
the largest. Nothing is ever deleted: a file some host has reaches every host, so one writer,
per-rank shards and ``latest`` files or links all end up complete everywhere.

Files already the same move nowhere. The others go host to host where the hosts reach each
other (the source's push helper serves them over TLS, ``HostSender.serve``; the target's push
session fetches them from there), else through this machine (fetched once with
``dlrun.push.pull.HostSender``, then pushed with ``dlrun.push.session``); sha256 verified on
every write. The mechanism is in ``docs/checkpoints.md``.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    relayed: int = 0  # of ``files``, those that went through this machine (the rest: host to host)

    def line(self) -> str:
        """``checkpoint ckpt: 3 files (1.2 MiB) from host0 to host1 in 0.4 s`` and what lost."""
        if not self.files:
            text = (f"checkpoint {self.folder}: the same on every host ({self.paths} files) in {self.seconds:.1f} s"
                    if self.paths else f"checkpoint {self.folder}: empty on every host ({self.seconds:.1f} s)")
        else:
            how = ("host to host" if not self.relayed else "through this machine" if self.relayed == self.files
                   else f"{self.relayed} through this machine")
            text = (f"checkpoint {self.folder}: {self.files} file{'s' if self.files != 1 else ''}"
                    f" ({human_bytes(self.bytes)}) from {', '.join(self.sources)} to {', '.join(self.targets)}"
                    f" in {self.seconds:.1f} s ({how})")
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
                failed_at: float | None = None, margin: float = SUSPECT_MARGIN_S,
                addresses: Mapping[str, str] | None = None, owner_check: bool = True) -> CheckpointSync:
    """Make ``roots[host]`` (one folder, as each host sees it) the same on every host: the
    winners of ``choose_copies`` go where they are missing or differ. With ``addresses`` (how
    the hosts reach each other), each file goes straight from the host that has it to those
    that lack it; what cannot (a host that cannot listen there or cannot be reached) goes
    through this machine. Raises ``SyncError`` (naming host and file) when a host cannot be
    read or written, and (``owner_check``, as a push: ``--insecure-workdir`` turns it off) where
    another user owns or may write the folder or one above it, on any host."""
    started = time.monotonic()
    senders = {h.name: HostSender(transport, h, roots[h.name], owner_check=owner_check) for h in hosts}
    pool = ThreadPoolExecutor(max_workers=max(1, min(32, 2 * len(hosts))), thread_name_prefix="dlrun-ckpt")
    relayed: dict[str, list[Choice]] = {}
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
        targets = [h for h in hosts if wanted[h.name]]
        if moving and addresses is not None and all(h.name in addresses for h in hosts):
            relayed = _direct(transport, targets, senders, roots, wanted, addresses, pool, owner_check)
            for sender in senders.values():  # the sources stop serving
                sender.close()
            if any(relayed.values()):  # fresh sessions: a serving helper sends nothing more
                senders = {h.name: HostSender(transport, h, roots[h.name], owner_check=owner_check) for h in hosts}
                _relay(transport, hosts, senders, roots, relayed, folder, pool, listed=False, owner_check=owner_check)
        elif moving:
            relayed = {h.name: wanted[h.name] for h in targets}
            _relay(transport, hosts, senders, roots, relayed, folder, pool, listed=True, owner_check=owner_check)
    finally:
        for sender in senders.values():
            sender.close()
        pool.shutdown(wait=True)
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
        relayed=sum(len(cs) for cs in relayed.values()),
    )


def _direct(transport: Transport, targets: Sequence[Host], senders: Mapping[str, HostSender],
            roots: Mapping[str, str], wanted: Mapping[str, Sequence[Choice]], addresses: Mapping[str, str],
            pool: ThreadPoolExecutor, owner_check: bool) -> dict[str, list[Choice]]:
    """Host to host: each source's helper listens (TLS with a certificate made for this copy,
    and a token), each target's push helper fetches its files from there. What is left for
    the relay, per target: files whose source could not listen, and a target's files when any
    of its sources could not be reached."""
    from dlrun.tls import make_job_tls

    tls = make_job_tls("checkpoint copy")
    token = secrets.token_hex(16)
    by_source: dict[str, set[str]] = {}
    for cs in wanted.values():
        for c in cs:
            by_source.setdefault(c.host, set()).add(c.path)
    ports: dict[str, int] = {}
    for name, paths in by_source.items():
        try:
            ports[name] = senders[name].serve(sorted(paths), addresses[name], token, tls.cert_pem, tls.key_pem)
        except SyncError:
            pass  # its files go through this machine

    def push(host: Host) -> list[Choice]:
        direct = [c for c in wanted[host.name] if c.host in ports]
        left = [c for c in wanted[host.name] if c.host not in ports]
        if not direct:
            return left
        sources = [{"address": addresses[src], "port": ports[src], "token": token, "cert": tls.cert_pem,
                    "paths": [c.path for c in direct if c.host == src]} for src in ports]
        try:
            _push_copies(transport, host, roots[host.name], direct, {}, sources=sources, owner_check=owner_check)
        except SyncError:
            return list(wanted[host.name])  # the relay's survey skips what did arrive
        return left

    return {h.name: cs for h, cs in zip(targets, pool.map(push, targets), strict=True)}


def _relay(transport: Transport, hosts: Sequence[Host], senders: Mapping[str, HostSender], roots: Mapping[str, str],
           wanted: Mapping[str, Sequence[Choice]], folder: str, pool: ThreadPoolExecutor, *, listed: bool,
           owner_check: bool) -> None:
    """Through this machine: each file once from its source into a temporary folder here, then
    pushed to the targets. ``listed``: the senders have listed already (else they list now;
    a file that changed since the choice fails its check)."""
    moving = {c.path: c for cs in wanted.values() for c in cs}
    staging = Path(tempfile.mkdtemp(prefix="dlrun-ckpt-"))
    try:
        staged_bytes = sum(c.entry.size for c in moving.values())
        free = shutil.disk_usage(staging).free
        if staged_bytes > free:
            raise SyncError(f"checkpoint folder {folder}: {human_bytes(staged_bytes)} must pass through {staging}"
                            f" on this machine, which has {human_bytes(free)} free",
                            hint="point TMPDIR at a filesystem with room for the files that differ")
        if not listed:
            list(pool.map(lambda s: s.listing(), senders.values()))
        by_source: dict[str, list[Choice]] = {h.name: [] for h in hosts}
        for choice in moving.values():
            by_source[choice.host].append(choice)
        for name, chosen in by_source.items():  # the helper sends what it lists now: the same, or no copy
            now = senders[name].listed
            assert now is not None
            for c in chosen:
                there = now.entries.get(c.path)
                if there is None or not there.same_content(c.entry):
                    raise SyncError(f"checkpoint file {c.path} changed while it was being copied", host=name,
                                    hint="the next attempt's copy starts over")

        def fetch(name: str) -> None:
            now = senders[name].listed
            assert now is not None
            items = [(now.entries[c.path], staging / str(idx) / c.path) for idx, c in enumerate(by_source[name])]
            _, failures = senders[name].fetch(items, staging)
            if failures:
                first = failures[0]
                raise SyncError(f"checkpoint file {first.path} could not be fetched: {first.message}", host=name)

        list(pool.map(fetch, senders))
        staged = {c.path: staging / str(idx) / c.path for cs in by_source.values() for idx, c in enumerate(cs)}
        targets = [h for h in hosts if wanted.get(h.name)]
        list(pool.map(lambda h: _push_copies(transport, h, roots[h.name], wanted[h.name], staged,
                                             owner_check=owner_check), targets))
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _push_copies(transport: Transport, host: Host, root: str, choices: Sequence[Choice],
                 staged: Mapping[str, Path], *, sources: Sequence[Mapping[str, Any]] = (),
                 owner_check: bool = True) -> None:
    from dlrun.push.session import PushTarget, _HostPush

    entries = []
    for c in sorted(choices, key=lambda c: c.path):
        mtime = int(c.entry.mtime_ns // 1_000_000_000)
        if c.entry.kind == "link":
            entries.append(FileEntry(c.path, 0, 0, "", link=c.entry.link, source=Source(mtime=mtime)))
        else:
            file = os.fspath(staged[c.path]) if c.path in staged else None  # None: a source host sends it
            entries.append(FileEntry(c.path, c.entry.size, c.entry.mode, c.entry.sha256,
                                     source=Source(file=file, mtime=mtime)))
    target = PushTarget("checkpoint", root, Manifest(tuple(entries)))
    _HostPush(transport, host, [target], delete=False, progress=None, file_progress=None,
              cancel=threading.Event(), sources=sources, owner_check=owner_check).run()


def sync_folders(transport: Transport, hosts: Sequence[Host], cwd_of: Callable[[Host], str],
                 folders: Sequence[str], *, failed_at: float | None = None,
                 addresses: Mapping[str, str] | None = None, owner_check: bool = True) -> list[CheckpointSync]:
    """``sync_folder`` for each of ``folders`` (relative to each host's ``cwd_of(host)``)."""
    import posixpath

    return [sync_folder(transport, hosts, {h.name: posixpath.join(cwd_of(h), folder) for h in hosts}, folder,
                        failed_at=failed_at, addresses=addresses, owner_check=owner_check) for folder in folders]
