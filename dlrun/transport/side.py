"""dlrun's end of a TLS side channel: bytes a host program sends straight over TCP instead of
through the SSH channel (``dlrun logs``' big answers, ``dlrun pull``'s files).

Where the transport reached a host over its own TCP connection (``Transport.direct_address``),
dlrun offers the host program a certificate and key made here for that host and a one-time
token, all sent over the SSH channel. The host program (``dlrun.remote.jobs.side_channel``,
which the push helper loads too) listens on the address that connection came to, says its port,
and takes the first connection that completes mutual TLS with that certificate and shows the
token; dlrun pins the certificate. The bytes come that way, read by OpenSSL with the GIL
released (paramiko's packet path copies each byte about ten times, in Python). A host whose
port cannot be reached (a firewall, a NAT) sends over the SSH channel instead, and is not
offered the side channel again. ``DLRUN_SIDE_CHANNEL=0`` in dlrun's environment turns it off
(everything over SSH). Mechanism: ``docs/detach.md``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import ssl
import threading
from collections.abc import Callable, Mapping
from typing import TypeVar

from dlrun.errors import HostUnreachable
from dlrun.transport.base import Channel

SIDE_CONNECT = 5.0  # seconds to reach a host's side channel before its answer comes over SSH instead
SLICE = 1.0  # seconds between two looks at the SSH connection while the side channel is quiet
OPT_OUT = "DLRUN_SIDE_CHANNEL"  # "0" in dlrun's environment: no side channel, everything over SSH
HINT = f"set {OPT_OUT}=0 to send everything over SSH (no side channel)"

T = TypeVar("T")


def side_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether a command may offer the side channel (``DLRUN_SIDE_CHANNEL`` is not ``0``)."""
    return (os.environ if environ is None else environ).get(OPT_OUT, "").strip() != "0"


class SideChannel:
    """The TLS side channel dlrun offers the hosts of one command: each host its own
    certificate, key and token (made on first use, kept for the command's later looks), so that
    no host holds what would let it pose as another; and the hosts whose side channel could not
    be reached (they answer over SSH from then on). ``purpose`` names the certificates."""

    def __init__(self, purpose: str = "logs") -> None:
        self.purpose = purpose
        self.refused: dict[str, str] = {}  # host -> why its side channel could not be reached
        self._offers: dict[str, tuple[dict[str, str], ssl.SSLContext]] = {}
        self._lock = threading.Lock()

    def offer(self, host: str) -> tuple[dict[str, str], ssl.SSLContext]:
        """What ``host`` is sent (certificate, key, token) and the context that pins it."""
        with self._lock:
            made = self._offers.get(host)
        if made is None:
            from dlrun.tls import make_job_tls

            tls = make_job_tls(f"{self.purpose} {host}")
            made = ({"cert": tls.cert_pem, "key": tls.key_pem, "token": secrets.token_urlsafe(32)},
                    side_context(tls.cert_pem, tls.key_pem))
            with self._lock:
                made = self._offers.setdefault(host, made)
        return made

    def prepare(self, host: str) -> None:
        """``offer`` ahead (in a thread, while a channel opens); a failure shows on ``offer``."""
        with contextlib.suppress(Exception):
            self.offer(host)

    def refuse(self, host: str, why: str) -> None:
        with self._lock:
            self.refused[host] = why


class TlsSource:
    """``recv_into`` over the side channel. It waits in slices, so that the SSH connection's own
    silence limit (the transport closes a host that stops answering) ends it as it ends the
    channel, and ``timeout`` seconds without a byte is a silent host program (``program``)."""

    def __init__(self, tls: ssl.SSLSocket, channel: Channel, host: str, timeout: float,
                 program: str = "dlrun-jobs") -> None:
        self.tls = tls
        self.channel = channel
        self.host = host
        self.timeout = timeout
        self.program = program
        tls.settimeout(min(SLICE, timeout))

    def recv_into(self, view: memoryview) -> int:
        return self._wait(lambda: self.tls.recv_into(view))

    def recv(self, max_bytes: int) -> bytes:
        """Up to ``max_bytes`` (one TLS record's worth or more); ``b""`` at the end."""
        return self._wait(lambda: self.tls.recv(max_bytes))

    def _wait(self, read: Callable[[], T]) -> T:
        quiet = 0.0
        while True:
            try:
                return read()
            except TimeoutError:
                quiet += min(SLICE, self.timeout)
                why = self.channel.lost_reason()
                if why:
                    raise HostUnreachable(f"connection lost: {why}", host=self.host) from None
                if quiet >= self.timeout:
                    raise HostUnreachable(f"{self.program} sent nothing for {self.timeout:g} s on its side channel",
                                          host=self.host, hint=HINT) from None
            except (OSError, ssl.SSLError) as exc:
                raise HostUnreachable(f"the side channel of {self.program} broke off: {exc}", host=self.host,
                                      hint=HINT) from exc


def side_context(cert_pem: str, key_pem: str) -> ssl.SSLContext:
    """The client's context of a side channel: it trusts exactly the certificate made for the
    host, and shows it back with its key (mutual TLS: the host lets in no one else)."""
    from dlrun.remote.jobs import load_pair
    from dlrun.tls import client_context

    context = client_context(cert_pem)
    load_pair(context, cert_pem, key_pem)
    return context


def connect_side(address: str, port: int, context: ssl.SSLContext, token: str) -> ssl.SSLSocket:
    """The host's side channel, its certificate checked and the token shown (OSError,
    ssl.SSLError when it cannot be had)."""
    conn = socket.create_connection((address, port), timeout=SIDE_CONNECT)
    try:
        tls = context.wrap_socket(conn)
        tls.sendall(token.encode() + b"\n")
    except BaseException:
        conn.close()
        raise
    return tls
