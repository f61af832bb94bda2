"""``user@host`` in hostfiles and inline ``--hosts`` lists: the login user, not part of the name."""

from __future__ import annotations

import pytest

from dlrun.errors import InventoryError
from dlrun.inventory import parse_hostfile, parse_inline, parse_toml_inventory


def test_inline_user_at_host_with_slots_and_ranges() -> None:
    inv = parse_inline("alice@node[1-2]:4,bob@gpu,h3:2")
    assert [(h.name, h.address, h.user, h.slots) for h in inv.hosts] == [
        ("node1", "node1", "alice", 4), ("node2", "node2", "alice", 4), ("gpu", "gpu", "bob", None),
        ("h3", "h3", None, 2)]


def test_hostfile_user_at_host_both_slot_spellings() -> None:
    inv = parse_hostfile("carol@n1 slots=2\ndave@n2:3  # comment\nops@corp@n3\n", source="hf")
    assert [(h.address, h.user, h.slots) for h in inv.hosts] == [("n1", "carol", 2), ("n2", "dave", 3),
                                                                  ("n3", "ops@corp", None)]


def test_user_at_localhost_is_reached_over_ssh() -> None:
    assert not parse_inline("me@localhost:2").hosts[0].is_local


@pytest.mark.parametrize("spec", ["@h", "-oProxyCommand=x@h", "a b@h", "al!ce@h:2"])
def test_bad_user_names_are_refused(spec: str) -> None:
    with pytest.raises(InventoryError, match="invalid user name"):
        parse_inline(spec)


def test_bad_user_in_a_hostfile_names_the_line() -> None:
    with pytest.raises(InventoryError, match=r"hf:2: key 'user': invalid user name"):
        parse_hostfile("ok@n1\n;x@n2 slots=1\n", source="hf")


@pytest.mark.parametrize(("table", "line"), [("[defaults]\nuser = \"$(touch x)x\"\n", 2),
                                             ("[[hosts]]\naddress = \"n1\"\nuser = \"-oProxyCommand=x\"\n", 3)])
def test_a_bad_user_in_hosts_toml_names_the_file_line_and_key(table: str, line: int) -> None:
    # as user@host is checked: the name reaches ssh's %r (a Match exec, a ProxyCommand)
    with pytest.raises(InventoryError, match=rf"hosts.toml:{line}: key '[\w.\[\]0-9]*user': invalid user name"):
        parse_toml_inventory(table + ("" if "hosts" in table else "[[hosts]]\naddress = \"n1\"\n"), source="hosts.toml")
