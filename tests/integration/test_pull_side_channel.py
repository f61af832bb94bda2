"""``dlrun pull``'s files over the TLS side channel (``dlrun.transport.side``, the host's end
``dlrun.remote.jobs.side_channel`` loaded by the push helper), with real sshd hosts: every file
still checked by sha256, and a host whose side channel cannot be reached pulled over SSH."""

from __future__ import annotations

import hashlib
import os
import socket
import ssl
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

from support.sshd_cluster import SshdCluster

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
    assert len(spy.reached) == 1
    assert [(f.path, f.message) for f in failures] == [
        ("model.bin", "content does not match its sha256 (changed on the host while pulling?)")]
    assert written == BIG and (local / "done.bin").read_bytes() == body(2, BIG)
    assert (local / "model.bin").read_bytes() == b"old copy"
    assert sorted(p.name for p in local.iterdir()) == ["done.bin", "model.bin"]  # no temporary file left
    assert os.stat(local / "done.bin").st_mtime_ns == listed.entries["done.bin"].mtime_ns
