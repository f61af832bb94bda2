"""A stand-in for NCCL's RAS client socket (NCCL >= 2.24, ``src/ras/client_support.cc``): the
same text protocol (``CLIENT PROTOCOL 2`` → ``SERVER PROTOCOL 2``, ``TIMEOUT n`` → ``OK``,
``[VERBOSE] STATUS`` → the status text, then the connection closes), answering with a status
text recorded from NCCL's guide (``tests/fixtures/nccl-ras/``). This machine has no GPU and no
NCCL; ``scripts/gpu_smoke.sh`` asks the real one on a lent GPU machine."""

from __future__ import annotations

import socket
import threading

FIXTURES = __file__.rsplit("/support/", 1)[0] + "/fixtures/nccl-ras"


def handle(conn: socket.socket, text: bytes, asked: list[str]) -> None:
    with conn, conn.makefile("rb") as reader:
        for raw in reader:
            line = raw.decode().strip()
            asked.append(line)
            word = line.upper()
            if word.startswith("CLIENT PROTOCOL "):
                conn.sendall(b"SERVER PROTOCOL 2\n")
            elif word.startswith("TIMEOUT ") or word.startswith("SET FORMAT "):
                conn.sendall(b"OK\n")
            elif word in ("STATUS", "VERBOSE STATUS"):
                conn.sendall(text)
                return
            else:
                conn.sendall(b"ERROR: Unknown command\n")
                return


def serve(addr: str, text: bytes) -> list[str]:
    """Listen at ``host:port`` (as NCCL does: ``SO_REUSEADDR``) in a daemon thread; the lines
    clients sent are appended to the returned list."""
    host, _, port = addr.rpartition(":")
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, int(port)))
    listener.listen(16)
    asked: list[str] = []

    def accept() -> None:
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=handle, args=(conn, text, asked), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return asked
