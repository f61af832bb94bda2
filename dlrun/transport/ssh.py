"""The SSH transport: one hardened paramiko connection per host, reused by every step of a job.

Imports paramiko (with ssh_config.py, the only modules that do) and translates its and the
socket layer's exceptions into dlrun's own (``HostUnreachable``, ``AuthenticationFailed``,
``HostKeyError``) at this one boundary. What it owns:

* **Connections**: each host's OpenSSH config (``ssh_config.SSHConfigReader``: ``ssh -G``) is
  read for every host first, then the hosts are reached in parallel, each within its connect
  timeout, on a socket with TCP_NODELAY, through ``ProxyJump`` hops (one connection per hop,
  shared with its failure by the hosts behind it; a hop's own ProxyJump followed) or a
  ``ProxyCommand``. Every host is reached before any rank starts; the failures are reported
  together, each with its host and the SSH error in words. Many hosts get progress lines, and
  once most of those that answered failed the rest are not tried (``FAIL_FAST_AFTER``). Keys:
  IdentityFile (OpenSSH's list), CertificateFile, ssh-agent unless IdentitiesOnly.
* **Host keys**, as OpenSSH checks them (``load_known_hosts``, ``_CheckHostKey``): known_hosts
  entries for the HostKeyAlias or ``host``/``[host]:port``, patterns and hashed names included;
  ``@revoked`` keys refused; a changed key always refused; an unknown one refused unless
  ``--accept-new-host-keys`` or the host's ``StrictHostKeyChecking accept-new`` (then appended to
  known_hosts). ``StrictHostKeyChecking no`` is honoured with a warning naming the host.
* **Bulk data**: paramiko's public ``Channel.send``, with AES-GCM offered first (one OpenSSL
  call per packet encrypts and authenticates).
* **Liveness** (OpenSSH's ``ServerAliveInterval``/``ServerAliveCountMax``): a thread per
  connection asks the host for a reply (``keepalive@openssh.com``) every few seconds and closes
  the connection when none has come for the host timeout. A host that loses power or network
  mid-push then fails that step within the timeout instead of after TCP's ~15 minutes; every
  wait on the connection ends when it closes.
* **Commands**: ``open`` runs an argv as one exec channel whose command line is always
  ``exec /bin/sh -s`` (``dlrun.transport.shell``: it parses in every login shell); the argv
  follows on stdin, joined with ``shlex.join`` for that POSIX sh, so no argument can inject a
  command. ``open`` returns once the program's start marker came; what the login shell printed
  before it is discarded and shown once per host (``notify``). Env never travels on the command
  line: the agent receives it inside JSON on stdin.

Why paramiko and not fabric's Connection: fabric's defaults are the unsafe ones (AutoAddPolicy
without known_hosts); plain paramiko keeps every one of those choices visible here.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import shlex
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

# isort: split
import paramiko

from dlrun.errors import AuthenticationFailed, HostKeyError, HostUnreachable, TransportError, UsageError
from dlrun.inventory import Host
from dlrun.plan import DEFAULT_HOST_TIMEOUT, heartbeat_interval
from dlrun.transport import shell
from dlrun.transport.base import Channel, Transport
from dlrun.transport.ssh_config import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_USER_KNOWN_HOSTS,
    HostConfig,
    Request,
    SSHConfigReader,
    host_matches,
)

# paramiko logs each failed handshake ("Error reading SSH protocol banner") with a traceback,
# which Python's last-resort handler prints to stderr; dlrun reports the same failure itself,
# naming the host, as a HostUnreachable.
logging.getLogger("paramiko").addHandler(logging.NullHandler())


# Tried first, then the rest of paramiko's list (what a server lacks is skipped, nothing is
# dropped). paramiko encrypts and authenticates in Python, once per packet: AES-GCM does both in
# one call to OpenSSL, where aes128-ctr adds a separate HMAC per packet (push of 200 MB to 4
# loopback hosts: client CPU 5.8 -> 4.2 s, docs/benchmarks.md "Push after AES-GCM ..."). EtM MACs only
# matter for a server without GCM.
PROGRESS_FROM = 32  # hosts: a connect to this many says how far it got
FAIL_FAST_AFTER = 8  # unreachable hosts, more than half of those that answered: the rest are not tried
FAILURES_LISTED = 20  # unreachable hosts named in the error; the rest are counted
PREFERRED_CIPHERS = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com", "aes128-ctr")
PREFERRED_MACS = ("hmac-sha2-256-etm@openssh.com", "hmac-sha2-512-etm@openssh.com")


def _preferred_first(available: Sequence[str], preferred: Sequence[str]) -> tuple[str, ...]:
    first = tuple(name for name in preferred if name in available)
    return first + tuple(name for name in available if name not in first)


def _ask_for_reply(transport: paramiko.Transport) -> bool:
    """Send ``keepalive@openssh.com`` with want-reply, as OpenSSH's ServerAliveInterval does, and
    wait for sshd's answer (a request failure). True when the answer came, False when the
    connection ended first."""
    try:
        transport.global_request("keepalive@openssh.com", wait=True)
    except (OSError, EOFError, paramiko.SSHException):
        return False  # the connection is ending; the clock reports it
    return transport.is_active()


class _HardenedTransport(paramiko.Transport):
    """paramiko's Transport with the cheapest secure cipher and MAC offered first, and the host key
    types known_hosts has for the host before the others (as paramiko's SSHClient and OpenSSH do)."""

    def __init__(self, sock: Any, *, known_types: Sequence[str] = (), **options: Any) -> None:
        super().__init__(sock, **options)
        security = self.get_security_options()
        security.ciphers = _preferred_first(security.ciphers, PREFERRED_CIPHERS)
        security.digests = _preferred_first(security.digests, PREFERRED_MACS)
        security.key_types = _preferred_first(security.key_types, known_types)


@dataclass(frozen=True)
class Target:
    """Where and how to connect: the host's ssh config, merged with the inventory and dlrun's
    command line."""

    name: str
    config: HostConfig
    known_hosts: str  # where a new key is written (--known-hosts, else the first UserKnownHostsFile)
    known_hosts_files: tuple[str, ...]  # every file read: UserKnownHostsFile(s), GlobalKnownHostsFile(s)
    connect_timeout: float
    alive_limit: float | None  # seconds without an answer before the host counts as lost (None: never)
    accept_new: bool  # --accept-new-host-keys, or StrictHostKeyChecking accept-new (or no) for this host

    @property
    def hostname(self) -> str:
        return self.config.hostname

    @property
    def port(self) -> int:
        return self.config.port

    @property
    def user(self) -> str:
        return self.config.user

    @property
    def proxy_jump(self) -> str | None:
        return self.config.proxy_jump

    @property
    def proxy_command(self) -> str | None:
        return self.config.proxy_command


#: How long stderr's start marker may lag behind stdout's (seconds).
STDERR_MARKER_WAIT = 2.0

_Sock = socket.socket | paramiko.Channel | paramiko.ProxyCommand  # what paramiko connects over


@dataclass
class _Hop:
    """One ProxyJump hop's connection, or why it failed (shared by the hosts behind it)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    client: paramiko.SSHClient | None = None
    error: TransportError | None = None


@dataclass(frozen=True)
class KnownHostKeys:
    """What the known_hosts files say about one host name."""

    keys: tuple[paramiko.PKey, ...] = ()
    revoked: tuple[paramiko.PKey, ...] = ()
    authorities: tuple[str, ...] = ()  # "file:line" of each @cert-authority line naming the host


def load_known_hosts(paths: Sequence[str], name: str) -> KnownHostKeys:
    """The entries of ``paths`` for ``name`` (``host``, ``[host]:port`` or a HostKeyAlias), matched as
    OpenSSH matches them: patterns with ``*``, ``?`` and ``!``, case-insensitive, hashed names.

    Read line by line, unlike paramiko's loader, which stops at the first line it cannot read:
    unknown key types and damaged lines are skipped; ``@revoked`` keys are refused;
    ``@cert-authority`` lines are noted (host certificates are not supported).
    """
    keys: list[paramiko.PKey] = []
    revoked: list[paramiko.PKey] = []
    authorities: list[str] = []
    for path in dict.fromkeys(paths):
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as fh:
            for number, raw in enumerate(fh, start=1):
                line = raw.strip()
                if not line or line.startswith("#"):
                    continue
                marker = ""
                if line.startswith("@"):
                    marker, line = [*line.split(None, 1), ""][:2]  # a space or a tab follows the marker
                    line = line.strip()
                patterns = line.split(None, 1)[0] if line else ""
                if not _names_host(patterns, name):
                    continue
                if marker == "@cert-authority":
                    authorities.append(f"{path}:{number}")
                    continue
                try:
                    entry = paramiko.hostkeys.HostKeyEntry.from_line(line, number)
                except (paramiko.hostkeys.InvalidHostKey, paramiko.SSHException, ValueError, IndexError):
                    continue
                if entry is None:
                    continue
                if marker == "@revoked":
                    revoked.append(entry.key)
                elif not marker:
                    keys.append(entry.key)
    return KnownHostKeys(tuple(keys), tuple(revoked), tuple(authorities))


def _names_host(patterns: str, name: str) -> bool:
    """Whether a known_hosts host field (patterns, or one hashed ``|1|salt|hash`` name) names ``name``."""
    if patterns.startswith("|1|"):
        try:
            return paramiko.HostKeys.hash_host(name.lower(), patterns) == patterns
        except (ValueError, IndexError):  # binascii.Error is a ValueError
            return False
    return host_matches(name, patterns.split(","))


class _CheckHostKey(paramiko.MissingHostKeyPolicy):
    """OpenSSH's host key check. The client's own HostKeys stay empty, so paramiko hands every
    host key to this policy, right after the key exchange and before the login."""

    def __init__(self, target: Target, known: KnownHostKeys, lock: threading.Lock) -> None:
        self.target = target
        self.known = known
        self.lock = lock

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        if any(key == bad for bad in self.known.revoked):
            raise _RevokedHostKey(key)  # even where --accept-new-host-keys would have saved it
        if any(key == good for good in self.known.keys):
            return
        if self.known.keys:
            if self.target.config.strict_host_key_checking == "no":
                return  # as OpenSSH's StrictHostKeyChecking no does (the warning was printed)
            raise _ChangedHostKey(key, self.known.keys[0])
        if not self.target.accept_new:
            raise _UnknownHostKey(key)
        self._append(key)

    def _append(self, key: paramiko.PKey) -> None:
        """Append the key to known_hosts (OpenSSH's accept-new)."""
        name = self.target.config.known_hosts_name
        if self.target.config.hash_known_hosts:
            name = paramiko.HostKeys.hash_host(name)
        entry = paramiko.hostkeys.HostKeyEntry([name], key)
        path = self.target.known_hosts
        with self.lock:
            Path(path).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
            with open(fd, "a+b") as fh:
                fh.seek(0, os.SEEK_END)
                if fh.tell():  # a file whose last line has no newline must not swallow the entry
                    fh.seek(-1, os.SEEK_END)
                    if fh.read(1) != b"\n":
                        fh.write(b"\n")
                fh.write((entry.to_line() or "").encode())


class _RevokedHostKey(Exception):
    def __init__(self, key: paramiko.PKey) -> None:
        super().__init__(key.fingerprint)
        self.key = key


class _ChangedHostKey(Exception):
    def __init__(self, key: paramiko.PKey, expected: paramiko.PKey) -> None:
        super().__init__(key.fingerprint)
        self.key = key
        self.expected = expected


class _UnknownHostKey(Exception):
    def __init__(self, key: paramiko.PKey) -> None:
        super().__init__(key.fingerprint)
        self.key = key


class SSHChannel(Channel):
    """One exec channel; stderr is drained on the side so it can never stall stdout."""

    def __init__(self, host: str, channel: paramiko.Channel, why: Callable[[], str] = lambda: "") -> None:
        self.host = host
        self.channel = channel
        self.why = why  # why the connection was closed, when dlrun closed it (silence)
        self._stderr = bytearray()
        self._lock = threading.Lock()
        self._pending = b""  # stdout that came with the start marker, for the first recv

    def await_start(self, mark: bytes, timeout: float) -> tuple[bytes, bytes]:
        """Read stdout until the program's start marker (``dlrun.transport.shell``), then stderr's
        (printed first, so it is on its way); return what the login shell printed before each.
        Raises ``LoginShellError`` naming that output if the shell ends or the marker has not come
        within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        out = bytearray()
        try:
            while (split := shell.split_at_marker(bytes(out), mark)) is None:
                left = deadline - time.monotonic()
                if left <= 0 or len(out) > shell.MAX_NOISE:
                    raise shell.not_started(self.host, bytes(out), self._take_stderr(), exit_code=None,
                                            timeout=None if left > 0 else timeout, overflow=left > 0)
                self.channel.settimeout(min(left, 0.25))
                try:
                    data = self.channel.recv(65536)
                except TimeoutError:
                    self._drain_stderr()  # a shell that floods stderr must not stall stdout's window
                    continue
                except (OSError, EOFError, paramiko.SSHException):
                    data = b""
                if not data:
                    code = self.wait(min(2.0, max(0.1, deadline - time.monotonic())))
                    why = self.why()
                    if why:
                        raise HostUnreachable(f"connection lost before dlrun's program started: {why}",
                                              host=self.host)
                    raise shell.not_started(self.host, bytes(out), self._take_stderr(), exit_code=code, timeout=None)
                out += data
            before, self._pending = split
            # stderr's marker was printed first and travels in the same sshd loop: it follows at
            # once, unless a startup file sent stderr elsewhere (exec 2>file), then it never comes
            return before, self._stderr_before(mark, min(deadline, time.monotonic() + STDERR_MARKER_WAIT))
        finally:
            self.channel.settimeout(None)

    def _stderr_before(self, mark: bytes, deadline: float) -> bytes:
        """Drop stderr up to its marker and return what came before it (all of it so far, if the
        marker has not come by ``deadline``)."""
        while (split := shell.split_at_marker(bytes(self._stderr), mark)) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return bytes(self._stderr)
            self.channel.settimeout(min(left, 0.25))
            try:
                chunk = self.channel.recv_stderr(65536)
            except TimeoutError:
                continue
            except (OSError, EOFError, paramiko.SSHException):
                chunk = b""
            if not chunk:
                return bytes(self._stderr)
            self._stderr += chunk
        before, after = split
        self._stderr[:] = after
        return before

    def _take_stderr(self) -> bytes:
        self._drain_stderr()
        return bytes(self._stderr)

    def send(self, data: bytes | memoryview) -> None:
        try:
            with self._lock:
                view = memoryview(data).cast("B")
                while view:
                    # paramiko's Message.add_string takes any buffer (util.asbytes passes it on):
                    # a view of the rest is sent without copying it for each packet, as bytes would be
                    sent = self.channel.send(view)  # type: ignore[arg-type]
                    if not sent:  # Channel.sendall would spin here: the channel is shut for sending
                        raise OSError("the channel is closed for sending")
                    view = view[sent:]
        except (OSError, EOFError, paramiko.SSHException) as exc:
            raise HostUnreachable(f"connection lost while sending: {self.why() or exc or type(exc).__name__}",
                                  host=self.host) from exc

    def recv(self, max_bytes: int = 65536) -> bytes:
        if self._pending:
            first, self._pending = self._pending[:max_bytes], self._pending[max_bytes:]
            return first
        try:
            data: bytes = self.channel.recv(max_bytes)
        except (OSError, EOFError, paramiko.SSHException):
            data = b""
        self._drain_stderr()
        return data

    def recv_within(self, timeout: float, max_bytes: int = 1 << 20) -> bytes | None:
        if self._pending:
            return self.recv(max_bytes)
        self.channel.settimeout(timeout)
        try:
            data: bytes = self.channel.recv(max_bytes)
        except TimeoutError:
            return None
        except (OSError, EOFError, paramiko.SSHException):
            data = b""
        finally:
            self.channel.settimeout(None)
        self._drain_stderr()
        return data

    def _drain_stderr(self) -> None:
        while self.channel.recv_stderr_ready():
            chunk = self.channel.recv_stderr(65536)
            if not chunk:
                break
            self._stderr += chunk[: max(0, (1 << 20) - len(self._stderr))]  # keep 1 MiB at most

    def close_stdin(self) -> None:
        try:
            with self._lock:
                self.channel.shutdown_write()
        except (OSError, EOFError, paramiko.SSHException):
            pass

    def wait(self, timeout: float | None = None) -> int | None:
        if not self.channel.status_event.wait(timeout):
            return None
        self._drain_stderr()
        status: int = self.channel.exit_status
        return None if status < 0 else status

    def stderr_text(self) -> str:
        self._drain_stderr()
        return self._stderr.decode(errors="replace")

    def lost_reason(self) -> str:
        return self.why()

    def close(self) -> None:
        try:
            self.channel.close()
        except (OSError, EOFError, paramiko.SSHException):
            pass


def _print_note(note: str) -> None:
    sys.stderr.write(f"dlrun: note: {note}\n")  # one write: threads print no half lines
    sys.stderr.flush()


def parse_jump(spec: str) -> tuple[str | None, str, int | None]:
    """One ProxyJump hop, ``[user@]host[:port]`` or ``ssh://[user@]host[:port]``; IPv6 hosts in
    brackets (``[::1]:2222``), or bare without a port. (user, host, port)."""
    rest = spec[len("ssh://"):] if spec.startswith("ssh://") else spec
    user, at, rest = rest.rpartition("@")
    match = re.fullmatch(r"\[([^\]]+)\](?::(\d+))?", rest)
    if match:
        host, port = match[1], match[2]
    elif rest.count(":") == 1:
        host, _, port = rest.partition(":")
    else:
        host, port = rest, None  # a name, or a bare IPv6 address
    if not host or (port is not None and not port.isdigit()):
        raise UsageError(f"ProxyJump hop {spec!r} is not [user@]host[:port]")
    return (user or None) if at else None, host, int(port) if port else None


def _request(host: Host | str) -> Request:
    if isinstance(host, str):
        return Request(host)
    return Request(host.address, port=host.port, user=host.user, identity_file=host.identity_file)


def _unknown_key_error(target: Target, known: KnownHostKeys, key: paramiko.PKey) -> HostKeyError:
    config = target.config
    keyscan = shlex.join(["ssh-keyscan", "-p", str(config.port), config.hostname])
    add = f"{keyscan} >> {shlex.quote(target.known_hosts)}"
    if config.host_key_alias:
        add += f" (then write {config.host_key_alias}, the HostKeyAlias, in place of the host name it prints)"
    if known.authorities:
        return HostKeyError(
            f"{config.known_hosts_name} is known only through @cert-authority ({', '.join(known.authorities)}):"
            f" dlrun does not support host certificates; the host offered a plain {key.get_name()} key"
            f" ({key.fingerprint})",
            host=target.name,
            hint=f"add the host's own key to known_hosts after checking it: {add}",
        )
    return HostKeyError(
        f"unknown host key ({key.get_name()} {key.fingerprint}) for {config.known_hosts_name};"
        f" not in {', '.join(target.known_hosts_files) or target.known_hosts}",
        host=target.name,
        hint=f"verify it, then add it: {add} — or pass --accept-new-host-keys to add unknown keys (changed keys"
        " are still refused)",
    )


def _hung_up(target: Target) -> HostUnreachable:
    return HostUnreachable(f"{target.hostname}:{target.port} hung up before the SSH banner (is it an SSH server?)",
                           host=target.name)


def _certifies(certificate: bytes, key: paramiko.PKey) -> bool:
    """Whether an OpenSSH certificate blob (type, nonce, then the public key's own fields) is
    for ``key``."""
    fields = paramiko.Message(key.asbytes())
    fields.get_string()  # the key type
    blob = paramiko.Message(certificate)
    blob.get_string()  # the certificate type
    blob.get_string()  # its nonce
    return blob.get_remainder().startswith(fields.get_remainder())


def _certified_key(target: Target) -> paramiko.PKey | None:
    """The identity that a CertificateFile belongs to, with that certificate loaded (None: no
    CertificateFile). paramiko loads ``<identity>-cert.pub`` by itself."""
    certificates = [c for c in target.config.certificate_files if os.path.isfile(c)]
    if not certificates:
        return None
    tried: list[str] = []
    for path in target.config.identity_files:
        if not os.path.isfile(path):
            continue
        try:
            key = paramiko.PKey.from_path(path)
        except (paramiko.SSHException, OSError, ValueError) as exc:
            tried.append(f"{path} ({exc or type(exc).__name__})")
            continue
        for certificate in certificates:
            try:
                key.load_certificate(certificate)  # checks the key type only
            except (ValueError, OSError, paramiko.SSHException):
                continue
            if key.public_blob is not None and _certifies(key.public_blob.key_blob, key):
                return key
        tried.append(path)
    raise AuthenticationFailed(
        f"CertificateFile {', '.join(certificates)} belongs to none of the identity files"
        f" ({'; '.join(tried) or 'none found'})",
        host=target.name,
        hint="set IdentityFile to the certificate's private key (an unencrypted one: dlrun asks for no"
        " passphrase; keys in ssh-agent are used without a certificate)",
    )


class SSHTransport(Transport):
    """paramiko connections, one per host, opened in parallel by ``connect``.

    ``connect_timeout`` and ``host_timeout`` None: not given on dlrun's command line, so each
    host's ConnectTimeout (else 10 s) and ServerAliveInterval × ServerAliveCountMax (else
    DEFAULT_HOST_TIMEOUT) apply; ``host_timeout`` 0: no liveness check. ``openssh`` False: read the
    ssh config with the fallback parser even where an ``ssh`` binary is installed.
    """

    def __init__(
        self,
        *,
        config_file: str | None = None,
        accept_new_host_keys: bool = False,
        connect_timeout: float | None = None,
        known_hosts: str | None = None,
        host_timeout: float | None = None,
        openssh: bool = True,
        notify: Callable[[str], None] | None = None,
    ) -> None:
        self.notify = notify or _print_note
        self._noted: set[str] = set()  # hosts whose login shell's output was shown
        self._notes_lock = threading.Lock()
        self.accept_new = accept_new_host_keys
        self.timeout = connect_timeout
        self.host_timeout = host_timeout
        self.silent: dict[str, float] = {}  # host -> seconds of silence after which dlrun closed it
        self.known_hosts_override = os.path.expanduser(known_hosts) if known_hosts else None
        self.reader = SSHConfigReader(config_file, shutil.which("ssh") if openssh else None)
        self.clients: dict[str, paramiko.SSHClient] = {}
        self.jump_hops: dict[str, _Hop] = {}
        self.jump_clients: list[paramiko.SSHClient] = []  # in the order they were connected
        self.targets: dict[str, Target] = {}
        self._known_hosts_lock = threading.Lock()
        self._jump_lock = threading.Lock()
        self._store_lock = threading.Lock()  # a connect thread's client kept, or closed: never lost to close()
        self._closed = False  # by close(); a connect thereafter opens again
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ config
    def target(self, host: Host | str) -> Target:
        """The host's ssh config merged with the inventory (inventory wins) and the command line."""
        name = host if isinstance(host, str) else host.name
        return self._target(name, self.reader.lookup(_request(host)))

    def _target(self, name: str, config: HostConfig) -> Target:
        users = (self.known_hosts_override,) if self.known_hosts_override else config.user_known_hosts_files
        if self.host_timeout is not None:
            alive: float | None = self.host_timeout or None
        elif config.server_alive_interval > 0:
            alive = config.server_alive_interval * max(1, config.server_alive_count_max)
        else:
            alive = DEFAULT_HOST_TIMEOUT
        if config.strict_host_key_checking == "no" and name not in self._warned:
            self._warned.add(name)
            print(f"dlrun: warning: {name}: StrictHostKeyChecking {config.strict_host_key_checking} in the ssh config:"
                  " unknown and changed host keys are accepted for this host", file=sys.stderr)
        return Target(
            name=name,
            config=config,
            known_hosts=users[0] if users else os.path.expanduser(DEFAULT_USER_KNOWN_HOSTS[0]),
            known_hosts_files=(*users, *config.global_known_hosts_files),
            connect_timeout=self.timeout or config.connect_timeout or DEFAULT_CONNECT_TIMEOUT,
            alive_limit=alive,
            accept_new=self.accept_new or config.strict_host_key_checking in ("accept-new", "no"),
        )

    # ------------------------------------------------------------------ connect
    def connect(self, hosts: Sequence[Host]) -> Mapping[str, str]:
        with self._store_lock:
            self._closed = False
        todo = [h for h in hosts if h.name not in self.clients]
        if len(todo) >= PROGRESS_FROM:
            print(f"dlrun: reading the ssh config for {len(todo)} hosts", file=sys.stderr, flush=True)
        # every host's config first: a config OpenSSH rejects stops dlrun before any connection
        configs = self.reader.lookup_all([_request(h) for h in todo])
        for host, config in zip(todo, configs, strict=True):
            self.targets[host.name] = self._target(host.name, config)
        errors, untried = self._connect_all(todo) if todo else ([], 0)
        if errors:
            if len(errors) == 1 and not untried:
                raise errors[0]
            first = errors[0]
            shown = errors[:FAILURES_LISTED]
            more = f"\n  … and {len(errors) - len(shown)} more" if len(errors) > len(shown) else ""
            stopped = (f" (stopped after {len(errors)} failures; {untried} of {len(todo)} hosts not tried)"
                       if untried else "")
            message = f"{len(errors)} hosts cannot be reached{stopped}; no rank was started:\n" + "\n".join(
                f"  {e}" for e in shown  # each with its own hint
            ) + more
            raise type(first)(message)
        return {h.name: self.targets[h.name].hostname for h in hosts}

    def _connect_all(self, todo: Sequence[Host]) -> tuple[list[TransportError], int]:
        """Reach ``todo`` in parallel: the errors, and how many hosts were never tried. Many hosts
        get progress lines (every tenth of them); once most of those that answered failed (at
        least ``FAIL_FAST_AFTER``), the rest are not tried: the launch has failed already, and a
        resolver flooded with bad names answers each in seconds."""
        errors: list[TransportError] = []
        abandoned = threading.Event()  # this round's: its threads take no more hosts, close late clients
        noisy = len(todo) >= PROGRESS_FROM
        if noisy:
            print(f"dlrun: connecting to {len(todo)} hosts", file=sys.stderr, flush=True)
        step = max(1, len(todo) // 10)
        waiting: queue.SimpleQueue[Host] = queue.SimpleQueue()
        for host in todo:
            waiting.put(host)
        answers: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()

        def work() -> None:  # daemon threads: a lookup still hanging after a fail-fast holds nothing up
            while not abandoned.is_set():
                try:
                    host = waiting.get_nowait()
                except queue.Empty:
                    return
                try:
                    answers.put(self._connect_one(host, abandoned))
                except BaseException as exc:  # not a host's failure (a ProxyJump loop): raised below
                    answers.put(exc)

        for i in range(min(64, len(todo))):
            threading.Thread(target=work, name=f"dlrun-connect-{i}", daemon=True).start()
        for done in range(1, len(todo) + 1):
            error = answers.get()
            if error is not None and not isinstance(error, TransportError):
                abandoned.set()
                raise error
            if error is not None:
                errors.append(error)
            if noisy and done % step == 0 and done < len(todo):
                print(f"dlrun: connecting: {done - len(errors)} of {len(todo)} hosts reached,"
                      f" {len(errors)} unreachable", file=sys.stderr, flush=True)
            if len(errors) >= FAIL_FAST_AFTER and 2 * len(errors) > done and done < len(todo):
                abandoned.set()  # the threads take no more hosts; those under way close theirs
                return errors, waiting.qsize()
        return errors, 0

    def reconnect(self, hosts: Sequence[Host]) -> Mapping[str, str]:
        for host in hosts:
            old = self.clients.pop(host.name, None)
            self.silent.pop(host.name, None)
            if old is not None:  # over a dead connection closing can block: aside
                threading.Thread(target=old.close, name=f"dlrun-drop-{host.name}", daemon=True).start()
        return self.connect(hosts)

    def _connect_one(self, host: Host, abandoned: threading.Event | None = None) -> TransportError | None:
        try:
            client = self._client(self.targets[host.name])
        except TransportError as exc:
            return exc
        with self._store_lock:  # connect gave up, or the transport closed, while this one was under way
            late = self._closed or (abandoned is not None and abandoned.is_set())
            if not late:
                self.clients[host.name] = client
        if late:
            client.close()
        return None

    def _socket(self, target: Target) -> _Sock:
        if target.proxy_jump:
            return self._jump_channel(target)
        if target.proxy_command:  # the user's own command from their ssh_config, run as OpenSSH runs it
            shell = os.environ.get("SHELL") or "/bin/sh"
            try:
                return paramiko.ProxyCommand(shlex.join([shell, "-c", "exec " + target.proxy_command]))
            except (paramiko.SSHException, OSError) as exc:
                raise HostUnreachable(f"ProxyCommand {target.proxy_command!r} failed: {exc}", host=target.name) from exc
        try:
            sock = socket.create_connection((target.hostname, target.port), timeout=target.connect_timeout)
        except socket.gaierror as exc:
            raise HostUnreachable(f"cannot resolve host name {target.hostname!r}", host=target.name) from exc
        except TimeoutError as exc:
            raise HostUnreachable(
                f"no answer from {target.hostname}:{target.port} within {target.connect_timeout:g} s",
                host=target.name,
            ) from exc
        except ConnectionRefusedError as exc:
            raise HostUnreachable(
                f"connection refused by {target.hostname}:{target.port} (is sshd running on that port?)",
                host=target.name,
            ) from exc
        except ConnectionResetError as exc:  # accepted, then reset before connect() returned
            raise _hung_up(target) from exc
        except OSError as exc:
            raise HostUnreachable(f"cannot connect to {target.hostname}:{target.port}: {exc.strerror or exc}",
                                  host=target.name) from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _jump_channel(self, target: Target, seen: frozenset[str] = frozenset()) -> paramiko.Channel:
        """A channel to ``target`` through its ProxyJump hops (each hop's connection shared by
        every host behind it; a hop's own ProxyJump followed, as OpenSSH does)."""
        assert target.proxy_jump is not None
        hops = [h.strip() for h in target.proxy_jump.split(",") if h.strip()]
        client: paramiko.SSHClient | None = None
        try:
            for hop in hops:
                client = self._jump_client(hop, client, seen | {target.name})
        except TransportError as exc:  # name the host asked for, and the hop that failed
            raise type(exc)(f"bastion {exc.host}: {exc.message}", host=target.name, hint=exc.hint) from exc
        assert client is not None
        transport = client.get_transport()
        assert transport is not None
        try:
            return transport.open_channel(
                "direct-tcpip", (target.hostname, target.port), ("127.0.0.1", 0), timeout=target.connect_timeout
            )
        except (paramiko.SSHException, OSError) as exc:
            raise HostUnreachable(
                f"bastion {hops[-1]} cannot reach {target.hostname}:{target.port}: {exc}", host=target.name
            ) from exc

    def _jump_client(self, spec: str, via: paramiko.SSHClient | None, seen: frozenset[str]) -> paramiko.SSHClient:
        """The connection to one hop. Hosts behind it wait for its one connection and share its
        failure: a dead bastion costs one connect timeout, not one per host."""
        if via is None and parse_jump(spec)[1] in seen:
            raise UsageError(f"ProxyJump loop: {spec} is reached through itself (via {', '.join(sorted(seen))})",
                             hint=f"give {spec} 'ProxyJump none' in the ssh config, before a 'Host *' that sets one")
        with self._jump_lock:
            hop = self.jump_hops.setdefault(spec if via is None else f"{spec} via {id(via)}", _Hop())
        with hop.lock:
            if hop.client is not None:
                return hop.client
            if hop.error is not None:
                raise hop.error
            try:
                hop.client = self._connect_hop(spec, via, seen)
            except TransportError as exc:
                hop.error = exc
                raise
            with self._store_lock:
                late = self._closed
                if not late:
                    self.jump_clients.append(hop.client)
            if late:
                hop.client.close()
            return hop.client

    def _connect_hop(self, spec: str, via: paramiko.SSHClient | None, seen: frozenset[str]) -> paramiko.SSHClient:
        user, name, port = parse_jump(spec)
        base = self.reader.lookup(Request(name, port=port, user=user))  # as OpenSSH's ssh -l user -p port hop
        target = self._target(spec, replace(base, proxy_jump=None))
        sock: _Sock
        if via is not None:
            transport = via.get_transport()
            assert transport is not None
            try:
                sock = transport.open_channel("direct-tcpip", (target.hostname, target.port), ("127.0.0.1", 0),
                                              timeout=target.connect_timeout)
            except (paramiko.SSHException, OSError) as exc:
                raise HostUnreachable(f"the hop before cannot reach {target.hostname}:{target.port}: "
                                      f"{exc or type(exc).__name__}", host=spec) from exc
        elif base.proxy_jump and name not in seen:
            sock = self._jump_channel(replace(target, config=base), seen | {name})
        else:
            sock = self._socket(target)
        return self._client(target, sock=sock)

    def _client(self, target: Target, sock: _Sock | None = None) -> paramiko.SSHClient:
        config = target.config
        try:
            known = load_known_hosts(target.known_hosts_files or (target.known_hosts,), config.known_hosts_name)
        except OSError as exc:
            raise HostKeyError(f"cannot read known_hosts {exc.filename}: {exc.strerror or exc}",
                               host=target.name) from exc
        client = paramiko.SSHClient()  # its HostKeys stay empty: _CheckHostKey sees every host key
        client.set_missing_host_key_policy(_CheckHostKey(target, known, self._known_hosts_lock))
        certified = _certified_key(target)
        if sock is None:
            sock = self._socket(target)
        timeout = target.connect_timeout
        try:
            client.connect(
                target.hostname,
                port=target.port,
                username=target.user,
                pkey=certified,
                key_filename=[f for f in config.identity_files if os.path.isfile(f)] or None,  # type: ignore[arg-type]
                look_for_keys=False,  # the identity files are OpenSSH's list, its defaults included
                allow_agent=not config.identities_only,
                sock=sock,
                timeout=timeout,
                banner_timeout=timeout,
                auth_timeout=timeout,
                channel_timeout=timeout,
                transport_factory=partial(_HardenedTransport, known_types=[k.get_name() for k in known.keys]),
            )
        except _RevokedHostKey as exc:
            client.close()
            raise HostKeyError(f"the host key of {target.hostname} ({exc.key.get_name()} {exc.key.fingerprint}) is"
                               " marked @revoked in known_hosts; dlrun refuses to connect", host=target.name) from None
        except _UnknownHostKey as exc:
            client.close()
            raise _unknown_key_error(target, known, exc.key) from None
        except _ChangedHostKey as exc:
            client.close()
            raise HostKeyError(
                f"HOST KEY CHANGED for {config.known_hosts_name}: known_hosts has {exc.expected.get_name()} "
                f"{exc.expected.fingerprint}, the host offered {exc.key.fingerprint}. Possible "
                "man-in-the-middle; dlrun refuses to connect",
                host=target.name,
                hint="if the host was reinstalled, remove the old key: "
                + shlex.join(["ssh-keygen", "-R", config.known_hosts_name, "-f", target.known_hosts]),
            ) from None
        except paramiko.AuthenticationException as exc:
            client.close()
            raise AuthenticationFailed(
                f"authentication failed for user {target.user!r} at {target.hostname}:{target.port} "
                f"({exc})",
                host=target.name,
                hint="check User/IdentityFile in ~/.ssh/config or the inventory, or load the key into ssh-agent",
            ) from exc
        except TimeoutError as exc:
            client.close()
            raise HostUnreachable(f"SSH handshake timed out after {timeout:g} s", host=target.name) from exc
        except (paramiko.SSHException, OSError, EOFError) as exc:
            begun = client.get_transport()
            banner = begun.remote_version if begun is not None else ""
            client.close()
            # a frozen sshd: the banner wait times out, or the key exchange gives up quietly
            if "No existing session" in str(exc) or isinstance(exc.__context__, TimeoutError):
                raise HostUnreachable(f"no SSH answer (banner or key exchange) from {target.hostname}:{target.port}"
                                      f" within {timeout:g} s", host=target.name) from exc
            # closed or reset: while paramiko sent its banner (a bare EOFError), read the host's
            # (chained), or after it (a bare reset from the transport's reader)
            closed = (EOFError, ConnectionResetError)
            if isinstance(exc, closed) or isinstance(exc.__context__, closed):
                if not banner:
                    raise _hung_up(target) from exc
                raise HostUnreachable(f"{target.hostname}:{target.port} ({banner}) closed the connection during"
                                      " the SSH handshake (sshd's MaxStartups, or a host under load?)",
                                      host=target.name) from exc
            raise HostUnreachable(f"SSH connection failed: {exc or type(exc).__name__}", host=target.name) from exc
        transport = client.get_transport()
        if transport is not None:
            self._watch(target.name, transport, target.alive_limit)
        return client

    # ------------------------------------------------------------------ liveness
    def _watch(self, name: str, transport: paramiko.Transport, limit: float | None) -> None:
        if limit is None:
            transport.set_keepalive(15)  # keeps NAT state; detects nothing by itself
            return
        threading.Thread(target=self._keep_alive, args=(name, transport, limit),
                         name=f"dlrun-alive-{name}", daemon=True).start()

    def _keep_alive(self, name: str, transport: paramiko.Transport, limit: float) -> None:
        """Ask the host for a reply every few seconds; close the connection after ``limit`` s
        without one.

        The request goes out from a short-lived thread: a send can block on a dead connection
        (a full socket buffer, a key exchange that never finishes), and the clock must not.
        """
        interval = heartbeat_interval(limit)
        answered = [time.monotonic()]

        def ask() -> None:
            if _ask_for_reply(transport):
                answered[0] = time.monotonic()

        sender: threading.Thread | None = None
        while transport.is_active():
            # the handshake has just answered: the first question waits one interval (a short
            # launch asks nothing), and the clock still runs from the connection's start
            time.sleep(interval)
            quiet = time.monotonic() - answered[0]
            if quiet > limit:
                self.silent[name] = quiet
                transport.close()  # every recv, send and wait on this connection ends now
                return
            if sender is None or not sender.is_alive():
                sender = threading.Thread(target=ask, name=f"dlrun-ask-{name}", daemon=True)
                sender.start()

    def _why(self, name: str) -> str:
        quiet = self.silent.get(name)
        if quiet is None:
            return ""
        return (f"no answer from the host for {quiet:.0f} s (host timeout {self.host_timeout:g} s): "
                "it is down, cut off from the network or frozen")

    # ------------------------------------------------------------------ commands
    def open(self, host: Host, argv: Sequence[str]) -> Channel:
        client = self.clients.get(host.name)
        if client is None:
            self.connect([host])
            client = self.clients[host.name]
        transport = client.get_transport()
        if transport is None or not transport.is_active():
            why = self._why(host.name)
            raise HostUnreachable("the SSH connection is closed" + (f": {why}" if why else ""), host=host.name)
        timeout = self.targets[host.name].connect_timeout
        token = shell.new_token()
        try:
            channel = transport.open_session(timeout=timeout)
            channel.exec_command(shell.BOOT_COMMAND)
        except (paramiko.SSHException, OSError, EOFError) as exc:
            why = self._why(host.name) or str(exc) or type(exc).__name__
            raise HostUnreachable(f"cannot start a command over SSH: {why}", host=host.name) from exc
        started = SSHChannel(host.name, channel, lambda: self._why(host.name))
        try:
            try:
                started.send(shell.boot_script(argv, token))
            except HostUnreachable:
                if self._why(host.name):
                    raise
                # the login shell may have ended already (a startup file's exit): what it printed
                # and its exit code say why, as await_start reports them
            # nothing more is sent until the marker: an sh that reads its script in blocks
            # would swallow bytes meant for the program
            stdout, stderr = started.await_start(shell.marker(token), timeout)
        except BaseException:
            started.close()
            raise
        self._note(host.name, shell.noise_note(host.name, stdout, stderr))
        return started

    def direct_address(self, host: Host) -> str | None:
        client = self.clients.get(host.name)
        transport = client.get_transport() if client is not None else None
        sock = transport.sock if transport is not None else None
        if not isinstance(sock, socket.socket):  # a ProxyJump channel, a ProxyCommand
            return None
        try:
            return str(sock.getpeername()[0])
        except OSError:
            return None

    def _note(self, name: str, note: str | None) -> None:
        """Show a host's note once per transport (each channel to the host would repeat it)."""
        with self._notes_lock:  # held while it prints: two hosts' notes never share a line
            if note is None or name in self._noted:
                return
            self._noted.add(name)
            self.notify(note)

    def close(self) -> None:
        # bastions first: a target's socket is a channel on its bastion, and closing it over
        # a dead bastion connection could wait; over a closed one it returns at once
        with self._store_lock:
            self._closed = True
            clients = [*self.jump_clients, *self.clients.values()]
            self.clients.clear()
            self.jump_clients.clear()
            self.jump_hops.clear()
        for client in clients:
            client.close()
