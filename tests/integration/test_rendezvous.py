"""dlrun.run.rendezvous against a Python twin of Horovod's C++ rendezvous client.

``HTTPStore`` below follows ``horovod/common/gloo/http_store.{h,cc}`` of Horovod 0.28.1 and the
``HTTPRequest.hpp`` it sends with: a new IPv4 connection per request, ``HTTP/1.1`` with ``Host``
and an always-present ``Content-Length``, the body read until ``Content-Length`` bytes or EOF,
3 tries 500 ms apart on any status but 200/404, ``get`` = one GET (a 404 gives an empty value),
``wait`` = GET every 10 ms until all keys exist or the timeout passes, ``Finalize`` =
``DELETE /<scope>/<rank>``. ``connect_full_mesh`` does the store traffic of gloo's
``rendezvous::Context::connectFullMesh`` followed by Horovod's barrier and ``Finalize``.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator, Sequence

import pytest

from dlrun.errors import RendezvousError
from dlrun.run.rendezvous import RendezvousServer, scope_sizes

# -- the client ---------------------------------------------------------------------------------


def http_request(
    addr: str, port: int, method: str, path: str, body: bytes = b"", *, length: bool = True
) -> tuple[int, dict[str, str], bytes]:
    """One request exactly as HTTPRequest.hpp sends it; returns (status, headers, body)."""
    head = f"{method} {path} HTTP/1.1\r\nHost: {addr}\r\n"
    if length:
        head += f"Content-Length: {len(body)}\r\n"
    with socket.create_connection((addr, port), timeout=5) as sock:
        sock.sendall(head.encode() + b"\r\n" + body)
        data = b""
        headers: dict[str, str] = {}
        status = 0
        content_size = -1
        parsed = False
        while True:
            chunk = sock.recv(4096)
            if not chunk:
                break  # disconnected
            data += chunk
            if not parsed and b"\r\n\r\n" in data:
                raw_head, data = data.split(b"\r\n\r\n", 1)
                lines = raw_head.decode("latin-1").split("\r\n")
                status = int(lines[0].split()[1])
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    headers[name] = value.strip()
                if "Content-Length" in headers:  # matched case-sensitively, as the C++ client does
                    content_size = int(headers["Content-Length"])
                parsed = True
            if parsed and content_size != -1 and len(data) >= content_size:
                break
        return status, headers, data


class HTTPStore:
    """horovod::common::HTTPStore, in Python."""

    MAX_RETRY_TIMES = 3
    RETRY_WAITING_TIME_S = 0.5

    def __init__(self, addr: str, port: int, scope: str, rank: int) -> None:
        self.addr, self.port, self.rank = addr, port, rank
        self.prefix = "/" + scope + "/"

    def _perform(self, method: str, key: str, body: bytes = b"") -> tuple[int, bytes]:
        for _ in range(self.MAX_RETRY_TIMES):
            try:
                status, _headers, data = http_request(
                    self.addr, self.port, method, self.prefix + key, body
                )
                if status in (200, 404):
                    return status, data
            except OSError:
                pass
            time.sleep(self.RETRY_WAITING_TIME_S)
        raise RuntimeError("HTTP request failed.")

    def set(self, key: str, data: bytes) -> None:
        self._perform("PUT", key, data)

    def _http_get(self, key: str) -> bytes | None:
        status, data = self._perform("GET", key)
        return None if status == 404 else data

    def get(self, key: str) -> bytes:
        value = self._http_get(key)
        return b"" if value is None else value

    def check_keys(self, keys: Sequence[str]) -> bool:
        return all(self._http_get(key) is not None for key in keys)

    def wait(self, keys: Sequence[str], timeout_s: float = 30.0) -> None:
        start = time.monotonic()
        while not self.check_keys(keys):
            if time.monotonic() - start > timeout_s:
                raise TimeoutError(f"Wait timeout after {timeout_s} seconds for key(s): {keys}")
            time.sleep(0.01)

    def wait_get(self, key: str, timeout_s: float = 30.0) -> bytes:
        """What gloo does for a peer's key: wait for it, then get it."""
        self.wait([key], timeout_s)
        return self.get(key)

    def finalize(self) -> None:
        self._perform("DELETE", str(self.rank))


def connect_full_mesh(
    store: HTTPStore, rank: int, size: int, hostname: str, barrier: threading.Barrier
) -> dict[int, bytes]:
    """gloo connectFullMesh's store traffic, then Horovod's barrier and Finalize."""
    store.set(f"rank_{rank}", hostname.encode())
    for i in range(rank):  # gloo gets these without waiting; a 404 just reads as ""
        store.get(f"rank_{i}")
    store.set(str(rank), f"addr:{store.prefix}{rank}".encode() + bytes(range(256)))
    peers = {i: store.wait_get(str(i), timeout_s=5) for i in range(size) if i != rank}
    barrier.wait(timeout=5)
    store.finalize()
    return peers


# -- fixtures -----------------------------------------------------------------------------------


@pytest.fixture
def server() -> Iterator[RendezvousServer]:
    with RendezvousServer({"global": 2, "local_a": 2, "cross_0": 1}) as srv:
        yield srv


def addr_of(srv: RendezvousServer) -> tuple[str, int]:
    address = srv.address
    assert address is not None
    return address


def store(srv: RendezvousServer, scope: str, rank: int = 0) -> HTTPStore:
    return HTTPStore(*addr_of(srv), scope, rank)


# -- tests --------------------------------------------------------------------------------------


def test_set_get_round_trip_binary(server: RendezvousServer) -> None:
    client = store(server, "global")
    values = {
        "0": bytes(range(256)) * 4,
        "rank_1": b"\r\n\r\nHTTP/1.1 200 OK\r\n\x00",
        "empty": b"",
        "big": bytes(range(256)) * 4096,  # 1 MiB, more than one recv()
    }
    for key, value in values.items():
        client.set(key, value)
    for key, value in values.items():
        assert client.get(key) == value
    client.set("0", b"overwritten")
    assert client.get("0") == b"overwritten"
    assert server.snapshot()["global"]["big"] == values["big"]


def test_wire_format_matches_horovods_client(server: RendezvousServer) -> None:
    addr, port = addr_of(server)
    status, headers, body = http_request(addr, port, "PUT", "/global/k", b"v")
    assert (status, headers["Content-Length"], body) == (200, "0", b"")
    status, headers, body = http_request(addr, port, "GET", "/global/k")
    assert (status, headers["Content-Length"], body) == (200, "1", b"v")
    status, headers, body = http_request(addr, port, "GET", "/global/missing")
    assert (status, headers["Content-Length"], body) == (404, "0", b"")
    status, headers, body = http_request(addr, port, "DELETE", "/global/0")
    assert (status, headers["Content-Length"], body) == (200, "0", b"")


def test_get_of_missing_key_is_404_until_another_rank_sets_it(server: RendezvousServer) -> None:
    reader, writer = store(server, "local_a", 1), store(server, "local_a", 0)
    addr, port = addr_of(server)
    assert http_request(addr, port, "GET", "/local_a/0")[0] == 404
    assert reader.get("0") == b""  # HTTPStore::get does not wait
    assert not reader.check_keys(["0"])
    timer = threading.Timer(0.1, writer.set, args=("0", b"\x00addr\xff"))
    timer.start()
    start = time.monotonic()
    try:
        assert reader.wait_get("0", timeout_s=5) == b"\x00addr\xff"
    finally:
        timer.join()
    assert 0.09 < time.monotonic() - start < 2


def test_wait_for_several_keys_and_timeout(server: RendezvousServer) -> None:
    client = store(server, "global")
    client.set("0", b"a")
    with pytest.raises(TimeoutError, match="key"):
        client.wait(["0", "1"], timeout_s=0.1)
    client.set("1", b"b")
    client.wait(["0", "1"], timeout_s=1)


def test_gloo_full_mesh_in_every_scope_then_scopes_are_cleared() -> None:
    # Hosts with different slot counts: a runs 3 ranks, b runs 1, c runs 2 (ranks host by host).
    plan = [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("c", 0), ("c", 1)]
    sizes = scope_sizes(plan)
    assert sizes == {
        "global": 6, "local_a": 3, "local_b": 1, "local_c": 2,
        "cross_0": 3, "cross_1": 2, "cross_2": 1,
    }  # fmt: skip
    hosts = sorted({h for h, _ in plan})
    barriers = {scope: threading.Barrier(n) for scope, n in sizes.items()}
    results: dict[tuple[str, int], dict[int, bytes]] = {}
    errors: list[BaseException] = []
    with RendezvousServer(sizes) as srv:
        addr, port = addr_of(srv)

        def rank_main(rank: int) -> None:
            host, local_rank = plan[rank]
            cross_rank = [h for h in hosts if (h, local_rank) in plan].index(host)
            try:  # the order of GlooContext::Initialize
                for scope, r in (
                    ("global", rank),
                    (f"local_{host}", local_rank),
                    (f"cross_{local_rank}", cross_rank),
                ):
                    client = HTTPStore(addr, port, scope, r)
                    results[(scope, r)] = connect_full_mesh(
                        client, r, sizes[scope], host, barriers[scope]
                    )
            except BaseException as exc:
                errors.append(exc)
                for barrier in barriers.values():
                    barrier.abort()

        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(len(plan))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10)
        assert not errors, errors
        # every rank saw every peer's address in every scope it belongs to
        for (scope, r), peers in results.items():
            assert sorted(peers) == [i for i in range(sizes[scope]) if i != r]
            for i, value in peers.items():
                assert value.startswith(f"addr:/{scope}/{i}".encode())
        assert len(results) == 3 * len(plan)
        # all ranks finalized every scope: the server dropped them all
        assert srv.snapshot() == {}
        # ... and a second hvd.init() can rendezvous in the same scopes again
        barrier = threading.Barrier(1)
        assert connect_full_mesh(HTTPStore(addr, port, "local_b", 0), 0, 1, "b", barrier) == {}
        assert srv.snapshot() == {}


def test_finalize_clears_a_sized_scope_only_when_every_rank_finished(
    server: RendezvousServer,
) -> None:
    r0, r1 = store(server, "global", 0), store(server, "global", 1)
    r0.set("0", b"x")
    r1.set("1", b"y")
    r0.finalize()
    r0.finalize()  # a retried DELETE counts once
    assert r1.get("0") == b"x"
    r1.finalize()
    assert server.snapshot() == {}
    assert r0.get("1") == b""


def test_finalize_order_across_scopes(server: RendezvousServer) -> None:
    # A fast rank finalizes local_a before the last rank finalizes global. Horovod's server
    # forgets that local_a DELETE when global completes; this one does not.
    g0, g1 = store(server, "global", 0), store(server, "global", 1)
    l0, l1 = store(server, "local_a", 0), store(server, "local_a", 1)
    for client in (g0, g1, l0, l1):
        client.set(str(client.rank), b"addr")
    g0.finalize()
    l0.finalize()
    g1.finalize()
    assert set(server.snapshot()) == {"local_a"}
    l1.finalize()
    assert server.snapshot() == {}


def test_scope_size_mismatch_keeps_the_scope_until_enough_ranks_finish() -> None:
    # The plan says 3 ranks, only 2 run: their DELETEs do not clear the scope.
    with RendezvousServer({"global": 3}) as srv:
        clients = [store(srv, "global", r) for r in range(3)]
        for c in clients[:2]:
            c.set(str(c.rank), b"addr")
        for c in clients[:2]:
            c.finalize()
        assert set(srv.snapshot()["global"]) == {"0", "1"}
        with pytest.raises(TimeoutError):
            clients[0].wait(["2"], timeout_s=0.05)
        clients[2].finalize()
        assert srv.snapshot() == {}


def test_unknown_scope_behaves_as_horovods_ad_hoc_scope(server: RendezvousServer) -> None:
    # e.g. the process-set scopes "global_process_set_hash_<hex>": not sized, created on PUT,
    # and a rank's DELETE removes that rank's key; the scope goes once empty.
    scope = "global_process_set_hash_1f2e"
    r0, r1 = store(server, scope, 0), store(server, scope, 1)
    assert r0.get("1") == b""
    r0.set("0", b"a0")
    r1.set("1", b"a1")
    r0.finalize()
    assert server.snapshot()[scope] == {"1": b"a1"}
    r1.finalize()
    assert scope not in server.snapshot()
    store(server, "never_seen", 3).finalize()  # DELETE in an absent scope: 200, nothing happens
    assert server.snapshot() == {}


def test_malformed_requests_are_4xx(server: RendezvousServer) -> None:
    addr, port = addr_of(server)
    assert http_request(addr, port, "GET", "/global")[0] == 400
    assert http_request(addr, port, "GET", "/global/0/extra")[0] == 400
    assert http_request(addr, port, "PUT", "//0", b"x")[0] == 400
    assert http_request(addr, port, "PUT", "/global/0", b"x", length=False)[0] == 411
    assert http_request(addr, port, "POST", "/global/0", b"x")[0] == 501
    assert server.snapshot() == {}


def test_paths_are_not_unquoted(server: RendezvousServer) -> None:
    addr, port = addr_of(server)
    assert http_request(addr, port, "PUT", "/local_h%2Fx/0", b"v")[0] == 200
    assert server.snapshot() == {"local_h%2Fx": {"0": b"v"}}


def test_many_simultaneous_connections(server: RendezvousServer) -> None:
    client = store(server, "global")
    client.set("k", b"v")
    out: list[bytes] = []
    threads = [threading.Thread(target=lambda: out.append(client.get("k"))) for _ in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == [b"v"] * 64


def test_stop_frees_the_port_and_is_idempotent() -> None:
    srv = RendezvousServer({"global": 1})
    addr, port = srv.start()
    assert addr == "127.0.0.1" and port > 0
    assert srv.start() == (addr, port)  # already serving
    srv.stop()
    srv.stop()
    assert srv.address is None
    with pytest.raises(ConnectionRefusedError):
        http_request(addr, port, "GET", "/global/0")
    with socket.socket() as sock:
        sock.bind((addr, port))
        sock.listen()
    with RendezvousServer({"global": 1}, port=port) as again:
        assert again.address == (addr, port)


def test_bind_errors_are_rendezvous_errors() -> None:
    with RendezvousServer({"global": 1}) as srv:
        _, port = addr_of(srv)
        with pytest.raises(RendezvousError, match=f"127.0.0.1:{port}"):
            RendezvousServer({"global": 1}, port=port).start()
    with pytest.raises(RendezvousError, match="IPv4"):
        RendezvousServer({"global": 1}, host="::1")
    with pytest.raises(ValueError):
        RendezvousServer({"global": 0})


def test_requests_are_not_logged(capfd: pytest.CaptureFixture[str]) -> None:
    with RendezvousServer({"global": 1}) as srv:
        addr, port = addr_of(srv)
        store(srv, "global").set("0", b"x")
        http_request(addr, port, "GET", "/bad")
        http_request(addr, port, "PUT", "/global/1", b"x", length=False)
    assert capfd.readouterr() == ("", "")


def test_scope_sizes() -> None:
    two_by_two = [("h1", 0), ("h1", 1), ("h2", 0), ("h2", 1)]
    assert scope_sizes(two_by_two) == {
        "global": 4, "local_h1": 2, "local_h2": 2, "cross_0": 2, "cross_1": 2,
    }  # fmt: skip
    assert scope_sizes([("localhost", 0)]) == {"global": 1, "local_localhost": 1, "cross_0": 1}
    assert scope_sizes([]) == {}
    with pytest.raises(ValueError, match="twice"):
        scope_sizes([("h1", 0), ("h1", 0)])
    with pytest.raises(ValueError):
        scope_sizes([("a/b", 0)])
