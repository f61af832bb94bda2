"""The ports of a job on this machine alone (``dlrun.run.addresses.local_base_port``): free,
and claimed, so that two launches started together do not both take them."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from dlrun.inventory import parse_inline
from dlrun.remote.agent import claim_ports
from dlrun.run.addresses import local_base_port

HERE = parse_inline("localhost:2")

#: another launch on this machine that found the same free ports, holding them until stdin closes
OTHER_LAUNCH = """
import sys
from dlrun.inventory import parse_inline
from dlrun.run.addresses import local_base_port
claims = {}
print(local_base_port(parse_inline("localhost:2"), 2, claims), flush=True)
sys.stdin.read()
"""


def test_two_launches_in_one_process_get_different_ports_until_the_first_ends() -> None:
    first: dict[int, socket.socket] = {}
    second: dict[int, socket.socket] = {}
    a = local_base_port(HERE, 2, first)
    b = local_base_port(HERE, 2, second)
    assert a != b and sorted(first) == [a, a + 1] and sorted(second) == [b, b + 1]
    for sock in first.values():
        sock.close()
    again = claim_ports(range(a, a + 2))  # free again: the first launch's ranks have ended
    assert again
    for sock in [*again, *second.values()]:
        sock.close()


def test_a_launch_in_another_process_holds_its_ports_until_it_ends() -> None:
    other = subprocess.Popen([sys.executable, "-c", OTHER_LAUNCH], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    assert other.stdout is not None and other.stdin is not None
    try:
        theirs = int(other.stdout.readline())
        mine: dict[int, socket.socket] = {}
        assert local_base_port(HERE, 2, mine) != theirs  # nothing bound yet: only the claim says so
        for sock in mine.values():
            sock.close()
    finally:
        other.stdin.close()
        other.wait(10)
    assert claim_ports(range(theirs, theirs + 2)) is not None  # its process ended, the kernel let go


def test_a_run_half_claimed_elsewhere_is_refused_whole_and_nothing_of_it_stays_held() -> None:
    base = 64000 + os.getpid() % 1000  # a run of its own, away from the launches' 23456 and up
    elsewhere = claim_ports([base + 1])
    assert elsewhere
    try:
        assert claim_ports([base, base + 1]) is None
        held = claim_ports([base])  # the half it could take was let go again
        assert held
        for sock in held:
            sock.close()
    finally:
        for sock in elsewhere:
            sock.close()


def test_a_detached_jobs_keeper_claims_them_while_the_launch_still_holds_them() -> None:
    base = 63000 + os.getpid() % 1000
    launch = claim_ports([base, base + 1])
    assert launch
    keeper = claim_ports([base, base + 1], keeper=True)  # the hand-over: no moment unclaimed
    assert keeper
    for sock in launch:
        sock.close()
    assert claim_ports([base]) is None  # another launch still finds them taken
    for sock in keeper:
        sock.close()
    free = claim_ports([base])
    assert free
    for sock in free:
        sock.close()
