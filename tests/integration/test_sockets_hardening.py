"""Issue 34, item 2: the leader keeper's door and the Horovod rendezvous against a neighbour
(mallory) on the same host: real sockets on loopback, real TLS, the rendezvous spoken to as
Horovod's C++ client speaks (``http_request``)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dlrun.remote import keeper, rendezvous
from dlrun.render import mask_env
from dlrun.run.rendezvous import RendezvousServer
from dlrun.tls import make_job_tls

from support.cli import run_dlrun
from support.ssh_jobs import hosts_toml, shared_script
from support.sshd_cluster import SshdCluster

MALLORY = "127.0.0.66"  # the neighbour's own source address (any 127/8 address is this host's)


def http_request(host: str, port: int, method: str, where: str, body: bytes = b"") -> tuple[int, bytes, bytes]:
    """One request as Horovod's HTTPRequest.hpp sends it (status, head, body); the server closes."""
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(f"{method} {where} HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                     + body)
        data = b""
        while chunk := sock.recv(4096):
            data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), head, rest


def path(key: str, port: int, scope: str, name: str) -> str:
    """The path Horovod's client sends with ``ADDR = host:port/key`` (``client_address``)."""
    url = f"http://{rendezvous.client_address('127.0.0.1', port, key)}:{port}/{scope}/{name}"
    return "/" + url.split("/", 3)[3]


@pytest.fixture
def keyed() -> Iterator[tuple[RendezvousServer, str]]:
    key = rendezvous.rendezvous_key("the job's secret")
    with RendezvousServer({"global": 2}, key=key) as server:
        yield server, key


def test_the_rendezvous_answers_only_requests_with_the_jobs_key(keyed: tuple[RendezvousServer, str]) -> None:
    server, key = keyed
    host, port = server.address or ("", 0)
    assert http_request(host, port, "PUT", "/global/0", b"mallory:1234")[0] == 403  # what Horovod's own allows
    assert http_request(host, port, "GET", "/global/0")[0] == 403
    wrong = rendezvous.rendezvous_key("another job")
    assert http_request(host, port, "PUT", path(wrong, port, "global", "0"), b"mallory")[0] == 403
    assert server.snapshot() == {}
    assert http_request(host, port, "PUT", path(key, port, "global", "0"), b"rank0")[0] == 200
    assert http_request(host, port, "GET", path(key, port, "global", "0"))[::2] == (200, b"rank0")
    assert server.snapshot() == {"global": {"0": b"rank0"}}


def test_the_rendezvous_refuses_a_huge_body_without_reading_it(keyed: tuple[RendezvousServer, str]) -> None:
    server, key = keyed
    host, port = server.address or ("", 0)
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(f"PUT {path(key, port, 'global', '0')} HTTP/1.1\r\nHost: x\r\n"
                     f"Content-Length: {rendezvous.MAX_VALUE_BYTES + 1}\r\n\r\n".encode())
        assert sock.recv(100).startswith(b"HTTP/1.0 413")
    assert server.snapshot() == {}


def test_the_rendezvous_closes_a_silent_connection_and_caps_each_source(
        keyed: tuple[RendezvousServer, str], monkeypatch: pytest.MonkeyPatch) -> None:
    server, key = keyed
    host, port = server.address or ("", 0)
    silent = socket.create_connection((host, port), timeout=30)
    assert silent.recv(10) == b""  # closed by the server after AUTH_TIMEOUT_S, not by our timeout
    silent.close()
    monkeypatch.setattr(rendezvous, "MAX_PER_SOURCE", 4)
    flood = []
    for _ in range(8):
        sock = socket.socket()
        sock.bind((MALLORY, 0))
        sock.connect((host, port))
        flood.append(sock)
    try:  # mallory's source is full; the ranks' is not
        assert http_request(host, port, "PUT", path(key, port, "global", "1"), b"rank1")[0] == 200
    finally:
        for sock in flood:
            sock.close()


def test_the_rendezvous_key_is_masked_in_printouts() -> None:
    env = {"HOROVOD_GLOO_RENDEZVOUS_ADDR": rendezvous.client_address("10.0.0.1", 4000, "ab" * 32)}
    assert mask_env(env) == {"HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.1:4000/****"}
    assert mask_env({"HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.1"}) == {"HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.1"}


def test_the_leader_listens_on_the_followers_address_only() -> None:
    listener = keeper.listen_at("127.0.0.2", 0)
    try:
        assert listener.getsockname()[0] == "127.0.0.2"
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.3", listener.getsockname()[1]), timeout=10).close()
    finally:
        listener.close()
    assert keeper.bindable("192.0.2.1") == "0.0.0.0"  # not this host's (a NAT): every interface


def test_a_flood_of_silent_strangers_does_not_keep_a_follower_out() -> None:
    """Mallory holds many connections open at the leader's door without a word (they held all
    16 slots for 10 s each before); a follower keeper still gets in, and each silent connection
    is closed after about AUTH_TIMEOUT."""
    job = make_job_tls("j")
    token = "the job's token"
    door = keeper.Door(lambda given: given == token)
    listener = keeper.listen_at("127.0.0.1", 0)
    port = listener.getsockname()[1]
    joined: list[dict[str, object]] = []
    threading.Thread(target=door.serve, args=(listener, keeper.server_context(job.cert_pem, job.key_pem),
                                              lambda sock, hello, rest: joined.append(hello)), daemon=True).start()
    stop = threading.Event()
    closed_by_leader: list[bool] = []

    def mallory() -> None:  # keeps the door as full as it lets her
        while not stop.is_set():
            socks = []
            for _ in range(keeper.MAX_GREETINGS + 8):
                sock = socket.socket()
                sock.bind((MALLORY, 0))
                sock.settimeout(30)
                try:
                    sock.connect(("127.0.0.1", port))
                except OSError:
                    sock.close()
                    continue
                socks.append(sock)
            for sock in socks[:3]:
                try:
                    closed_by_leader.append(sock.recv(10) == b"")
                except OSError:
                    closed_by_leader.append(True)
            for sock in socks:
                sock.close()

    flooder = threading.Thread(target=mallory, daemon=True)
    flooder.start()
    try:
        time.sleep(0.5)
        context = keeper.client_context(job.cert_pem)
        deadline = time.monotonic() + 60
        while not joined and time.monotonic() < deadline:  # a follower's tries, as connect_leader makes them
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
                        context.wrap_socket(raw) as sock:
                    sock.sendall(json.dumps({"token": token, "host": "host1"}).encode() + b"\n")
                    line, _ = keeper.read_line(sock)
                    assert json.loads(line) == {"op": "welcome"}
            except OSError:
                time.sleep(0.5)
        assert joined == [{"token": token, "host": "host1"}]
        deadline = time.monotonic() + 60
        while not closed_by_leader and time.monotonic() < deadline:
            time.sleep(0.1)
        assert closed_by_leader and all(closed_by_leader)
    finally:
        stop.set()
        listener.close()
        flooder.join(60)


HOROVOD_WAITS = """
import time
import horovod.torch as hvd
hvd.init()
print("ready", hvd.rank(), flush=True)
time.sleep(300)
"""


@pytest.mark.slow
@pytest.mark.ssh
def test_a_detached_horovod_rendezvous_listens_on_host0_and_wants_the_key(
        cluster: SshdCluster, tmp_path: Path, horovod: None) -> None:
    """Real Horovod ranks meet at the leader keeper's rendezvous (their requests carry the key);
    mallory, on the same host, can neither reach it on another address nor read or write it."""
    from support.sshd_cluster import TEST_USER_HOME

    script = shared_script(cluster, "hvd_waits.py", HOROVOD_WAITS)
    hosts = ["--hosts", str(hosts_toml(cluster, tmp_path / "hosts.toml", 2)), "--ssh-config", str(cluster.ssh_config)]
    out = run_dlrun("launch", "--detach", "--grace", "2", "--framework", "horovod", *hosts, str(script),
                    cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    job = out.stdout.strip().splitlines()[-1].split()[-1]
    try:
        deadline = time.monotonic() + 120
        logs = ""
        while logs.count("] ready") < 2 and time.monotonic() < deadline:
            logs = run_dlrun("logs", job, *hosts, cwd=tmp_path, timeout=60).stdout
            time.sleep(1)
        assert logs.count("] ready") == 2, logs  # hvd.init() went through the keyed rendezvous
        state = json.loads((TEST_USER_HOME / ".dlrun" / "jobs" / job / "host-host0" / "state.json").read_text())
        port = int(state["rendezvous_port"])
        with pytest.raises(ConnectionRefusedError):  # not every interface: only host0's address
            socket.create_connection(("127.0.0.1", port), timeout=10).close()
        leader = cluster.hosts[0].address
        assert http_request(leader, port, "GET", "/global/0")[0] == 403
        assert http_request(leader, port, "PUT", "/global/0", b"mallory:1")[0] == 403
    finally:
        stopped = run_dlrun("stop", job, *hosts, cwd=tmp_path, timeout=120)
    assert stopped.returncode == 143, stopped.stdout + stopped.stderr
