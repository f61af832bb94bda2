"""An attached job's door for a second dlrun on the same machine (``dlrun stack JOB``).

The attached client listens on a Unix socket ``~/.dlrun/attached/<JOB-ID>.sock`` (folder and
socket 0700: this user only) for the job's life. A request is one JSON line, the answer one
JSON line; ``{"op": "stacks", "hosts": [...] | null}`` answers ``{"summary": [...], "folder",
"notes", "cause"}``. The socket's name is the job id ``dlrun launch`` printed; a stale socket
(its client killed -9) refuses connections: ``ask`` takes a refusal as "no attached job here",
and the next client to start removes it.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

ANSWER_TIMEOUT = 180.0


def socket_path(job_id: str) -> Path:
    return Path.home() / ".dlrun" / "attached" / f"{job_id}.sock"


class ControlServer:
    """Serves ``handler(request) -> answer`` on the job's socket, a thread per connection."""

    def __init__(self, job_id: str, handler: Callable[[Mapping[str, Any]], Mapping[str, Any]]) -> None:
        self.job_id = job_id
        self.path = socket_path(job_id)
        self.handler = handler
        self.sock: socket.socket | None = None

    def start(self) -> bool:
        """Listen; False where a socket cannot be made here, or the job has no id (the job runs
        without the door)."""
        if not self.job_id or "/" in self.job_id:
            return False
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            self.path.parent.chmod(0o700)
            prune(self.path.parent)
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            old = os.umask(0o077)
            try:
                sock.bind(str(self.path))
            finally:
                os.umask(old)
            sock.listen(8)
        except OSError:
            return False
        self.sock = sock
        threading.Thread(target=self._accept, name="dlrun-control", daemon=True).start()
        return True

    def _accept(self) -> None:
        sock = self.sock
        while sock is not None:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(10)
                data = b""
                while b"\n" not in data and len(data) < 65536:
                    chunk = conn.recv(4096)
                    if not chunk:
                        return
                    data += chunk
                request = json.loads(data.partition(b"\n")[0])
                answer = self.handler(request)
            except (OSError, ValueError) as exc:
                answer = {"error": str(exc)}
            with contextlib.suppress(OSError):
                conn.settimeout(10)
                conn.sendall(json.dumps(answer).encode() + b"\n")

    def close(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
            with contextlib.suppress(OSError):
                self.path.unlink()


def prune(folder: Path) -> None:
    """Remove the sockets nobody listens on (their client was killed with SIGKILL)."""
    for path in folder.glob("*.sock"):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(1)
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            with contextlib.suppress(OSError):
                path.unlink()
        except OSError:
            pass
        finally:
            probe.close()


def ask(job_id: str, request: Mapping[str, Any], timeout: float = ANSWER_TIMEOUT) -> dict[str, Any] | None:
    """The attached job's answer, or None when no attached job of that id runs on this machine."""
    path = socket_path(job_id)
    if not path.exists():
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        try:
            sock.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            return None
        sock.sendall(json.dumps(dict(request)).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    finally:
        sock.close()
    answer: dict[str, Any] = json.loads(data) if data.strip() else {"error": "the job's client closed the door"}
    return answer
