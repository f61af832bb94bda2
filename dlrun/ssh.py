"""The SSH transport: one hardened paramiko connection per host, reused by every step of a job.

The only module that imports paramiko; it translates paramiko's and the socket layer's
exceptions into dlrun's own (``HostUnreachable``, ``AuthenticationFailed``, ``HostKeyError``)
at this one boundary. What it owns:

* **OpenSSH configuration**: ``~/.ssh/config`` or ``--ssh-config``: ``HostName``, ``User``,
  ``Port``, ``IdentityFile``, ``ProxyJump`` (bastions, chained), ``UserKnownHostsFile``.
  Inventory values override the config. ssh-agent keys are used.
* **Host keys**: known_hosts is always loaded. An unknown host is refused unless the user
  passed ``--accept-new-host-keys`` (then the key is appended to known_hosts, like OpenSSH's
  ``accept-new``); a changed key is always refused. (fabric's default, AutoAddPolicy without
  known_hosts, would accept anything; dlrun does not use it.)
* **Connections**: opened in parallel, each within ``connect_timeout``, on a socket with
  TCP_NODELAY (181 → 125 ms per host on loopback). Every host is reached before any rank
  starts; all failures are reported together, each with its host and the SSH error in words.
* **Bulk data**: what a channel sends goes out through ``_FastPacketizer`` under AES-GCM: each
  packet laid out and encrypted once in reused buffers, the same bytes paramiko would write
  (tests/test_ssh_fastpath.py); other ciphers and messages take paramiko's own path.
* **Liveness** (OpenSSH's ``ServerAliveInterval``/``ServerAliveCountMax``): a thread per
  connection asks the host for a reply (``keepalive@openssh.com``) whenever it has been quiet
  for a few seconds, and closes the connection when nothing at all has arrived for
  ``host_timeout`` seconds. A host that loses power or network mid-push or mid-probe then
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
import logging
import os
import shlex
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from dlrun.errors import AuthenticationFailed, HostKeyError, HostUnreachable, TransportError, UsageError
from dlrun.inventory import Host
from dlrun.plan import DEFAULT_HOST_TIMEOUT, heartbeat_interval
from dlrun.transport import Channel, Transport

# paramiko.config imports invoke (unittest.mock, asyncio, yaml: ~60 ms of every job) only to run
# ``Match exec`` lines. It is kept out of the import and fetched the first time one is evaluated.
_BLOCK_INVOKE = "invoke" not in sys.modules
if _BLOCK_INVOKE:
    sys.modules["invoke"] = None  # type: ignore[assignment]
try:
    import paramiko
    import paramiko.config
    from paramiko.packet import Packetizer
finally:
    if _BLOCK_INVOKE:
        sys.modules.pop("invoke", None)


# paramiko logs each failed handshake ("Error reading SSH protocol banner") with a traceback,
# which Python's last-resort handler prints to stderr; dlrun reports the same failure itself,
# naming the host, as a HostUnreachable.
logging.getLogger("paramiko").addHandler(logging.NullHandler())


class _InvokeOnFirstUse:
    """Stands in for the invoke module in paramiko.config until a ``Match exec`` needs it."""

    def __getattr__(self, name: str) -> Any:
        import invoke

        paramiko.config.invoke = invoke  # type: ignore[attr-defined]
        return getattr(invoke, name)


if getattr(paramiko.config, "invoke", None) is None:
    paramiko.config.invoke = _InvokeOnFirstUse()  # type: ignore[attr-defined]

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


_MSG_CHANNEL_DATA = 94  # SSH_MSG_CHANNEL_DATA (RFC 4254 5.2)
_GCM_TAG = 16


class _ChannelData:
    """One SSH_MSG_CHANNEL_DATA message whose data is copied only once, into the packet.

    paramiko's ``Channel.send`` builds a ``Message`` (a BytesIO) for each packet, and its
    Packetizer copies the bytes about six times on the way to the socket (push of 200 MB: 23 %
    of the client's samples in ``memmove``). ``_send_data`` hands this object to paramiko's own
    ``Channel._send`` instead, which keeps the send window, the channel lock and the wait while a
    key exchange runs; only ``add_string`` (the data, a view: not copied) is called on it.
    ``_FastPacketizer`` encrypts it straight from that view; any other packetizer, or a cipher
    the fast path does not handle, gets the exact bytes paramiko would have built from
    ``asbytes``.
    """

    __slots__ = ("chanid", "data")

    def __init__(self, chanid: int) -> None:
        self.chanid = chanid
        self.data: bytes | memoryview = b""

    def add_string(self, data: bytes | memoryview) -> None:
        self.data = data

    def asbytes(self) -> bytes:
        return struct.pack(">BII", _MSG_CHANNEL_DATA, self.chanid, len(self.data)) + bytes(self.data)


class _FastPacketizer(Packetizer):
    """paramiko's Packetizer with a lean path for channel data under AES-GCM.

    For a ``_ChannelData`` message on an AES-GCM connection without compression, the packet is
    laid out once in a reused buffer (header, data, padding), encrypted with one ``encrypt_into``
    into a second reused buffer behind the clear length field, and written from there: one
    copy of the data where paramiko makes about six. The bytes on the wire are the ones
    paramiko's ``send_message`` writes (same padding length rule, AAD, nonce sequence; the
    tests decode them with paramiko's own Packetizer and compare them with its output), and the
    sequence number, byte and packet counters and the rekey trigger are kept the way
    ``send_message`` keeps them. Everything else (other messages, other ciphers, EtM or plain
    MACs, compression, packet dumps) goes to paramiko's ``send_message`` unchanged.
    """

    # Random padding drawn from os.urandom this many bytes at a time (one getrandom(2) per ~680
    # packets of 32 KiB instead of one per packet: 8 % of the client's samples in the push).
    _PAD_POOL = 4096

    # the paramiko internals the lean path reads and writes (paramiko 3.3 … 5.1 have them all):
    # where one is missing, or cryptography has no AESGCM.encrypt_into, every packet takes
    # paramiko's own path
    _INTERNALS = ("block_engine_out", "aead_out", "compress_engine_out", "dump_packets", "block_size_out",
                  "write_lock", "iv_out", "sequence_number_out", "socket", "sent_bytes", "sent_packets",
                  "need_rekey", "received_bytes_overflow", "received_packets_overflow")

    def __init__(self, sock: Any) -> None:
        super().__init__(sock)
        self._lean = (
            hasattr(AESGCM, "encrypt_into")
            and all(hasattr(self, "_Packetizer__" + name) for name in self._INTERNALS)
            and all(hasattr(self, name) for name in ("_inc_iv_counter", "_trigger_rekey", "_initial_kex_done"))
        )
        self._pad_pool = b""
        self._pad_used = 0
        self._plain = bytearray()
        self._wire = bytearray()
        self.last_read = time.monotonic()  # when the last packet arrived (the liveness clock)

    def read_message(self) -> tuple[int, paramiko.Message]:
        result: tuple[int, paramiko.Message] = super().read_message()
        self.last_read = time.monotonic()
        return result

    def _padding(self, count: int) -> bytes:
        """``count`` bytes from os.urandom, fetched in batches.

        Under AES-GCM the padding is encrypted and authenticated like the payload, and RFC 4253
        6 only asks for random bytes; OpenSSH fills it from its own CSPRNG (arc4random) for the
        same reason. The bytes still come from the kernel's CSPRNG, each used once; only the
        number of getrandom calls drops. The pool is only touched under the write lock.
        """
        if self._pad_used + count > len(self._pad_pool):
            self._pad_pool = os.urandom(self._PAD_POOL)
            self._pad_used = 0
        start = self._pad_used
        self._pad_used = start + count
        return self._pad_pool[start : start + count]

    def send_message(self, data: Any) -> None:
        # paramiko keeps this state in private (name-mangled) attributes; read them untyped.
        p: Any = self
        engine = p._Packetizer__block_engine_out
        if (
            type(data) is not _ChannelData
            or not self._lean
            or not p._Packetizer__aead_out
            or not isinstance(engine, AESGCM)
            or p._Packetizer__compress_engine_out is not None
            or p._Packetizer__dump_packets
        ):
            super().send_message(data)
            return
        payload = data.data
        size = len(payload)
        # paramiko's _build_packet under AEAD: the length field is not counted, at least 4 bytes.
        block = p._Packetizer__block_size_out
        padding = 3 + block - ((9 + size + 4) % block)
        length = 1 + 9 + size + padding
        lock = p._Packetizer__write_lock
        with lock:
            if len(self._plain) < length:
                self._plain = bytearray(length)
                self._wire = bytearray(4 + length + _GCM_TAG)
            plain = memoryview(self._plain)[:length]
            wire = memoryview(self._wire)[: 4 + length + _GCM_TAG]
            struct.pack_into(">BBII", plain, 0, padding, _MSG_CHANNEL_DATA, data.chanid, size)
            plain[10 : 10 + size] = payload
            plain[10 + size :] = self._padding(padding)
            struct.pack_into(">I", wire, 0, length)
            iv = p._Packetizer__iv_out
            engine.encrypt_into(iv, plain, wire[:4], wire[4:])
            p._Packetizer__iv_out = p._inc_iv_counter(iv)
            # From here on as in paramiko's send_message.
            next_seq = (p._Packetizer__sequence_number_out + 1) & 0xFFFFFFFF
            if next_seq == 0 and not p._initial_kex_done:
                raise paramiko.SSHException("Sequence number rolled over during initial kex!")
            p._Packetizer__sequence_number_out = next_seq
            sock = p._Packetizer__socket
            self.write_all(wire if isinstance(sock, socket.socket) else bytes(wire))
            p._Packetizer__sent_bytes += len(wire)
            p._Packetizer__sent_packets += 1
            if (
                p._Packetizer__sent_packets >= self.REKEY_PACKETS
                or p._Packetizer__sent_bytes >= self.REKEY_BYTES
            ) and not p._Packetizer__need_rekey:
                p._log(
                    paramiko.common.DEBUG,
                    f"Rekeying (hit {p._Packetizer__sent_packets} packets, "
                    f"{p._Packetizer__sent_bytes} bytes sent)",
                )
                p._Packetizer__received_bytes_overflow = 0
                p._Packetizer__received_packets_overflow = 0
                p._trigger_rekey()


def _send_data(channel: paramiko.Channel, data: bytes | memoryview) -> None:
    """``channel.sendall(data)``, in ``_ChannelData`` packets when the connection can take them.

    Each packet goes through paramiko's ``Channel._send`` (lock, closed check, send window and
    maximum packet size, then ``Transport._send_user_message``, which waits out a key exchange),
    exactly as ``Channel.send`` does; only the message object differs.
    """
    transport = channel.get_transport()
    if not isinstance(transport.packetizer, _FastPacketizer):
        channel.sendall(data)  # type: ignore[arg-type]
        return
    view = memoryview(data).cast("B")
    while view:
        sent: int = channel._send(view, _ChannelData(channel.remote_chanid))  # type: ignore[attr-defined]
        if not sent:
            # paramiko's sendall would spin here: the window closed because the channel is shut.
            raise OSError("the channel is closed for sending")
        view = view[sent:]


def _ask_for_reply(transport: paramiko.Transport) -> None:
    """Send ``keepalive@openssh.com`` with want-reply, as OpenSSH's ServerAliveInterval does:
    sshd answers (a request failure), and any packet restarts the liveness clock."""
    message = paramiko.Message()
    message.add_byte(paramiko.common.cMSG_GLOBAL_REQUEST)
    message.add_string("keepalive@openssh.com")
    message.add_boolean(True)
    try:
        transport._send_user_message(message)  # type: ignore[attr-defined]  # paramiko's own sender
    except (OSError, EOFError, paramiko.SSHException):
        pass  # the connection is ending; the clock reports it


class _FastTransport(paramiko.Transport):
    """paramiko's Transport with the cheapest secure cipher and MAC offered first, and
    ``_FastPacketizer`` for its packets."""

    # bench/push.py --baseline sets paramiko's own Packetizer here to time the path without it.
    packetizer_factory: type[Packetizer] = _FastPacketizer

    def __init__(self, sock: Any, **options: Any) -> None:
        options.setdefault("packetizer_class", type(self).packetizer_factory)
        super().__init__(sock, **options)
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
    known_hosts: str


class _AcceptNew(paramiko.MissingHostKeyPolicy):
    """Add an unknown key and append it to known_hosts (OpenSSH's accept-new)."""

    def __init__(self, path: str, lock: threading.Lock) -> None:
        self.path = path
        self.lock = lock

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        entry = paramiko.hostkeys.HostKeyEntry([hostname], key)
        with self.lock:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            with open(self.path, "a", encoding="utf-8") as fh:
                fh.write(entry.to_line() or "")
        client.get_host_keys().add(hostname, key.get_name(), key)


class _RejectUnknown(paramiko.MissingHostKeyPolicy):
    def __init__(self, known_hosts: str) -> None:
        self.known_hosts = known_hosts

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        raise _UnknownHostKey(hostname, key, self.known_hosts)


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
                _send_data(self.channel, data)
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
            self._stderr += chunk[: max(0, 1 << 20 - len(self._stderr))]

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
            self.config = paramiko.SSHConfig.from_path(path)
        self.clients: dict[str, paramiko.SSHClient] = {}
        self.jump_clients: dict[str, paramiko.SSHClient] = {}
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
        known = self.known_hosts_override or (cfg.get("userknownhostsfile") or "~/.ssh/known_hosts").split()[0]
        proxy = cfg.get("proxyjump")
        return Target(
            name=name,
            hostname=cfg.get("hostname", address),
            port=int(port_value),
            user=user,
            identity_files=tuple(_expand(i) for i in identities),
            proxy_jump=None if proxy in (None, "none") else proxy,
            known_hosts=_expand(known),
        )

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

    def _socket(self, target: Target) -> socket.socket | paramiko.Channel:
        if target.proxy_jump:
            return self._jump_channel(target)
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

    def _jump_channel(self, target: Target) -> paramiko.Channel:
        assert target.proxy_jump is not None
        hops = [h.strip() for h in target.proxy_jump.split(",") if h.strip()]
        client: paramiko.SSHClient | None = None
        for hop in hops:
            client = self._jump_client(hop, via=client)
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

    def _jump_client(self, spec: str, via: paramiko.SSHClient | None) -> paramiko.SSHClient:
        user, _, rest = spec.rpartition("@")
        name, _, port = rest.partition(":")
        with self._jump_lock:
            if spec in self.jump_clients:
                return self.jump_clients[spec]
            base = self.target(name)
            target = Target(
                name=f"{spec} (bastion)",
                hostname=base.hostname,
                port=int(port) if port else base.port,
                user=user or base.user,
                identity_files=base.identity_files,
                proxy_jump=None,
                known_hosts=self.known_hosts_override or base.known_hosts,
            )
            if via is not None:
                transport = via.get_transport()
                assert transport is not None
                sock: socket.socket | paramiko.Channel = transport.open_channel(
                    "direct-tcpip", (target.hostname, target.port), ("127.0.0.1", 0), timeout=self.timeout
                )
            else:
                sock = self._socket(target)
            client = self._client(target, sock=sock)
            self.jump_clients[spec] = client
            return client

    def _client(self, target: Target, sock: socket.socket | paramiko.Channel | None = None) -> paramiko.SSHClient:
        client = paramiko.SSHClient()
        if os.path.isfile(target.known_hosts):
            try:
                client.load_host_keys(target.known_hosts)
            except (OSError, paramiko.SSHException) as exc:
                raise HostKeyError(f"cannot read known_hosts {target.known_hosts}: {exc}", host=target.name) from exc
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
                transport_factory=_FastTransport,
            )
        except _UnknownHostKey as exc:
            client.close()
            shown = exc.hostname
            raise HostKeyError(
                f"unknown host key ({exc.key.get_name()} {exc.key.fingerprint}) for {shown}; not in {exc.known_hosts}",
                host=target.name,
                hint=f"verify it, then add it: ssh-keyscan -p {target.port} {target.hostname} >> {exc.known_hosts}"
                " — or pass --accept-new-host-keys to add unknown keys (changed keys are still refused)",
            ) from None
        except paramiko.BadHostKeyException as exc:
            client.close()
            raise HostKeyError(
                f"HOST KEY CHANGED for {exc.hostname}: known_hosts has {exc.expected_key.get_name()} "
                f"{exc.expected_key.fingerprint}, the host offered {exc.key.fingerprint}. Possible "
                "man-in-the-middle; dlrun refuses to connect",
                host=target.name,
                hint=f"if the host was reinstalled, remove the old key: ssh-keygen -R '{exc.hostname}' "
                f"-f {target.known_hosts}",
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
            raise HostUnreachable(f"SSH connection failed: {exc or type(exc).__name__}", host=target.name) from exc
        transport = client.get_transport()
        if transport is not None:
            self._watch(target.name, transport)
        return client

    # ------------------------------------------------------------------ liveness
    def _watch(self, name: str, transport: paramiko.Transport) -> None:
        packetizer = transport.packetizer
        if self.host_timeout is None or not isinstance(packetizer, _FastPacketizer):
            transport.set_keepalive(15)  # keeps NAT state; detects nothing by itself
            return
        threading.Thread(target=self._keep_alive, args=(name, transport, packetizer, self.host_timeout),
                         name=f"dlrun-alive-{name}", daemon=True).start()

    def _keep_alive(self, name: str, transport: paramiko.Transport, packetizer: _FastPacketizer,
                    limit: float) -> None:
        """Ask a quiet host for a reply; close the connection after ``limit`` s without a packet.

        The request goes out from a short-lived thread: a send can block on a dead connection
        (a full socket buffer, a key exchange that never finishes), and the clock must not.
        """
        interval = heartbeat_interval(limit)
        sender: threading.Thread | None = None
        while transport.is_active():
            time.sleep(interval)
            quiet = time.monotonic() - packetizer.last_read
            if quiet > limit:
                self.silent[name] = quiet
                transport.close()  # every recv, send and wait on this connection ends now
                return
            if quiet >= interval and (sender is None or not sender.is_alive()):
                sender = threading.Thread(target=_ask_for_reply, args=(transport,), daemon=True)
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
        for client in [*self.jump_clients.values(), *self.clients.values()]:
            client.close()
        self.clients.clear()
        self.jump_clients.clear()
