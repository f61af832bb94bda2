"""Reading ``dlrun-jobs``' streamed ``logs`` answer home: over the SSH channel, or over a TLS
side channel the host opens for a big answer.

The frame format (``R``, ``P``, ``J`` lines) is ``dlrun.remote.jobs.stream_logs``'.
``stream_logs`` offers the host a ``SideChannel`` (``dlrun.transport.side``) where the
transport reached the host over its own TCP connection. The host listens on the address that
connection came to and says its port (``T``); dlrun connects, pins the certificate and shows the
token, and the answer comes that way, read straight into its pieces by OpenSSL with the GIL
released. A host whose port cannot be reached (a firewall, a NAT) answers on the SSH channel
instead, and is not offered the side channel again. Mechanism:
``docs/detach.md``; measured in ``docs/benchmarks.md`` ("Reading a detached job's logs home").
"""

from __future__ import annotations

import json
import ssl
import threading
from collections.abc import Callable, Mapping
from typing import Any

from dlrun.errors import DlrunError, HostUnreachable
from dlrun.inventory import Host
from dlrun.remote import boot_argv, boot_payload
from dlrun.transport.base import Channel, Transport, default_python
from dlrun.transport.side import HINT, SideChannel, TlsSource, connect_side, side_context, side_enabled

__all__ = ["ChannelSource", "Frames", "SideChannel", "TlsSource", "connect_side", "side_context", "side_enabled",
           "stream_logs"]

LINE_MAX = 1 << 26  # bytes of one frame line (the records of a job with many ranks fit)
PIECE_MAX = 1 << 24  # bytes of one piece (the jobs program sends at most 1 MiB): memory stays bounded


class Frames:
    """Lines and exact byte counts from ``recv_into`` (a socket's, or a channel's through
    ``ChannelSource``), through one small buffer; a piece is read straight into its own bytes."""

    def __init__(self, recv_into: Callable[[memoryview], int]) -> None:
        self.recv_into = recv_into
        self.buf = bytearray(1 << 16)
        self.piece = bytearray()
        self.start = 0
        self.end = 0

    def _fill(self) -> None:
        if self.start == self.end:
            self.start = self.end = 0
        elif self.end == len(self.buf):
            if self.start:  # move what is left to the front
                self.buf[: self.end - self.start] = self.buf[self.start: self.end]
                self.end -= self.start
                self.start = 0
            else:
                if len(self.buf) >= LINE_MAX:
                    raise ValueError(f"a line of more than {LINE_MAX} bytes")
                self.buf.extend(bytes(len(self.buf)))
        got = self.recv_into(memoryview(self.buf)[self.end:])
        if not got:
            raise EOFError
        self.end += got

    def line(self) -> bytes:
        """The next line, without its end."""
        while True:
            at = self.buf.find(b"\n", self.start, self.end)
            if at >= 0:
                line = bytes(self.buf[self.start: at])
                self.start = at + 1
                return line
            self._fill()

    def exact(self, n: int) -> bytearray:
        """The next ``n`` bytes, in one buffer reused by the next call (pieces are about the same
        size: resized in place, no fresh zeroed megabyte per piece)."""
        out = self.piece
        if len(out) > n:
            del out[n:]
        elif len(out) < n:
            out.extend(bytes(n - len(out)))
        have = min(n, self.end - self.start)
        out[:have] = self.buf[self.start: self.start + have]
        self.start += have
        with memoryview(out) as view:
            while have < n:
                got = self.recv_into(view[have:])
                if not got:
                    raise EOFError
                have += got
        return out


class ChannelSource:
    """``recv_into`` over a transport channel: ``None`` from it after ``timeout`` seconds is a
    silent host; what did not fit the caller's view waits for the next call."""

    def __init__(self, channel: Channel, host: str, timeout: float) -> None:
        self.channel = channel
        self.host = host
        self.timeout = timeout
        self.rest = memoryview(b"")

    def recv_into(self, view: memoryview) -> int:
        data = self.rest
        if not data:
            got = self.channel.recv_within(self.timeout, max(len(view), 1 << 16))
            if got is None:
                raise HostUnreachable(f"dlrun-jobs sent nothing for {self.timeout:g} s", host=self.host)
            data = memoryview(got)
        n = min(len(view), len(data))
        view[:n] = data[:n]
        self.rest = data[n:]
        return n


def stream_logs(transport: Transport, host: Host, request: Mapping[str, Any],
                on_records: Callable[[list[dict[str, Any]]], None],
                on_piece: Callable[[str, Mapping[str, Any], bytearray], None], timeout: float = 120.0,
                side: SideChannel | None = None) -> dict[str, Any]:
    """``dlrun-jobs``'s streamed ``logs`` answer (``dlrun.remote.jobs.stream_logs``): the host's
    records to ``on_records`` first, then each piece to ``on_piece(key, header, data)`` as it
    arrives (``data`` is reused for the next piece), so memory stays bounded whatever the logs
    hold; the closing document (``jobs``, ``ends``). ``timeout``: seconds without a byte from the
    host (time spent showing what came, a paused pager, does not count; the transport's own
    silence clock covers a dead host).
    ``side``: offer the host the TLS side channel, where the transport reached it directly."""
    address = transport.direct_address(host) if side is not None and host.name not in side.refused else None
    making = None
    if side is not None and address is not None:  # the key is made while the channel opens
        making = threading.Thread(target=side.prepare, args=(host.name,), name=f"dlrun-side-{host.name}",
                                  daemon=True)
        making.start()
    channel = transport.open(host, boot_argv(default_python(host), "jobs"))
    if making is not None:
        making.join()
    offer, context = side.offer(host.name) if side is not None and address is not None else (None, None)
    tls: ssl.SSLSocket | None = None
    try:
        document = {**request, "stream": True, **({"side": offer} if offer is not None else {})}
        channel.send(boot_payload("jobs") + json.dumps(document).encode() + b"\n")
        if offer is None:
            channel.close_stdin()
        frames = Frames(ChannelSource(channel, host.name, timeout).recv_into)
        records: dict[str, Any] = {}
        while True:
            try:
                line = frames.line()
                if line.startswith(b"P "):
                    header = json.loads(line[2:])
                    if not 0 <= int(header["length"]) <= PIECE_MAX:
                        raise DlrunError(f"dlrun-jobs sent a piece of {header['length']} bytes", host=host.name)
                    on_piece(str(header["key"]), header, frames.exact(int(header["length"])))
                    continue
            except EOFError:
                code = channel.wait(5)
                detail = " / ".join(channel.stderr_text().strip().splitlines()[-3:])
                how = "its side channel closed" if tls is not None else f"dlrun-jobs ended (exit {code})"
                raise HostUnreachable(f"{how} before its answer was whole: {detail}", host=host.name,
                                      hint=HINT if tls is not None else None) from None
            if line.startswith(b"R "):
                records = json.loads(line[2:])
                on_records(records.get("jobs") or [])
            elif line.startswith(b"J "):
                answer: dict[str, Any] = json.loads(line[2:])
                return {**answer, **records}
            elif line.startswith(b"T ") and offer is not None and context is not None and tls is None:
                assert address is not None
                try:
                    tls = connect_side(address, int(json.loads(line[2:])["port"]), context, offer["token"])
                except (OSError, ssl.SSLError, ValueError, KeyError) as exc:
                    side.refuse(host.name, str(exc) or type(exc).__name__)  # type: ignore[union-attr]
                    channel.close_stdin()  # the host answers on the channel
                    continue
                frames = Frames(TlsSource(tls, channel, host.name, timeout).recv_into)
            else:
                raise DlrunError(f"dlrun-jobs answered {line[:200]!r}", host=host.name)
    finally:
        if tls is not None:
            tls.close()
        channel.close()
