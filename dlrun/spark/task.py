"""The executor side of the Spark engine: what each barrier task runs (``task_main``), and the
TLS link both ends of the driver–task channel use (``client_context``, ``TlsLink``, ``relay``).

Standard library and pyspark only, nothing from dlrun: the driver pickles this module by
value (``cloudpickle.register_pickle_by_value``), so executors need pyspark and Python, not
dlrun (nor ``cryptography``). A task connects to the driver, completes a TLS 1.3 handshake
trusting only the job's certificate (pinned in its closure), picks a free port, waits at the
barrier, says hello (with the job's token) inside TLS, then starts the host agent through the
bootstrap's loader (the driver sends the agent's source and the spec on the channel) and
reports the agent's end (``TASK_END``) before the verdict.

The agent and the task read and write a plain local socket; ``relay`` carries its bytes over
TLS in one thread (memory BIOs: no SSL object is shared between threads), framed so that a
half-close (EOF one way) crosses too.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import select
import socket
import ssl
import struct
import sys
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

TASK_END = 100  # frame kind a task appends after its agent exited: {"code", "stderr"}
#: Stands for the executor's own python in the agent's argv the driver sends (it cannot know it).
EXECUTOR_PYTHON = "{executor python}"
HANDSHAKE_TIMEOUT = 30.0  # seconds for a TLS handshake (either side)
_RELAY = ">BI"  # relay frame: kind (_DATA, _EOF), length (a format: a Struct does not pickle)
_RELAY_SIZE = struct.calcsize(_RELAY)
_DATA, _EOF = 0, 1
_CHUNK = 65536
_BACKLOG = 1 << 20  # bytes a relay buffers one way before it stops reading that way's source


def client_context(cert_pem: str) -> ssl.SSLContext:
    """A task's side: TLS 1.3, trusting exactly the job's certificate (pinned). The host name is
    not checked: no other certificate can pass, and the driver's address may be any of its own."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_verify_locations(cadata=cert_pem)
    return context


class TlsLink:
    """TLS over a connected TCP socket through memory BIOs: whoever holds it does all its I/O."""

    def __init__(self, sock: socket.socket, context: ssl.SSLContext, *, server_side: bool) -> None:
        self.sock = sock
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = context.wrap_bio(self.incoming, self.outgoing, server_side=server_side)

    def handshake(self, timeout: float = HANDSHAKE_TIMEOUT) -> None:
        """Complete the handshake (blocking, within ``timeout``); ssl.SSLError or OSError if not."""
        self.sock.settimeout(timeout)
        try:
            while True:
                try:
                    self.tls.do_handshake()
                    break
                except ssl.SSLWantReadError:
                    self.sock.sendall(self.outgoing.read())
                    data = self.sock.recv(_CHUNK)
                    if not data:
                        raise ConnectionError("the peer closed the connection during the TLS handshake") from None
                    self.incoming.write(data)
        except ssl.SSLError:
            with contextlib.suppress(OSError, ssl.SSLError):  # the alert, so the peer learns why
                self.sock.sendall(self.outgoing.read())
            raise
        self.sock.sendall(self.outgoing.read())  # the client's Finished, the server's tickets

    def close(self) -> None:
        """close_notify and FIN, then wait (a little) for the peer's: closing with its bytes
        unread would send a reset, which can discard what it has not read yet."""
        with contextlib.suppress(OSError, ssl.SSLError):
            try:
                self.tls.unwrap()
            except ssl.SSLError:
                pass
            self.sock.settimeout(5.0)
            self.sock.sendall(self.outgoing.read())
            self.sock.shutdown(socket.SHUT_WR)
            while self.sock.recv(_CHUNK):
                pass
        self.sock.close()


def relay(link: TlsLink, local: socket.socket) -> None:
    """Carry bytes both ways between ``local`` (plain) and ``link`` (TLS) until both ways ended.

    EOF on ``local`` becomes an EOF frame; the peer's EOF frame shuts ``local``'s write side.
    A connection dropped or broken (either side) drops the other side too.
    """
    net = link.sock
    net.setblocking(False)
    local.setblocking(False)
    to_net, to_local, plain = bytearray(link.outgoing.read()), bytearray(), bytearray()
    local_eof = peer_eof = local_shut = False
    clean = False
    try:
        while True:
            if peer_eof and not to_local and not local_shut:
                local.shutdown(socket.SHUT_WR)
                local_shut = True
            if local_eof and local_shut and not to_net:
                clean = True
                return
            readers = [s for s, ok in ((net, not peer_eof and len(to_local) < _BACKLOG),
                                       (local, not local_eof and len(to_net) < _BACKLOG)) if ok]
            writers = [s for s, ok in ((net, to_net), (local, to_local)) if ok]
            readable, writable, _ = select.select(readers, writers, [])
            if net in writable:
                del to_net[:net.send(to_net)]
            if local in writable:
                del to_local[:local.send(to_local)]
            if net in readable:
                try:
                    data = net.recv(_CHUNK)
                except BlockingIOError:
                    data = None
                if data == b"":
                    return  # dropped without an EOF frame
                if data:
                    link.incoming.write(data)
                    closed = False
                    while not closed:
                        try:
                            more = link.tls.read(_CHUNK)
                        except ssl.SSLWantReadError:
                            break
                        except ssl.SSLZeroReturnError:
                            more = b""
                        closed = not more  # the peer's close_notify
                        plain += more
                    while len(plain) >= _RELAY_SIZE:
                        kind, size = struct.unpack_from(_RELAY, plain)
                        if kind not in (_DATA, _EOF) or size > _CHUNK:
                            return  # not our peer's framing
                        if len(plain) < _RELAY_SIZE + size:
                            break
                        if kind == _EOF:
                            peer_eof = True
                        else:
                            to_local += plain[_RELAY_SIZE:_RELAY_SIZE + size]
                        del plain[:_RELAY_SIZE + size]
                    to_net += link.outgoing.read()  # what reading produced (e.g. a key update)
                    if closed and not peer_eof:
                        return  # closed without an EOF frame
            if local in readable:
                try:
                    data = local.recv(_CHUNK)
                except BlockingIOError:
                    data = None
                except ConnectionResetError:  # closed with our bytes unread: its own are all in
                    data = b""
                if data is not None:
                    local_eof = not data
                    link.tls.write(struct.pack(_RELAY, _EOF if local_eof else _DATA, len(data)) + data)
                    to_net += link.outgoing.read()
    except (OSError, ssl.SSLError):
        pass
    finally:
        if clean:
            link.close()
        else:
            with contextlib.suppress(OSError, ssl.SSLError):  # what was said before the drop
                net.setblocking(True)
                net.settimeout(5.0)
                net.sendall(to_net)
            net.close()
            with contextlib.suppress(OSError, ssl.SSLError):  # what the peer said before it dropped, then EOF
                local.setblocking(True)
                local.settimeout(5.0)
                local.sendall(to_local)
        local.close()


def start_relay(link: TlsLink, name: str) -> tuple[socket.socket, threading.Thread]:
    """A plain local socket whose bytes ``relay`` carries over ``link`` (from a new thread)."""
    mine, theirs = socket.socketpair()
    thread = threading.Thread(target=relay, args=(link, mine), name=name, daemon=True)
    thread.start()
    return theirs, thread


def interface_holding(address: str) -> str | None:
    """The name of this machine's interface holding IPv4 ``address`` (Linux), else None."""
    try:
        import fcntl
    except ImportError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:  # SIOCGIFADDR: the interface's primary IPv4 address
                got = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(got[20:24]) == address:
                return name
    return None


_SPARK_WORKER_ENV = ("PYTHON_WORKER_", "PYTHON_UDF_", "PYTHON_DAEMON_", "_PYSPARK_", "SPARK_PYTHON_RUNTIME",
                     "SPARK_REUSE_WORKER", "SPARK_CONNECT_MODE", "SPARK_JOB_ARTIFACT_UUID", "SPARK_LOCAL_DIRS")


def rank_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """The task's environment without what Spark set up for its own Python worker: ranks get
    what an SSH host's would. Gone: the worker's secret (``PYTHON_WORKER_FACTORY_SECRET``, which
    authenticates it to the executor), Spark's worker settings, its default ``PYTHONHASHSEED=0``
    and pyspark's and py4j's entries in ``PYTHONPATH``. Kept: ``SPARK_HOME`` and the like, and
    ``OMP_NUM_THREADS`` (Spark sets it to the task's CPUs)."""
    env = {k: v for k, v in environ.items() if not k.startswith(_SPARK_WORKER_ENV)}
    if env.get("PYTHONHASHSEED") == "0":
        del env["PYTHONHASHSEED"]
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
             if p and not re.search(r"pyspark|py4j|spark-core", os.path.basename(p))]
    env.pop("PYTHONPATH", None)
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def task_main(setup: Mapping[str, Any], _rows: Iterable[Any]) -> Iterator[str]:
    import ctypes
    import signal
    import subprocess
    import tempfile

    pyspark = importlib.import_module("pyspark")
    ctx = pyspark.BarrierTaskContext.get()
    partition = int(ctx.partitionId())
    tcp = socket.create_connection((setup["driver"][0], int(setup["driver"][1])), timeout=60)
    host = tcp.getsockname()[0]  # the address on the route to the driver
    link = TlsLink(tcp, client_context(setup["cert"]), server_side=False)
    try:
        link.handshake()
    except (OSError, ssl.SSLError) as exc:
        tcp.close()
        raise RuntimeError(f"dlrun job {setup['job_id']}: no TLS channel to the driver at"
                           f" {setup['driver'][0]}:{setup['driver'][1]}: {exc}") from exc
    # the task and its agent read and write a plain local socket; the relay carries it over TLS
    sock, relaying = start_relay(link, f"dlrun-relay-{partition}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        port = int(probe.getsockname()[1])
    # the barrier: no task starts its agent before every task runs (and each learns the others)
    ctx.allGather(json.dumps({"host": host, "port": port}))
    resources = ctx.resources()
    gpus = [str(a) for a in resources["gpu"].addresses] if "gpu" in resources else []
    script = None
    if setup["archive"]:
        script = os.path.join(pyspark.SparkFiles.get(setup["archive"]), setup["script"])
    hello = {
        "token": setup["token"],
        "job_id": setup["job_id"],
        "partition": partition,
        "host": host,
        "port": port,
        "gpus": gpus,
        "python": sys.executable,
        "script": script,
        "pid": os.getpid(),
        "iface": interface_holding(host),
    }
    sock.settimeout(None)
    sock.sendall(json.dumps(hello).encode() + b"\n")

    # the agent: the socket is its stdin and stdout; its stderr goes to a file whose tail the
    # driver gets in TASK_END. It dies with this task: SIGHUP, not SIGTERM, because in a PID
    # namespace the child is `unshare --fork` (the wrapper execs it), which blocks SIGTERM and
    # SIGINT while it waits; SIGHUP ends unshare (whose --kill-child then ends the whole
    # namespace) or, without a namespace, makes the agent kill its ranks.
    parent = os.getpid()
    try:
        libc: Any = ctypes.CDLL(None, use_errno=True)
    except OSError:
        libc = None

    def die_with_parent() -> None:
        if libc is not None:
            libc.prctl(1, int(signal.SIGHUP), 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the task died before the prctl: go too
            os._exit(1)  # in the forked child before exec, where only _exit is safe

    # the bootstrap's loader (in the PID namespace wrapper): the agent's source comes on the socket
    argv = [sys.executable if arg == EXECUTOR_PYTHON else arg for arg in setup["agent_argv"]]
    with tempfile.TemporaryFile() as errors:
        try:
            proc = subprocess.Popen(argv, stdin=sock.fileno(), stdout=sock.fileno(), stderr=errors,
                                    env=rank_environ(os.environ), preexec_fn=die_with_parent)
            code = proc.wait()
            code = 128 - code if code < 0 else code
        except OSError as exc:
            code = 127
            errors.write(f"cannot start the dlrun agent with {sys.executable}: {exc}".encode())
        errors.seek(0)
        stderr = errors.read()[-8192:].decode(errors="replace")
    payload = json.dumps({"code": code, "stderr": stderr}).encode()
    sock.setblocking(True)  # the agent made the shared socket non-blocking
    verdict: dict[str, Any] | None = None
    try:
        sock.sendall(struct.pack(">BiI", TASK_END, -1, len(payload)) + payload)
        sock.shutdown(socket.SHUT_WR)
        buf = b""
        while verdict is None:
            data = sock.recv(65536)
            if not data:
                break
            buf += data
            while b"\n" in buf and verdict is None:
                line, _, buf = buf.partition(b"\n")
                try:
                    message = json.loads(line)
                except ValueError:
                    continue
                if isinstance(message, dict) and "verdict" in message:  # not a late "stop" for the agent
                    verdict = message
    except OSError:
        pass
    finally:
        sock.close()
        relaying.join(10)  # the TLS connection's orderly close
    if verdict is None:
        raise RuntimeError(f"dlrun job {setup['job_id']}: the driver hung up before the job ended (agent exit {code})")
    if int(verdict["verdict"]) != 0:
        raise RuntimeError(f"dlrun job {setup['job_id']} failed: {verdict.get('message', '')}")
    yield json.dumps({"partition": partition, "host": host, "agent_exit": code})
