"""The keepers' TLS connection (``keeper.Peer``) with sends from several threads while its reader
reads, both ways at once, as the loop, the heartbeat and the reader do in a detached job. Before
every TLS call held one lock, this broke the stream within a few hundred messages (each side saw
the connection close: a host wrongly lost)."""

from __future__ import annotations

import queue
import socket
import ssl
import threading
from typing import Any

from dlrun.remote import keeper
from dlrun.tls import make_job_tls

from support.trickle import trickle


def pair(timeout: float | None) -> tuple[keeper.Peer, keeper.Peer]:
    job = make_job_tls("j")
    server, client = keeper.server_context(job.cert_pem, job.key_pem), keeper.client_context(job.cert_pem)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        accepted: dict[str, ssl.SSLSocket] = {}

        def accept() -> None:
            raw, _ = listener.accept()
            accepted["sock"] = server.wrap_socket(raw, server_side=True)

        thread = threading.Thread(target=accept)
        thread.start()
        ours = client.wrap_socket(socket.create_connection(listener.getsockname()))
        thread.join()
    for sock in (ours, accepted["sock"]):
        sock.settimeout(timeout)  # as the keeper sets --host-timeout
    return keeper.Peer(accepted["sock"], "leader-side"), keeper.Peer(ours, "follower-side")


def test_sends_from_three_threads_each_way_while_both_read_arrive_whole_and_in_order() -> None:
    a, b = pair(30.0)
    events: dict[str, queue.Queue[Any]] = {"a": queue.Queue(), "b": queue.Queue()}
    for name, peer in (("a", a), ("b", b)):
        threading.Thread(target=peer.read_into, args=(events[name],), daemon=True).start()
    count = 1500

    def sender(peer: keeper.Peer, k: int) -> None:
        for i in range(count):
            peer.send({"op": "beat", "k": k, "i": i, "pad": "x" * (i % 900)})

    threads = [threading.Thread(target=sender, args=(peer, k)) for peer in (a, b) for k in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        for name in ("a", "b"):
            seen: dict[int, list[int]] = {0: [], 1: [], 2: []}
            while sum(map(len, seen.values())) < 3 * count:
                event = events[name].get(timeout=30)
                assert event[0] == "peer", f"{name}: {event} after {sum(map(len, seen.values()))} messages"
                seen[event[2]["k"]].append(event[2]["i"])
            assert all(v == list(range(count)) for v in seen.values())
        assert not a.closed and not b.closed
    finally:
        a.close()
        b.close()


def test_a_peer_that_stops_reading_is_closed_after_the_timeout_and_reading_goes_on() -> None:
    a, b = pair(1.0)
    events: queue.Queue[Any] = queue.Queue()
    threading.Thread(target=a.read_into, args=(events,), daemon=True).start()  # b never reads
    try:
        b.send({"op": "note", "text": "hello"})
        assert events.get(timeout=10)[2] == {"op": "note", "text": "hello"}
        big = {"op": "end", "result": "x" * (1 << 20)}
        for _ in range(64):  # until the buffers are full and one send finds no room for 1 s
            a.send(big)
            if a.closed:
                break
        assert a.closed
        b.send({"op": "beat"})  # its own reader still reads: the send lock is not the TLS lock
        assert events.get(timeout=10)[2] == {"op": "beat"}
    finally:
        a.close()
        b.close()


def test_the_door_closes_on_a_stranger_who_trickles_the_hello_past_auth_timeout() -> None:
    # TLS done at once, then the hello a byte per AUTH_TIMEOUT / 4 (each read inside its own
    # timeout): the door's timer closes it after AUTH_TIMEOUT in all, and nobody joins
    job = make_job_tls("j")
    joined: list[object] = []
    door = keeper.Door(lambda given: given == "the token")
    server, ours = socket.socketpair()
    greeter = threading.Thread(target=door.welcome, args=(
        server, keeper.server_context(job.cert_pem, job.key_pem), lambda *args: joined.append(args)))
    greeter.start()
    line = b'{"token": "the token", "host": "h1"}\n'
    with keeper.client_context(job.cert_pem).wrap_socket(ours) as tls:
        sent = trickle(tls.sendall, line, greeter, keeper.AUTH_TIMEOUT / 4)
    assert not greeter.is_alive() and not joined and sent < len(line), sent
