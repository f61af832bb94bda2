"""The side channel's byte stream of ``dlrun pull`` (``dlrun.push.pull._SocketStream``): exact
counts across reads of any size, a megabyte at a time, and the end of the stream."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dlrun.push.pull import _SocketStream
from dlrun.transport.side import side_enabled


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


def test_a_failed_write_ends_the_send_and_a_failed_read_sends_zeros(tmp_path: Path) -> None:
    # a lost side channel (the write fails) must end the helper, not be taken for an unreadable file
    from dlrun.remote import push_helper

    (tmp_path / "a.bin").write_bytes(b"a" * 5000)
    entries = {"a.bin": ["file", 5000, 0o644, "x", 0], "gone.bin": ["file", 700, 0o644, "x", 0]}
    sent = bytearray()
    push_helper.send_tree(str(tmp_path), entries, ["gone.bin"], sent.extend)  # vanished since the listing
    assert bytes(sent[512:512 + 700]) == bytes(700) and len(sent) == 512 + 1024 + 1024

    failed: list[int] = []

    def broken(data: Any) -> None:
        if len(data) > 512 and not failed:  # the header goes, the body's first write fails (only that one)
            failed.append(len(data))
            raise ConnectionResetError(104, "Connection reset by peer")

    with pytest.raises(ConnectionResetError):
        push_helper.send_tree(str(tmp_path), entries, ["a.bin"], broken)


def test_the_side_channel_is_off_where_dlrun_side_channel_is_0() -> None:
    assert side_enabled({}) and side_enabled({"DLRUN_SIDE_CHANNEL": "1"})
    assert not side_enabled({"DLRUN_SIDE_CHANNEL": "0"})
