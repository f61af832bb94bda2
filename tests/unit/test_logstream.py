"""The client's side of the streamed ``logs`` answer (``dlrun.run.logstream``): frames read right
whatever sizes the bytes come in, a silent channel, the ``[rank host]`` lines written from a
piece, and the shared-home skip of the jobs program."""

from __future__ import annotations

import io
import json
import random
import socket
import ssl
import threading
from pathlib import Path

import pytest

from dlrun.errors import HostUnreachable
from dlrun.remote import jobs
from dlrun.run.detach import JobHosts, LogFollower
from dlrun.run.logstream import ChannelSource, Frames, side_context
from dlrun.testing import FakeTransport
from dlrun.tls import make_job_tls

from support.trickle import trickle


def chopped(data: bytes, seed: int) -> Frames:
    """Frames over ``data`` handed out in random sizes (1 byte to 100 KB), as sockets do."""
    rng = random.Random(seed)
    at = [0]

    def recv_into(view: memoryview) -> int:
        n = min(len(view), rng.choice((1, 7, 100, 4096, 100_000)), len(data) - at[0])
        view[:n] = data[at[0]: at[0] + n]
        at[0] += n
        return n

    return Frames(recv_into)


@pytest.mark.parametrize("seed", range(5))
def test_frames_are_read_whole_whatever_sizes_the_bytes_come_in(seed: int) -> None:
    long_line = b"R " + json.dumps({"jobs": ["x" * 200_000]}).encode()  # longer than the buffer
    pieces = [bytes(random.Random(seed + i).randbytes(size)) for i, size in enumerate((1, 70_000, 3, 1 << 20))]
    stream = long_line + b"\n" + b"".join(b"P %d\n" % len(p) + p for p in pieces) + b"J {}\n"
    frames = chopped(stream, seed)
    assert frames.line() == long_line
    for piece in pieces:
        head = frames.line()
        assert head == b"P %d" % len(piece)
        assert frames.exact(int(head[2:])) == piece
    assert frames.line() == b"J {}"
    with pytest.raises(EOFError):
        frames.line()


class Silent:
    """A channel whose host sends nothing."""

    def recv_within(self, timeout: float, max_bytes: int = 1 << 20) -> bytes | None:
        return None


def test_a_silent_channel_is_an_unreachable_host() -> None:
    source = ChannelSource(Silent(), "h2", 7)  # type: ignore[arg-type]
    with pytest.raises(HostUnreachable, match="sent nothing for 7 s"):
        Frames(source.recv_into).line()


@pytest.mark.parametrize("data", [b"a\nb\n", b"a\nb", bytearray(b"one\n"), b"\n"])
def test_a_piece_becomes_prefixed_lines_byte_for_byte(data: bytes) -> None:
    out = io.TextIOWrapper(io.BytesIO(), write_through=True)
    follower = LogFollower(JobHosts(FakeTransport(), []), "j", out)
    follower.show("host-h/attempt-0/rank-3.log", "h", data)
    out.flush()
    lines = bytes(data).split(b"\n")
    if bytes(data).endswith(b"\n"):
        lines.pop()
    assert out.buffer.getvalue() == b"".join(b"[3 h] " + line + b"\n" for line in lines)


def test_hosts_that_share_a_home_each_send_only_their_own_folder(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    for host in ("a", "b"):
        folder = tmp_path / ".dlrun" / "jobs" / "j" / f"host-{host}" / "attempt-0"
        folder.mkdir(parents=True)
        (folder / "rank-0.log").write_bytes(b"line\n")
    keys = [key for key, *_ in jobs.log_files("j", {}, None, frozenset({"host-b"}))]
    assert keys == ["host-a/attempt-0/rank-0.log"]
    assert len(jobs.log_files("j", {}, None)) == 2  # b cannot be reached: a sends its folder too




def greet(token: bytes, shown: bytes, pace: float | None) -> tuple[int, int]:
    """One connection with the right certificate to a host's side channel (``jobs.side_greet``)
    that shows ``shown``, all at once (``pace`` None) or a byte every ``pace`` seconds: how many
    connections were let in, and how many bytes of ``shown`` went out."""
    pair = make_job_tls("logs test")
    won: list[ssl.SSLSocket] = []

    def take(tls: ssl.SSLSocket) -> bool:
        won.append(tls)
        return True

    server, client = socket.socketpair()
    greeter = threading.Thread(target=jobs.side_greet, args=(
        server, jobs.server_context(pair.cert_pem, pair.key_pem), token, take))
    greeter.start()
    with side_context(pair.cert_pem, pair.key_pem).wrap_socket(client) as tls:
        if pace is None:
            tls.sendall(shown)
            sent = len(shown)
            greeter.join(timeout=60)
        else:
            sent = trickle(tls.sendall, shown, greeter, pace)
        assert not greeter.is_alive()
    for tls in won:
        tls.close()
    return len(won), sent


def test_the_side_channel_lets_in_no_one_who_trickles_even_the_right_token() -> None:
    # the whole greeting has jobs.SIDE_AUTH, not each read: the right certificate and token,
    # sent a byte at a time, are closed before the token is whole, and never served
    token = b"t" * 43
    assert greet(token, token + b"\n", None) == (1, len(token) + 1)  # dlrun: in at once
    assert greet(token, b"x" * 43 + b"\n", None)[0] == 0  # a wrong token: out
    let_in, sent = greet(token, token + b"\n", jobs.SIDE_AUTH / 4)
    assert let_in == 0 and sent < len(token) + 1


def test_a_trickled_tls_handshake_is_cut_off_too() -> None:
    # a ClientHello sent a byte at a time (each byte well inside a read's timeout) is closed after
    # about jobs.SIDE_AUTH: CPython bounds the whole handshake by the socket's timeout, and the
    # timer (through its own descriptor: wrap_socket takes the connection's) would too
    pair = make_job_tls("logs test")
    client = side_context(pair.cert_pem, pair.key_pem)
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    hello = client.wrap_bio(incoming, outgoing)
    with pytest.raises(ssl.SSLWantReadError):
        hello.do_handshake()
    first = outgoing.read()
    server, ours = socket.socketpair()
    greeter = threading.Thread(target=jobs.side_greet, args=(
        server, jobs.server_context(pair.cert_pem, pair.key_pem), b"t" * 43, lambda tls: True))
    greeter.start()
    sent = trickle(ours.sendall, first[:32], greeter, jobs.SIDE_AUTH / 4)  # 8 x SIDE_AUTH at most
    ours.close()
    assert not greeter.is_alive() and sent < 8 * 4, sent
