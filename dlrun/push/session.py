"""The push itself: per host, one channel to ``dlrun.remote.push_helper``, in parallel.

What gets sent is planned by ``dlrun.push.tree`` (manifests, ignore rules, size guard) and
``dlrun.push.shard`` (data shards); this module speaks the protocol with the host helper,
started by the bootstrap (``boot_argv``, then ``boot_payload`` on its stdin):

1. dlrun sends one JSON line: per target (code, data) its remote root and the local paths.
   The helper answers one JSON line: the remote state of those paths and of the paths an
   earlier push wrote (size, mode, sha256 — cached by stat on the host in
   ``<parent>/.dlrun-cache/<root name>.json``), free space, and a permission problem if any.
2. dlrun diffs, checks free space and permissions (a problem: ``{"abort": true}``, nothing is
   written; the same when there is nothing to send, delete or record, or for a dry run), then
   sends the plan (deletions; expected sha256 and mode per file) and one tar stream with only
   new or changed files, one SSH packet per write, while a thread reads the replies.
3. The helper deletes files that an earlier push wrote and that are gone locally (never files
   a job created), writes each file under a temporary name (``.dlrun-part-*``) in its final
   directory, verifies its sha256, renames it into place and reports per file. A code tree is
   built so in ``<workdir>/.dlrun-versions/<project>/next`` (a hard-link clone of the current
   one) and swapped in with one rename of the ``<workdir>/<project>`` symlink (docs/push.md).
   EOF in the middle (dlrun killed, Ctrl-C, dropped connection) removes the partial temporary
   file and leaves the old tree in place; the next push sends only what is missing or
   different in ``next``.

A plan may also name ``sources``: other hosts' helpers serving some of the files
(``dlrun.push.checkpoint``); the helper then fetches those from there over TLS after the
stream, with the same checks.

A file counts as pushed (and so may be deleted) only while it is the file the push wrote: the
same inode, as recorded. Nothing is read, written or deleted through a symlink below the root.
``dlrun launch`` asks step 1 of each host's agent instead, with the preflight probe (the agent
runs the helper's ``survey`` in-process, from ``helper_source()``); a host whose answer says
there is nothing to do (``settled_push``) gets no helper session at all.
"""

from __future__ import annotations

import contextlib
import io
import json
import queue
import re
import shlex
import tarfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from dlrun.errors import DlrunError, HostUnreachable, RemoteCommandError, SyncError, TransportError, UsageError
from dlrun.inventory import Host
from dlrun.push.shard import SHARD_POLICIES, plan_data, remote_data_dir, shard_env
from dlrun.push.tree import (
    DATA_DIR_NAME,
    DEFAULT_LOG_DIR,
    FileEntry,
    HashCache,
    IgnoreRule,
    Manifest,
    PushLimit,
    RemoteEntry,
    RemoteTree,
    TransferPlan,
    check_project,
    check_space,
    default_cache_path,
    diff_manifests,
    largest_items,
    remote_code_dir,
    scan_tree,
)
from dlrun.remote import boot_argv, boot_payload, source_of
from dlrun.render import printable
from dlrun.transport.base import Channel, Transport, default_python

# Kept importable from here, where dlrun.run and older callers import them.
__all__ = ["HostPushSummary", "Manifest", "PushTarget", "code_dir_on", "code_target",
           "helper_source", "push", "scan_code", "settled_push", "shard_env", "survey_request"]

# One SSH packet: OpenSSH's 32 KiB maximum less the 64 bytes paramiko keeps for the header. A
# 64 KiB write went out as 32704 + 32704 + 128 bytes, three packets where two would do.
SEND_CHUNK = 32 * 1024 - 64
READ_CHUNKS = 8  # SEND_CHUNKs per read of a local file

ProgressHook = Callable[[str, int, int], None]
DEFAULT_LIMIT = PushLimit()  # 200 MiB, 20,000 files (dlrun.push.tree)


def helper_source() -> str:
    """The push helper's source (``dlrun.remote.push_helper``): what ``dlrun.remote.agent``'s
    ``survey`` op is sent to run in-process."""
    return source_of("push_helper")



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
    dry_run: bool = False  # nothing was written: the counts say what a push would do
    largest: tuple[tuple[str, int, int], ...] = ()  # what would be sent: (name, bytes, files), largest first
    deleting: tuple[str, ...] = ()  # what would be deleted (a dry run)
    # older versions of the code tree left in place: they hold files a job wrote there after a
    # later push, found nowhere else (docs/push.md)
    kept: tuple[str, ...] = ()


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
        unsafe=tuple((str(a), str(b), str(c)) for a, b, c in raw.get("unsafe") or ()),
    )


class _Pieces:
    """The tar stream in SEND_CHUNK pieces, sent as the buffer of READ_CHUNKS pieces fills.

    File bytes are read straight into that buffer (``readinto``, one read for several packets:
    each blocking call lets another host's thread take the GIL), and each piece is a view of it
    (``Channel.send`` copies before it returns), so a byte is copied once here.
    """

    def __init__(self, send: Callable[[memoryview], None]) -> None:
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
            self.send(self.view[start : min(start + SEND_CHUNK, fill)])


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
                 cancel: threading.Event, dry_run: bool = False, sources: Sequence[Mapping[str, Any]] = (),
                 owner_check: bool = True) -> None:
        self.transport = transport
        self.owner_check = owner_check
        # other hosts' helpers that send some of target 0's files straight to this one
        # (``address``, ``port``, ``token``, ``cert``, ``paths``: dlrun.push.checkpoint)
        self.sources = sources
        self.dry_run = dry_run
        self.host = host
        self.targets = targets
        self.delete = delete
        self.progress = progress
        self.file_progress = file_progress
        self.cancel = cancel
        self.channel: Channel | None = None
        self.kept: tuple[str, ...] = ()
        self.argv = boot_argv([*default_python(host), *HELPER_FLAGS], "push_helper")
        self.command = shlex.join([a if len(a) <= 200 else "<dlrun loader>" for a in self.argv])

    def run(self) -> HostPushSummary:
        started = time.monotonic()
        channel = self.channel = self.transport.open(self.host, self.argv)
        try:
            replies = _Replies(channel)
            self._send(boot_payload("push_helper"), replies)  # the program, before its protocol
            self._send_line(survey_request(self.targets, owner_check=self.owner_check), replies)
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
                return replace(nothing, seconds=time.monotonic() - started, dry_run=self.dry_run)
            try:
                self._check(trees, plans)
            except SyncError:
                self._send_line({"abort": True}, replies)
                channel.close_stdin()
                channel.wait(10)
                raise
            if self.dry_run:  # the helper ends on "abort" having written nothing
                self._send_line({"abort": True}, replies)
                channel.close_stdin()
                channel.wait(10)
                return self._dry_run_summary(trees, plans, time.monotonic() - started)
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
                kept=self.kept,
                code_dir=next((tree.root for t, tree in zip(self.targets, trees, strict=True) if t.label == "code"),
                              None),
                data_dir=next((tree.root for t, tree in zip(self.targets, trees, strict=True) if t.label == "data"),
                              None),
            )
        finally:
            channel.close()

    def _dry_run_summary(self, trees: Sequence[RemoteTree], plans: Sequence[TransferPlan],
                         seconds: float) -> HostPushSummary:
        named = [(f"{'[data] ' if t.label == 'data' else ''}{e.path}", e.size)
                 for t, plan in zip(self.targets, plans, strict=True) for e in plan.send]
        roots = {t.label: tree.root for t, tree in zip(self.targets, trees, strict=True)}
        return HostPushSummary(
            host=self.host.name,
            files_sent=sum(len(p.send) for p in plans),
            bytes_sent=sum(p.bytes_to_send for p in plans),
            files_unchanged=sum(len(p.unchanged) for p in plans),
            files_deleted=sum(len(p.delete) for p in plans),
            seconds=seconds,
            code_dir=roots.get("code"),
            data_dir=roots.get("data"),
            dry_run=True,
            largest=largest_items(named),
            deleting=tuple(f"{'[data] ' if t.label == 'data' else ''}{path}"
                           for t, plan in zip(self.targets, plans, strict=True) for path in plan.delete),
        )

    def _send_line(self, message: Mapping[str, Any], replies: _Replies) -> None:
        self._send(json.dumps(message).encode() + b"\n", replies)

    def _send(self, data: bytes | memoryview, replies: _Replies) -> None:
        assert self.channel is not None
        try:
            self.channel.send(data)
        except HostUnreachable as exc:
            code = self.channel.wait(2)
            if code not in (None, 0):
                raise self._helper_failed("the push helper stopped", replies) from exc
            raise

    def _check(self, trees: Sequence[RemoteTree], plans: Sequence[TransferPlan]) -> None:
        check_owners(self.host.name, trees)
        for tree in trees:
            if tree.error:
                raise SyncError(f"{tree.error}: {tree.error_path or tree.root}", host=self.host.name,
                                hint=f"dlrun writes to {tree.root}: check the workdir in the inventory and the "
                                "directory's owner and mode")
        check_space(self.host.name, trees, plans)

    def _transfer(self, trees: Sequence[RemoteTree], plans: Sequence[TransferPlan],
                  replies: _Replies) -> tuple[int, list[dict[str, Any]], int]:
        assert self.channel is not None
        direct = {p for source in self.sources for p in source["paths"]}
        items = [(f"{index}/{entry.path}", entry) for index, plan in enumerate(plans) for entry in plan.send
                 if not (index == 0 and entry.path in direct)]
        plan_message: dict[str, Any] = {
            "files": [[index, e.path, e.sha256, e.mode, e.source.mtime if e.source else 0]
                      for index, plan in enumerate(plans) for e in plan.send],
            "delete": [[index, path] for index, plan in enumerate(plans) for path in plan.delete],
            "keep": [list(plan.unchanged) for plan in plans],
        }
        if self.sources:
            needed = {e.path for e in plans[0].send}
            plan_message["sources"] = [
                {"address": s["address"], "port": s["port"], "token": s["token"], "cert": s["cert"],
                 "files": [f"0/{p}" for p in s["paths"] if p in needed]}
                for s in self.sources if any(p in needed for p in s["paths"])]
        self._send_line(plan_message, replies)
        outcome: dict[str, Any] = {"failures": [], "deleted": 0, "done": None, "kept": ()}
        total = sum(len(plan.send) for plan in plans)
        collector = threading.Thread(target=self._collect, args=(replies, total, outcome), daemon=True)
        collector.start()
        sent = self._stream(items, replies)
        self.channel.close_stdin()
        collector.join()
        if outcome["done"] is None:
            raise self._helper_failed("the push helper stopped before reporting every file", replies)
        self.channel.wait(30)
        self.kept = outcome["kept"]
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
            elif "kept" in message:
                outcome["kept"] = tuple(str(path) for path in message["kept"])
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
            hint="the host needs python >= 3.8 as the inventory's 'python' (default python3)",
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
    log_dir: str | Path | None = DEFAULT_LOG_DIR,
    limit: PushLimit | None = DEFAULT_LIMIT,
    dry_run: bool = False,
    insecure_workdir: bool = False,
) -> tuple[HostPushSummary, ...]:
    """Bring ``code_dir`` (to ``remote_code_dir``) and each host's shard of ``data_dir`` (to
    ``remote_data_dir``) up to date on every host, in parallel; one summary per host, in order.

    ``project`` defaults to the code directory's name. ``delete`` removes files an earlier push
    wrote that are gone locally (or, for data, no longer in the host's shard). ``progress(host,
    bytes_done, bytes_total)`` and ``file_progress(host, files_done, files_total)`` are called
    from the hosts' threads. ``leave_out``: a directory inside ``code_dir`` not to send with
    the code (the dataset, pushed as shards on its own). ``log_dir``: the job's log folder, left
    out of the code wherever it is (relative: from the current directory). ``limit``: a code
    push over it stops before anything is hashed or sent (data shards are not limited).
    ``dry_run``: survey each host and return what a push would send and delete
    (``HostPushSummary.dry_run``), writing nothing anywhere. ``insecure_workdir``: push even into
    folders another user owns or may write (``check_owners``). Raises ``SyncError`` (space, permissions, verification),
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
        code_manifest, data_manifests = _plan_local(
            code_root, data_root, len(hosts), shard, split_lines, leave_root,
            log_dir=Path(log_dir).resolve() if log_dir is not None else None, limit=limit, save_cache=not dry_run)
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
                      cancel=cancel, dry_run=dry_run, owner_check=not insecure_workdir)
            for host, targets in zip(hosts, host_targets, strict=True)]
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
    lines = "\n".join(f"  {exc.host}: {exc.message}" if isinstance(exc, DlrunError) and exc.host else f"  {exc}"
                      for exc in failures)
    hints = dict.fromkeys(exc.hint for exc in failures if isinstance(exc, DlrunError) and exc.hint)  # each once
    # hosts that could not be reached (or whose login shell never started the helper) exit 255, as one does
    kind = TransportError if all(isinstance(exc, TransportError) for exc in failures) else SyncError
    raise kind(f"push failed on {len(failures)} of {len(hosts)} hosts:\n{lines}",
               hint="; ".join([*hints, "hosts not listed are up to date"]))


def _plan_local(code_root: Path | None, data_root: Path | None, count: int, shard: str, split_lines: bool,
                leave_out: Path | None = None, *, log_dir: Path | None = None, limit: PushLimit | None = None,
                save_cache: bool = True) -> tuple[Manifest | None, tuple[Manifest, ...] | None]:
    """The code manifest (without the dataset, which goes in shards, when it lies inside the
    code: ``data_root``, or ``leave_out`` when the data is pushed on its own; without the
    folders left out by default and the log folder ``log_dir``; within ``limit``) and the shards."""
    code_manifest = data_manifests = None
    if code_root is not None:
        extra: tuple[IgnoreRule, ...] = ()
        inside = leave_out or data_root
        if inside is not None and inside.is_relative_to(code_root) and inside != code_root:
            nested = inside.relative_to(code_root).as_posix()
            extra = (IgnoreRule(pattern=f"/{nested}", regex=re.escape(nested)),)
        logs = ([log_dir.relative_to(code_root).as_posix()]
                if log_dir is not None and log_dir.is_relative_to(code_root) and log_dir != code_root else [])
        cache = HashCache(default_cache_path(code_root))
        code_manifest = scan_tree(code_root, extra_rules=extra, cache=cache, leave_out_defaults=True,
                                  left_out_folders=logs, limit=limit)
        if save_cache:
            cache.save()
    if data_root is not None:
        cache = HashCache(default_cache_path(data_root))
        data_manifests = plan_data(data_root, count, shard, split_lines=split_lines, cache=cache)
        if save_cache:
            cache.save()
    return code_manifest, data_manifests


# =============================================================================== a push with nothing to do


def check_owners(host: str, trees: Sequence[RemoteTree]) -> None:
    """Refuse a push (and so a launch) into folders another user could write or owns
    (``dlrun.remote.push_helper.unsafe_folders``): a SyncError naming each folder and its fix."""
    unsafe = list(dict.fromkeys(problem for tree in trees for problem in tree.unsafe))
    if unsafe:
        raise unsafe_error(host, unsafe, "pushed or started")


def unsafe_error(host: str, unsafe: Sequence[tuple[str, str, str]], what: str) -> SyncError:
    """The refusal of ``check_owners`` (and of a checkpoint copy: ``what`` says what did not happen)."""
    lines = "\n".join(f"  {printable(folder)} {problem}: {printable(fix)}" for folder, problem, fix in unsafe)
    return SyncError(f"another user could plant code that the job runs; nothing was {what}:\n{lines}",
                     host=host, hint="fix the folders above, or pass --insecure-workdir to accept the risk")


def survey_request(targets: Sequence[PushTarget], *, owner_check: bool = True) -> dict[str, Any]:
    """The survey message of the protocol: per target its remote root and the local paths.

    The helper reads it first; ``dlrun.remote.agent`` answers it too (op ``survey``, running
    ``helper_source()``'s ``survey`` in-process), so that a launch learns whether its code is
    already on a host without a second session and interpreter there.
    """
    return {"targets": [{"root": t.root, "paths": list(t.manifest.paths()), "owner_check": owner_check,
                         "folders": [list(f) for f in t.manifest.folders], "versioned": t.label == "code"}
                        for t in targets],
            "idle": HELPER_IDLE_S}


def scan_code(code_root: Path, leave_out: Path | None = None, *, log_dir: str | Path | None = DEFAULT_LOG_DIR,
              limit: PushLimit | None = DEFAULT_LIMIT, save_cache: bool = True) -> Manifest:
    """The code manifest ``push(code_dir=code_root, leave_out=…, log_dir=…, limit=…)`` sends
    (hashes cached by stat; a push over ``limit`` raises ``UsageError`` before any hashing)."""
    manifest, _ = _plan_local(code_root.resolve(), None, 1, "files", False,
                              leave_out.resolve() if leave_out is not None else None,
                              log_dir=Path(log_dir).resolve() if log_dir is not None else None, limit=limit,
                              save_cache=save_cache)
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
    if (not settled or any(tree.error or tree.unsafe for tree in trees)
            or any(plan.send or plan.delete for plan in plans)):
        return None
    roots = {t.label: tree.root for t, tree in zip(targets, trees, strict=True)}
    return HostPushSummary(host=host, files_sent=0, bytes_sent=0,
                           files_unchanged=sum(len(plan.unchanged) for plan in plans), files_deleted=0,
                           seconds=0.0, code_dir=roots.get("code"), data_dir=roots.get("data"))


# =============================================================================== --no-push


def check_in_place(transport: Transport, hosts: Sequence[Host], folders: Mapping[str, Sequence[str]]) -> None:
    """``--no-push``: the folders a job runs in and reads its script from (``folders``: host name
    → paths as on the host, relative to the home folder) pass the check a push's folder does
    (``check_owners``), asked of each host's push helper in parallel; nothing is written."""
    chosen = [h for h in hosts if folders.get(h.name)]
    if not chosen:
        return

    def ask(host: Host) -> None:
        targets = [PushTarget("in place", folder, Manifest(entries=())) for folder in folders[host.name]]
        job = _HostPush(transport, host, targets, delete=False, progress=None, file_progress=None,
                        cancel=threading.Event(), dry_run=True)
        channel = job.channel = transport.open(host, job.argv)
        try:
            replies = _Replies(channel)
            job._send(boot_payload("push_helper"), replies)
            request = survey_request(targets)
            for spec in request["targets"]:
                spec["versioned"] = False
            job._send_line(request, replies)
            first = replies.get()
            if first is None or "targets" not in first:
                raise job._helper_failed("the push helper did not report the host's folders", replies)
            job._send_line({"abort": True}, replies)
            check_owners(host.name, [_parse_tree(raw) for raw in first["targets"]])
        finally:
            channel.close()

    with ThreadPoolExecutor(max_workers=min(32, len(chosen)), thread_name_prefix="dlrun-check") as pool:
        futures = [pool.submit(ask, host) for host in chosen]
    failures = [exc for exc in (f.exception() for f in futures) if exc is not None]
    if len(failures) == 1:
        raise failures[0]
    if failures:
        lines = "\n".join(f"  {exc.host}: {exc.message}" if isinstance(exc, DlrunError) and exc.host else f"  {exc}"
                          for exc in failures)
        raise SyncError(f"the folders the job would run in failed the check on {len(failures)} hosts:\n{lines}",
                        hint="fix the folders above, or pass --insecure-workdir to accept the risk")
