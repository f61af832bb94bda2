"""Where the ranks reach each other: the addresses of hosts, this machine's address facing
them, each host's Gloo/NCCL interface, and a free base port for jobs on this machine alone.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from dlrun.inventory import Host, Inventory
from dlrun.plan import DEFAULT_BASE_PORT, Plan, is_loopback
from dlrun.remote.agent import claim_ports
from dlrun.render import SocketIface

if TYPE_CHECKING:
    from dlrun.topo.records import HostReport


def local_base_port(inventory: Inventory, np: int | None, claims: dict[int, socket.socket] | None = None) -> int:
    """The base port for a job whose ranks all run on this machine: the first run of free ports
    from ``DEFAULT_BASE_PORT`` up (two local jobs side by side, e.g. CI smoke tests, would
    otherwise collide on 23456) that no other launch on this machine has claimed. The run's
    claims (``claim_ports``, by port) go to ``claims``; the caller closes them when its ranks have ended.
    Hosts elsewhere: ``DEFAULT_BASE_PORT``, which is checked there."""
    if not all(h.is_local for h in inventory.hosts):
        return DEFAULT_BASE_PORT
    count = np or (inventory.total_slots if all(h.slots for h in inventory.hosts) else 16)  # 16: slots from GPUs

    def free(port: int) -> bool:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("", port))
            except OSError:
                return False
            return True

    for base in range(DEFAULT_BASE_PORT, 65536 - count, count):
        if all(free(base + i) for i in range(count)):
            held = claim_ports(range(base, base + count))
            if held is None:
                continue  # another launch chose these a moment ago; its ranks have not bound them yet
            if claims is not None:
                claims.update(zip(range(base, base + count), held, strict=False))  # none held: not Linux
            else:
                for sock in held:
                    sock.close()
            return base
    return DEFAULT_BASE_PORT


def socket_ifaces(plan: Plan, iface: str | None, found: Mapping[str, str]) -> dict[str, SocketIface]:
    """Each of the plan's hosts' Gloo/NCCL interface (``host_ifaces``)."""
    return host_ifaces(plan.hosts, {r.host.name: r.address for r in plan.ranks}, iface, found)


def host_ifaces(hosts: Sequence[Host], addresses: Mapping[str, str], iface: str | None,
                found: Mapping[str, str]) -> dict[str, SocketIface]:
    """Each host's Gloo/NCCL interface, the one rule of ``launch`` and ``topo``: the inventory's
    ``iface``, else ``--iface``, else ``lo`` when every host is this machine (``addresses``:
    where the ranks reach each host), else the one the probe found holding the address the
    other ranks reach the host at (``found``, ``interfaces_at``). Hosts need not share
    interface names."""
    every_rank_here = all(is_loopback(addresses.get(h.name, h.address)) for h in hosts)
    out: dict[str, SocketIface] = {}
    for host in hosts:
        if host.iface or iface:
            out[host.name] = SocketIface(host.iface or iface or "")
        elif every_rank_here:  # gloo must not pick an interface the other ranks cannot reach
            out[host.name] = SocketIface("lo")
        elif host.name in found:
            out[host.name] = SocketIface(found[host.name], named=False)
    return out


def interfaces_at(reports: Sequence[HostReport], addresses: Mapping[str, str]) -> dict[str, str]:
    """host name → the interface (from its probe) holding the address dlrun reached it at."""
    from dlrun.topo.findings import interface_with_address

    found = {}
    for report in reports:
        ipv4 = ipv4_of(addresses.get(report.host, ""))
        if ipv4 is not None and (name := interface_with_address(report, ipv4)) is not None:
            found[report.host] = name
    return found


def ipv4_of(address: str) -> str | None:
    try:
        return str(ipaddress.IPv4Address(address))
    except ValueError:
        pass
    try:  # a host name: resolved as the connection resolved it
        return socket.gethostbyname(address) if address else None
    except OSError:
        return None


def facing_address(addresses: Sequence[str]) -> str:
    """This machine's address on the route to the hosts (127.0.0.1 when they are all local)."""
    remote = [a for a in addresses if not is_loopback(a)]
    if not remote:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((remote[0], 9))  # UDP: no packet is sent, the kernel picks the route
            return str(probe.getsockname()[0])
        except OSError:
            return "0.0.0.0"


def reachable_addresses(hosts: Sequence[Host], addresses: Mapping[str, str]) -> dict[str, str]:
    """Where the ranks reach each host. In a job that mixes this machine with remote hosts, a
    local host's loopback address would send the remote ranks to themselves: it becomes this
    machine's address on the route to them (unchanged when no route is known)."""
    found = {h.name: addresses.get(h.name, h.address) for h in hosts}
    remote = [found[h.name] for h in hosts if not h.is_local]
    if not remote or all(not h.is_local for h in hosts):
        return found
    mine = facing_address(remote)
    if mine == "0.0.0.0":
        return found
    local = {h.name for h in hosts if h.is_local}
    return {name: mine if name in local and is_loopback(address) else address for name, address in found.items()}
