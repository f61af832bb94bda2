"""The Spark channel's TLS: a task trusts exactly the job's certificate, over TLS 1.3."""

from __future__ import annotations

import socket
import ssl
import threading

import pytest

from dlrun.spark.tls import client_context, make_job_tls, server_context


def serve_once(context: ssl.SSLContext) -> tuple[int, list[object]]:
    listener = socket.create_server(("127.0.0.1", 0))
    results: list[object] = []

    def accept() -> None:
        conn, _ = listener.accept()
        try:
            with context.wrap_socket(conn, server_side=True) as tls:
                results.append(tls.version())
                results.append(tls.recv(100))
                tls.sendall(b"spec")
        except (ssl.SSLError, OSError) as exc:
            results.append(exc)
        finally:
            listener.close()

    threading.Thread(target=accept, daemon=True).start()
    return listener.getsockname()[1], results


def test_a_task_that_pins_the_jobs_certificate_talks_tls13() -> None:
    job = make_job_tls("j1")
    port, results = serve_once(server_context(job))
    with socket.create_connection(("127.0.0.1", port)) as raw, \
            client_context(job.cert_pem).wrap_socket(raw) as tls:
        tls.sendall(b"hello token")
        assert tls.recv(100) == b"spec"
    assert results[:2] == ["TLSv1.3", b"hello token"]


def test_another_certificate_is_refused() -> None:
    port, _ = serve_once(server_context(make_job_tls("impostor")))
    with socket.create_connection(("127.0.0.1", port)) as raw, pytest.raises(ssl.SSLCertVerificationError):
        client_context(make_job_tls("j1").cert_pem).wrap_socket(raw)


def test_a_plain_tcp_client_gets_nothing() -> None:
    port, _ = serve_once(server_context(make_job_tls("j1")))
    with socket.create_connection(("127.0.0.1", port)) as raw:
        raw.sendall(b'{"token": "x", "job_id": "j1"}\n')
        raw.settimeout(10)
        try:
            data = raw.recv(100)
        except ConnectionResetError:
            data = b""
    assert b"spec" not in data


def relayed_pair() -> tuple[socket.socket, socket.socket, list[threading.Thread]]:
    """A driver's and a task's plain sockets, joined by two relays over one real TLS connection."""
    from dlrun.spark.task import TlsLink, start_relay

    job = make_job_tls("j1")
    listener = socket.create_server(("127.0.0.1", 0))
    driver: list[tuple[socket.socket, threading.Thread]] = []

    def accept() -> None:
        conn, _ = listener.accept()
        link = TlsLink(conn, server_context(job), server_side=True)
        link.handshake()
        driver.append(start_relay(link, "driver"))

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    link = TlsLink(socket.create_connection(listener.getsockname()), client_context(job.cert_pem), server_side=False)
    link.handshake()
    task, task_relay = start_relay(link, "task")
    thread.join(10)
    listener.close()
    return driver[0][0], task, [driver[0][1], task_relay]


def read_to_eof(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(1 << 20):
        data += chunk
    return data


def test_the_relays_carry_bytes_and_each_half_close_and_then_end() -> None:
    driver, task, relays = relayed_pair()
    task.sendall(b"hello\n")
    assert driver.recv(100) == b"hello\n"
    spec = bytes(range(256)) * 12_000  # megabytes one way: backpressure, many records
    sender = threading.Thread(target=driver.sendall, args=(spec,))
    sender.start()
    got = b""
    while len(got) < len(spec):
        got += task.recv(1 << 20)
    sender.join()
    assert got == spec
    task.sendall(b"task end")
    task.shutdown(socket.SHUT_WR)  # the task's half-close: the driver reads to EOF, still may write
    assert read_to_eof(driver) == b"task end"
    driver.sendall(b"verdict\n")
    driver.close()
    assert read_to_eof(task) == b"verdict\n"
    task.close()
    for relay in relays:
        relay.join(10)
        assert not relay.is_alive()


def test_a_dropped_side_drops_the_other() -> None:
    driver, task, relays = relayed_pair()
    task.sendall(b"agent output")
    assert driver.recv(100) == b"agent output"
    driver.shutdown(socket.SHUT_RDWR)  # the driver abandons the task
    driver.close()
    task.settimeout(10)
    assert read_to_eof(task) == b""  # the agent's stdin ends: its watchdog stops the ranks
    task.close()
    for relay in relays:
        relay.join(10)
        assert not relay.is_alive()


def test_the_listener_faces_the_executors() -> None:
    from dlrun.spark.driver import listen_addresses

    assert listen_addresses("local[3]", {"spark.driver.host": "10.1.2.3"}) == ("127.0.0.1", "127.0.0.1")
    assert listen_addresses("local-cluster[2,1,1024]", {}) == ("127.0.0.1", "127.0.0.1")
    assert listen_addresses("spark://head:7077", {"spark.driver.host": "10.1.2.3"}) == ("10.1.2.3", "10.1.2.3")
    behind_nat = {"spark.driver.host": "gw.example", "spark.driver.bindAddress": "172.17.0.2"}
    assert listen_addresses("yarn", behind_nat) == ("172.17.0.2", "gw.example")


def test_the_hello_server_admits_only_a_tls_task_with_the_token() -> None:
    import json

    from dlrun.spark.driver import HelloServer
    from dlrun.spark.task import TlsLink, start_relay

    job = make_job_tls("j1")
    server = HelloServer("t0ken", "j1", 1, job)
    address = ("127.0.0.1", server.port)

    def task(token: str) -> socket.socket:
        link = TlsLink(socket.create_connection(address), client_context(job.cert_pem), server_side=False)
        link.handshake()
        sock, _ = start_relay(link, "task")
        hello = {"token": token, "job_id": "j1", "partition": 0, "host": "127.0.0.1", "port": 4000}
        sock.sendall(json.dumps(hello).encode() + b"\n")
        return sock

    try:
        with socket.create_connection(address) as plain:  # no TLS: refused
            plain.sendall(b'{"token": "t0ken", "job_id": "j1", "partition": 0}\n')
            plain.settimeout(10)
            try:
                assert b"{" not in plain.recv(100)
            except ConnectionResetError:
                pass
        impostor = task("wrong")
        impostor.settimeout(10)
        assert read_to_eof(impostor) == b""  # dropped without a word
        reported: list[str] = []
        good = task("t0ken")
        links = server.wait(10, lambda: None, report=reported.append)
        assert list(links) == [0] and links[0].hello.port == 4000
        links[0].sock.sendall(b"spec\n")
        assert good.recv(100) == b"spec\n"
        assert len(reported) == 2 and "no TLS handshake" in reported[0], reported
        assert "without this job's hello" in reported[1], reported
    finally:
        server.close()
