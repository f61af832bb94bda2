"""The SSH transport: one hardened paramiko connection per host, reused by every step of a job.

The only module that imports paramiko; it translates paramiko's and the socket layer's
exceptions into dlrun's own (``HostUnreachable``, ``AuthenticationFailed``, ``HostKeyError``)
at this one boundary. What it owns:

* **OpenSSH configuration**: ``~/.ssh/config`` or ``--ssh-config``, its ``Include`` files
  inlined (``read_ssh_config``: paramiko ignores them): ``HostName``, ``User``, ``Port``,
  ``IdentityFile``, ``ProxyJump`` (bastions, chained; a hop's own ProxyJump followed; one
  connection per hop, shared with its failure by the hosts behind it), ``ProxyCommand``,
  ``UserKnownHostsFile`` and ``GlobalKnownHostsFile``. Inventory values override the config.
  ssh-agent keys are used.
* **Host keys**: known_hosts is always loaded, line by line (``load_known_hosts``: a
  ``@cert-authority`` or damaged line is skipped, ``@revoked`` keys are refused). An unknown
  host is refused unless the user passed ``--accept-new-host-keys`` (then the key is appended
  to known_hosts, like OpenSSH's ``accept-new``); a changed key is always refused.
  (fabric's default, AutoAddPolicy without known_hosts, would accept anything; dlrun does
  not use it.)
* **Connections**: opened in parallel, each within ``connect_timeout``, on a socket with
  TCP_NODELAY (181 → 125 ms per host on loopback). Every host is reached before any rank
  starts; all failures are reported together, each with its host and the SSH error in words.
* **Bulk data**: paramiko's public ``Channel.send``, with AES-GCM offered first (one OpenSSL
  call per packet encrypts and authenticates).
* **Liveness** (OpenSSH's ``ServerAliveInterval``/``ServerAliveCountMax``): a thread per
  connection asks the host for a reply (``keepalive@openssh.com``) every few seconds, and
  closes the connection when no reply has arrived for ``host_timeout`` seconds. A host that loses power or network mid-push or mid-probe then
  fails that step within the timeout instead of after TCP's ~15 minutes (or never, when the
  host's kernel still acknowledges); every wait on the connection ends when it closes.
* **Commands**: ``open`` runs an argv as one exec channel; the argv is joined with
  ``shlex.join`` for the remote login shell, so no argument can inject a command. Env never
  travels on the command line: the agent receives it inside JSON on stdin.

Why paramiko and not fabric's Connection: fabric adds config loading and gateways we need
differently (known_hosts policy, one socket option, per-host error mapping); its defaults
are the unsafe ones. Plain paramiko keeps every one of those choices visible here.
"""

from __future__ import annotations

import getpass
import glob as globmod
import logging
import os
import re
import shlex
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import paramiko

from dlrun.errors import AuthenticationFailed, HostKeyError, HostUnreachable, TransportError, UsageError
from dlrun.inventory import Host
from dlrun.plan import DEFAULT_HOST_TIMEOUT, heartbeat_interval
from dlrun.transport.base import Channel, Transport

# paramiko logs each failed handshake ("Error reading SSH protocol banner") with a traceback,
# which Python's last-resort handler prints to stderr; dlrun reports the same failure itself,
# naming the host, as a HostUnreachable.
logging.getLogger("paramiko").addHandler(logging.NullHandler())


# Tried first, then the rest of paramiko's list (what a server lacks is skipped, nothing is
# dropped). paramiko encrypts and authenticates in Python, once per packet: AES-GCM does both in
# one call to OpenSSL, where aes128-ctr adds a separate HMAC per packet (push of 200 MB to 4
# loopback hosts: client CPU 5.8 -> 4.2 s, docs/benchmarks.md "Push after AES-GCM ..."). EtM MACs only
# matter for a server without GCM.
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
    """paramiko's Transport with the cheapest secure cipher and MAC offered first, and known_hosts'
    ``@revoked`` keys refused right after the key exchange."""

    def get_remote_server_key(self) -> paramiko.PKey:
        # paramiko asks for the key right after the key exchange, before known_hosts and the
        # login: a revoked key stops here, before --accept-new-host-keys could save it
        key: paramiko.PKey = super().get_remote_server_key()
        if any(key == bad for bad in self.revoked):
            raise _RevokedHostKey(key)
        return key

    def __init__(self, sock: Any, *, revoked: Sequence[paramiko.PKey] = (), **options: Any) -> None:
        super().__init__(sock, **options)
        self.revoked = tuple(revoked)  # known_hosts' @revoked keys: refused before any check or login
        security = self.get_security_options()
        security.ciphers = _preferred_first(security.ciphers, PREFERRED_CIPHERS)
        security.digests = _preferred_first(security.digests, PREFERRED_MACS)


@dataclass(frozen=True)
class Target:
    """Where and how to connect, after merging ssh_config and the inventory."""

    name: str
    hostname: str
    port: int
    user: str
    identity_files: tuple[str, ...]
    proxy_jump: str | None
    known_hosts: str  # where --accept-new-host-keys writes (the first UserKnownHostsFile)
    known_hosts_files: tuple[str, ...] = ()  # every file read: UserKnownHostsFile(s), GlobalKnownHostsFile(s)
    proxy_command: str | None = None  # ssh_config's ProxyCommand (when there is no ProxyJump)


_Sock = socket.socket | paramiko.Channel | paramiko.ProxyCommand  # what paramiko connects over


@dataclass
class _Hop:
    """One ProxyJump hop's connection, or why it failed (shared by the hosts behind it)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    client: paramiko.SSHClient | None = None
    error: TransportError | None = None


class _AcceptNew(paramiko.MissingHostKeyPolicy):
    """Add an unknown key and append it to known_hosts (OpenSSH's accept-new)."""

    def __init__(self, path: str, lock: threading.Lock) -> None:
        self.path = path
        self.lock = lock

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        entry = paramiko.hostkeys.HostKeyEntry([hostname], key)
        with self.lock:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
            with open(fd, "a+b") as fh:
                fh.seek(0, os.SEEK_END)
                if fh.tell():  # a file whose last line has no newline must not swallow the entry
                    fh.seek(-1, os.SEEK_END)
                    if fh.read(1) != b"\n":
                        fh.write(b"\n")
                fh.write((entry.to_line() or "").encode())
        client.get_host_keys().add(hostname, key.get_name(), key)


class _RejectUnknown(paramiko.MissingHostKeyPolicy):
    def __init__(self, known_hosts: str) -> None:
        self.known_hosts = known_hosts

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        raise _UnknownHostKey(hostname, key, self.known_hosts)


class _RevokedHostKey(Exception):
    def __init__(self, key: paramiko.PKey) -> None:
        super().__init__(key.fingerprint)
        self.key = key


class _UnknownHostKey(Exception):
    def __init__(self, hostname: str, key: paramiko.PKey, known_hosts: str) -> None:
        super().__init__(hostname)
        self.hostname = hostname
        self.key = key
        self.known_hosts = known_hosts


class SSHChannel(Channel):
    """One exec channel; stderr is drained on the side so it can never stall stdout."""

    def __init__(self, host: str, channel: paramiko.Channel, why: Callable[[], str] = lambda: "") -> None:
        self.host = host
        self.channel = channel
        self.why = why  # why the connection was closed, when dlrun closed it (silence)
        self._stderr = bytearray()
        self._lock = threading.Lock()

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
        try:
            data: bytes = self.channel.recv(max_bytes)
        except (OSError, EOFError, paramiko.SSHException):
            data = b""
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


def _expand(path: str) -> str:
    return os.path.expanduser(path)


def read_ssh_config(path: str, depth: int = 0) -> str:
    """The text of an ssh_config with its ``Include`` lines replaced by the files they name
    (globs; relative names from ``~/.ssh``, as OpenSSH reads them): paramiko ignores Include."""
    if depth > 16:
        raise UsageError(f"ssh config {path}: Include nested more than 16 deep")
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise UsageError(f"cannot read ssh config {path}: {exc.strerror or exc}") from exc
    out: list[str] = []
    context = "Host *"  # the Host or Match block a line belongs to (top level: every host)
    for line in text.splitlines():
        words = line.strip().split(None, 1)
        if len(words) == 2 and words[0].lower() == "include":
            for pattern in shlex.split(words[1]):
                pattern = _expand(pattern)
                if not os.path.isabs(pattern):
                    pattern = _expand(os.path.join("~/.ssh", pattern))
                out.extend(read_ssh_config(f, depth + 1) for f in sorted(globmod.glob(pattern)) if os.path.isfile(f))
            out.append(context)  # what follows the Include is back in the including block
            continue
        if words and words[0].lower() in ("host", "match"):
            context = line.strip()
        out.append(line)
    return "\n".join(out)


def load_known_hosts(keys: paramiko.HostKeys, path: str) -> list[paramiko.PKey]:
    """Add the entries of one known_hosts file to ``keys``; return its ``@revoked`` keys.

    Read line by line, unlike paramiko's loader, which stops at the first line it cannot
    read: ``@cert-authority`` lines (host certificates are not supported: such hosts count as
    unknown), unknown key types and damaged lines are skipped.
    """
    revoked = []
    with open(path, encoding="utf-8", errors="replace") as fh:
        for number, raw in enumerate(fh, start=1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            marker = ""
            if line.startswith("@"):
                marker, line = [*line.split(None, 1), ""][:2]  # a space or a tab follows the marker
                if marker != "@revoked":
                    continue
            try:
                entry = paramiko.hostkeys.HostKeyEntry.from_line(line.strip(), number)
            except (paramiko.hostkeys.InvalidHostKey, paramiko.SSHException, ValueError, IndexError):
                continue
            if entry is None:
                continue
            if marker:
                revoked.append(entry.key)
                continue
            for name in entry.hostnames:
                keys.add(name, entry.key.get_name(), entry.key)
    return revoked


def known_hosts_name(hostname: str, port: int) -> str:
    """How known_hosts (and ``ssh-keygen -R``) name a host: ``[host]:port`` off port 22."""
    return hostname if port == 22 else f"[{hostname}]:{port}"


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


class SSHTransport(Transport):
    """paramiko connections, one per host, opened in parallel by ``connect``."""

    def __init__(
        self,
        *,
        config_file: str | None = None,
        accept_new_host_keys: bool = False,
        connect_timeout: float = 10.0,
        known_hosts: str | None = None,
        host_timeout: float | None = DEFAULT_HOST_TIMEOUT,
    ) -> None:
        self.accept_new = accept_new_host_keys
        self.timeout = connect_timeout
        self.host_timeout = host_timeout or None  # 0 / None: paramiko's one-way keepalive only
        self.silent: dict[str, float] = {}  # host -> seconds of silence after which dlrun closed it
        self.known_hosts_override = known_hosts
        self.config = paramiko.SSHConfig()
        path = config_file or _expand("~/.ssh/config")
        if config_file and not os.path.isfile(config_file):
            raise UsageError(f"ssh config file not found: {config_file}")
        if os.path.isfile(path):
            self.config = paramiko.SSHConfig.from_text(read_ssh_config(path))
        self.clients: dict[str, paramiko.SSHClient] = {}
        self.jump_hops: dict[str, _Hop] = {}
        self.jump_clients: list[paramiko.SSHClient] = []  # in the order they were connected
        self.targets: dict[str, Target] = {}
        self._known_hosts_lock = threading.Lock()
        self._jump_lock = threading.Lock()

    # ------------------------------------------------------------------ config
    def target(self, host: Host | str) -> Target:
        """Merge ssh_config with the inventory (inventory wins)."""
        address = host if isinstance(host, str) else host.address
        name = host if isinstance(host, str) else host.name
        cfg = self.config.lookup(address)
        user = (None if isinstance(host, str) else host.user) or cfg.get("user") or getpass.getuser()
        port_value = (None if isinstance(host, str) else host.port) or cfg.get("port") or 22
        identity = None if isinstance(host, str) else host.identity_file
        identities = (identity,) if identity else tuple(cfg.get("identityfile", []))
        try:
            port = int(port_value)
        except ValueError:
            raise UsageError(f"Port {port_value!r} for {address} in the ssh config is not a number") from None
        hostname = cfg.get("hostname", address)
        tokens = {"%h": hostname, "%p": str(port), "%r": user, "%u": getpass.getuser(), "%d": _expand("~"),
                  "%n": address, "%k": address}

        def files(value: str | None, default: str) -> list[str]:  # several, with %tokens
            def expand(name: str) -> str:
                return _expand(re.sub(r"%[%hprudnk]", lambda m: "%" if m[0] == "%%" else tokens[m[0]], name))

            value = value or default  # paramiko took off the quotes: "a b" may be one file or two
            names = [value] if os.path.isfile(expand(value)) else shlex.split(value)
            return [expand(name) for name in names if name.lower() != "none"]

        users = [_expand(self.known_hosts_override)] if self.known_hosts_override else files(
            cfg.get("userknownhostsfile"), "~/.ssh/known_hosts ~/.ssh/known_hosts2")
        proxy = cfg.get("proxyjump")
        command = self._raw(address, "proxycommand") or cfg.get("proxycommand")
        if command not in (None, "none"):  # tokens from the merged values: the inventory's port and user win
            values = {"%h": hostname, "%p": str(port), "%r": user, "%n": address}
            command = re.sub(r"%[%hprn]", lambda m: "%" if m[0] == "%%" else shlex.quote(values[m[0]]), command)
        return Target(
            name=name,
            hostname=hostname,
            port=port,
            user=user,
            identity_files=tuple(_expand(i) for i in identities),
            proxy_jump=None if proxy in (None, "none") else proxy,
            proxy_command=None if command in (None, "none") or proxy not in (None, "none") else command,
            known_hosts=users[0] if users else _expand("~/.ssh/known_hosts"),
            known_hosts_files=(*users, *files(cfg.get("globalknownhostsfile"),
                                              "/etc/ssh/ssh_known_hosts /etc/ssh/ssh_known_hosts2")),
        )

    def _raw(self, address: str, key: str) -> str | None:
        """A config value before paramiko put its own %-tokens in (None where that is not known)."""
        try:
            value = self.config._lookup(address).get(key)  # type: ignore[attr-defined]
        except (AttributeError, TypeError):
            return None
        return value if isinstance(value, str) else None

    # ------------------------------------------------------------------ connect
    def connect(self, hosts: Sequence[Host]) -> Mapping[str, str]:
        todo = [h for h in hosts if h.name not in self.clients]
        errors: list[TransportError] = []
        if todo:
            with ThreadPoolExecutor(max_workers=min(64, len(todo))) as pool:
                errors = [e for e in pool.map(self._connect_one, todo) if e is not None]
        if errors:
            if len(errors) == 1:
                raise errors[0]
            first = errors[0]
            message = f"{len(errors)} hosts cannot be reached; no rank was started:\n" + "\n".join(
                f"  {e}" for e in errors  # each with its own hint
            )
            raise type(first)(message)
        return {h.name: self.targets[h.name].hostname for h in hosts}

    def _connect_one(self, host: Host) -> TransportError | None:
        target = self.target(host)
        self.targets[host.name] = target
        try:
            self.clients[host.name] = self._client(target)
        except TransportError as exc:
            return exc
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
            sock = socket.create_connection((target.hostname, target.port), timeout=self.timeout)
        except socket.gaierror as exc:
            raise HostUnreachable(f"cannot resolve host name {target.hostname!r}", host=target.name) from exc
        except TimeoutError as exc:
            raise HostUnreachable(
                f"no answer from {target.hostname}:{target.port} within {self.timeout:g} s", host=target.name
            ) from exc
        except ConnectionRefusedError as exc:
            raise HostUnreachable(
                f"connection refused by {target.hostname}:{target.port} (is sshd running on that port?)",
                host=target.name,
            ) from exc
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
                "direct-tcpip", (target.hostname, target.port), ("127.0.0.1", 0), timeout=self.timeout
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
            self.jump_clients.append(hop.client)
            return hop.client

    def _connect_hop(self, spec: str, via: paramiko.SSHClient | None, seen: frozenset[str]) -> paramiko.SSHClient:
        user, name, port = parse_jump(spec)
        base = self.target(name)
        target = replace(base, name=spec, port=port or base.port, user=user or base.user, proxy_jump=None)
        sock: _Sock
        if via is not None:
            transport = via.get_transport()
            assert transport is not None
            try:
                sock = transport.open_channel(
                    "direct-tcpip", (target.hostname, target.port), ("127.0.0.1", 0), timeout=self.timeout
                )
            except (paramiko.SSHException, OSError) as exc:
                raise HostUnreachable(f"the hop before cannot reach {target.hostname}:{target.port}: "
                                      f"{exc or type(exc).__name__}", host=spec) from exc
        elif base.proxy_jump and name not in seen:
            sock = self._jump_channel(replace(target, proxy_jump=base.proxy_jump), seen | {name})
        else:
            sock = self._socket(target)
        return self._client(target, sock=sock)

    def _client(self, target: Target, sock: _Sock | None = None) -> paramiko.SSHClient:
        client = paramiko.SSHClient()
        revoked: list[paramiko.PKey] = []
        for path in dict.fromkeys(target.known_hosts_files or (target.known_hosts,)):
            if os.path.isfile(path):
                try:
                    revoked += load_known_hosts(client.get_host_keys(), path)
                except OSError as exc:
                    raise HostKeyError(f"cannot read known_hosts {path}: {exc.strerror or exc}",
                                       host=target.name) from exc
        if self.accept_new:
            client.set_missing_host_key_policy(_AcceptNew(target.known_hosts, self._known_hosts_lock))
        else:
            client.set_missing_host_key_policy(_RejectUnknown(target.known_hosts))
        if sock is None:
            sock = self._socket(target)
        try:
            client.connect(
                target.hostname,
                port=target.port,
                username=target.user,
                key_filename=list(target.identity_files) or None,  # type: ignore[arg-type]
                look_for_keys=not target.identity_files,
                allow_agent=True,
                sock=sock,
                timeout=self.timeout,
                banner_timeout=self.timeout,
                auth_timeout=self.timeout,
                channel_timeout=self.timeout,
                transport_factory=partial(_HardenedTransport, revoked=revoked),
            )
        except _RevokedHostKey as exc:
            client.close()
            raise HostKeyError(f"the host key of {target.hostname} ({exc.key.get_name()} {exc.key.fingerprint}) is"
                               " marked @revoked in known_hosts; dlrun refuses to connect", host=target.name) from None
        except _UnknownHostKey as exc:
            client.close()
            shown = exc.hostname
            keyscan = shlex.join(["ssh-keyscan", "-p", str(target.port), target.hostname])
            raise HostKeyError(
                f"unknown host key ({exc.key.get_name()} {exc.key.fingerprint}) for {shown}; not in {exc.known_hosts}",
                host=target.name,
                hint=f"verify it, then add it: {keyscan} >> {shlex.quote(exc.known_hosts)}"
                " — or pass --accept-new-host-keys to add unknown keys (changed keys are still refused)",
            ) from None
        except paramiko.BadHostKeyException as exc:
            client.close()
            raise HostKeyError(
                f"HOST KEY CHANGED for {exc.hostname}: known_hosts has {exc.expected_key.get_name()} "
                f"{exc.expected_key.fingerprint}, the host offered {exc.key.fingerprint}. Possible "
                "man-in-the-middle; dlrun refuses to connect",
                host=target.name,
                hint="if the host was reinstalled, remove the old key: "
                + shlex.join(["ssh-keygen", "-R", known_hosts_name(target.hostname, target.port),
                              "-f", target.known_hosts]),
            ) from exc
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
            raise HostUnreachable(f"SSH handshake timed out after {self.timeout:g} s", host=target.name) from exc
        except (paramiko.SSHException, OSError, EOFError) as exc:
            client.close()
            # a frozen sshd: the banner wait times out, or the key exchange gives up quietly
            if "No existing session" in str(exc) or isinstance(exc.__context__, TimeoutError):
                raise HostUnreachable(f"no SSH answer (banner or key exchange) from {target.hostname}:{target.port}"
                                      f" within {self.timeout:g} s", host=target.name) from exc
            if isinstance(exc.__context__, EOFError) and "banner" in str(exc):
                raise HostUnreachable(f"{target.hostname}:{target.port} hung up before the SSH banner (is it an"
                                      " SSH server?)", host=target.name) from exc
            raise HostUnreachable(f"SSH connection failed: {exc or type(exc).__name__}", host=target.name) from exc
        transport = client.get_transport()
        if transport is not None:
            self._watch(target.name, transport)
        return client

    # ------------------------------------------------------------------ liveness
    def _watch(self, name: str, transport: paramiko.Transport) -> None:
        if self.host_timeout is None:
            transport.set_keepalive(15)  # keeps NAT state; detects nothing by itself
            return
        threading.Thread(target=self._keep_alive, args=(name, transport, self.host_timeout),
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
            if sender is None or not sender.is_alive():
                sender = threading.Thread(target=ask, name=f"dlrun-ask-{name}", daemon=True)
                sender.start()
            time.sleep(interval)
            quiet = time.monotonic() - answered[0]
            if quiet > limit:
                self.silent[name] = quiet
                transport.close()  # every recv, send and wait on this connection ends now
                return

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
        try:
            channel = transport.open_session(timeout=self.timeout)
            channel.exec_command(shlex.join(argv))
        except (paramiko.SSHException, OSError, EOFError) as exc:
            why = self._why(host.name) or str(exc) or type(exc).__name__
            raise HostUnreachable(f"cannot start a command over SSH: {why}", host=host.name) from exc
        return SSHChannel(host.name, channel, lambda: self._why(host.name))

    def close(self) -> None:
        # bastions first: a target's socket is a channel on its bastion, and closing it over
        # a dead bastion connection could wait; over a closed one it returns at once
        for client in [*self.jump_clients, *self.clients.values()]:
            client.close()
        self.clients.clear()
        self.jump_clients.clear()
        self.jump_hops.clear()
