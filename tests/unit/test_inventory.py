from __future__ import annotations

from pathlib import Path

import pytest

from dlrun.errors import InventoryError
from dlrun.inventory import expand_range, load_inventory, parse_hostfile, parse_inline, parse_toml_inventory

GOOD = """
[defaults]
user = "ml"
python = "/opt/venv/bin/python"
workdir = "/scratch/job"
env = { NCCL_DEBUG = "WARN", SHARED = "defaults" }

[[hosts]]
address = "10.0.0.1"
name = "gpu-a"
slots = 4

[[hosts]]
address = "gpu-b.example.org"
slots = 2
port = 2222
user = "other"
role = "worker"
env = { SHARED = "host" }
"""


def test_toml_defaults_and_overrides() -> None:
    inv = parse_toml_inventory(GOOD, source="hosts.toml")
    a, b = inv.hosts
    assert (a.name, a.address, a.slots, a.user, a.python, a.workdir) == (
        "gpu-a", "10.0.0.1", 4, "ml", "/opt/venv/bin/python", "/scratch/job")
    assert (b.name, b.port, b.user, b.role) == ("gpu-b.example.org", 2222, "other", "worker")
    assert a.env == {"NCCL_DEBUG": "WARN", "SHARED": "defaults"}
    assert b.env == {"NCCL_DEBUG": "WARN", "SHARED": "host"}
    assert inv.total_slots == 6
    assert not a.is_local


def test_slots_unset_is_none_and_counts_one() -> None:
    inv = parse_toml_inventory('[[hosts]]\naddress = "h"\n')
    assert inv.hosts[0].slots is None and inv.total_slots == 1
    assert inv.with_slots({"h": 8}).hosts[0].slots == 8
    # GPUs found on a chief's or evaluator's host make no second chief: TF allows one
    roles = parse_toml_inventory('[[hosts]]\naddress = "c"\nrole = "chief"\n[[hosts]]\naddress = "e"\n'
                                 'role = "evaluator"\n[[hosts]]\naddress = "w"\n')
    assert [h.effective_slots for h in roles.with_slots({"c": 4, "e": 4, "w": 4}).hosts] == [1, 1, 4]


def test_localhost_without_port_or_user_is_local() -> None:
    inv = parse_toml_inventory(
        '[[hosts]]\naddress = "localhost"\nslots = 2\n[[hosts]]\naddress = "127.0.0.1"\nport = 22\n'
    )
    assert inv.hosts[0].is_local and not inv.hosts[1].is_local


@pytest.mark.parametrize(
    ("text", "line", "key", "words"),
    [
        ('[[hosts]]\naddress = "a"\nslotz = 2\n', 3, "hosts[0].slotz", "unknown key"),
        ('[[hosts]]\naddress = "a"\n\n[[hosts]]\naddress = "b"\nslots = "two"\n', 6, "hosts[1].slots", "integer"),
        ('[[hosts]]\naddress = "a"\nslots = 0\n', 3, "hosts[0].slots", "at least 1"),
        ('[[hosts]]\naddress = "a"\nrole = "boss"\n', 3, "hosts[0].role", "unknown role"),
        ('[[hosts]]\naddress = "a"\n[[hosts]]\naddress = "a"\n', 4, "hosts[1].address", "duplicate"),
        ('[[hosts]]\naddress = "a"\nname = "x"\n[[hosts]]\naddress = "b"\nname = "x"\n', 6, "hosts[1].name",
         "duplicate"),
        ('[[hosts]]\naddress = "a"\nrole = "chief"\n[[hosts]]\naddress = "b"\nrole = "chief"\n', 6,
         "hosts[1].role", "more than one chief"),
        ('[[hosts]]\naddress = "a"\nrole = "evaluator"\nslots = 2\n', 3, "hosts[0].role", "more than one evaluator"),
        ('[[hosts]]\nname = "a"\n', 1, "hosts[0].address", "missing"),
        ('[defaults]\nuser = 3\n[[hosts]]\naddress = "a"\n', 2, "defaults.user", "string"),
        ('[defaults]\nfoo = 1\n[[hosts]]\naddress = "a"\n', 2, "defaults.foo", "unknown key"),
        ('[[hosts]]\naddress = "a"\nenv = { X = 1 }\n', 3, "hosts[0].env.X", "string"),
        ('[[hosts]]\naddress = "a"\nport = 70000\n', 3, "hosts[0].port", "TCP port"),
        ('[[hosts]]\naddress = "a b"\n', 2, "hosts[0].address", "invalid host name"),
        # an address reaches a shell through ssh_config 'Match exec "… %h"' (CVE-2023-51385)
        ('[[hosts]]\naddress = "gpu1;touch${IFS}/tmp/x;#"\n', 2, "hosts[0].address", "invalid host name"),
        ('[[hosts]]\nslots = 1\naddress = "-oProxyCommand"\n', 3, "hosts[0].address", "invalid host name"),
        ('[[hosts]]\naddress = "node[01-04]"\n', 2, "hosts[0].address", "ranges"),
        ('[[hosts]]\naddress = "gpu2:4"\n', 2, "hosts[0].address", "':N' slots"),
        ('[[hosts]]\naddress = "a"\niface = "eth 0"\n', 3, "hosts[0].iface", "network interface name"),
        ('[[hosts]]\naddress = "a"\nname = "x\\n[9 fake] forged"\n', 3, "hosts[0].name", "printable name"),
        ('[[hosts]]\naddress = "a"\nenv = { A = "x\\u0000y" }\n', 3, "hosts[0].env.A", "NUL byte"),
        ('[[hosts]]\naddress = "a"\n\n[hosts.env]\nA = 5\n', 5, "hosts[0].env.A", "string"),
        ('[[hosts]]\naddress = "a"\nslots = 1\nenv.A = 5\n', 4, "hosts[0].env.A", "string"),
        ('[[hosts]]\naddress = "a"\n\n[hosts.env]\nB = "1"\nA = 5\n', 6, "hosts[0].env.A", "string"),
        ('[defaults]\nuser = "ml"\n\n[defaults.env]\nB = "1"\nA = 5\n\n[[hosts]]\naddress = "a"\n', 6,
         "defaults.env.A", "string"),
        ('[defaults]\nuser = "ml"\nenv.A = 5\n[[hosts]]\naddress = "a"\n', 3, "defaults.env.A", "string"),
        ('[defaults.env]\nA = 5\n\n[[hosts]]\naddress = "a"\n', 2, "defaults.env.A", "string"),
        ('[defaults.env]\nB = "1"\nA = 5\n[defaults]\nuser = "ml"\n[[hosts]]\naddress = "a"\n', 3,
         "defaults.env.A", "string"),
        ('[defaults]\niface = "a-very-long-interface"\n[[hosts]]\naddress = "a"\n', 2, "defaults.iface",
         "1-15 characters"),
        ('[defaults]\nsetup = 3\n[[hosts]]\naddress = "a"\n', 2, "defaults.setup", "string"),
        ('[[hosts]]\naddress = "a"\nsetup = "  "\n', 3, "hosts[0].setup", "shell command"),
        ('[cluster]\nx = 1\n', 1, "cluster", "unknown top-level"),
        ('[defaults]\n', None, "hosts", "no hosts"),
        ('[[hosts]]\naddress = "a"\nslots = 2\nslots = 3\n', 4, None, "not valid TOML"),
    ],
)
def test_toml_errors_name_file_line_and_key(text: str, line: int | None, key: str | None, words: str) -> None:
    with pytest.raises(InventoryError) as info:
        parse_toml_inventory(text, source="hosts.toml")
    err = info.value
    assert err.source == "hosts.toml"
    assert err.line == line, str(err)
    assert err.key == key
    assert words in str(err)
    assert str(err).startswith("hosts.toml")


def test_inline_and_ranges_keep_padding() -> None:
    inv = parse_inline("h1:2,node[01-03,07]:8,solo")
    assert [(h.name, h.slots) for h in inv.hosts] == [
        ("h1", 2), ("node01", 8), ("node02", 8), ("node03", 8), ("node07", 8), ("solo", None)]
    assert expand_range("n[8-10]") == ["n8", "n9", "n10"]
    assert expand_range("rack[1-2]-gpu[0-1]") == ["rack1-gpu0", "rack1-gpu1", "rack2-gpu0", "rack2-gpu1"]


@pytest.mark.parametrize("spec", ["h1:0", "h1:x", "a,,b", "n[3-1]", "n[1-", "h;rm -rf /", "a:2,a:3",
                                  "h1:\u00b2", "node[\u00b2-3]", "node[\u0661-\u0663]", "-h1", "GPU1:4,gpu1:4",
                                  "node[1-200000]", "n[1-100]x[1-100]y[1-100]", "localhost:2,127.0.0.1:2"])
def test_inline_errors(spec: str) -> None:
    with pytest.raises(InventoryError):
        parse_inline(spec)


def test_this_machine_may_hold_several_tensorflow_roles() -> None:
    # a tf-ps job on one machine: a chief, a ps and a worker, each an entry of its own
    inv = parse_toml_inventory('[[hosts]]\naddress = "localhost"\nrole = "chief"\n'
                               '[[hosts]]\naddress = "127.0.0.1"\nrole = "ps"\n'
                               '[[hosts]]\naddress = "::1"\nrole = "worker"\n')
    assert [h.role for h in inv.hosts] == ["chief", "ps", "worker"]
    with pytest.raises(InventoryError, match="is this machine"):
        parse_toml_inventory('[[hosts]]\naddress = "localhost"\nrole = "chief"\n[[hosts]]\naddress = "127.0.0.1"\n')


def test_ipv6_addresses_keep_their_last_group() -> None:
    inv = parse_inline("::1,2001:db8::10,fe80::1%eth0,h1:2")
    assert [(h.address, h.slots) for h in inv.hosts] == [("::1", None), ("2001:db8::10", None),
                                                         ("fe80::1%eth0", None), ("h1", 2)]
    assert inv.hosts[0].is_local
    inv = parse_hostfile("::1 slots=2\n2001:db8::10\n", source="hf")
    assert [(h.address, h.slots) for h in inv.hosts] == [("::1", 2), ("2001:db8::10", None)]


@pytest.mark.parametrize("text", ["h1 slots=2 slots=8\n", "h2:4 slots=2\n", "h3 max_slots=abc\n",
                                  "h4 slots=\u00b2\n"])
def test_hostfile_values_are_not_dropped_or_overridden(text: str) -> None:
    with pytest.raises(InventoryError) as info:
        parse_hostfile(text, source="hf")
    assert info.value.line == 1


def test_a_utf8_bom_is_not_part_of_the_inventory(tmp_path: Path) -> None:
    toml = tmp_path / "hosts.toml"
    toml.write_text('\ufeff[[hosts]]\naddress = "gpu1"\n', encoding="utf-8")
    assert [h.address for h in load_inventory(str(toml)).hosts] == ["gpu1"]
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("\ufeffgpu1 slots=2\n", encoding="utf-8")
    assert [h.address for h in load_inventory(str(hostfile)).hosts] == ["gpu1"]


def test_hostfile_mpi_style() -> None:
    text = "# cluster\nworker-1 slots=4\n\nworker-[2-3] slots=2  # racks\nlast\n"
    inv = parse_hostfile(text, source="hostfile")
    assert [(h.name, h.slots) for h in inv.hosts] == [("worker-1", 4), ("worker-2", 2), ("worker-3", 2),
                                                       ("last", None)]


def test_hostfile_errors_name_the_line() -> None:
    with pytest.raises(InventoryError) as info:
        parse_hostfile("a slots=1\nb slots=zero\n", source="hf")
    assert info.value.line == 2 and "hf:2" in str(info.value)
    with pytest.raises(InventoryError) as info:
        parse_hostfile("a slots=1\nb cpus=3\n", source="hf")
    assert info.value.line == 2
    with pytest.raises(InventoryError) as info:
        parse_hostfile("a\nb\na\n", source="hf")
    assert info.value.line == 3


def test_load_inventory_dispatches_on_files(tmp_path: Path) -> None:
    toml = tmp_path / "hosts.toml"
    toml.write_text(GOOD)
    assert len(load_inventory(str(toml)).hosts) == 2
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("a slots=2\nb slots=2\n")
    assert load_inventory(str(hostfile)).total_slots == 4
    assert load_inventory("x:3").total_slots == 3
    with pytest.raises(InventoryError, match="no such file"):
        load_inventory(str(tmp_path / "missing.toml"))
    # a typo of a file name is no host name either; the file meant is named
    with pytest.raises(InventoryError, match=r"hosts\.tml: no such file, and no host name ends in \.tml") as info:
        load_inventory(str(tmp_path / "hosts.tml"))
    assert f"did you mean {toml}?" in str(info.value)
    for spec in ("hosts.txt", "cluster.yaml"):
        with pytest.raises(InventoryError, match="no such file"):
            load_inventory(spec)
    assert load_inventory("gpu1.example.com,node.tl:2").total_slots == 3  # domains stay host names


def test_example_inventory_is_valid() -> None:
    example = Path(__file__).resolve().parents[2] / "hosts.example.toml"
    inv = load_inventory(str(example))
    assert inv.hosts


def test_iface_per_host_over_defaults() -> None:
    inv = parse_toml_inventory('[defaults]\niface = "eth0"\n[[hosts]]\naddress = "a"\n'
                               '[[hosts]]\naddress = "b"\niface = "enp65s0f1"\n')
    assert [h.iface for h in inv.hosts] == ["eth0", "enp65s0f1"]


def test_setup_per_host_over_defaults() -> None:
    inv = parse_toml_inventory('[defaults]\nsetup = "pip install -r requirements.txt"\n[[hosts]]\naddress = "a"\n'
                               '[[hosts]]\naddress = "b"\nsetup = "make deps"\n')
    assert [h.setup for h in inv.hosts] == ["pip install -r requirements.txt", "make deps"]
