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
