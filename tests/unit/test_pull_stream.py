"""The side channel's byte stream of ``dlrun pull`` (``dlrun.push.pull._SocketStream``): exact
counts across reads of any size, a megabyte at a time, and the end of the stream."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from dlrun.push.pull import _SocketStream


def source(data: bytes, step: int) -> Callable[[memoryview], int]:
    """``recv_into`` that gives at most ``step`` bytes a call (a TLS record's worth)."""
    at = [0]

    def recv_into(view: memoryview) -> int:
        n = min(len(view), step, len(data) - at[0])
        view[:n] = data[at[0]:at[0] + n]
        at[0] += n
        return n

    return recv_into


@pytest.mark.parametrize("step", [997, 16384, 1 << 22])
def test_exact_counts_come_whole_whatever_the_reads(step: int) -> None:
    data = bytes(range(256)) * 8200  # 2 MiB and a little
    stream = _SocketStream(source(data[100:], step), data[:100])
    assert stream.read(512) == data[:512]
    pieces = [bytes(c) for c in stream.chunks(2_000_000)]
    assert b"".join(pieces) == data[512:2_000_512]
    assert max(len(p) for p in pieces) <= 1 << 20  # hashed and written a megabyte at a time at most
    assert stream.read(len(data) - 2_000_512) == data[2_000_512:]
    with pytest.raises(EOFError):
        stream.read(1)


def test_a_helper_that_cannot_listen_says_so_and_sends_over_ssh(monkeypatch: pytest.MonkeyPatch,
                                                                 capfdbinary: pytest.CaptureFixture[bytes]) -> None:
    # no SSH_CONNECTION (the address to listen on is unknown), or a jobs program that does not
    # load: ``T {}``, and the caller sends on stdout
    from dlrun.remote import push_helper, source_of
    from dlrun.tls import make_job_tls

    pair = make_job_tls("pull")
    offer = {"cert": pair.cert_pem, "key": pair.key_pem, "token": "t", "source": source_of("jobs")}
    monkeypatch.delenv("SSH_CONNECTION", raising=False)
    assert push_helper.side_channel(offer)[1] is None
    monkeypatch.setenv("SSH_CONNECTION", "127.0.0.1 5000 127.0.0.1 22")
    assert push_helper.side_channel({**offer, "source": "this is not python"})[1] is None
    assert capfdbinary.readouterr().out == b"T {}\nT {}\n"
