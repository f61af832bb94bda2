"""``dlrun pull``'s files over the TLS side channel (``dlrun.transport.side``, the host's end
``dlrun.remote.jobs.side_channel`` loaded by the push helper), with real sshd hosts: every file
still checked by sha256, and a host whose side channel cannot be reached pulled over SSH."""

from __future__ import annotations

import hashlib
import os
import socket
import ssl
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from dlrun.inventory import Host
from dlrun.push import pull as pull_module
from dlrun.push.pull import SIDE_FROM, HostSender, pull
from dlrun.transport import side as side_module
from dlrun.transport.local import HostRouter
from dlrun.transport.side import SideChannel
from dlrun.transport.ssh import SSHTransport

from support.ssh_jobs import host_programs
from support.sshd_cluster import SshdCluster
from support.wait import wait_until

pytestmark = pytest.mark.ssh

BIG = SIDE_FROM * 2  # a host with this much to send is offered the side channel


def body(seed: int, size: int) -> bytes:
    block = hashlib.sha256(b"%d" % seed).digest() * 2048  # 64 KiB
    return (block * (size // len(block) + 1))[:size]


class Spy:
    """Where dlrun connected (address, port, and whether the host's port answered on any
    other address), and which hosts it refused."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reached: list[tuple[str, int]] = []
        self.elsewhere: list[bool] = []
        self.refused: dict[str, str] = {}
        connect, refuse = side_module.connect_side, SideChannel.refuse

        def connect_side(address: str, port: int, *args: Any) -> ssl.SSLSocket:
            other = "127.0.0.1" if address != "127.0.0.1" else "127.0.0.2"
            with socket.socket() as probe:  # the host listens on its SSH connection's address only
                self.elsewhere.append(probe.connect_ex((other, port)) == 0)
            tls = connect(address, port, *args)
            self.reached.append((address, port))
            return tls

        def refused(side: SideChannel, host: str, why: str) -> None:
            self.refused[host] = why
            refuse(side, host, why)

        monkeypatch.setattr(pull_module, "connect_side", connect_side)
        monkeypatch.setattr(SideChannel, "refuse", refused)


def folders(cluster: SshdCluster, name: str, hosts: int) -> list[Host]:
    """``hosts`` hosts, each with ``<name>/out``: a big file of its own, a big file the same on
    every host, and a small one."""
    for i in range(hosts):
        out = Path(cluster.hosts[i].workdir) / name / "out"
        (out / "sub").mkdir(parents=True)
        (out / f"own-{i}.bin").write_bytes(body(i, BIG + 123))
        (out / "sub" / "shared.bin").write_bytes(body(99, BIG))
        (out / "note.txt").write_text(f"host {i}\n")
    return [Host(address=h.name, name=f"host{i}", workdir=str(h.workdir), python=cluster.python)
            for i, h in enumerate(cluster.hosts[:hosts])]


def expected(hosts: int) -> dict[str, bytes]:
    return {"out/sub/shared.bin": body(99, BIG),
            **{f"host{i}/out/own-{i}.bin": body(i, BIG + 123) for i in range(hosts)},
            **{f"host{i}/out/note.txt": f"host {i}\n".encode() for i in range(hosts)}}


def pulled(local: Path) -> dict[str, bytes]:
    return {p.relative_to(local).as_posix(): p.read_bytes() for p in local.rglob("*") if p.is_file()}


def test_a_first_pull_comes_over_the_side_channel_and_every_file_is_whole(
        cluster: SshdCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spy = Spy(monkeypatch)
    hosts = folders(cluster, f"side-{tmp_path.name}", 2)
    transport = HostRouter(remote=SSHTransport(config_file=str(cluster.ssh_config)))
    try:
        summaries = pull(transport, hosts, "out", tmp_path / "home", project=f"side-{tmp_path.name}")
    finally:
        transport.close()
    assert pulled(tmp_path / "home") == expected(2)
    assert sorted(a for a, _ in spy.reached) == [cluster.hosts[0].address, cluster.hosts[1].address]
    assert spy.elsewhere == [False, False] and spy.refused == {}
    assert sum(s.files_received for s in summaries) == 5


def test_a_host_whose_side_channel_cannot_be_reached_is_pulled_over_ssh(
        cluster: SshdCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # host1 listens on the address its SSH connection came to; dlrun is sent elsewhere, where
    # nothing listens on that port (as behind a firewall or a NAT): refused, its files come over SSH
    direct = SSHTransport.direct_address
    monkeypatch.setattr(SSHTransport, "direct_address",
                        lambda self, host: "127.0.0.254" if host.name == "host1" else direct(self, host))
    spy = Spy(monkeypatch)
    hosts = folders(cluster, f"side-{tmp_path.name}", 2)
    transport = HostRouter(remote=SSHTransport(config_file=str(cluster.ssh_config)))
    try:
        pull(transport, hosts, "out", tmp_path / "home", project=f"side-{tmp_path.name}")
    finally:
        transport.close()
    assert pulled(tmp_path / "home") == expected(2)
    assert [a for a, _ in spy.reached] == [cluster.hosts[0].address]
    assert list(spy.refused) == ["host1"]


def test_a_file_changed_after_the_listing_is_named_over_the_side_channel_too(
        cluster: SshdCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spy = Spy(monkeypatch)
    folder = Path(cluster.hosts[0].workdir) / f"side-{tmp_path.name}"
    folder.mkdir()
    (folder / "model.bin").write_bytes(body(1, BIG))
    (folder / "done.bin").write_bytes(body(2, BIG))
    host = Host(address=cluster.hosts[0].name, name="host0", workdir=str(cluster.hosts[0].workdir),
                python=cluster.python)
    transport = HostRouter(remote=SSHTransport(config_file=str(cluster.ssh_config)))
    try:
        sender = HostSender(transport, host, str(folder), side=SideChannel("pull"))
        listed = sender.listing()
        (folder / "model.bin").write_bytes(body(3, BIG))  # the job rewrites it
        local = tmp_path / "home"
        local.mkdir()
        (local / "model.bin").write_bytes(b"old copy")
        written, failures = sender.fetch([(listed.entries[p], local / p) for p in ("done.bin", "model.bin")], local)
    finally:
        transport.close()
    assert len(spy.reached) == 1 and spy.refused == {}  # the bytes came over the side channel
    assert [(f.path, f.message) for f in failures] == [
        ("model.bin", "content does not match its sha256 (changed on the host while pulling?)")]
    assert written == BIG and (local / "done.bin").read_bytes() == body(2, BIG)
    assert (local / "model.bin").read_bytes() == b"old copy"
    assert sorted(p.name for p in local.iterdir()) == ["done.bin", "model.bin"]  # no temporary file left
    assert os.stat(local / "done.bin").st_mtime_ns == listed.entries["done.bin"].mtime_ns


def asked(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, list[str]]]:
    """Each request for files: (host, paths), in order."""
    calls: list[tuple[str, list[str]]] = []
    ask = HostSender._ask

    def spied(self: HostSender, items: Sequence[tuple[Any, Path]], total: int) -> None:
        calls.append((self.host.name, [e.path for e, _ in items]))
        ask(self, items, total)

    monkeypatch.setattr(HostSender, "_ask", spied)
    return calls


def pull_with_notices(cluster: SshdCluster, tmp_path: Path, hosts: list[Host]) -> list[str]:
    """The pull's notices; once it returned, no push helper of its is left on the hosts (the
    SSH connections still open)."""
    notices: list[str] = []
    ssh = SSHTransport(config_file=str(cluster.ssh_config))
    transport = HostRouter(remote=ssh)
    try:
        pull(transport, hosts, "out", tmp_path / "home", project=f"side-{tmp_path.name}", notice=notices.append)
        ports = [ssh.clients[h.name].get_transport().sock.getsockname()[1]  # type: ignore[union-attr]
                 for h in hosts]
        assert wait_until(lambda: not any(helpers(p) for p in ports), timeout=60)
    finally:
        transport.close()
    return notices


@pytest.mark.parametrize("how", ["reset", "stall"])
def test_a_side_channel_that_breaks_mid_transfer_falls_back_to_ssh_for_the_rest(
        cluster: SshdCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    # a firewall or NAT that lets the flow start, then resets it or drops it silently: each host's
    # helper breaks its side channel after 1.5 MB (its first, small file is in place by then); the files
    # not yet in place come over SSH from a fresh helper, every one verified
    monkeypatch.setenv("DLRUN_TEST_SIDE_BREAK", f"{how}:1500000")
    monkeypatch.setattr(pull_module, "SIDE_IDLE_S", 5.0)  # a dropped flow: no byte for this long
    spy = Spy(monkeypatch)
    calls = asked(monkeypatch)
    hosts = folders(cluster, f"side-{tmp_path.name}", 2)
    notices = pull_with_notices(cluster, tmp_path, hosts)
    assert pulled(tmp_path / "home") == expected(2)
    assert len(spy.reached) == 2 and sorted(spy.refused) == ["host0", "host1"]
    for name in ("host0", "host1"):
        first, again = [paths for host, paths in calls if host == name]
        assert 0 < len(again) < len(first) and first[-len(again):] == again  # only what was not in place
    why = "side channel" if how == "reset" else "sent nothing"  # a reset reads as an error or as an early end
    fell_back = sorted(n for n in notices if "came over SSH" in n)
    assert [n.split(":")[0] for n in fell_back] == ["host0", "host1"] and all(why in n for n in fell_back), notices


def test_the_side_channel_can_be_turned_off(cluster: SshdCluster, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DLRUN_SIDE_CHANNEL", "0")
    spy = Spy(monkeypatch)
    hosts = folders(cluster, f"side-{tmp_path.name}", 2)
    assert pull_with_notices(cluster, tmp_path, hosts) == []
    assert pulled(tmp_path / "home") == expected(2)
    assert spy.reached == [] and spy.refused == {}


def helpers(client_port: int) -> list[int]:
    """The ``dlrun-push_helper`` processes started over the SSH connection from ``client_port``."""
    return host_programs("dlrun-push_helper", client_port)


class Gone(Exception):
    pass


def test_the_host_stops_sending_when_dlrun_is_gone(cluster: SshdCluster, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    spy = Spy(monkeypatch)
    folder = Path(cluster.hosts[0].workdir) / f"side-{tmp_path.name}"
    folder.mkdir()
    for i in range(8):
        (folder / f"part-{i}.bin").write_bytes(body(i, BIG))
    host = Host(address=cluster.hosts[0].name, name="host0", workdir=str(cluster.hosts[0].workdir),
                python=cluster.python)
    ssh = SSHTransport(config_file=str(cluster.ssh_config))
    transport = HostRouter(remote=ssh)
    lingering: list[Any] = []
    try:
        sender = HostSender(transport, host, str(folder), side=SideChannel("pull"))
        listed = sender.listing()
        ours = ssh.clients["host0"].get_transport().sock.getsockname()[1]  # type: ignore[union-attr]

        def progress(name: str, done: int, total: int) -> None:
            if done and not lingering:
                assert sender.tls is not None and len(helpers(ours)) == 1
                # dlrun reads no more and its SSH channel ends (as when it is killed while its TCP
                # connection to the side channel lingers): the helper must end, not wait on the socket
                lingering.append(sender.tls)
                sender.tls = None
                assert sender.channel is not None
                sender.channel.close()
                assert wait_until(lambda: not helpers(ours), timeout=60)
                raise Gone

        local = tmp_path / "home"
        local.mkdir()
        with pytest.raises(Gone):
            sender.fetch([(e, local / p) for p, e in sorted(listed.entries.items())], local, progress=progress)
    finally:
        for tls in lingering:
            tls.close()
        transport.close()
    assert len(spy.reached) == 1 and lingering


def test_a_file_changed_before_the_fallback_is_named_and_the_rest_comes_over_ssh(
        cluster: SshdCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the side channel resets in the middle of a.bin; b.bin is rewritten meanwhile: the fresh
    # listing shows it changed, so it is named (the old local copy stays) and a.bin comes over SSH
    monkeypatch.setenv("DLRUN_TEST_SIDE_BREAK", "reset:1500000")
    spy = Spy(monkeypatch)
    folder = Path(cluster.hosts[0].workdir) / f"side-{tmp_path.name}"
    folder.mkdir()
    (folder / "a.bin").write_bytes(body(1, BIG))
    (folder / "b.bin").write_bytes(body(2, BIG))
    host = Host(address=cluster.hosts[0].name, name="host0", workdir=str(cluster.hosts[0].workdir),
                python=cluster.python)
    transport = HostRouter(remote=SSHTransport(config_file=str(cluster.ssh_config)))
    rewritten: list[bool] = []

    def progress(name: str, done: int, total: int) -> None:
        if done and not rewritten:
            (folder / "b.bin").write_bytes(body(3, BIG))  # the job rewrites it
            rewritten.append(True)

    try:
        sender = HostSender(transport, host, str(folder), side=SideChannel("pull"))
        listed = sender.listing()
        local = tmp_path / "home"
        local.mkdir()
        (local / "b.bin").write_bytes(b"old copy")
        written, failures = sender.fetch([(listed.entries[p], local / p) for p in ("a.bin", "b.bin")], local,
                                         progress=progress)
    finally:
        transport.close()
    assert rewritten and len(spy.reached) == 1 and list(spy.refused) == ["host0"]
    assert [f.path for f in failures] == ["b.bin"] and "changed on the host" in failures[0].message
    assert written == BIG and (local / "a.bin").read_bytes() == body(1, BIG)
    assert (local / "b.bin").read_bytes() == b"old copy"
    assert sorted(p.name for p in local.iterdir()) == ["a.bin", "b.bin"]  # no temporary file left
