"""The Horovod gloo rendezvous: an HTTP key-value server that ranks meet at during ``hvd.init()``.

This module owns the server dlrun runs for ``--framework horovod`` (what ``horovodrun`` runs as
``RendezvousServer`` in ``horovod/runner/http/http_server.py``) and the scope sizes derived from
the plan. Nothing else: the per-rank ``HOROVOD_*`` env and choosing the bind address live
elsewhere. Standard library only, Python >= 3.8: the client imports it (attached jobs, Spark;
``dlrun.run.rendezvous`` turns its errors into ``dlrun.errors.RendezvousError``) and a detached
job's leader keeper loads it from its source (``dlrun.remote.keeper``), never importing dlrun.

The protocol, as Horovod 0.28.1's C++ client speaks it (``horovod/common/gloo/http_store.cc``,
``third_party/HTTPRequest``) and its Python server answers it:

* Every request opens a new TCP connection (IPv4 only), sends ``HTTP/1.1`` with ``Host`` and an
  always-present ``Content-Length`` (``0`` for GET and DELETE), and reads the response until
  ``Content-Length`` bytes of body have arrived or the server closes. We answer ``HTTP/1.0``,
  close after each response, and always send ``Content-Length``.
* The path is ``/<scope>/<key>``, used raw: the client does not URL-quote it and the server does
  not unquote it. Anything but exactly two ``/``-separated parts is ``400``.
* ``PUT /<scope>/<key>``: the body (exactly ``Content-Length`` bytes, binary) is stored; ``200``.
  Scopes need not be known: any scope is created on its first PUT. No ``Content-Length``: ``411``;
  body not complete within 3 s: ``408``.
* ``GET /<scope>/<key>``: ``200`` with the value, or ``404`` (empty body) if absent. The client's
  ``get`` does not retry a 404; its ``wait(keys)`` polls GET every 10 ms until every key is
  there or ``HOROVOD_GLOO_TIMEOUT_SECONDS`` (default 30) pass.
* ``DELETE /<scope>/<rank>`` (the client's ``Finalize``, sent by each rank once it has passed
  the barrier after ``connectFullMesh``): for a scope sized at construction (``global``,
  ``local_<HOROVOD_HOSTNAME>``, ``cross_<local_rank>``) the rank is recorded as finished, and
  when as many distinct ranks as the scope's size have finished, every key of the scope is
  dropped and the count starts again (so a later ``hvd.init()`` can reuse the scope). For any
  other ("ad-hoc") scope, such as the process-set scopes ``global_process_set_hash_<hex>``, the
  key ``<rank>`` (that rank's published address) is deleted, and the scope with it once empty.
  Always ``200``.
* The client retries (3 tries, 500 ms apart) any status other than 200/404 and any connection
  error, then fails: so 4xx here is fatal for a rank, as it is with ``horovodrun``.

Gloo itself stores, per scope, the key ``<rank>`` (that rank's pair addresses) and
``rank_<rank>`` (its host name); every rank waits for every other rank's ``<rank>`` key.

**Authentication.** Horovod's server (and its C++ client) has none: any local user could read
and write ``/global/0`` and redirect the ranks' gloo connections. Horovod's client cannot sign a
request, but it puts ``HOROVOD_GLOO_RENDEZVOUS_ADDR`` into every URL as is
(``http://<ADDR>:<PORT>/<scope>/<key>``), so dlrun's ranks get ``ADDR = <ip>:<port>/<key>``
(``client_address``), where ``<key>`` is an HMAC-SHA256 of the job's secret
(``rendezvous_key``). Every request's path then starts with ``/<key>:<port>/``; a server made with
a key answers ``403`` and closes for any other path. The key lives only in the ranks'
environment (never a command line). A connection whose request line has not arrived within
``AUTH_TIMEOUT_S`` is closed; each source address may hold ``MAX_PER_SOURCE`` connections at once
(``MAX_CONNECTIONS`` in all); a value may be ``MAX_VALUE_BYTES`` (``413``) and all values
``MAX_STORE_BYTES`` together (``507``).

Deliberate differences from Horovod's server, none visible to a correct client: a finished rank
is counted once even if its DELETE is retried (Horovod counts a list), completing one scope does
not reset the finished counts of the other scopes (Horovod clears all of them, so a fast rank's
``local_*`` DELETE sent before the last ``global`` one is forgotten and that scope is never
cleared), a malformed request gets a 4xx instead of a dropped connection, and nothing is logged.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import socket
import socketserver
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, Mapping, Sequence, TypeVar

__all__ = ["RendezvousServer", "RendezvousServerError", "client_address", "rendezvous_key", "scope_sizes"]

log = logging.getLogger(__name__)

# Horovod's server gives a request this long to arrive (SINGLE_REQUEST_TIMEOUT).
REQUEST_TIMEOUT_S = 3.0
# Every rank connects at once during hvd.init(); socketserver's default backlog (5) drops SYNs.
LISTEN_BACKLOG = 1024
AUTH_TIMEOUT_S = 1.0  # a connection's request line (with the key) must arrive within this
MAX_PER_SOURCE = 256  # connections at once from one address (a host's ranks poll every 10 ms)
MAX_CONNECTIONS = 4096  # connections at once in all (each is a thread)
MAX_VALUE_BYTES = 16 << 20  # one PUT's body (a rank's gloo addresses: ~100 bytes per peer)
MAX_STORE_BYTES = 512 << 20  # every value together


def rendezvous_key(secret: str) -> str:
    """The rendezvous credential of a job: HMAC-SHA256 of the job's secret (hex, URL-safe)."""
    return hmac.new(secret.encode(), b"dlrun horovod rendezvous", hashlib.sha256).hexdigest()


def client_address(host: str, port: int, key: str | None) -> str:
    """``HOROVOD_GLOO_RENDEZVOUS_ADDR`` for the ranks: the host, or with a key ``host:port/key``
    (Horovod's client then sends ``/<key>:<port>/<scope>/<key>`` paths, see the docstring)."""
    return f"{host}:{port}/{key}" if key else host


class RendezvousServerError(Exception):
    """The server cannot serve there (bad address, port taken); ``hint`` says what to do."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.hint = hint


def scope_sizes(rank_hosts: Sequence[tuple[str, int]]) -> dict[str, int]:
    """Size every fixed scope from the plan, as ``horovodrun`` does from its host_alloc_plan.

    ``rank_hosts[i]`` is ``(HOROVOD_HOSTNAME, HOROVOD_LOCAL_RANK)`` of global rank ``i``.
    Returns ``{"global": N, "local_<host>": ranks on that host,
    "cross_<local_rank>": hosts that run that local rank}``; ``{}`` for no ranks.
    """
    seen: set[tuple[str, int]] = set()
    per_host: Counter[str] = Counter()
    per_local_rank: Counter[int] = Counter()
    for rank, (host, local_rank) in enumerate(rank_hosts):
        if not host or "/" in host:
            raise ValueError(f"rank {rank}: host name {host!r} cannot be part of a scope name")
        if local_rank < 0:
            raise ValueError(f"rank {rank}: negative local rank {local_rank}")
        if (host, local_rank) in seen:
            raise ValueError(f"rank {rank}: ({host!r}, {local_rank}) is assigned twice")
        seen.add((host, local_rank))
        per_host[host] += 1
        per_local_rank[local_rank] += 1
    if not seen:
        return {}
    sizes = {"global": len(seen)}
    sizes.update({f"local_{host}": n for host, n in per_host.items()})
    sizes.update({f"cross_{lr}": n for lr, n in sorted(per_local_rank.items())})
    return sizes


class _Store:
    """The scopes, their values and the finished ranks of the sized scopes; thread-safe."""

    def __init__(self, sizes: Mapping[str, int]) -> None:
        self.sizes = dict(sizes)
        self.lock = threading.Lock()
        self.values: dict[str, dict[str, bytes]] = {}
        self.finished: dict[str, set[str]] = {}

    def put(self, scope: str, key: str, value: bytes) -> bool:
        """Store ``value``; False (nothing stored) when the store would exceed ``MAX_STORE_BYTES``."""
        with self.lock:
            old = len(self.values.get(scope, {}).get(key, b""))
            total = sum(len(v) for kv in self.values.values() for v in kv.values())
            if total - old + len(value) > MAX_STORE_BYTES:
                return False
            self.values.setdefault(scope, {})[key] = value
            return True

    def get(self, scope: str, key: str) -> bytes | None:
        with self.lock:
            return self.values.get(scope, {}).get(key)

    def delete(self, scope: str, key: str) -> None:
        with self.lock:
            size = self.sizes.get(scope)
            if size is not None:
                done = self.finished.setdefault(scope, set())
                done.add(key)
                if len(done) >= size:
                    self.values.pop(scope, None)
                    done.clear()
                return
            values = self.values.get(scope)
            if values is not None:
                values.pop(key, None)
                if not values:
                    del self.values[scope]

    def snapshot(self) -> dict[str, dict[str, bytes]]:
        with self.lock:
            return {scope: dict(kv) for scope, kv in self.values.items()}

    def clear(self) -> None:
        with self.lock:
            self.values.clear()
            self.finished.clear()


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = LISTEN_BACKLOG

    def __init__(self, address: tuple[str, int], store: _Store, key: str | None = None) -> None:
        self.store = store
        self.key = key
        self.open: Counter[str] = Counter()  # source address -> connections being served
        self.open_lock = threading.Lock()
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        source = str(client_address[0])
        with self.open_lock:
            full = self.open[source] >= MAX_PER_SOURCE or sum(self.open.values()) >= MAX_CONNECTIONS
            if not full:
                self.open[source] += 1
        if full:  # no thread for a flood: its connections are closed at once
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.open_lock:
                self.open[str(client_address[0])] -= 1
                if self.open[str(client_address[0])] <= 0:
                    del self.open[str(client_address[0])]

    def server_bind(self) -> None:
        # HTTPServer.server_bind() calls socket.getfqdn(), a reverse DNS lookup that can hang.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name = str(host)
        self.server_port = int(port)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("rendezvous: error serving %s", client_address, exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    timeout = REQUEST_TIMEOUT_S
    protocol_version = "HTTP/1.0"

    def setup(self) -> None:
        super().setup()
        # the request line (which holds the key) must come within AUTH_TIMEOUT_S in all, not per
        # byte: a connection that sends nothing, or drips, is closed
        self.authenticated = False
        self.watchdog = threading.Timer(AUTH_TIMEOUT_S, self._expire)
        self.watchdog.daemon = True
        self.watchdog.start()

    def _expire(self) -> None:
        if not self.authenticated:
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def finish(self) -> None:
        self.watchdog.cancel()
        super().finish()

    def _split(self) -> tuple[str, str] | None:
        parts = self.path.split("/")
        key = self.server.key
        if key is not None:  # /<key>:<port>/<scope>/<key>
            given = parts[1].partition(":")[0] if len(parts) > 1 else ""
            if len(parts) != 4 or parts[0] != "" or not hmac.compare_digest(given.encode(), key.encode()):
                self.close_connection = True
                self._reply(403)
                return None
            parts = ["", *parts[2:]]
        self.authenticated = True
        if len(parts) != 3 or parts[0] != "" or not parts[1]:
            self._reply(400)
            return None
        return parts[1], parts[2]

    def _reply(self, status: int, body: bytes = b"") -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body:
            self.wfile.write(body)

    def do_GET(self) -> None:
        where = self._split()
        if where is None:
            return
        value = self.server.store.get(*where)
        if value is None:
            self._reply(404)
        else:
            self._reply(200, value)

    def do_PUT(self) -> None:
        where = self._split()
        if where is None:
            return
        length_header = self.headers.get("Content-Length")
        if length_header is None:
            self._reply(411)
            return
        try:
            length = int(length_header)
        except ValueError:
            length = -1
        if length < 0:
            self._reply(400)
            return
        if length > MAX_VALUE_BYTES:
            self.close_connection = True
            self._reply(413)
            return
        try:
            value = self.rfile.read(length)
        except socket.timeout:  # TimeoutError from Python 3.10 on
            self._reply(408)
            return
        if len(value) != length:  # the client went away mid-body
            self.close_connection = True
            return
        self._reply(200 if self.server.store.put(*where, value) else 507)

    def do_DELETE(self) -> None:
        where = self._split()
        if where is None:
            return
        self.server.store.delete(*where)
        self._reply(200)

    def log_message(self, format: str, *args: Any) -> None:
        pass


_Server = TypeVar("_Server", bound="RendezvousServer")  # Self before 3.11: a subclass enters as itself


class RendezvousServer:
    """Horovod-compatible gloo rendezvous server, serving from a daemon thread.

    ``scope_sizes`` maps each fixed scope to its number of ranks (see :func:`scope_sizes`).
    ``host`` must be an IPv4 address or name (Horovod's client connects over IPv4 only);
    ``port=0`` picks a free port. ``key`` (:func:`rendezvous_key`): every request must carry it
    (the ranks' ``HOROVOD_GLOO_RENDEZVOUS_ADDR`` is :func:`client_address`); None: none needed.
    Use as a context manager, or ``start()`` / ``stop()``.
    """

    def __init__(
        self, scope_sizes: Mapping[str, int], host: str = "127.0.0.1", port: int = 0, key: str | None = None
    ) -> None:
        for scope, size in scope_sizes.items():
            if not scope or "/" in scope:
                raise ValueError(f"invalid scope name {scope!r}")
            if size < 1:
                raise ValueError(f"scope {scope!r} has size {size}; sizes must be >= 1")
        if ":" in host:
            raise RendezvousServerError(
                f"rendezvous address {host!r} is IPv6; Horovod's rendezvous client is IPv4-only",
                hint="bind to the IPv4 address of the interface facing the hosts",
            )
        self._sizes = dict(scope_sizes)
        self._key = key
        self._host = host
        self._port = port
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def address(self) -> tuple[str, int] | None:
        """``(address, port)`` while bound (serving or not), else ``None``."""
        httpd = self._httpd
        if httpd is None:
            return None
        host, port = httpd.server_address[:2]
        return str(host), int(port)

    def start(self) -> tuple[str, int]:
        """Bind, serve in a background thread, and return the bound ``(address, port)``.

        Raises :class:`RendezvousError` when the address cannot be bound. Calling it while
        already serving returns the current address.
        """
        with self._lock:
            httpd = self._bind()
            if self._thread is None:
                thread = threading.Thread(
                    target=httpd.serve_forever,
                    kwargs={"poll_interval": 0.05},
                    name=f"dlrun-rendezvous-{httpd.server_address[1]}",
                    daemon=True,
                )
                thread.start()
                self._thread = thread
            address = self.address
            assert address is not None
            return address

    def bind(self) -> tuple[str, int]:
        """Bind and listen without serving yet (requests wait in the backlog until
        :meth:`start`): a detached keeper binds before it forks, serves after."""
        with self._lock:
            self._bind()
            address = self.address
            assert address is not None
            return address

    def _bind(self) -> _HTTPServer:
        if self._httpd is None:
            try:
                self._httpd = _HTTPServer((self._host, self._port), _Store(self._sizes), self._key)
            except OSError as exc:
                raise RendezvousServerError(
                    f"cannot bind the Horovod rendezvous server to {self._host}:{self._port}:"
                    f" {exc.strerror or exc}",
                    hint="pick another --rendezvous address/port, or free that port",
                ) from exc
        return self._httpd

    def stop(self) -> None:
        """Stop serving and close the listening socket; safe to call more than once."""
        with self._lock:
            httpd, thread = self._httpd, self._thread
            self._httpd = self._thread = None
        if httpd is None:
            return
        if thread is not None:
            httpd.shutdown()
        httpd.server_close()
        if thread is not None:
            thread.join()

    def clear(self) -> None:
        """Forget every key and finished rank: a fresh rendezvous on the same address (a detached
        job's restart, once every rank of the failed attempt has ended)."""
        httpd = self._httpd
        if httpd is not None:
            httpd.store.clear()

    def snapshot(self) -> dict[str, dict[str, bytes]]:
        """A copy of every scope's keys and values (for diagnostics and tests)."""
        httpd = self._httpd
        return {} if httpd is None else httpd.store.snapshot()

    def __enter__(self: _Server) -> _Server:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        address = self.address
        where = f"{address[0]}:{address[1]}" if address else "stopped"
        return f"RendezvousServer({where}, scopes={self._sizes!r})"
