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
