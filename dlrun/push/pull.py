"""Bringing files from the hosts: ``dlrun pull`` and the transfers of ``--checkpoint-dir``.

The push helper (``dlrun.remote.push_helper``) in its sending mode, one channel per host:

1. dlrun sends ``{"send": {"root"}, "idle"}``; the helper answers one JSON line
   ``{"listing": {"root", "dir", "entries", "missing", "error", "now"}}``: per path (relative
   to the root; a single file: its name) ``[kind, size, mode, sha256 or link target,
   mtime_ns]``, and the host's clock. Hashes are cached by stat on the host, beside the push's
   record (``<parent>/.dlrun-cache/<name>.hashes.json``).
2. dlrun plans (``plan_pull``: files the same on every host once, the rest per host; only what
   differs from the local copy) and sends ``{"files": [paths]}`` or ``{"abort": true}``.
3. The helper sends one tar stream of exactly those files as listed; dlrun writes each under
   a temporary name (``.dlrun-part-*``) beside its final place, checks its sha256 against the
   listing, sets mode and mtime and renames it into place. A file that changed on the host
   since it was listed fails that check and is named; the old local copy stays. Local files
   are never deleted.

The stream comes over the TLS side channel of ``dlrun logs`` (``dlrun.transport.side``) where
the transport reached the host over its own TCP connection and the host has ``SIDE_FROM`` bytes
or more to send: the files request carries the offer (certificate, key, token, and the source of
``dlrun.remote.jobs``, whose ``side_channel`` the helper runs), the helper says ``T {"port"}``
(``T {}``: it cannot listen), dlrun connects, and OpenSSL decrypts with the GIL released, where
paramiko's transport thread would hold it for every 32 KiB packet. A host whose port cannot be
reached, or that closes the side channel before the first byte, sends over SSH instead
(``sendfile`` into the channel), and is not offered it again by the same pull. A side channel
that breaks off later (an error, a reset, or ``SIDE_IDLE_S`` without a byte) while the SSH
connection still works ends that helper; a fresh one lists again and sends the files not yet
in place over SSH (one that changed since the first listing is named). Each host that fell
back is named through ``notice``; ``DLRUN_SIDE_CHANNEL=0`` turns the side channel off.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import posixpath
import shlex
import socket
import ssl
import stat
import tarfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from dlrun.errors import DlrunError, HostUnreachable, RemoteCommandError, SyncError, UsageError
from dlrun.inventory import Host
from dlrun.push.tree import (
    HashCache,
    PushLimit,
    check_project,
    default_cache_path,
    human_bytes,
    largest_items,
    remote_code_dir,
    sha256_file,
)
from dlrun.remote import boot_argv, boot_payload, source_of
from dlrun.transport.base import Channel, Transport, default_python
from dlrun.transport.side import OPT_OUT, SideChannel, TlsSource, connect_side, side_enabled

ProgressHook = Callable[[str, int, int], None]
PART = ".dlrun-part-"
HELPER_FLAGS = ("-S",)  # dlrun.push.session.HELPER_FLAGS
HELPER_IDLE_S = 300
SIDE_FROM = 1 << 20  # bytes from one host from which its files come over the TLS side channel
SIDE_IDLE_S = 60.0  # seconds without a byte on the side channel before the rest comes over SSH


@dataclass(frozen=True)
class RemoteFile:
    """One path a host listed: a file (size, mode, sha256) or a link (its target)."""

    path: str
    kind: str  # "file" or "link"
    size: int
    mode: int
    sha256: str
    mtime_ns: int
    link: str | None = None

    def same_content(self, other: RemoteFile) -> bool:
        return self.kind == other.kind and self.sha256 == other.sha256 and self.link == other.link


@dataclass(frozen=True)
class Listing:
    """A host's tree at a root: ``entries`` by path; ``offset``: the host's clock minus ours
    (seconds, measured when the listing arrived)."""

    host: str
    root: str  # resolved on the host; for a single file, its folder
    entries: Mapping[str, RemoteFile]
    is_dir: bool = True
    missing: bool = False
    error: str | None = None
    offset: float = 0.0


@dataclass(frozen=True)
class PullItem:
    """One file to bring from ``host``'s ``entry`` to ``dest`` (relative to the local root)."""

    host: str
    entry: RemoteFile
    dest: str


@dataclass(frozen=True)
class PullPlan:
    """What a pull writes (``fetch``), what is already in place, and which hosts lack the root."""

    fetch: tuple[PullItem, ...]
    unchanged: tuple[PullItem, ...]
    shared: int  # paths the same on every host (written once)
    per_host: int  # paths written per host
    missing: tuple[str, ...] = ()

    @property
    def bytes_to_fetch(self) -> int:
        return sum(i.entry.size for i in self.fetch)


@dataclass(frozen=True)
class HostPullSummary:
    """What a pull did with one host: files and bytes received, what was already in place."""

    host: str
    files_received: int
    bytes_received: int
    files_unchanged: int
    seconds: float
    root: str = ""
    missing: bool = False
    dry_run: bool = False
    largest: tuple[tuple[str, int, int], ...] = ()


@dataclass
class FetchFailure:
    host: str
    path: str
    message: str


# =============================================================================== one host


class _Stream:
    """The helper's stdout (or its side channel) as a byte stream: lines, then exact counts of
    bytes. ``recv(n)``: up to ``n`` bytes, ``b""`` at the end."""

    def __init__(self, recv: Callable[[int], bytes]) -> None:
        self.recv = recv
        self.buf = b""
        self.pos = 0

    def _more(self) -> bool:
        data = self.recv(1 << 18)
        if not data:
            return False
        self.buf = self.buf[self.pos:] + data if self.pos < len(self.buf) else data
        self.pos = 0
        return True

    def readline(self) -> bytes:
        while True:
            end = self.buf.find(b"\n", self.pos)
            if end >= 0:
                line = self.buf[self.pos:end]
                self.pos = end + 1
                return line
            if not self._more():
                return b""

    def chunks(self, n: int) -> Iterator[memoryview]:
        """Exactly ``n`` bytes in pieces (EOFError if the stream ends first)."""
        while n > 0:
            if self.pos >= len(self.buf) and not self._more():
                raise EOFError
            take = min(n, len(self.buf) - self.pos)
            yield memoryview(self.buf)[self.pos:self.pos + take]
            self.pos += take
            n -= take

    def read(self, n: int) -> bytes:
        return b"".join(bytes(c) for c in self.chunks(n))


class _SocketStream(_Stream):
    """The side channel as the same byte stream, read with ``recv_into`` into one buffer, so a
    file's bytes are hashed and written a megabyte at a time (a TLS read gives one 16 KiB
    record). ``first``: bytes already read."""

    def __init__(self, recv_into: Callable[[memoryview], int], first: bytes) -> None:
        super().__init__(lambda n: b"")
        self.recv_into = recv_into
        self.mem = bytearray(max(1 << 20, len(first)))
        self.mem[:len(first)] = first
        self.start, self.end = 0, len(first)

    def _fill(self, want: int) -> bool:
        """At least ``want`` (at most the buffer's size) bytes from ``start``; False at the end."""
        if self.start == self.end:
            self.start = self.end = 0
        elif len(self.mem) - self.start < want:
            self.mem[:self.end - self.start] = self.mem[self.start:self.end]
            self.end -= self.start
            self.start = 0
        with memoryview(self.mem) as view:
            while self.end - self.start < want:
                got = self.recv_into(view[self.end:])
                if not got:
                    return False
                self.end += got
        return True

    def readline(self) -> bytes:
        raise NotImplementedError  # the side channel carries only the tar stream

    def chunks(self, n: int) -> Iterator[memoryview]:
        while n > 0:
            if self.start == self.end and not self._fill(min(n, len(self.mem))):
                raise EOFError
            take = min(n, self.end - self.start)
            with memoryview(self.mem) as view:
                yield view[self.start:self.start + take]
            self.start += take
            n -= take


def safe_path(path: str) -> bool:
    """A relative POSIX path that stays below its root (no ``..``, empty or absolute part)."""
    parts = path.split("/")
    return bool(path) and not path.startswith("/") and all(p not in ("", ".", "..") for p in parts) \
        and "\0" not in path


def _parse_listing(host: str, raw: Mapping[str, Any], arrived: float) -> Listing:
    entries = {}
    for path, (kind, size, mode, value, mtime_ns) in raw.get("entries", {}).items():
        if not safe_path(path) or kind not in ("file", "link"):
            raise SyncError(f"the host listed {path!r} ({kind}), which is not a file below {raw.get('root')}",
                            host=host)
        entries[path] = RemoteFile(path=path, kind=kind, size=int(size), mode=int(mode),
                                   sha256=value if kind == "file" else "", mtime_ns=int(mtime_ns),
                                   link=value if kind == "link" else None)
    now = raw.get("now")
    return Listing(host=host, root=str(raw["root"]), entries=entries, is_dir=bool(raw.get("dir", True)),
                   missing=bool(raw.get("missing")), error=raw.get("error"),
                   offset=float(now) - arrived if now is not None else 0.0)


class HostSender:
    """One session with a host's push helper in sending mode: ``listing``, then ``fetch`` or
    ``close``."""

    def __init__(self, transport: Transport, host: Host, root: str, *, owner_check: bool = False,
                 side: SideChannel | None = None) -> None:
        self.transport, self.host, self.root = transport, host, root
        self.owner_check = owner_check  # a checkpoint copy: refuse folders another user could write
        self.side = side  # offer the files' TLS side channel (dlrun.transport.side) where it can be reached
        self.tls: ssl.SSLSocket | None = None
        self.argv = boot_argv([*default_python(host), *HELPER_FLAGS], "push_helper")
        self.command = shlex.join([a if len(a) <= 200 else "<dlrun loader>" for a in self.argv])
        self.channel: Channel | None = None
        self.stream: _Stream | None = None
        self.listed: Listing | None = None

    def listing(self) -> Listing:
        channel = self.channel = self.transport.open(self.host, self.argv)
        self.stream = _Stream(channel.recv)
        channel.send(boot_payload("push_helper"))
        request: dict[str, Any] = {"root": self.root}
        if self.owner_check:
            request["owner_check"] = True
        channel.send(json.dumps({"send": request, "idle": HELPER_IDLE_S}).encode() + b"\n")
        line = self.stream.readline()
        arrived = time.time()
        try:
            raw = json.loads(line)["listing"]
        except (ValueError, KeyError, TypeError):
            raise self._failed("the push helper did not list the host's files", line) from None
        if raw.get("unsafe"):
            from dlrun.push.session import unsafe_error

            raise unsafe_error(self.host.name, [tuple(u) for u in raw["unsafe"]], "copied")
        self.listed = _parse_listing(self.host.name, raw, arrived)
        side = self.side
        if side is not None and self.host.name not in side.refused and not self.host.is_local \
                and sum(e.size for e in self.listed.entries.values()) >= SIDE_FROM:
            # its certificate is made while the other hosts list (the fetch offers it)
            threading.Thread(target=side.prepare, args=(self.host.name,), name=f"dlrun-side-{self.host.name}",
                             daemon=True).start()
        return self.listed

    def fetch(self, items: Sequence[tuple[RemoteFile, Path]], root: Path, *, progress: ProgressHook | None = None,
              file_progress: ProgressHook | None = None, cancel: threading.Event | None = None,
              ) -> tuple[int, list[FetchFailure]]:
        """Receive ``items`` (a listed entry, its local path below ``root``) in one stream;
        bytes written and the files that failed (each named; the others are in place). Nothing
        is written through a link below ``root``."""
        assert self.channel is not None and self.stream is not None and self.listed is not None
        if not items:
            if progress is not None:
                progress(self.host.name, 0, 0)
            self.close()
            return 0, []
        total = sum(e.size for e, _ in items)
        self._ask(items, total)
        done = written = count = 0
        failures: list[FetchFailure] = []
        if progress is not None:
            progress(self.host.name, 0, total)
        if file_progress is not None:
            file_progress(self.host.name, 0, len(items))
        try:
            rest = list(items)
            while rest:
                try:
                    while rest:
                        entry, dest = rest[0]
                        if cancel is not None and cancel.is_set():
                            raise KeyboardInterrupt
                        name = self._header()
                        if name != entry.path:
                            raise self._failed(f"the push helper sent {name!r} where {entry.path!r} was due", b"")
                        problem = self._receive(entry, dest, root, progress, done, total)
                        rest.pop(0)
                        done += entry.size
                        count += 1
                        if problem is None:
                            written += entry.size
                        else:
                            failures.append(FetchFailure(self.host.name, dest.relative_to(root).as_posix(), problem))
                        if file_progress is not None:
                            file_progress(self.host.name, count, len(items))
                except (EOFError, HostUnreachable) as exc:
                    if self.tls is None or (cancel is not None and cancel.is_set()) or self._lost():
                        if isinstance(exc, EOFError):
                            raise self._failed("the push helper stopped before sending every file", b"") from None
                        raise
                    # the side channel broke off while SSH still works: the rest over SSH
                    rest, changed = self._fall_back(rest, exc)
                    for entry, dest in changed:
                        done += entry.size
                        count += 1
                        failures.append(FetchFailure(self.host.name, dest.relative_to(root).as_posix(),
                                                     "changed on the host while pulling (listed again to send"
                                                     " it over SSH)"))
        finally:
            self.close()
        return written, failures

    def _lost(self) -> bool:
        """The SSH connection of this host is lost (nothing to fall back on)."""
        channel = self.channel
        return channel is None or bool(channel.lost_reason())

    def _fall_back(self, rest: list[tuple[RemoteFile, Path]], exc: BaseException,
                   ) -> tuple[list[tuple[RemoteFile, Path]], list[tuple[RemoteFile, Path]]]:
        """After the side channel broke off: this helper ended (its channel closed), the host
        refused the side channel, and a fresh helper asked for ``rest`` over SSH; what it will
        send, and the files that changed since they were listed (not asked for)."""
        assert self.side is not None and self.listed is not None
        why = exc.message if isinstance(exc, DlrunError) else "the side channel closed before every file came"
        self.side.refuse(self.host.name, why)
        self.close()
        before = self.listed
        again = self.listing()  # the side channel refused: never offered now
        keep: list[tuple[RemoteFile, Path]] = []
        changed: list[tuple[RemoteFile, Path]] = []
        for entry, dest in rest:
            now = again.entries.get(entry.path) if not again.missing and again.error is None else None
            same = now is not None and now.size == entry.size and now.same_content(entry)
            (keep if same else changed).append((entry, dest))
        self.listed = before
        if keep:
            self._ask(keep, sum(e.size for e, _ in keep))
        return keep, changed

    def _ask(self, items: Sequence[tuple[RemoteFile, Path]], total: int) -> None:
        """Ask for ``items``' files: over the TLS side channel where the host can be reached at
        the address of its SSH connection (``self.stream`` reads from it then), else over SSH."""
        assert self.channel is not None and self.stream is not None
        request: dict[str, Any] = {"files": [e.path for e, _ in items]}
        side, name = self.side, self.host.name
        address = self.transport.direct_address(self.host) \
            if side is not None and total >= SIDE_FROM and name not in side.refused else None
        if side is None or address is None:
            self.channel.send(json.dumps(request).encode() + b"\n")
            return
        offer, context = side.offer(name)
        extra = {"test_break": os.environ["DLRUN_TEST_SIDE_BREAK"]} if os.environ.get("DLRUN_TEST_SIDE_BREAK") else {}
        self.channel.send(json.dumps({**request, "side": {**offer, "source": source_of("jobs"), **extra}}).encode()
                          + b"\n")
        line = self.stream.readline()
        if not line.startswith(b"T "):
            raise self._failed("the push helper did not answer the side channel's offer", line)
        try:
            port = json.loads(line[2:]).get("port")
        except (ValueError, AttributeError):
            raise self._failed("the push helper did not answer the side channel's offer", line) from None
        if port is None:  # it could not listen: the files come over SSH
            side.refuse(name, "the host could not listen")
            return
        tls: ssl.SSLSocket | None = None
        first = b""
        why = "the host closed its side channel"
        try:
            tls = connect_side(address, int(port), context, offer["token"])
            source = TlsSource(tls, self.channel, name, SIDE_IDLE_S, "the push helper")
            first = source.recv(1 << 16)
        except (OSError, ssl.SSLError, ValueError, DlrunError) as exc:
            why = (exc.message if isinstance(exc, DlrunError) else str(exc)) or type(exc).__name__
        except BaseException:
            if tls is not None:
                tls.close()
            raise
        if tls is None or not first:  # not reached (a firewall, a NAT), or the host stopped waiting: over SSH
            if tls is not None:
                tls.close()
            side.refuse(name, why)
            with contextlib.suppress(DlrunError, OSError):
                self.channel.close_stdin()
            return
        self.tls = tls
        self.stream = _SocketStream(source.recv_into, first)

    def serve(self, paths: Sequence[str], bind: str, token: str, cert_pem: str, key_pem: str) -> int:
        """Have this host's helper send ``paths`` of its listing straight to other hosts' push
        helpers (TLS with ``cert_pem``, pinned by them, and ``token``); the port it listens on
        at ``bind``. It serves until ``close``. Raises ``SyncError`` when it cannot listen."""
        assert self.channel is not None and self.stream is not None
        self.channel.send(json.dumps({"serve": {"files": list(paths), "bind": bind, "token": token,
                                                "cert": cert_pem, "key": key_pem}}).encode() + b"\n")
        line = self.stream.readline()
        try:
            answer = json.loads(line)
        except ValueError:
            raise self._failed("the push helper did not start serving", line) from None
        if "port" not in answer:
            raise SyncError(str(answer.get("error", "the push helper did not start serving")), host=self.host.name)
        return int(answer["port"])

    def _header(self) -> str:
        assert self.stream is not None
        path: str | None = None
        while True:
            block = self.stream.read(512)
            info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
            if info.type in (tarfile.XHDTYPE, tarfile.XGLTYPE):
                data = self.stream.read(info.size + (-info.size % 512))[:info.size]
                pos = 0
                while pos < len(data):
                    space = data.index(b" ", pos)
                    length = int(data[pos:space])
                    key, _, value = data[space + 1:pos + length - 1].partition(b"=")
                    if key == b"path" and info.type == tarfile.XHDTYPE:
                        path = value.decode("utf-8", "surrogateescape")
                    pos += length
                continue
            return path if path is not None else info.name

    def _receive(self, entry: RemoteFile, dest: Path, root: Path, progress: ProgressHook | None, done: int,
                 total: int) -> str | None:
        """Write one entry (its body is next on the stream) to ``dest``; None, or what failed."""
        assert self.stream is not None
        temp = dest.parent / f"{PART}{hashlib.sha1(dest.name.encode('utf-8', 'surrogateescape')).hexdigest()[:16]}" \
                              f"-{os.getpid()}-{threading.get_ident()}"
        problem: str | None = None
        fd: int | None = None
        try:
            _make_parents(dest, root)
            if entry.kind == "link":
                assert entry.link is not None
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(temp)
                os.symlink(entry.link, temp)
                os.replace(temp, dest)
                return None
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as exc:
            problem = f"{exc.strerror or exc} ({exc.filename or dest})"
        if entry.kind == "link":
            return problem
        hasher = hashlib.sha256()
        got = 0
        try:
            for chunk in self.stream.chunks(entry.size):
                hasher.update(chunk)
                got += len(chunk)
                while fd is not None and chunk:
                    try:
                        chunk = chunk[os.write(fd, chunk):]
                    except OSError as exc:
                        problem = f"{exc.strerror or exc} ({dest})"
                        os.close(fd)
                        fd = None
                if progress is not None:
                    progress(self.host.name, done + got, total)
            for _ in self.stream.chunks(-entry.size % 512):
                pass
            if fd is not None:
                os.fchmod(fd, entry.mode)
                os.close(fd)
                fd = None
                if hasher.hexdigest() != entry.sha256:
                    problem = "content does not match its sha256 (changed on the host while pulling?)"
                else:
                    os.utime(temp, ns=(entry.mtime_ns, entry.mtime_ns))
                    os.replace(temp, dest)
        except OSError as exc:
            problem = f"{exc.strerror or exc} ({dest})"
        finally:
            if fd is not None:
                os.close(fd)
            if problem is not None or os.path.lexists(temp):
                with contextlib.suppress(OSError):
                    os.unlink(temp)
        return problem

    def _failed(self, what: str, line: bytes) -> DlrunError:
        channel = self.channel
        code = channel.wait(10) if channel is not None else None
        stderr = channel.stderr_text() if channel is not None else ""
        if line.strip():
            stderr += "\nunexpected output: " + line[:200].decode(errors="replace")
        if code is None and not stderr:
            return HostUnreachable(f"{what}: the connection was lost", host=self.host.name)
        return RemoteCommandError(what, host=self.host.name, command=self.command,
                                  exit_code=255 if code is None else code, stderr=stderr,
                                  hint="the host needs python >= 3.8 as the inventory's 'python' (default python3)")

    def cancel(self) -> None:
        """End this host's transfer from another thread: the side channel is shut down (the
        thread reading it closes it) and the SSH channel closed."""
        tls = self.tls
        if tls is not None:
            with contextlib.suppress(OSError, ValueError):
                tls.shutdown(socket.SHUT_RDWR)
        self._close_channel()

    def close(self) -> None:
        """End this session, from the thread that runs it."""
        if self.tls is not None:
            with contextlib.suppress(OSError):
                self.tls.close()
            self.tls = None
        self._close_channel()

    def _close_channel(self) -> None:
        if self.channel is not None:
            with contextlib.suppress(DlrunError, OSError):
                self.channel.send(b'{"abort": true}\n')  # ignored once the helper is streaming
            self.channel.close()
            self.channel = None


def _make_parents(dest: Path, root: Path) -> None:
    """The folders between ``root`` and ``dest``; a link or a file where a folder belongs, or
    a folder where the file goes, is an error (never followed, never replaced)."""
    folder = root
    for part in dest.relative_to(root).parts[:-1]:
        folder = folder / part
        if folder.is_symlink():
            raise NotADirectoryError(20, "a link is in the way (not followed)", str(folder))
        if not folder.is_dir():
            try:
                folder.mkdir()
            except FileExistsError:  # another host's file made it a moment ago
                if folder.is_symlink() or not folder.is_dir():
                    raise
    if dest.is_dir() and not dest.is_symlink():
        raise IsADirectoryError(21, "a folder is in the way", str(dest))


# =============================================================================== planning (pure)


def host_folder(name: str) -> str:
    """The local subfolder of a host's own files: its inventory name, made a single path part."""
    name = name.replace("/", "_").replace("\0", "_")
    return f"_{name}" if name in ("", ".", "..") else name


def plan_pull(listings: Sequence[Listing], local: Callable[[str], tuple[str, str] | None], *,
              prefix: str = "") -> PullPlan:
    """Which file of which host goes where: a path every listing host has with the same content
    goes to ``<prefix><path>`` once (from the host with the fewest bytes so far, so that the
    hosts share the work); any other goes to ``<host>/<prefix><path>`` for each host that has
    it. ``local(dest)``: what is there now, ``("file", sha256)``/``("link", target)`` or None;
    an item whose destination already holds it is unchanged. Missing roots are left out."""
    present = [li for li in listings if not li.missing]
    missing = tuple(li.host for li in listings if li.missing)
    paths = sorted({p for li in present for p in li.entries})
    load = {li.host: 0 for li in present}
    items: list[PullItem] = []
    shared = per_host = 0
    for path in paths:
        copies = [(li.host, li.entries.get(path)) for li in present]
        first = copies[0][1]
        if first is not None and all(e is not None and e.same_content(first) for _, e in copies):
            host = min(load, key=lambda h: (load[h], [li.host for li in present].index(h)))
            load[host] += first.size
            items.append(PullItem(host, first, prefix + path))
            shared += 1
            continue
        per_host += 1
        for host, entry in copies:
            if entry is not None:
                items.append(PullItem(host, entry, f"{host_folder(host)}/{prefix}{path}"))
    fetch: list[PullItem] = []
    unchanged: list[PullItem] = []
    for item in items:
        there = local(item.dest)
        want = ("link", item.entry.link) if item.entry.kind == "link" else ("file", item.entry.sha256)
        (unchanged if there == want else fetch).append(item)
    return PullPlan(tuple(fetch), tuple(unchanged), shared, per_host, missing)


def check_pull_size(plan: PullPlan, limit: PushLimit, remote: str) -> None:
    """Raise ``UsageError`` when what a pull would write is over ``limit``; nothing is written."""
    total = plan.bytes_to_fetch
    over_bytes = limit.max_bytes is not None and total > limit.max_bytes
    over_files = limit.max_files is not None and len(plan.fetch) > limit.max_files
    if not (over_bytes or over_files):
        return
    what = (f"over the {human_bytes(limit.max_bytes or 0)} limit" if over_bytes
            else f"over the {limit.max_files} files limit")
    largest = largest_items([(i.dest, i.entry.size) for i in plan.fetch])
    lines = "\n".join(f"    {name:<40} {human_bytes(size):>10}  {files} file{'s' if files != 1 else ''}"
                      for name, size, files in largest)
    raise UsageError(f"pulling {remote} would write {human_bytes(total)} in {len(plan.fetch)} files, {what};"
                     f" nothing was written. Largest:\n{lines}",
                     hint="pull a smaller folder, or raise the limit with --max-size 2G (none: no limit)")


# =============================================================================== the pull


def remote_root(host: Host, remote: str, project: str | None) -> str:
    """REMOTE on ``host``: absolute (or ``~``) as given, else inside the project folder
    (``<workdir>/<project>``; on this machine, the current folder)."""
    if remote.startswith(("/", "~")):
        return remote
    if host.is_local:
        return os.path.join(os.getcwd(), remote)
    if project is None:
        project = Path.cwd().name
    return posixpath.join(remote_code_dir(host, check_project(project)), remote)


def local_state(root: Path, cache: HashCache | None = None) -> Callable[[str], tuple[str, str] | None]:
    """What ``plan_pull`` needs to know of a local destination (a file there is hashed, or its
    hash taken from ``cache`` while its size, mtime, ctime and inode are unchanged)."""

    def state(dest: str) -> tuple[str, str] | None:
        path = root / dest
        try:
            st = path.lstat()
            if stat.S_ISLNK(st.st_mode):
                return ("link", os.readlink(path))
            if stat.S_ISREG(st.st_mode):
                digest = partial(sha256_file, str(path))
                return ("file", cache.digest(dest, st, digest) if cache is not None else digest())
        except OSError:
            return None
        return None

    return state


def pull(transport: Transport, hosts: Sequence[Host], remote: str, local: Path, *, project: str | None = None,
         limit: PushLimit | None = None, dry_run: bool = False, progress: ProgressHook | None = None,
         file_progress: ProgressHook | None = None, notice: Callable[[str], None] | None = None,
         ) -> tuple[HostPullSummary, ...]:
    """Copy ``remote`` from every host into ``local`` (see ``plan_pull`` for where each file
    goes); one summary per host, in order. A host without ``remote`` is named through
    ``notice`` and left out (``SyncError`` when no host has it). ``limit``: what the pull would
    write, checked before anything is written. Every file is verified by sha256; failures are
    collected and raised as one ``SyncError`` after the others are in place."""
    if not remote:
        raise UsageError("dlrun pull needs a REMOTE path")
    hosts = tuple(hosts)
    contents = remote.endswith("/") and remote.strip("/") != ""
    side = SideChannel("pull") if side_enabled() else None
    senders = [HostSender(transport, h, remote_root(h, remote.rstrip("/") or "/", project), side=side) for h in hosts]
    started = time.monotonic()
    pool = ThreadPoolExecutor(max_workers=max(1, min(32, len(senders))), thread_name_prefix="dlrun-pull")
    cancel = threading.Event()
    try:
        transport.connect(hosts)
        listed = list(pool.map(lambda s: s.listing(), senders))
        for li in listed:
            if li.error and not li.missing:
                raise SyncError(f"cannot read {li.root}: {li.error}", host=li.host)
        found = [li for li in listed if not li.missing]
        if not found:
            raise SyncError(f"{remote} is on none of the hosts ({', '.join(h.name for h in hosts)})",
                            hint="REMOTE is relative to the project folder on each host (--project), or absolute")
        plan_missing = [li.host for li in listed if li.missing]
        if plan_missing and notice is not None:
            notice(f"{remote} is not on {', '.join(plan_missing)}: pulling from {', '.join(li.host for li in found)}")
        name = posixpath.basename(remote.rstrip("/")) if not contents else ""
        prefix = f"{name}/" if name and all(li.is_dir for li in found) else ""
        cache = HashCache(default_cache_path(local.resolve()))
        plan = plan_pull(listed, local_state(local, cache), prefix=prefix)
        folders = {host_folder(li.host) for li in found} if plan.per_host else set()
        clash = sorted({i.dest.split("/", 1)[0] for i in plan.fetch + plan.unchanged
                        if i.dest.split("/", 1)[0] in folders and not i.dest.startswith(f"{host_folder(i.host)}/")})
        if clash:
            raise UsageError(f"{', '.join(clash)} in {remote} has the name of a host's folder",
                             hint=f"pull into a folder of its own, or name the folder: dlrun pull {remote.rstrip('/')}")
        if limit is not None and not dry_run:
            check_pull_size(plan, limit, remote)
        by_host: dict[str, list[PullItem]] = {h.name: [] for h in hosts}
        for item in plan.fetch:
            by_host[item.host].append(item)
        if dry_run:
            for sender in senders:
                sender.close()
            return tuple(_summary(li, by_host[li.host], plan, time.monotonic() - started, dry_run=True)
                         for li in listed)
        local.mkdir(parents=True, exist_ok=True)

        def fetch(sender: HostSender) -> tuple[int, list[FetchFailure]]:
            items = [(i.entry, local / i.dest) for i in by_host[sender.host.name]]
            return sender.fetch(items, local, progress=progress, file_progress=file_progress, cancel=cancel)

        results = list(pool.map(fetch, senders))
        cache.save()
    except BaseException:
        cancel.set()
        for sender in senders:
            sender.cancel()
        raise
    finally:
        pool.shutdown(wait=True)
    if side is not None and notice is not None:
        for host in hosts:
            why = side.refused.get(host.name)
            if why is not None:
                notice(f"{host.name}: its files came over SSH, not the side channel ({why};"
                       f" {OPT_OUT}=0 skips the side channel)")
    failures = [f for _, fails in results for f in fails]
    if failures:
        shown = "\n".join(f"  {f.host}: {f.path}: {f.message}" for f in failures[:5])
        more = f"\n  … and {len(failures) - 5} more" if len(failures) > 5 else ""
        raise SyncError(f"{len(failures)} file(s) could not be pulled:\n{shown}{more}",
                        hint="the other files are in place; pull again once the job stopped writing them")
    seconds = time.monotonic() - started
    return tuple(_summary(li, by_host[li.host], plan, seconds) for li in listed)


def _summary(listing: Listing, items: Sequence[PullItem], plan: PullPlan, seconds: float, *,
             dry_run: bool = False) -> HostPullSummary:
    return HostPullSummary(
        host=listing.host, files_received=len(items), bytes_received=sum(i.entry.size for i in items),
        files_unchanged=sum(1 for i in plan.unchanged if i.host == listing.host), seconds=seconds,
        root=listing.root, missing=listing.missing, dry_run=dry_run,
        largest=largest_items([(i.dest, i.entry.size) for i in items]) if dry_run else ())


def summary_line(s: HostPullSummary) -> str:
    """``host0: 12 files received (3.1 MiB), 40 unchanged in 0.8 s``; a dry run says what it
    would receive, with the largest items."""
    if s.missing:
        return f"{s.host}: nothing at {s.root}"
    if not s.dry_run:
        return (f"{s.host}: {s.files_received} files received ({human_bytes(s.bytes_received)}),"
                f" {s.files_unchanged} unchanged in {s.seconds:.1f} s")
    lines = [f"{s.host}: would receive {s.files_received} files ({human_bytes(s.bytes_received)}),"
             f" {s.files_unchanged} unchanged, from {s.root} (dry run: nothing written)"]
    lines += [f"  get {name:<40} {human_bytes(size):>10}  {files} file{'s' if files != 1 else ''}"
              for name, size, files in s.largest]
    return "\n".join(lines)


def summary_json(summaries: Sequence[HostPullSummary]) -> dict[str, Any]:
    """The ``--json`` document of a pull: per host and the totals."""
    hosts = [{"host": s.host, "root": s.root, "missing": s.missing, "files_received": s.files_received,
              "bytes_received": s.bytes_received, "files_unchanged": s.files_unchanged,
              "seconds": round(s.seconds, 3)} for s in summaries]
    document: dict[str, Any] = {"hosts": hosts, "total": {
        "files_received": sum(s.files_received for s in summaries),
        "bytes_received": sum(s.bytes_received for s in summaries),
        "files_unchanged": sum(s.files_unchanged for s in summaries)}}
    if any(s.dry_run for s in summaries):
        document["dry_run"] = True
    return document


