"""``dlrun logs``' TLS side channel over real sshd hosts (``dlrun.run.logstream``): a big answer
comes over it whole, a host whose port cannot be reached answers over SSH instead, a wrong
token or certificate gets nothing, and a host that goes quiet mid-answer is left out in time."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dlrun import api
from dlrun.errors import HostUnreachable
from dlrun.options import SSHOptions
from dlrun.remote import boot_argv, boot_payload, jobs
from dlrun.run import detach, logstream
from dlrun.tls import client_context, make_job_tls
from dlrun.transport.base import default_python
from dlrun.transport.ssh import SSHTransport

from support.ssh_jobs import host_programs, hosts_toml
from support.sshd_cluster import TEST_USER_HOME, SshdCluster
from support.wait import wait_until

pytestmark = pytest.mark.ssh

BIG_LINES = 200_000  # about 12 MB: more than dlrun.remote.jobs.SIDE_FROM


def line(rank: int, i: int) -> bytes:
    return b"rank %d line %06d %s\n" % (rank, i, b"x" * 40)


@pytest.fixture
def job(request: pytest.FixtureRequest) -> Iterator[str]:
    """A detached job's folders as its keepers leave them on host0 (rank 0: ``BIG_LINES`` lines)
    and host1 (rank 1: 1,000 lines), in the login user's home the hosts share."""
    job_id = "side-" + re.sub(r"\W", "", request.node.name)[-32:] + f"-{os.getpid()}"  # two runs at once do not meet
    root = TEST_USER_HOME / ".dlrun" / "jobs" / job_id
    owner = os.stat(TEST_USER_HOME)
    for parent in (root.parent.parent, root.parent):  # the login user's own, as its keepers make them
        if not parent.exists():
            parent.mkdir(mode=0o700)
            os.chown(parent, owner.st_uid, owner.st_gid)
    for rank, (host, count) in enumerate((("host0", BIG_LINES), ("host1", 1000))):
        folder = root / f"host-{host}"
        (folder / "attempt-0").mkdir(parents=True)
        ranks = [{"rank": r, "host": h, "state": "succeeded", "code": 0} for r, h in enumerate(("host0", "host1"))]
        (folder / "result.json").write_text(json.dumps({
            "job_id": job_id, "state": "succeeded", "exit_code": 0, "host": host, "leader": rank == 0,
            "ranks": ranks, "hosts": ["host0", "host1"]}))
        (folder / "state.json").write_text(json.dumps({"job_id": job_id, "host": host}))
        (folder / "attempt-0" / f"rank-{rank}.log").write_bytes(b"".join(line(rank, i) for i in range(count)))
    for walked, dirs, files in os.walk(root):
        for name in [".", *dirs, *files]:
            os.chown(os.path.join(walked, name), owner.st_uid, owner.st_gid)
    yield job_id
    shutil.rmtree(root, ignore_errors=True)


def shown_lines(text: bytes, rank: int, host: str) -> list[bytes]:
    prefix = f"[{rank} {host}] ".encode()
    return [t[len(prefix):] + b"\n" for t in text.split(b"\n") if t.startswith(prefix)]


class Spy:
    """What ``dlrun logs`` did: side channels reached, hosts refused, bytes each host sent."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reached: list[tuple[str, int]] = []
        self.refused: dict[str, str] = {}
        self.sent: dict[tuple[str, str], int] = {}
        self.lock = threading.Lock()
        connect, refuse, stream = logstream.connect_side, logstream.SideChannel.refuse, logstream.stream_logs

        def connect_side(address: str, port: int, *args: Any) -> ssl.SSLSocket:
            tls = connect(address, port, *args)
            self.reached.append((address, port))
            return tls

        def refused(side: logstream.SideChannel, host: str, why: str) -> None:
            self.refused[host] = why
            refuse(side, host, why)

        def stream_logs(transport: Any, host: Any, request: Any, on_records: Any, on_piece: Any,
                        **options: Any) -> dict[str, Any]:
            def counted(key: str, header: Any, data: bytearray) -> None:
                with self.lock:
                    self.sent[(host.name, key)] = self.sent.get((host.name, key), 0) + len(data)
                on_piece(key, header, data)

            return stream(transport, host, request, on_records, counted, **options)

        monkeypatch.setattr(logstream, "connect_side", connect_side)
        monkeypatch.setattr(logstream.SideChannel, "refuse", refused)
        monkeypatch.setattr(detach, "stream_logs", stream_logs)


def read_logs(cluster: SshdCluster, tmp_path: Path, job: str) -> bytes:
    out = io.TextIOWrapper(io.BytesIO(), write_through=True)
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 2)
    record = api.logs(job, str(hosts), out=out, ssh=SSHOptions(ssh_config=str(cluster.ssh_config)))
    assert record is not None and record.state == "succeeded"
    out.flush()
    return out.buffer.getvalue()


def test_a_big_answer_comes_whole_over_the_side_channel(cluster: SshdCluster, tmp_path: Path, job: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    spy = Spy(monkeypatch)
    text = read_logs(cluster, tmp_path, job)
    assert shown_lines(text, 0, "host0") == [line(0, i) for i in range(BIG_LINES)]
    assert shown_lines(text, 1, "host1") == [line(1, i) for i in range(1000)]
    assert spy.reached == [(cluster.hosts[0].address, spy.reached[0][1])]  # host0 only: host1's answer is small
    assert spy.refused == {}
    # the hosts share a home: each sent its own folder, none the other's
    assert spy.sent == {("host0", "host-host0/attempt-0/rank-0.log"): BIG_LINES * len(line(0, 0)),
                        ("host1", "host-host1/attempt-0/rank-1.log"): 1000 * len(line(1, 0))}


def test_dlrun_side_channel_0_keeps_the_big_answer_on_ssh(cluster: SshdCluster, tmp_path: Path, job: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DLRUN_SIDE_CHANNEL", "0")
    spy = Spy(monkeypatch)
    text = read_logs(cluster, tmp_path, job)
    assert shown_lines(text, 0, "host0") == [line(0, i) for i in range(BIG_LINES)]
    assert spy.reached == [] and spy.refused == {}  # never offered


def test_a_host_whose_side_channel_cannot_be_reached_answers_over_ssh(
        cluster: SshdCluster, tmp_path: Path, job: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # the host listens on the address the SSH connection came to; dlrun is sent elsewhere, where
    # nothing listens on that port (as behind a firewall or a NAT): refused, so the answer comes over SSH
    monkeypatch.setattr(SSHTransport, "direct_address", lambda self, host: "127.0.0.254")
    spy = Spy(monkeypatch)
    text = read_logs(cluster, tmp_path, job)
    assert shown_lines(text, 0, "host0") == [line(0, i) for i in range(BIG_LINES)]
    assert shown_lines(text, 1, "host1") == [line(1, i) for i in range(1000)]
    assert spy.reached == [] and list(spy.refused) == ["host0"]


@pytest.fixture
def jobs_program(cluster: SshdCluster, tmp_path: Path, job: str) -> Iterator[tuple[Any, Any, dict[str, str], int]]:
    """host0's ``dlrun-jobs`` asked for the job's logs with a side channel offered: the
    transport, the channel, the offer, and the port the host said."""
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 1)
    with api._job_hosts(str(hosts), SSHOptions(ssh_config=str(cluster.ssh_config))) as job_hosts:
        host = job_hosts.hosts[0]
        tls = make_job_tls("logs")
        offer = {"cert": tls.cert_pem, "key": tls.key_pem, "token": "a-token-only-dlrun-knows"}
        channel = job_hosts.transport.open(host, boot_argv(default_python(host), "jobs"))
        request = {"op": "logs", "job": job, "offsets": {}, "whole": True, "stream": True, "side": offer}
        channel.send(boot_payload("jobs") + json.dumps(request).encode() + b"\n")
        said = logstream.Frames(logstream.ChannelSource(channel, host.name, 60).recv_into).line()
        assert said.startswith(b"T "), said
        try:
            yield job_hosts.transport, channel, offer, int(json.loads(said[2:])["port"])
        finally:
            channel.close()


def test_the_side_channel_gives_nothing_without_the_token_and_dlrun_trusts_only_its_certificate(
        cluster: SshdCluster, jobs_program: tuple[Any, Any, dict[str, str], int]) -> None:
    _transport, _channel, offer, port = jobs_program
    address = cluster.hosts[0].address
    impostor = client_context(make_job_tls("someone else").cert_pem)  # dlrun pins its own certificate
    with pytest.raises(ssl.SSLCertVerificationError):
        logstream.connect_side(address, port, impostor, offer["token"])
    other = make_job_tls("someone else")
    shows_another = client_context(offer["cert"])
    jobs.load_pair(shows_another, other.cert_pem, other.key_pem)
    for stranger in (client_context(offer["cert"]), shows_another):  # mutual TLS: only dlrun's certificate
        try:  # TLS 1.3: the host's refusal of the client's certificate shows on the first read
            nobody = logstream.connect_side(address, port, stranger, offer["token"])
            nobody.settimeout(30)
            assert nobody.recv(1 << 16) == b""
            nobody.close()
        except (ConnectionError, ssl.SSLError):
            pass
    right = logstream.side_context(offer["cert"], offer["key"])
    wrong = logstream.connect_side(address, port, right, "a-guessed-token")
    wrong.settimeout(30)
    try:
        assert wrong.recv(1 << 16) == b""  # closed without a byte of the answer
    except (ConnectionError, ssl.SSLError):
        pass
    wrong.close()
    tls = logstream.connect_side(address, port, right, offer["token"])
    tls.settimeout(30)
    assert logstream.Frames(tls.recv_into).line().startswith(b"R {")
    tls.close()


def test_a_host_that_goes_quiet_on_the_side_channel_is_left_out_in_time(
        cluster: SshdCluster, tmp_path: Path, job: str) -> None:
    log = TEST_USER_HOME / ".dlrun" / "jobs" / job / "host-host0" / "attempt-0" / "rank-0.log"
    with open(log, "ab") as fh:  # more than the socket buffers hold: the host is still sending when frozen
        for _ in range(5):
            fh.write(os.urandom(4 << 20).hex().encode() + b"\n")
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 1)
    with api._job_hosts(str(hosts), SSHOptions(ssh_config=str(cluster.ssh_config))) as job_hosts:
        host = job_hosts.hosts[0]
        transport = job_hosts.transport
        ssh = transport.remote if hasattr(transport, "remote") else transport
        ours = ssh.clients[host.name].get_transport().sock.getsockname()[1]  # type: ignore[union-attr]
        stopped: list[int] = []

        def freeze(key: str, header: Any, data: bytearray) -> None:
            if not stopped:
                stopped.extend(jobs_processes(ours))
                for pid in stopped:
                    os.kill(pid, signal.SIGSTOP)

        request = {"op": "logs", "job": job, "offsets": {}, "whole": True}
        try:
            with pytest.raises(HostUnreachable, match="sent nothing for 3 s"):
                logstream.stream_logs(transport, host, request, lambda records: None, freeze, timeout=3,
                                      side=logstream.SideChannel())
        finally:
            for pid in stopped:
                os.kill(pid, signal.SIGKILL)
                os.kill(pid, signal.SIGCONT)
        assert len(stopped) == 1


def jobs_processes(client_port: int) -> list[int]:
    """The ``dlrun-jobs`` processes started over the SSH connection from ``client_port``."""
    return host_programs("dlrun-jobs", client_port)


def test_attach_reads_a_big_backlog_over_the_side_channel(cluster: SshdCluster, tmp_path: Path, job: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    spy = Spy(monkeypatch)
    out = io.StringIO()
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 2)
    assert api.attach(job, str(hosts), out=out, ssh=SSHOptions(ssh_config=str(cluster.ssh_config))) == 0
    text = out.getvalue().encode()
    assert shown_lines(text, 0, "host0") == [line(0, i) for i in range(BIG_LINES)]
    assert shown_lines(text, 1, "host1") == [line(1, i) for i in range(1000)]
    assert [address for address, _port in spy.reached] == [cluster.hosts[0].address]


class Strangers:
    """Local users at the side channel's port before dlrun: one holds a bare TCP connection
    open, one completes what TLS it can without dlrun's certificate (no client certificate)
    and trickles bytes, one trickles bytes without TLS. They connect first, so a host that
    greets one connection at a time would serve them before dlrun."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self.socks: list[socket.socket] = []
        self.connected = threading.Semaphore(0)

    def come(self, address: str, port: int) -> None:
        for how in ("hold", "tls", "raw"):
            thread = threading.Thread(target=self.one, args=(address, port, how), daemon=True)
            thread.start()
            self.threads.append(thread)
        for _ in self.threads:
            assert self.connected.acquire(timeout=30)

    def one(self, address: str, port: int, how: str) -> None:
        try:
            sock = socket.create_connection((address, port), timeout=30)
        except OSError:
            self.connected.release()
            return
        self.socks.append(sock)
        try:
            if how == "tls":
                context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
                context.check_hostname = False
                context.verify_mode = ssl.CERT_NONE
                sock = context.wrap_socket(sock)
                self.socks.append(sock)
            self.connected.release()
            while how != "hold" and not self.stop.wait(0.3):
                sock.sendall(b"a")  # the token, one byte at a time
            self.stop.wait()
        except (OSError, ssl.SSLError):
            self.connected.release()

    def leave(self) -> None:
        self.stop.set()
        for sock in self.socks:
            sock.close()
        for thread in self.threads:
            thread.join(timeout=30)


def test_strangers_at_the_side_channel_do_not_keep_dlrun_out(cluster: SshdCluster, tmp_path: Path, job: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    strangers = Strangers()
    connect = logstream.connect_side

    def first_strangers(address: str, port: int, *args: Any) -> ssl.SSLSocket:
        strangers.come(address, port)
        return connect(address, port, *args)

    monkeypatch.setattr(logstream, "connect_side", first_strangers)
    spy = Spy(monkeypatch)
    try:
        text = read_logs(cluster, tmp_path, job)
    finally:
        strangers.leave()
    assert shown_lines(text, 0, "host0") == [line(0, i) for i in range(BIG_LINES)]
    assert shown_lines(text, 1, "host1") == [line(1, i) for i in range(1000)]
    assert [address for address, _port in spy.reached] == [cluster.hosts[0].address]
    assert spy.refused == {}


def test_the_host_stops_sending_when_dlrun_is_gone(
        cluster: SshdCluster, jobs_program: tuple[Any, Any, dict[str, str], int]) -> None:
    transport, channel, offer, port = jobs_program
    ssh = transport.remote if hasattr(transport, "remote") else transport
    ours = ssh.clients[cluster.hosts[0].name].get_transport().sock.getsockname()[1]
    assert len(jobs_processes(ours)) == 1
    tls = logstream.connect_side(cluster.hosts[0].address, port,
                                 logstream.side_context(offer["cert"], offer["key"]), offer["token"])
    try:
        tls.settimeout(30)
        assert logstream.Frames(tls.recv_into).line().startswith(b"R {")
        # dlrun reads no more and its SSH channel ends (as when it is killed while its TCP
        # connection to the side channel lingers): the host's send must end, not wait on the socket
        channel.close()
        assert wait_until(lambda: not jobs_processes(ours), timeout=60)
    finally:
        tls.close()


def test_a_host_that_fails_mid_answer_has_its_folder_sent_by_one_that_shares_its_home(
        cluster: SshdCluster, tmp_path: Path, job: str,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # host1 skips host0's folder (host0 sends its own); host0's dlrun-jobs is killed after its
    # first piece: host1 is asked again for host0's folder, from where host0 broke off
    stream = logstream.stream_logs
    killed: list[int] = []
    asked: list[tuple[str, tuple[str, ...]]] = []

    def stream_logs(transport: Any, host: Any, request: Any, on_records: Any, on_piece: Any,
                    **options: Any) -> dict[str, Any]:
        asked.append((host.name, tuple(request.get("skip") or ())))
        ssh = transport.remote if hasattr(transport, "remote") else transport
        ours = ssh.clients[host.name].get_transport().sock.getsockname()[1]

        def piece(key: str, header: Any, data: bytearray) -> None:
            on_piece(key, header, data)
            if host.name == "host0" and not killed:
                killed.extend(jobs_processes(ours))
                for pid in killed:
                    os.kill(pid, signal.SIGKILL)

        return stream(transport, host, request, on_records, piece, **options)

    monkeypatch.setattr(detach, "stream_logs", stream_logs)
    text = read_logs(cluster, tmp_path, job)
    assert len(killed) == 1
    assert shown_lines(text, 0, "host0") == [line(0, i) for i in range(BIG_LINES)]  # every byte, once, in order
    assert shown_lines(text, 1, "host1") == [line(1, i) for i in range(1000)]
    assert ("host1", ("host-host0",)) in asked  # the first look: host0 sends its own
    assert asked[-1] == ("host1", ("host-host1",))  # the second: host1 sends host0's folder
    warned = capsys.readouterr().err
    assert "host0 cannot be reached" in warned
    assert "the logs of host0 came through host1" in warned


#: The host's end of a side channel as the jobs program and the push helper run it: serves one line.
SIDE_HOST = """import json, sys
from dlrun.remote import jobs
class Out:
    def write(self, data): sys.stdout.buffer.write(data)
    def flush(self): sys.stdout.buffer.flush()
tls = jobs.side_channel(json.loads(sys.argv[1]), Out())
if tls is not None:
    tls.sendall(b"served\\n")
    jobs.close_side(tls)
"""


def test_connections_from_other_addresses_are_closed_before_tls() -> None:
    """The host takes connections only from the address dlrun's SSH connection came from: a
    local user (or another machine) connecting from elsewhere is closed at once, never gets the
    host's certificate and never holds a greeting slot, however many come."""
    side = logstream.SideChannel("logs")
    offer, context = side.offer("host0")
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo), "SSH_CONNECTION": "127.0.0.1 40000 127.0.0.1 22"}
    host = subprocess.Popen([sys.executable, "-c", SIDE_HOST, json.dumps(offer)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=env)
    assert host.stdout is not None and host.stdin is not None
    strangers: list[socket.socket] = []
    try:
        said = host.stdout.readline()
        assert said.startswith(b"T "), said
        port = int(json.loads(said[2:])["port"])
        peek = ssl.create_default_context()
        peek.check_hostname, peek.verify_mode = False, ssl.CERT_NONE
        for _ in range(jobs.SIDE_GREETINGS + 8):
            stranger = socket.socket()
            stranger.bind(("127.0.0.77", 0))
            stranger.settimeout(30)
            stranger.connect(("127.0.0.1", port))
            strangers.append(stranger)
        with peek.wrap_socket(strangers.pop(), do_handshake_on_connect=False) as tls, \
                pytest.raises((OSError, ssl.SSLError)):
            tls.do_handshake()  # no server hello: closed before TLS
        with logstream.connect_side("127.0.0.1", port, context, offer["token"]) as tls:
            tls.settimeout(30)
            assert tls.recv(64) == b"served\n"  # the held strangers took no slot from dlrun
        assert host.wait(timeout=60) == 0
    finally:
        for stranger in strangers:
            stranger.close()
        host.kill()
        host.wait()


def test_a_host_out_of_reach_from_the_start_is_read_through_a_host_that_shares_its_home(
        cluster: SshdCluster, tmp_path: Path, job: str, capsys: pytest.CaptureFixture[str]) -> None:
    # host1 cannot be reached at all (nothing listens where the inventory points); host0 shares
    # its home, so it sends host1's folder too: every line is shown, and the look is complete
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # a port of ours that never listens: connection refused
    hosts = tmp_path / "hosts.toml"
    hosts.write_text(f'[defaults]\npython = "{cluster.python}"\n'
                     f'[[hosts]]\naddress = "host0"\nworkdir = "{cluster.hosts[0].workdir}"\n'
                     f'[[hosts]]\naddress = "127.0.0.1"\nname = "host1"\nport = {closed.getsockname()[1]}\n'
                     f'workdir = "{cluster.hosts[1].workdir}"\n')
    out = io.TextIOWrapper(io.BytesIO(), write_through=True)
    try:
        record = api.logs(job, str(hosts), out=out, ssh=SSHOptions(ssh_config=str(cluster.ssh_config)))
    finally:
        closed.close()
    assert record is not None and record.state == "succeeded"
    text = out.buffer.getvalue()
    assert shown_lines(text, 0, "host0") == [line(0, i) for i in range(BIG_LINES)]
    assert shown_lines(text, 1, "host1") == [line(1, i) for i in range(1000)]
    warned = capsys.readouterr().err
    assert "host1 cannot be reached" in warned
    assert "the logs of host1 came through host0" in warned
