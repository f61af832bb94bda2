"""The topology parsers against the real captures in tests/fixtures/topology."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dlrun.topo.parse import (
    parse_cuda_version,
    parse_driver_version,
    parse_ib_state,
    parse_ibstat,
    parse_ip_addr,
    parse_os_release,
    parse_proc_net_route,
    parse_query_gpu_csv,
    parse_smi_L,
    parse_sysfs_ib,
    parse_sysfs_pci_numa,
    parse_topo_matrix,
)
from dlrun.topo.records import (
    DeviceAffinity,
    Gpu,
    HostReport,
    Nic,
    TopoMatrix,
    attach_nic_affinity,
    host_report_to_json,
    is_p2p_by_default,
    link_class,
    link_rank,
    normalize_pci_bus_id,
)

from support.topo_fixtures import (
    FIXTURES,
    all_fixture_files,
    fixture,
    sysfs_root_of,
    sysfs_tree,
)

# Files whose parse is empty on purpose (the capture holds no data of that kind).
EXPECTED_EMPTY = {
    "topo-m/windows-rtx2080super-topo-unsupported-error-drv591.txt",
}


def parse_fixture(path: Path) -> object:
    """Parse one capture with the parser of its folder; the folder decides, nothing else."""
    rel = path.relative_to(FIXTURES)
    folder = rel.parts[0]
    if folder == "sysfs-ib":
        return parse_sysfs_ib(sysfs_tree(str(sysfs_root_of(path).relative_to(FIXTURES))))
    text = path.read_text(encoding="utf-8")
    parsers = {
        "topo-m": parse_topo_matrix,
        "query-gpu-csv": parse_query_gpu_csv,
        "smi-L": parse_smi_L,
        "smi-header": parse_driver_version,
        "ibstat": parse_ibstat,
    }
    if rel.as_posix() == "SOURCES.md":
        return [d.name for d in FIXTURES.iterdir() if d.is_dir() and f"{d.name}/" in text]
    if folder not in parsers:
        raise AssertionError(f"no parser for fixture folder {folder!r}: add one to this test")
    return parsers[folder](text)


def _is_empty(result: object) -> bool:
    if isinstance(result, TopoMatrix):
        return not result.devices
    return not result


@pytest.mark.parametrize(
    "path", all_fixture_files(), ids=lambda p: p.relative_to(FIXTURES).as_posix()
)
def test_every_fixture_parses(path: Path) -> None:
    rel = path.relative_to(FIXTURES).as_posix()
    result = parse_fixture(path)
    assert _is_empty(result) == (rel in EXPECTED_EMPTY), f"{rel} parsed to {result!r}"
    if rel.startswith("sysfs-ib/") and "/ports/" in rel:
        device, port = rel.split("/class/infiniband/")[1].split("/")[0::2][:2]
        assert isinstance(result, tuple)
        assert any(n.name == device and n.port == int(port) for n in result)


def test_sources_md_names_every_folder() -> None:
    folders = {d.name for d in FIXTURES.iterdir() if d.is_dir()}
    named = parse_fixture(FIXTURES / "SOURCES.md")
    assert isinstance(named, list) and set(named) == folders


# ----------------------------------------------------------------------------- topo -m


TOPO = FIXTURES / "topo-m"
RAW_TABS = sorted(p.name for p in TOPO.glob("*") if "\t" in p.read_text())


@pytest.mark.parametrize("name", RAW_TABS)
def test_tabs_and_expanded_spaces_give_the_same_matrix(name: str) -> None:
    text = fixture(f"topo-m/{name}")
    assert parse_topo_matrix(text.expandtabs()) == parse_topo_matrix(text)
    assert parse_topo_matrix(text.replace("\n", "\r\n")) == parse_topo_matrix(text)
    # pasted as a whole with an indent: a markdown code block, a quoted mail
    for indent in ("    ", "\t", "  "):
        indented = "\n".join(indent + line if line.strip() else line for line in text.expandtabs().splitlines())
        assert parse_topo_matrix(indented) == parse_topo_matrix(text.expandtabs()), repr(indent)


def test_raw_tab_files_are_the_ones_sources_md_names() -> None:
    assert {
        "dgx1-v100-hybrid-cube-mesh-nv1-nv2-4nic-raw-tabs.txt",
        "h100-80gb-hbm3-vm-single-gpu-raw-tabs-drv580.txt",
        "k40m-4gpu-2socket-mlx4-soc-legacy-tabs.txt",
        "h100-80gb-hbm3-single-gpu-raw-tabs-drv590.txt",
        "windows-rtx2080super-empty-affinity-drv610.txt",
    } <= set(RAW_TABS)


ASUS = "topo-m/asus-esc8000a-4x-rtx6000ada-4nic-cx7-node-sys-gpu-numa-id.txt"
DGX1 = "topo-m/dgx1-v100-hybrid-cube-mesh-nv1-nv2-4nic-raw-tabs.txt"


def test_nic_legend_names_the_columns_even_when_offset() -> None:
    text = fixture(ASUS)
    m = parse_topo_matrix(text)
    assert m.nic_legend == {f"NIC{i}": f"mlx5_{i}" for i in range(4)}
    assert m.nics == ("mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3")
    # a legend that starts at mlx5_1 (seen on H20 boards): the names follow the legend, not the index
    shifted = text
    for i in reversed(range(4)):
        shifted = shifted.replace(f"NIC{i}: mlx5_{i}", f"NIC{i}: mlx5_{i + 1}")
    s = parse_topo_matrix(shifted)
    assert s.nics == ("mlx5_1", "mlx5_2", "mlx5_3", "mlx5_4")
    assert s.links["GPU0"]["mlx5_1"] == m.links["GPU0"]["mlx5_0"]
    assert not any(k.startswith("NIC") for row in s.links.values() for k in row)
    assert not any(k.startswith("NIC") for k in s.links)
    assert "mlx5_2" not in s.links["mlx5_1"]  # NIC↔NIC cells stay in .cells only
    assert s.cells["mlx5_1"]["mlx5_2"] == m.cells["mlx5_0"]["mlx5_1"]


def test_dgx1_mesh_nics_named_by_device_rows_with_empty_affinity_cells() -> None:
    m = parse_topo_matrix(fixture(DGX1))
    assert m.gpus == tuple(f"GPU{i}" for i in range(8)) and not m.nic_legend
    assert m.nics == ("mlx5_0", "mlx5_2", "mlx5_1", "mlx5_3")  # in the order printed
    assert m.links["GPU0"]["GPU3"] == "NV2" and m.links["GPU0"]["GPU1"] == "NV1"
    assert m.links["GPU0"]["GPU5"] == "SYS"
    assert m.links["GPU2"]["mlx5_1"] == "PIX" and m.links["GPU0"]["mlx5_1"] == "PHB"
    assert m.links["mlx5_3"]["GPU6"] == "PIX"
    assert m.cells["mlx5_0"]["mlx5_1"] == "PHB"
    assert m.affinity["GPU4"].cpus == "20-39,60-79" and m.affinity["GPU4"].numa is None
    assert not any(n in m.affinity for n in m.nics)  # NIC rows end with an empty cell


def test_empty_affinity_cells_are_not_shifted() -> None:
    # Row `GPU0\t X \t\t\t\tN/A`: a whitespace split would read N/A as the CPU affinity.
    text = fixture("topo-m/windows-rtx2080super-empty-affinity-drv610.txt")
    m = parse_topo_matrix(text)
    assert m.gpus == ("GPU0",) and m.links == {}
    assert m.affinity["GPU0"] == DeviceAffinity(None, None, None)
    # The same row with a GPU NUMA ID that is a number: it must land in that column, also
    # once tabs are expanded (a pasted terminal).
    numbered = text.replace("\t\t\t\tN/A", "\t\t\t\t7")
    for variant in (numbered, numbered.expandtabs()):
        aff = parse_topo_matrix(variant).affinity["GPU0"]
        assert (aff.cpus, aff.numa, aff.gpu_numa_id) == (None, None, "7")


def test_single_gpu_ansi_header_and_double_tab() -> None:
    text = fixture("topo-m/h100-80gb-hbm3-single-gpu-raw-tabs-drv590.txt")
    assert "\x1b[4m" in text
    m = parse_topo_matrix(text)
    assert m.devices == ("GPU0",)
    assert m.affinity["GPU0"].cpus == "0-19"
    assert m.affinity["GPU0"].numa == "0"
    assert m.gpu_numa_node("GPU0") == 0
    vm = parse_topo_matrix(fixture("topo-m/h100-80gb-hbm3-vm-single-gpu-raw-tabs-drv580.txt"))
    assert vm.devices == ("GPU0",) and vm.affinity["GPU0"] == DeviceAffinity("0-15", "0", None)


def test_legacy_soc_is_kept_as_printed_and_ranked_as_sys() -> None:
    m = parse_topo_matrix(fixture("topo-m/k40m-4gpu-2socket-mlx4-soc-legacy-tabs.txt"))
    assert m.devices == ("GPU0", "GPU1", "GPU2", "GPU3", "mlx4_0")
    assert m.links["GPU0"]["GPU2"] == "SOC"
    assert m.links["GPU0"]["GPU1"] == "PHB"
    assert m.links["GPU2"]["mlx4_0"] == "PHB"
    assert m.links["mlx4_0"]["GPU0"] == "SOC"
    assert link_class("SOC") == "SYS" and link_rank("SOC") == link_rank("SYS")
    assert m.affinity["GPU2"].cpus == "6-11" and m.affinity["GPU2"].numa is None


@pytest.mark.parametrize(
    ("name", "gpus", "cell", "cpus", "numa"),
    [
        ("asus-esc8000a-4x-rtx6000ada-4nic-cx7-node-sys-gpu-numa-id.txt", 4, "NODE", "0-31", "0"),
        ("puget-threadripper-2gpu-phb-2nic-pix.txt", 2, "PHB", "0-23", "0"),
    ],
)
def test_space_separated_captures(
    name: str, gpus: int, cell: str, cpus: str, numa: str | None
) -> None:
    m = parse_topo_matrix(fixture(f"topo-m/{name}"))
    assert len(m.gpus) == gpus
    assert m.links["GPU0"]["GPU1"] == cell
    assert m.affinity["GPU0"].cpus == cpus
    assert m.affinity["GPU0"].numa == numa
    assert m.affinity["GPU0"].gpu_numa_id is None


def test_hand_compacted_spacing_parses_like_the_capture() -> None:
    # a matrix pasted with its columns squeezed to two spaces (as people tidy it in docs and mail)
    text = fixture(ASUS)
    compacted = "\n".join(re.sub(r" {2,}", "  ", line) for line in text.splitlines())
    assert compacted != text and parse_topo_matrix(compacted) == parse_topo_matrix(text)


def test_legend_maps_pcie_only_nics() -> None:
    m = parse_topo_matrix(
        fixture("topo-m/asus-esc8000a-4x-rtx6000ada-4nic-cx7-node-sys-gpu-numa-id.txt")
    )
    assert m.nics == ("mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3")
    assert m.links["GPU2"]["mlx5_2"] == "NODE" and m.links["GPU0"]["mlx5_3"] == "SYS"
    assert m.cells["mlx5_0"]["mlx5_1"] == "PIX"


def test_windows_unsupported_message_is_an_empty_matrix() -> None:
    m = parse_topo_matrix(fixture("topo-m/windows-rtx2080super-topo-unsupported-error-drv591.txt"))
    assert m.devices == () and m.links == {}
    assert m.error is not None and m.error.startswith("ERROR: Option -m is missing its value")
    assert parse_topo_matrix("") == TopoMatrix()


def test_link_ranks() -> None:
    order = ["X", "NV18", "PIX", "PXB", "PHB", "NODE", "SYS"]
    assert [link_rank(c) for c in order] == sorted(link_rank(c) for c in order)
    assert link_class("NV4") == "NV#" and link_class("bogus") == "?"
    assert is_p2p_by_default("PXB") and is_p2p_by_default("NV1")
    assert not is_p2p_by_default("PHB") and not is_p2p_by_default("SOC")
    assert not is_p2p_by_default("X")


# ----------------------------------------------------------------------------- GPUs


def test_query_gpu_csv_by_header_name() -> None:
    (gpu,) = parse_query_gpu_csv(
        fixture("query-gpu-csv/h100-80gb-hbm3-all-fields-idle-drv590.csv.txt")
    )
    assert gpu == Gpu(
        index=0,
        name="NVIDIA H100 80GB HBM3",
        uuid="GPU-00000000-0000-0000-0000-000000000000",
        pci_bus_id="00000000:00:09.0",
        memory_mib=81559,
        driver="590.48.01",
        compute_cap="9.0",
        mig=False,
    )
    assert gpu.pci_address == "0000:00:09.0"


def test_query_gpu_csv_mig_enabled_and_windows_na() -> None:
    (mig,) = parse_query_gpu_csv(
        fixture("query-gpu-csv/h100-mig-enabled-all-fields-idle-drv590.csv.txt")
    )
    assert mig.mig is True
    (win,) = parse_query_gpu_csv(
        fixture("query-gpu-csv/windows-rtx2080super-all-fields-idle-drv591.csv.txt")
    )
    assert win.mig is None  # [N/A]
    assert (win.name, win.memory_mib, win.pci_address) == (
        "NVIDIA GeForce RTX 2080 SUPER",
        8192,
        "0000:0c:00.0",
    )


def test_query_gpu_csv_probe_fields_noheader_and_errors() -> None:
    text = (
        "index, uuid, name, pci.bus_id, memory.total [MiB], driver_version, compute_cap, "
        "mig.mode.current\n"
        "0, GPU-a, NVIDIA A100-SXM4-80GB, 00000000:07:00.0, 81920 MiB, 535.54.03, 8.0, [N/A]\n"
        "1, GPU-b, NVIDIA A100-SXM4-80GB, 00000000:0F:00.0, 81920 MiB, 535.54.03, 8.0, Enabled\n"
    )
    gpus = parse_query_gpu_csv(text)
    assert [(g.index, g.uuid, g.pci_address, g.mig) for g in gpus] == [
        (0, "GPU-a", "0000:07:00.0", None),
        (1, "GPU-b", "0000:0f:00.0", True),
    ]
    noheader = "\n".join(text.splitlines()[1:]).replace(" MiB", "")
    assert parse_query_gpu_csv(noheader) == gpus
    assert parse_query_gpu_csv('Field "compute_cap" is not a valid field to query.\n') == ()
    assert parse_query_gpu_csv("") == ()
    assert parse_query_gpu_csv("0, " + "x" * 200_000 + ", y\n") == ()  # over csv's field limit: no traceback
    assert parse_query_gpu_csv(text.replace("\n", "\r\n")) == gpus


def test_smi_L_mig_children() -> None:
    (gpu,) = parse_smi_L(fixture("smi-L/h200-mig-5-instances-drv590.txt"))
    assert gpu.name == "NVIDIA H200"
    assert [m.profile for m in gpu.mig_devices] == [
        "1c.3g.71gb",
        "2c.3g.71gb",
        "2g.35gb",
        "1g.18gb",
        "1g.18gb",
    ]
    assert gpu.mig_devices[4].uuid == "MIG-00000004-0000-0000-0000-000000000004"
    two = parse_smi_L("GPU 0: Tesla V100 (UUID: GPU-a)\nGPU 1: Tesla V100 (UUID: GPU-b)\n")
    assert [(g.index, g.uuid, g.mig_devices) for g in two] == [(0, "GPU-a", ()), (1, "GPU-b", ())]


def test_cuda_and_driver_version_from_the_header() -> None:
    header = (
        "+-----------------------------------------------------------------------------+\n"
        "| NVIDIA-SMI 535.161.08   Driver Version: 535.161.08   CUDA Version: 12.2     |\n"
    )
    assert parse_cuda_version(header) == "12.2"
    assert parse_driver_version(header) == "535.161.08"
    captured = fixture("smi-header/h100-80gb-hbm3-vm-drv580.txt")
    assert (parse_cuda_version(captured), parse_driver_version(captured)) == ("13.0", "580.159.04")
    assert parse_cuda_version("CUDA Version: N/A") is None


# ----------------------------------------------------------------------------- NICs


def test_sysfs_tree_with_bond_ethernet() -> None:
    nics = parse_sysfs_ib(sysfs_tree("sysfs-ib/gpud-h100-testdata"))
    names = [n.name for n in nics]
    assert names == [
        "mlx5_0",
        "mlx5_1",
        "mlx5_4",
        "mlx5_5",
        "mlx5_6",
        "mlx5_7",
        "mlx5_8",
        "mlx5_9",
        "mlx5_bond_0",
    ]
    ib = nics[0]
    assert (ib.port, ib.state, ib.rate_gbps, ib.link_layer, ib.phys_state, ib.hca_type) == (
        1,
        "ACTIVE",
        400.0,
        "InfiniBand",
        "LinkUp",
        "MT4129",
    )
    bond = nics[-1]
    assert (bond.state, bond.rate_gbps, bond.link_layer, bond.hca_type) == (
        "ACTIVE",
        200.0,
        "Ethernet",
        "MT41692",
    )


def test_sysfs_trailing_newlines_two_ports_and_other_vendors() -> None:
    nics = {(n.name, n.port): n for n in parse_sysfs_ib(sysfs_tree("sysfs-ib/procfs-testdata"))}
    assert set(nics) == {("hfi1_0", 1), ("mlx4_0", 1), ("mlx4_0", 2), ("mlx5_0", 1)}
    assert nics[("mlx4_0", 2)].link_layer == "InfiniBand"  # file ends with "\n\n"
    assert nics[("mlx4_0", 2)].rate_gbps == 40.0
    assert nics[("hfi1_0", 1)].hca_type is None
    assert nics[("mlx5_0", 1)].rate_gbps == 25.0


def test_sysfs_device_link_netdev_and_numa() -> None:
    files = {
        "sys/class/infiniband/mlx5_0/ports/1/state": "4: ACTIVE\n",
        "sys/class/infiniband/mlx5_0/ports/1/rate": "200 Gb/sec (4X HDR)\n",
        "sys/class/infiniband/mlx5_0/ports/1/link_layer": "InfiniBand\n",
        "sys/class/infiniband/mlx5_0/device": "/sys/devices/pci0000:00/0000:00:01.0/0000:07:00.0",
        "sys/class/infiniband/mlx5_0/device/numa_node": "1\n",
        "sys/class/infiniband/mlx5_0/device/net/ib0": "",
        "sys/class/infiniband/mlx4_0/ports/1/state": "1: DOWN\n",
        "sys/class/infiniband/mlx4_0/ports/2/state": "2: INIT\n",
        "sys/class/infiniband/mlx4_0/device/net/eth2/dev_port": "0\n",
        "sys/class/infiniband/mlx4_0/device/net/eth3/dev_port": "1\n",
        "sys/class/infiniband/mlx4_0/device/numa_node": "-1\n",
        "sys/bus/pci/devices/0000:07:00.0/numa_node": "1\n",
        "sys/bus/pci/devices/0000:0f:00.0/numa_node": "-1\n",
    }
    nics = {(n.name, n.port): n for n in parse_sysfs_ib(files)}
    assert set(nics) == {("mlx4_0", 1), ("mlx4_0", 2), ("mlx5_0", 1)}
    mlx5 = nics[("mlx5_0", 1)]
    assert (mlx5.pci_bus_id, mlx5.numa_node, mlx5.netdev) == ("0000:07:00.0", 1, "ib0")
    assert nics[("mlx4_0", 1)].netdev == "eth2" and nics[("mlx4_0", 2)].netdev == "eth3"
    assert nics[("mlx4_0", 1)].state == "DOWN" and nics[("mlx4_0", 2)].state == "INIT"
    assert nics[("mlx4_0", 1)].numa_node is None
    assert parse_sysfs_pci_numa(files) == {"0000:07:00.0": 1}


def test_ibstat_exit_255_after_valid_output() -> None:
    text = fixture("ibstat/gpud-a100-ibpanic-partial-output-exit255.txt")
    assert "ibpanic" in text.strip().splitlines()[-1]
    nics = parse_ibstat(text)
    assert [n.name for n in nics] == [f"mlx5_{i}" for i in range(8)]
    assert all(
        n.state == "ACTIVE" and n.rate_gbps == 200.0 and n.hca_type == "MT4124" for n in nics
    )
    assert {n.source for n in nics} == {"ibstat"}


def test_ibstat_down_ports_and_natural_order() -> None:
    nics = parse_ibstat(fixture("ibstat/gpud-h100-some-ports-down.txt"))
    assert [n.name for n in nics][:3] == ["mlx5_0", "mlx5_1", "mlx5_2"]
    assert nics[-1].name == "mlx5_11"
    down = [n.name for n in nics if not n.active]
    assert down == ["mlx5_2", "mlx5_7", "mlx5_8"]
    assert nics[2].phys_state == "Disabled"
    polling = parse_ibstat(fixture("ibstat/gpud-h100-some-down-with-polling.txt"))
    assert any(n.phys_state == "Polling" for n in polling)


def test_ib_states_in_every_spelling() -> None:
    cases = {
        "4: ACTIVE": "ACTIVE",
        "1: DOWN\n": "DOWN",
        "2: INIT": "INIT",
        "3: ARMED": "ARMED",
        "Active": "ACTIVE",
        "Initializing": "INIT",
        "Armed": "ARMED",
        "PORT_DOWN (1)": "DOWN",
        "PORT_ACTIVE (4)": "ACTIVE",
        "5: ACTIVE_DEFER": "ACTIVE_DEFER",
        "": None,
    }
    assert {k: parse_ib_state(k) for k in cases} == cases


# ----------------------------------------------------------------------------- matching


@pytest.mark.parametrize(
    ("raw", "normal"),
    [
        ("00000000:07:00.0", "0000:07:00.0"),
        ("0000:07:00.0", "0000:07:00.0"),
        ("00000000:C1:00.0", "0000:c1:00.0"),
        ("07:00.0", "0000:07:00.0"),
        ("00010000:01:00.0", "10000:01:00.0"),
        ("GPU-abc", None),
        (None, None),
    ],
)
def test_pci_bus_ids_spelled_both_ways(raw: str | None, normal: str | None) -> None:
    assert normalize_pci_bus_id(raw) == normal


def test_nic_affinity_from_topo_cells_then_numa() -> None:
    m = parse_topo_matrix(fixture(DGX1))
    gpus = tuple(Gpu(index=i, name="Tesla V100-SXM2-16GB", numa_node=i // 4) for i in range(8))
    nics = (
        Nic("mlx5_0", 1, "ACTIVE"),
        Nic("mlx5_3", 1, "ACTIVE"),
        Nic("mlx5_4", 1, "ACTIVE", numa_node=1),  # not in the matrix: NUMA decides
        Nic("mlx5_bond_0", 1, "ACTIVE"),  # neither: stays unknown
    )
    out = {n.name: n for n in attach_nic_affinity(nics, m, gpus)}
    assert (out["mlx5_0"].nearest_gpus, out["mlx5_0"].nearest_link) == ((0, 1), "PIX")
    assert (out["mlx5_3"].nearest_gpus, out["mlx5_3"].nearest_link) == ((6, 7), "PIX")
    assert (out["mlx5_4"].nearest_gpus, out["mlx5_4"].nearest_link) == ((4, 5, 6, 7), "NUMA")
    assert out["mlx5_bond_0"].nearest_gpus == ()


# ----------------------------------------------------------------------------- host facts, JSON


def test_os_release_ip_addr_and_default_route() -> None:
    assert parse_os_release(
        'NAME="Ubuntu"\nVERSION_ID="22.04"\nPRETTY_NAME="Ubuntu 22.04.4 LTS"\n'
    ) == ("Ubuntu 22.04.4 LTS")
    assert parse_os_release('NAME="Alpine"\nVERSION_ID=3.19\n') == "Alpine 3.19"
    ip = (
        "1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever preferred_lft forever\n"
        "2: ens5    inet 10.0.0.5/24 brd 10.0.0.255 scope global ens5\\       valid_lft forever\n"
        "2: ens5    inet 10.0.1.5/24 scope global secondary ens5\\       valid_lft forever\n"
        "5: ib0    inet 192.168.0.5/16 scope global ib0\n"
    )
    ifaces = parse_ip_addr(ip)
    assert [(i.name, i.ipv4) for i in ifaces] == [
        ("lo", ("127.0.0.1",)),
        ("ens5", ("10.0.0.5", "10.0.1.5")),
        ("ib0", ("192.168.0.5",)),
    ]
    assert ifaces[0].loopback and not ifaces[1].loopback
    route = (
        "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n"
        "ib0\t00000000\t0100A8C0\t0003\t0\t0\t200\t00000000\t0\t0\t0\n"
        "ens5\t00000000\t0100000A\t0003\t0\t0\t100\t00000000\t0\t0\t0\n"
        "ens5\t0000000A\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n"
    )
    assert parse_proc_net_route(route) == "ens5"
    assert parse_proc_net_route("") is None


def test_host_report_json_shape() -> None:
    m = parse_topo_matrix(fixture(DGX1))
    report = HostReport(
        host="gpu1",
        gpus=(Gpu(0, "NVIDIA GeForce RTX 3090", "GPU-a", "00000000:01:00.0", 24576, "535.54.03"),),
        cuda_version="12.2",
        links=m.links,
        nics=(Nic("mlx5_0", 1, "ACTIVE", 100.0, "InfiniBand", "ib0"),),
        topo=m,
    )
    doc = host_report_to_json(report)
    json.dumps(doc)
    assert {"host", "reachable", "gpus", "cuda_version", "links", "nics", "findings"} <= set(doc)
    assert {
        k: doc["gpus"][0][k]
        for k in ("index", "name", "uuid", "pci_bus_id", "memory_mib", "driver", "mig")
    } == {
        "index": 0,
        "name": "NVIDIA GeForce RTX 3090",
        "uuid": "GPU-a",
        "pci_bus_id": "00000000:01:00.0",
        "memory_mib": 24576,
        "driver": "535.54.03",
        "mig": False,
    }
    assert doc["links"] == m.links and doc["links"]["GPU0"]["GPU3"] == "NV2"
    assert {
        k: doc["nics"][0][k] for k in ("name", "port", "state", "rate_gbps", "link_layer", "netdev")
    } == {
        "name": "mlx5_0",
        "port": 1,
        "state": "ACTIVE",
        "rate_gbps": 100.0,
        "link_layer": "InfiniBand",
        "netdev": "ib0",
    }
    assert doc["findings"] == [] and doc["cuda_version"] == "12.2" and doc["reachable"] is True
    down = host_report_to_json(HostReport.unreachable("gpu2", "connection refused"))
    assert (
        down["reachable"] is False and down["gpus"] == [] and down["error"] == "connection refused"
    )


def test_cuda_visible_devices_keeps_the_gpus_it_names_as_cuda_reads_it() -> None:
    from dlrun.topo.records import Gpu, MigDevice, visible_subset

    gpus = [Gpu(index=i, name="H100", uuid=f"GPU-{i}aaa-bbbb") for i in range(4)]
    mig = Gpu(index=4, name="A100", uuid="GPU-4aaa-bbbb", mig=True,
              mig_devices=(MigDevice("1g.10gb", 0, "MIG-x1"), MigDevice("1g.10gb", 1, "MIG-x2")))
    every = [*gpus, mig]
    assert visible_subset(every, "2,3") == ("GPU-2aaa-bbbb", "GPU-3aaa-bbbb")
    assert visible_subset(every, "3, GPU-1a") == ("GPU-3aaa-bbbb", "GPU-1aaa-bbbb")  # order kept, prefixes
    assert visible_subset(every, "1,9,2") == ("GPU-1aaa-bbbb",)  # CUDA stops at one it cannot find
    assert visible_subset(every, "1,1") == ("GPU-1aaa-bbbb",)
    assert visible_subset(every, "GPU-") == () and visible_subset(every, "") == () and visible_subset(every, "-1") == ()
    assert visible_subset(every, "MIG-x2,4") == ("MIG-x2", "MIG-x1")
    assert visible_subset(every, "MIG-x") == ()  # not unique: names no device
