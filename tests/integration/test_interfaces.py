"""The probe's interfaces from the kernel's netlink dump, checked against ``ip -o -4 addr show``
(the authority) here and in network namespaces made for it: secondary and labelled addresses, a
point-to-point address, an interface that is down, a 15-character name, one without an address;
and the fallbacks, ``ip`` when netlink cannot answer and the ioctl list without either."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dlrun.remote import LOADER, boot_argv, boot_payload, probe
from dlrun.topo.parse import parse_ip_addr
from dlrun.topo.probe import parse_probe_output

from support.topo_fixtures import env_with_path

REPO = Path(__file__).resolve().parents[2]
IP = shutil.which("ip") or shutil.which("ip", path="/usr/sbin:/sbin")
needs_ip = pytest.mark.skipif(IP is None, reason="no ip(8) here: the authority is missing")

#: Run inside the namespace: the interfaces below, then what `ip` prints, netlink's list and the
#: whole probe's document (run by the loader, as a launch runs it).
SETUP = r"""
import json, subprocess, sys
def ip(*args):
    subprocess.run(["ip", *args], check=True)
ip("link", "set", "lo", "up")
ip("addr", "add", "127.0.0.9/8", "dev", "lo")  # a secondary address on lo
ip("link", "add", "veth0", "type", "veth", "peer", "name", "averyveryverylo")  # 15 characters, kept down
ip("addr", "add", "10.1.0.1/24", "dev", "veth0")
ip("addr", "add", "10.2.0.1/16", "dev", "veth0", "label", "veth0:x")  # another subnet, a label
ip("addr", "add", "10.1.0.2/24", "dev", "veth0")  # secondary: listed after 10.2.0.1
ip("addr", "add", "10.3.0.1/24", "dev", "averyveryverylo")
ip("link", "set", "veth0", "up")
ip("link", "add", "name", "br0", "type", "bridge")  # no address: not listed
ip("link", "add", "name", "br1", "type", "bridge")
ip("addr", "add", "10.4.0.1", "peer", "10.4.0.2/32", "dev", "br1")  # point-to-point: the local one
print("interfaces made", file=sys.stderr, flush=True)
sys.path.insert(0, sys.argv[1])
from dlrun.remote import probe, boot_argv, boot_payload
shown = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, check=True).stdout
doc = subprocess.run(boot_argv([sys.executable], "probe"), input=boot_payload("probe"), capture_output=True,
                     check=True).stdout.decode()
print(json.dumps({"ip": shown, "netlink": probe.interfaces_netlink(), "probe": doc}))
"""


def _namespace_prefix() -> list[str] | None:
    """How to run a command in a new network namespace here (root, or a user namespace)."""
    if shutil.which("unshare") is None:
        return None
    for prefix in (["unshare", "--net"], ["unshare", "--user", "--map-root-user", "--net"]):
        try:
            if subprocess.run([*prefix, "true"], capture_output=True, timeout=30).returncode == 0:
                return prefix
        except (OSError, subprocess.TimeoutExpired):
            continue
    return None


def _pairs(listed: Any) -> list[tuple[str, list[str]]]:
    return [(item["name"], item["ipv4"]) for item in listed]


def _ip_pairs(shown: str) -> list[tuple[str, list[str]]]:
    return [(i.name, list(i.ipv4)) for i in parse_ip_addr(shown)]


def _run_probe(env: dict[str, str], before_loader: str = "") -> dict[str, Any]:
    argv = boot_argv([sys.executable], "probe")
    argv[argv.index(LOADER)] = before_loader + LOADER
    proc = subprocess.run(argv, input=boot_payload("probe"), capture_output=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc: dict[str, Any] = json.loads(proc.stdout)
    return doc


@needs_ip
def test_netlink_lists_what_ip_lists_on_this_machine() -> None:
    shown = subprocess.run([str(IP), "-o", "-4", "addr", "show"], capture_output=True, text=True, check=True).stdout
    listed = probe.interfaces_netlink()
    assert listed is not None
    assert _pairs(listed) == _ip_pairs(shown)
    assert any(name == "lo" and "127.0.0.1" in addrs for name, addrs in _pairs(listed))


@needs_ip
def test_netlink_lists_what_ip_lists_in_a_namespace_with_odd_interfaces() -> None:
    prefix = _namespace_prefix()
    if prefix is None:
        pytest.skip("no network namespace can be made here")
    proc = subprocess.run([*prefix, sys.executable, "-c", SETUP, str(REPO)], capture_output=True, text=True,
                          timeout=120)
    if proc.returncode != 0 and "interfaces made" not in proc.stderr:  # no veth or bridge in this kernel
        pytest.skip(f"the interfaces cannot be made in a namespace here: {proc.stderr.strip()[-300:]}")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    expected = [
        ("lo", ["127.0.0.1", "127.0.0.9"]),
        ("averyveryverylo", ["10.3.0.1"]),
        ("veth0", ["10.1.0.1", "10.2.0.1", "10.1.0.2"]),
        ("br1", ["10.4.0.1"]),
    ]
    assert _ip_pairs(out["ip"]) == expected  # the authority says what the namespace holds
    assert _pairs(out["netlink"]) == expected
    doc = json.loads(out["probe"])
    assert "ip_addr" not in doc["commands"]  # no process: the kernel answered
    report = parse_probe_output("ns", out["probe"])
    assert [(i.name, list(i.ipv4)) for i in report.interfaces] == expected


@needs_ip
def test_without_netlink_the_probe_runs_ip(tmp_path: Path) -> None:
    """Where no netlink socket can be had (AF_NETLINK gone, as on a platform without it), the
    probe runs ``ip`` as before, and the client reads the same interfaces from it."""
    env = env_with_path(None, PATH=f"{tmp_path}:{os.path.dirname(str(IP))}", DLRUN_SYSFS_ROOT=str(tmp_path))
    doc = _run_probe(env, "import socket\ndel socket.AF_NETLINK\n")
    assert "interfaces_netlink" not in doc and "interfaces_ioctl" not in doc
    assert doc["commands"]["ip_addr"]["rc"] == 0
    report = parse_probe_output("h", json.dumps(doc))
    listed = probe.interfaces_netlink()
    assert listed is not None
    assert [(i.name, list(i.ipv4)) for i in report.interfaces] == _pairs(listed)


def test_without_netlink_or_ip_the_interfaces_come_from_ioctl(tmp_path: Path) -> None:
    env = env_with_path(None, PATH=str(tmp_path), DLRUN_SYSFS_ROOT=str(tmp_path))  # no `ip`
    doc = _run_probe(env, "import socket\ndel socket.AF_NETLINK\n")
    assert doc["commands"]["ip_addr"]["missing"] and "interfaces_ioctl" in doc
    report = parse_probe_output("h", json.dumps(doc))
    assert any(i.name == "lo" and "127.0.0.1" in i.ipv4 for i in report.interfaces)


def test_a_cut_attribute_is_skipped_not_read_past() -> None:
    """Attributes are read within their message: a length past its end stops the walk."""
    local = b"\x08\x00\x02\x00" + bytes([10, 0, 0, 7])
    address = b"\x08\x00\x01\x00" + bytes([10, 0, 0, 8])
    assert probe.ifa_address(address + local, 0, 16) == bytes([10, 0, 0, 7])
    assert probe.ifa_address(address, 0, 8) == bytes([10, 0, 0, 8])
    cut = b"\x40\x00\x02\x00" + bytes([10, 0, 0, 7])  # says 64 bytes, has 8
    assert probe.ifa_address(cut, 0, 8) is None
    assert probe.ifa_address(address + b"\x00\x00\x00\x00" + local, 0, 20) == bytes([10, 0, 0, 8])


class _KernelReply:
    """A netlink socket whose dump answer is ``datagram`` (the kernel cannot be made to fail a
    dump on purpose): for the parser's reading of NLMSG_DONE only."""

    datagram = b""

    def __init__(self, *_args: object) -> None:
        pass

    def settimeout(self, _timeout: float) -> None:
        pass

    def bind(self, _address: object) -> None:
        pass

    def getsockname(self) -> tuple[int, int]:
        return (4242, 0)

    def sendto(self, data: bytes, _address: object) -> int:
        return len(data)

    def recvmsg(self, _size: int) -> tuple[bytes, list[object], int, object]:
        return self.datagram, [], 0, None

    def close(self) -> None:
        pass


@pytest.mark.parametrize(("status", "whole"), [(0, True), (-4, False)])
def test_a_dump_the_kernel_ends_with_an_error_counts_as_no_answer(monkeypatch: pytest.MonkeyPatch, status: int,
                                                                   whole: bool) -> None:
    """The kernel ends a dump that failed partway with NLMSG_DONE carrying a negative error (as
    ``ip`` reads it): the addresses so far are not the whole list, so ``ip`` runs instead."""
    import socket
    import struct

    header = struct.Struct("=IHHII")
    body = struct.pack("=BBBBI", socket.AF_INET, 8, 0, 0, 1) + b"\x08\x00\x02\x00" + bytes([10, 0, 0, 7])
    address = header.pack(header.size + len(body), probe.RTM_NEWADDR, 2, 1, 4242) + body
    done = header.pack(header.size + 4, probe.NLMSG_DONE, 2, 1, 4242) + struct.pack("=i", status)
    _KernelReply.datagram = address + done
    monkeypatch.setattr(socket, "socket", _KernelReply)
    listed = probe.interfaces_netlink()
    assert (listed == [{"name": socket.if_indextoname(1), "ipv4": ["10.0.0.7"]}]) if whole else listed is None
