"""Findings, suggested environment, the --json document and the rich report, on hosts built from
the real captures."""

from __future__ import annotations

import io
import json
import os
from dataclasses import replace
from typing import Any, TypedDict

import pytest
from rich.console import Console

from dlrun.inventory import Host
from dlrun.render import SocketIface
from dlrun.run.addresses import host_ifaces, interfaces_at
from dlrun.topo.findings import Finding, analyse, exit_code, has_errors, socket_note, suggested_env, topo_document
from dlrun.topo.parse import parse_ibstat, parse_sysfs_ib, parse_topo_matrix
from dlrun.topo.probe import parse_probe_output
from dlrun.topo.records import (
    Gpu,
    HostReport,
    MigDevice,
    NetInterface,
    Nic,
    attach_nic_affinity,
)
from dlrun.topo.report import hostlist, render_topo

from support.topo_fixtures import FIXTURES, fixture, sysfs_tree


def host(
    name: str,
    topo: str | None = None,
    *,
    model: str = "NVIDIA H100 80GB HBM3",
    gpus: int | None = None,
    nics: tuple[Nic, ...] = (),
    sysfs: str | None = None,
    ibstat: str | None = None,
    **facts: Any,
) -> HostReport:
    """A reachable host whose matrix and NICs come from captures; GPUs follow the matrix."""
    m = parse_topo_matrix(fixture(f"topo-m/{topo}")) if topo else parse_topo_matrix("")
    count = len(m.gpus) if gpus is None else gpus
    gpu_list = tuple(Gpu(i, model, f"GPU-{name}-{i}", driver="535.161.08") for i in range(count))
    if sysfs:
        nics = parse_sysfs_ib(sysfs_tree(f"sysfs-ib/{sysfs}"))
    if ibstat:
        nics = parse_ibstat(fixture(f"ibstat/{ibstat}"))
    base = HostReport(
        host=name,
        gpus=gpu_list,
        cuda_version="12.2",
        links=m.links,
        nics=attach_nic_affinity(nics, m, gpu_list),
        python="3.11.7",
        tensorflow="2.21.0",
        topo=m,
        interfaces=(NetInterface("lo", ("127.0.0.1",)), NetInterface("eth0", ("10.0.0.1",), True)),
    )
    return replace(base, **facts)


DGX1 = "dgx1-v100-hybrid-cube-mesh-nv1-nv2-4nic-raw-tabs.txt"  # NV1/NV2 mesh, each NIC at PIX to 2 GPUs
ASUS = "asus-esc8000a-4x-rtx6000ada-4nic-cx7-node-sys-gpu-numa-id.txt"  # PCIe only, NICs at NODE/SYS
PUGET = "puget-threadripper-2gpu-phb-2nic-pix.txt"  # 2 GPUs at PHB, NICs at NODE
ONE_GPU = "h100-80gb-hbm3-vm-single-gpu-raw-tabs-drv580.txt"


def messages(findings: tuple[Finding, ...], severity: str | None = None) -> list[str]:
    return [f.message for f in findings if severity is None or f.severity == severity]


def test_identical_healthy_hosts_have_no_findings() -> None:
    nics = tuple(Nic(f"mlx5_{i}", 1, "ACTIVE", 200.0, "InfiniBand") for i in range(4))
    reports = [host(f"n{i}", ONE_GPU, nics=nics) for i in range(2)]
    findings = analyse(reports, {"n0": 1, "n1": 1})
    assert findings == ()
    assert exit_code(findings) == 0


def test_unreachable_host_is_an_error() -> None:
    reports = [host("a", DGX1), HostReport.unreachable("b", "connection refused")]
    findings = analyse(reports)
    assert findings[0] == Finding("error", "unreachable: connection refused", "b")
    assert has_errors(findings) and exit_code(findings) == 1
    failed = analyse([HostReport("c", error="the probe printed no JSON document (empty output)")])
    assert failed[0].severity == "error" and failed[0].message.startswith("probe failed:")


def test_gpu_count_model_and_versions_differ() -> None:
    a = host("a", DGX1)
    b = host(
        "b",
        PUGET,
        model="NVIDIA GeForce RTX 3090",
        cuda_version="12.4",
        python="3.10.12",
        tensorflow=None,
    )
    b = replace(b, gpus=tuple(replace(g, driver="550.54.14") for g in b.gpus))
    found = analyse([a, b])
    warnings = messages(found, "warning")
    assert "GPU counts differ across hosts: 8 on a; 2 on b" in warnings
    assert (
        "GPU models differ across hosts: NVIDIA H100 80GB HBM3 on a; NVIDIA GeForce RTX 3090 on b"
        in warnings
    )
    assert "NVIDIA driver versions differ across hosts: 535.161.08 on a; 550.54.14 on b" in warnings
    assert "CUDA versions differ across hosts: 12.2 on a; 12.4 on b" in warnings
    assert "Python versions differ across hosts: 3.11 on a; 3.10 on b" in warnings
    assert "TensorFlow versions differ across hosts: 2.21.0 on a; not installed on b" in warnings
    assert not has_errors(found)


def test_torch_cuda_build_and_nccl_differences_warn_and_stop_a_torch_job() -> None:
    a = host("a", ONE_GPU, torch="2.11.0+cu130", torch_cuda="13.0", nccl="2.28.9")
    b = host("b", ONE_GPU, torch="2.10.0+cu128", torch_cuda="12.8", nccl="2.27.3")
    for torch_job, severity in ((False, "warning"), (True, "error")):
        found = messages(analyse([a, b], torch_job=torch_job), severity)
        assert "torch versions differ across hosts: 2.11.0+cu130 on a; 2.10.0+cu128 on b" in found
        assert "torch CUDA builds differ across hosts: 13.0 on a; 12.8 on b" in found
        assert "NCCL versions differ across hosts: 2.28.9 on a; 2.27.3 on b" in found
    assert not analyse([a, replace(a, host="c")], torch_job=True)


def test_python_patch_levels_are_only_info() -> None:
    found = analyse([host("a", ONE_GPU), host("b", ONE_GPU, python="3.11.2")])
    assert messages(found, "info") == [
        "Python patch levels differ across hosts: 3.11.7 on a; 3.11.2 on b"
    ]


def test_ports_down_and_slower_than_peers() -> None:
    down = host("down", DGX1, ibstat="gpud-h100-some-ports-down.txt")
    found = analyse([down])
    (msg,) = [m for m in messages(found, "warning") if "not ACTIVE" in m]
    assert "mlx5_2 port 1 DOWN (Disabled)" in msg and "mlx5_7" in msg and "mlx5_8" in msg
    slow_nics = tuple(
        replace(n, rate_gbps=200.0) if n.name == "mlx5_9" else n
        for n in parse_sysfs_ib(sysfs_tree("sysfs-ib/gpud-h100-testdata"))
    )
    fast = host("fast", DGX1, sysfs="gpud-h100-testdata")
    slow = host("slow", DGX1, nics=slow_nics)
    found = analyse([fast, slow])
    slower = [f for f in found if "slower than their peers" in f.message]
    assert slower == [
        Finding(
            "warning",
            "RDMA port(s) slower than their peers (InfiniBand MT4129 at 400 Gb/s): "
            "mlx5_9 port 1 at 200 Gb/s",
            "slow",
        )
    ]
    # The 200 Gb/s BlueField bond (Ethernet, MT41692) is not compared with the 400 Gb/s IB ports.
    assert not [f for f in analyse([fast]) if "slower" in f.message]


def test_gpu_pairs_without_p2p() -> None:
    phb = analyse([host("ws", PUGET)])
    assert [(f.severity, f.host) for f in phb if "P2P" in f.message] == [("warning", "ws")]
    assert "GPU0-GPU1 (PHB)" in phb[0].message
    # DGX-1 hybrid cube mesh: SYS pairs, but every GPU reaches the others over NVLink: info.
    dgx = [f for f in analyse([host("dgx", DGX1)]) if "P2P" in f.message]
    assert [f.severity for f in dgx] == ["info"] and "12 GPU pair(s)" in dgx[0].message
    soc = [
        f
        for f in analyse([host("k40", "k40m-4gpu-2socket-mlx4-soc-legacy-tabs.txt")])
        if "P2P" in f.message
    ]
    assert soc[0].severity == "warning" and "GPU0-GPU2 (SOC)" in soc[0].message
    assert not [f for f in analyse([host("h100", ONE_GPU)]) if "P2P" in f.message]


def test_gpu_without_a_close_nic() -> None:
    single = [f for f in analyse([host("asus", ASUS)]) if "no NIC" in f.message]
    assert single[0].severity == "info"  # one host: inter-node traffic does not matter
    assert "4 GPU(s)" in single[0].message and "GPU0 (best NODE)" in single[0].message
    two = [f for f in analyse([host("asus", ASUS), host("asus2", ASUS)]) if "no NIC" in f.message]
    assert [f.severity for f in two] == ["warning", "warning"]
    assert not [f for f in analyse([host("dgx", DGX1)]) if "no NIC" in f.message]
    # No NIC in the matrix at all: nothing to say.
    assert not [f for f in analyse([host("h100", ONE_GPU)]) if "NIC" in f.message]


def test_only_active_nics_count_for_gpu_nic_affinity() -> None:
    nics = tuple(Nic(f"mlx5_{i}", 1, "ACTIVE" if i else "DOWN", 100.0, "InfiniBand") for i in range(4))
    found = [f for f in analyse([host("dgx", DGX1, nics=nics)]) if "no active NIC" in f.message]
    assert found and "GPU0 (best PHB)" in found[0].message and "GPU4" not in found[0].message


def test_slots_greater_than_gpus() -> None:
    reports = [host("a", PUGET), host("cpu", None, gpus=0)]
    found = analyse(reports, {"a": 4, "cpu": 16})
    errors = [f for f in found if f.severity == "error"]
    assert errors == [
        Finding("error", "4 slots but only 2 GPUs: ranks would have to share a GPU", "a")
    ]
    assert not [f for f in analyse(reports, {"a": 2}) if f.severity == "error"]
    mig_gpu = Gpu(
        0,
        "NVIDIA H100 80GB HBM3",
        mig=True,
        mig_devices=tuple(MigDevice("1g.10gb", i, f"MIG-{i}") for i in range(4)),
    )
    mig = replace(host("m", None, gpus=0), gpus=(mig_gpu,))
    assert not has_errors(analyse([mig], {"m": 4}))
    assert has_errors(analyse([mig], {"m": 5}))
    assert any("MIG is enabled on GPU0 (4 MIG devices)" in m for m in messages(analyse([mig])))


def test_timed_out_tool_is_a_warning() -> None:
    r = host("a", None, gpus=0, problems=("nvidia-smi topo -m: timed out after 30 s",))
    assert messages(analyse([r]), "warning") == ["nvidia-smi topo -m: timed out after 30 s"]


def test_suggested_env_from_active_hcas_and_launchs_interfaces() -> None:
    a = host("a", DGX1, sysfs="gpud-h100-testdata")
    b = host("b", DGX1, sysfs="gpud-h100-testdata")
    hcas = {"NCCL_IB_HCA": "=mlx5_0:1,mlx5_1:1,mlx5_4:1,mlx5_5:1,mlx5_6:1,mlx5_7:1,mlx5_8:1,mlx5_9:1"}
    assert suggested_env([a, b]) == hcas  # launch's interfaces not known: none suggested
    found = {"a": SocketIface("eth0", named=False), "b": SocketIface("eth0", named=False)}
    assert suggested_env([a, b], found) == {**hcas, "GLOO_SOCKET_IFNAME": "eth0"}  # NCCL: its own choice
    # RoCE only: the 400 Gb/s back-end ports, not the 100 Gb/s front-end ones.
    roce = suggested_env([host("r", None, gpus=0, ibstat="gpud-h100-all-active.txt")])
    assert (
        roce["NCCL_IB_HCA"]
        == "=mlx5_0:1,mlx5_3:1,mlx5_4:1,mlx5_5:1,mlx5_6:1,mlx5_9:1,mlx5_10:1,mlx5_11:1"
    )
    mixed = suggested_env([host("x", None, gpus=0, ibstat="gpud-a100-8x-hdr200-all-active.txt")])
    assert mixed["NCCL_IB_HCA"] == "=" + ",".join(
        f"mlx5_{i}:1" for i in range(1, 9)
    )  # IB, not the Ethernet mlx5_0
    down = host("d", None, gpus=0, ibstat="gpud-h100-some-ports-down.txt")
    assert "mlx5_2:1" not in suggested_env([down])["NCCL_IB_HCA"]
    assert "NCCL_IB_HCA" not in suggested_env([host("none", None, gpus=0)])
    assert suggested_env([HostReport.unreachable("u", "timeout")]) == {}


def test_topo_suggests_and_says_the_interfaces_launch_gives_each_host() -> None:
    def with_iface(name: str, iface: str, address: str) -> HostReport:
        return host(name, None, gpus=0, interfaces=(
            NetInterface("lo", ("127.0.0.1",)), NetInterface("docker0", ("172.17.0.1",)),
            NetInterface("eth0", ("192.0.2.9",), True),  # the default route: not where dlrun reaches the host
            NetInterface(iface, (address,))))

    reports = [with_iface("a", "enp1s0f0", "10.0.0.2"), with_iface("b", "enp65s0f0", "10.0.0.3")]
    hosts = [Host(address="a", name="a"), Host(address="b", name="b")]
    reached = {"a": "10.0.0.2", "b": "10.0.0.3"}
    ifaces = host_ifaces(hosts, reached, None, interfaces_at(reports, reached))
    assert {h: i.name for h, i in ifaces.items()} == {"a": "enp1s0f0", "b": "enp65s0f0"}
    assert suggested_env(reports, ifaces) == {}  # names differ: no one export fits, and never eth0
    note = socket_note(reports, ifaces)
    assert "sets each host's GLOO_SOCKET_IFNAME itself (enp1s0f0 on a; enp65s0f0 on b)" in note
    assert "NCCL picks its own" in note
    same = host_ifaces(hosts, reached, None, {"a": "bond0", "b": "bond0"})
    assert suggested_env(reports, same) == {"GLOO_SOCKET_IFNAME": "bond0"}
    assert "sets GLOO_SOCKET_IFNAME=bond0 itself on every host" in socket_note(reports, same)
    named = host_ifaces([Host(address="a", name="a", iface="ib0"), Host(address="b", name="b", iface="ib0")],
                        reached, None, {})
    assert suggested_env(reports, named) == {"GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "ib0"}
    assert "NCCL uses the same" in socket_note(reports, named)
    behind_nat = host_ifaces(hosts, reached, None, {"a": "enp1s0f0"})
    assert suggested_env(reports, behind_nat) == {}
    note = socket_note(reports, behind_nat)
    assert "GLOO_SOCKET_IFNAME=enp1s0f0 itself on a:" in note and "No interface of b holds the address" in note
    alone = socket_note(reports, None)  # dlrun topo without --hosts: no address known yet
    assert "the interface holding the address it reaches the host at" in alone and "--hosts" in alone
    local = host_ifaces([Host(address="localhost", name="localhost")], {"localhost": "127.0.0.1"}, None, {})
    assert suggested_env([with_iface("localhost", "x", "1.2.3.4")], local) == {
        "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}


def test_topo_document_shape() -> None:
    reports = [
        host("a", DGX1, sysfs="gpud-h100-testdata"),
        HostReport.unreachable("b", "no route to host"),
    ]
    findings = analyse(reports, {"a": 8})
    doc = topo_document(reports, findings)
    json.dumps(doc)
    assert set(doc) >= {"hosts", "findings"}
    a, b = doc["hosts"]
    assert a["host"] == "a" and a["reachable"] is True and len(a["gpus"]) == 8
    assert a["links"]["GPU2"]["mlx5_1"] == "PIX" and a["links"]["mlx5_1"]["GPU0"] == "PHB"
    nic = next(n for n in a["nics"] if n["name"] == "mlx5_1")
    assert {k: nic[k] for k in ("name", "port", "state", "rate_gbps", "link_layer", "netdev")} == {
        "name": "mlx5_1",
        "port": 1,
        "state": "ACTIVE",
        "rate_gbps": 400.0,
        "link_layer": "InfiniBand",
        "netdev": None,
    }
    assert b["reachable"] is False
    assert b["findings"] == [{"severity": "error", "message": "unreachable: no route to host"}]
    assert {"severity": "error", "message": "unreachable: no route to host", "host": "b"} in doc[
        "findings"
    ]
    assert all(set(f) == {"severity", "message"} for h in doc["hosts"] for f in h["findings"])
    assert doc["env"]["NCCL_IB_HCA"].startswith("=mlx5_0:1")


@pytest.mark.parametrize("topo", [DGX1, ASUS, "k40m-4gpu-2socket-mlx4-soc-legacy-tabs.txt", None])
def test_render_topo(topo: str | None) -> None:
    reports = [
        host("a", topo, sysfs="gpud-h100-testdata", os="Ubuntu 22.04.4 LTS"),
        HostReport.unreachable("b", "connection refused"),
    ]
    findings = analyse(reports, {"a": 99})
    renderable = render_topo(reports, findings, suggested_env(reports))
    console = Console(width=240, color_system=None, force_terminal=False, record=True)
    console.print(renderable)
    out = console.export_text()
    assert "unreachable: connection refused" in out
    assert "Findings" in out
    assert ("99 slots" in out) == (topo is not None)  # no GPUs: slots are not judged
    assert "export NCCL_IB_HCA==mlx5_0:1" in out
    assert "mlx5_bond_0" in out and "Ubuntu 22.04.4 LTS" in out
    if topo == DGX1:
        assert "NV2" in out and "GPU2, GPU3 PIX" in out  # mlx5_1's nearest GPUs
    if topo and topo.startswith("k40m"):
        assert "SOC" in out


def test_host_names_that_look_like_markup_render_as_written() -> None:
    reports = [HostReport.unreachable("a[/]b", "no route [/] to host")]
    console = Console(width=200, color_system=None, record=True)
    console.print(render_topo(reports, analyse(reports), {}))
    out = console.export_text()
    assert "a[/]b" in out and "no route [/] to host" in out


def test_render_colors_link_classes() -> None:
    reports = [host("a", DGX1)]
    console = Console(width=200, color_system="truecolor", force_terminal=True, record=True)
    console.print(render_topo(reports, analyse(reports), {}))
    styled = console.export_text(styles=True)
    assert "\x1b[" in styled  # cells carry their class colour


def test_cuda_devices_and_mig_without_instances() -> None:
    plain = host("p", PUGET)
    assert plain.cuda_devices == ("GPU-p-0", "GPU-p-1") and plain.gpu_slots == 2
    migs = tuple(MigDevice("3g.40gb", i, f"MIG-{i}") for i in range(2))
    mixed = replace(
        plain,
        gpus=(
            replace(plain.gpus[0], mig=True, mig_devices=migs),
            replace(plain.gpus[1], mig=True),  # MIG on, no instance
        ),
    )
    assert mixed.cuda_devices == ("MIG-0", "MIG-1") and mixed.gpu_slots == 2
    (warning,) = [f for f in analyse([mixed]) if "no MIG device" in f.message]
    assert warning.severity == "warning" and "GPU1" in warning.message
    assert replace(plain, gpus=(Gpu(3, "T4"),)).cuda_devices == ("3",)


# ----------------------------------------------------------------------------- the report at 80 and 120 columns

REPORTS = FIXTURES / "report"
UPDATE = os.environ.get("DLRUN_UPDATE_REPORTS") == "1"  # rewrite the expected reports (then review the diff)


class Captures(TypedDict, total=False):
    """Which captures (under tests/fixtures/topology) a host's tools print: ``probe_doc``'s keywords."""

    query: str
    topo: str
    listing: str
    header: str
    ibstat: str


def probe_doc(
    name: str,
    *,
    query: str | None = None,
    topo: str | None = None,
    listing: str | None = None,
    header: str | None = None,
    ibstat: str | None = None,
    replace_text: tuple[str, str] = ("", ""),
) -> str:
    """What the probe prints on a host whose tools print these captures (a probe document)."""

    def command(rel: str | None, argv: list[str]) -> dict[str, object]:
        if rel is None:
            return {"argv": argv, "missing": True}
        text = fixture(rel).replace(*replace_text) if replace_text[0] else fixture(rel)
        return {"argv": argv, "path": f"/usr/bin/{argv[0]}", "rc": 0, "stdout": text, "stderr": ""}

    doc = {
        "version": 1,
        "hostname": name,
        "python": "3.12.3",
        "cpu_count": 16,
        "numa_nodes": [0],
        "os_release": 'PRETTY_NAME="Ubuntu 24.04.3 LTS"\n',
        "sysfs": {},
        "proc_net_route": "Iface\tDestination\tGateway\tFlags\tRefCnt\tUse\tMetric\tMask\n"
        "eth0\t00000000\t0100A8C0\t0003\t0\t0\t0\t00000000\n",
        "commands": {
            "query_gpu": command(query, ["nvidia-smi", "--query-gpu=..."]),
            "topo": command(topo, ["nvidia-smi", "topo", "-m"]),
            "list": command(listing, ["nvidia-smi", "-L"]),
            "header": command(header, ["nvidia-smi"]),
            "ip_addr": {"argv": ["ip"], "rc": 0, "stdout": "1: lo    inet 127.0.0.1/8 scope host lo\n"
                        "2: eth0    inet 192.168.0.7/24 scope global eth0\n"},
            "ibstat": command(ibstat, ["ibstat"]),
        },
    }
    return json.dumps(doc)


VM: Captures = {  # the project's own capture: one H100 in a VM, driver 580.159.04
    "query": "query-gpu-csv/h100-80gb-hbm3-vm-probe-fields-drv580.csv.txt",
    "topo": "topo-m/h100-80gb-hbm3-vm-single-gpu-raw-tabs-drv580.txt",
    "listing": "smi-L/h100-80gb-hbm3-vm-no-mig-drv580.txt",
    "header": "smi-header/h100-80gb-hbm3-vm-drv580.txt",
}


def nv18_twelve_nics() -> str:
    """An 8-GPU NVSwitch board with 12 NICs, written in nvidia-smi's raw format (tabs, NIC legend).

    Constructed, not captured: no permissively licensed capture of such a board was found (see
    tests/fixtures/topology/SOURCES.md). Its layout is a DGX H100's: GPUs 0-3 and NICs 0-5 on
    NUMA node 0, the rest on node 1; each GPU has its own NIC at PIX; NICs 1+2 and 7+8 are the
    two ports of a front-end card."""
    own = [0, 3, 4, 5, 6, 9, 10, 11]  # each GPU's compute NIC
    node = [0] * 4 + [1] * 4
    nic_node = [0] * 6 + [1] * 6
    devices = [f"GPU{i}" for i in range(8)] + [f"NIC{i}" for i in range(12)]

    def cell(a: str, b: str) -> str:
        if a == b:
            return " X "
        ka, ia = a[:3], int(a[3:])
        kb, ib = b[:3], int(b[3:])
        if ka == kb == "GPU":
            return "NV18"
        if ka == kb == "NIC":
            if {ia, ib} in ({1, 2}, {7, 8}):
                return "PIX"
            return "NODE" if nic_node[ia] == nic_node[ib] else "SYS"
        gpu, nic = (ia, ib) if ka == "GPU" else (ib, ia)
        if own[gpu] == nic:
            return "PIX"
        return "NODE" if node[gpu] == nic_node[nic] else "SYS"

    cpus = ["0-55,112-167", "56-111,168-223"]
    lines = ["\t" + "\t".join(devices) + "\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID"]
    for d in devices:
        row = d + "\t" + "\t".join(cell(d, e) for e in devices)
        if d.startswith("GPU"):
            row += f"\t{cpus[node[int(d[3:])]]}\t{node[int(d[3:])]}\t\tN/A"
        lines.append(row)
    lines += ["", "Legend:", "", "  X    = Self", "", "NIC Legend:", ""]
    lines += [f"  NIC{i}: mlx5_{i}" for i in range(12)]
    return "\n".join(lines) + "\n"


def nv18_host(name: str) -> HostReport:
    m = parse_topo_matrix(nv18_twelve_nics())
    gpus = tuple(
        Gpu(i, "NVIDIA H100 80GB HBM3", f"GPU-{name}-{i}", f"00000000:{0x18 + 0x10 * i:02X}:00.0", 81559,
            "535.161.08", "9.0", False, numa_node=i // 4)
        for i in range(8)
    )
    nics = attach_nic_affinity(parse_ibstat(fixture("ibstat/gpud-h100-all-active.txt")), m, gpus)
    return HostReport(host=name, gpus=gpus, cuda_version="12.2", links=m.links, nics=nics, cpu_count=224,
                      numa_nodes=2, os="Ubuntu 22.04.4 LTS", python="3.11.7", driver_version="535.161.08",
                      topo=m, interfaces=(NetInterface("lo", ("127.0.0.1",)),
                                          NetInterface("eth0", ("10.0.0.1",), True)))


def rendered(reports: list[HostReport], width: int) -> str:
    """``dlrun topo --hosts``'s report, each host reached at the address of its default route."""
    addresses = {r.host: i.ipv4[0] for r in reports for i in r.interfaces if i.default_route and i.ipv4}
    hosts = [Host(address=addresses.get(r.host, r.host), name=r.host) for r in reports]
    ifaces = host_ifaces(hosts, addresses, None, interfaces_at(reports, addresses))
    console = Console(width=width, color_system=None, record=True, file=io.StringIO())
    console.print(render_topo(reports, analyse(reports), suggested_env(reports, ifaces), socket_note(reports, ifaces)))
    return console.export_text()


def expect_report(name: str, text: str) -> None:
    path = REPORTS / f"{name}.txt"
    if UPDATE:
        path.parent.mkdir(exist_ok=True)
        path.write_text(text, encoding="utf-8")
    assert text == path.read_text(encoding="utf-8"), f"{name}: run with DLRUN_UPDATE_REPORTS=1 and review the diff"


def link_codes(report: HostReport) -> set[str]:
    return {c for row in report.topo.cells.values() for c in row.values()}


CASES = {
    "nv18-12nic": lambda: [nv18_host("gpu1")],
    "dgx1-mesh": lambda: [host("dgx1", DGX1, model="Tesla V100-SXM2-16GB",
                               ibstat="gpud-a100-8x-hdr200-all-active.txt")],
    "one-gpu": lambda: [parse_probe_output("vm1", probe_doc("vm1", **VM))],
}


@pytest.mark.parametrize("width", [80, 120])
@pytest.mark.parametrize("case", list(CASES))
def test_report_at_80_and_120_columns(case: str, width: int) -> None:
    reports = CASES[case]()
    text = rendered(reports, width)
    expect_report(f"{case}-{width}", text)
    assert "…" not in text and "..." not in text
    assert max(len(line) for line in text.splitlines()) <= width
    tokens = set(text.split())
    for code in link_codes(reports[0]):
        assert code in tokens, f"{code} is not shown whole"
    for label, name in (reports[0].topo.nic_legend.items() or {}):
        assert f"{label} = {name}" in text


def test_nv18_summary_and_the_matrix_split_at_80_columns() -> None:
    (gpu1,) = CASES["nv18-12nic"]()
    narrow, wide = rendered([gpu1], 80), rendered([gpu1], 120)
    summary = ("8× H100 80GB HBM3 · NVLink all-to-all (NV18) · 12 NICs, 8 at PIX, one per GPU · "
               "GPUDirect RDMA: yes")
    assert " ".join(narrow.split()).count(summary) == 1 and " ".join(wide.split()).count(summary) == 1
    assert "GPU↔GPU links" in narrow and "GPU↔NIC links" in narrow and "NIC11 = mlx5_11" in narrow
    assert "uuid" not in narrow  # the UUID column does not fit 80 columns: --json has it
    assert "Links (nvidia-smi topo -m)" in rendered([gpu1], 200)  # whole where it fits


def test_identical_hosts_share_a_section_and_the_odd_one_says_how_it_differs() -> None:
    reports = [parse_probe_output(n, probe_doc(n, **VM)) for n in ("h1", "h2")]
    reports.append(parse_probe_output("h3", probe_doc("h3", **VM, replace_text=("580.159.04", "580.65.06"))))
    text = rendered(reports, 120)
    headers = [line.split()[0] for line in text.splitlines() if "────" in line and not line.startswith(" ")]
    assert headers == ["h1,h2", "h3"]
    assert "differs from h1,h2: driver 580.65.06 (not 580.159.04)" in text
    assert "NVIDIA driver versions differ across hosts: 580.159.04 on h1, h2; 580.65.06 on h3" in text
    doc = topo_document(reports, analyse(reports), suggested_env(reports))
    assert [h["host"] for h in doc["hosts"]] == ["h1", "h2", "h3"]  # --json: one entry per host


@pytest.mark.parametrize("width", [80, 120])
def test_sixty_four_identical_hosts_fit_one_screen(width: int) -> None:
    reports = [host(f"h{i}", DGX1, model="Tesla V100-SXM2-16GB", ibstat="gpud-a100-8x-hdr200-all-active.txt")
               for i in range(1, 65)]
    text = rendered(reports, width)
    assert len(text.splitlines()) < 80, text
    assert text.splitlines()[0].startswith("h[1-64] ")
    assert "h2 " not in text and "h64" not in text


def test_a_finding_on_two_hosts_is_printed_once_naming_both() -> None:
    reports = [host(n, ASUS, ibstat="gpud-h100-some-ports-down.txt") for n in ("h1", "h2")]
    findings = analyse(reports)
    down = [f for f in findings if "not ACTIVE" in f.message]
    assert [f.host for f in down] == ["h1", "h2"] and down[0].message == down[1].message
    text = rendered(reports, 120)
    assert text.count("RDMA port(s) not ACTIVE") == 1
    (row,) = [line for line in text.splitlines() if "RDMA port(s) not ACTIVE" in line]
    assert row.split()[:2] == ["warning", "h1,h2"]
    assert exit_code(findings) == 0


def test_hostlist_form() -> None:
    assert hostlist([f"node{i:02d}" for i in range(1, 65)]) == "node[01-64]"
    assert hostlist(["h1", "h2"]) == "h1,h2"
    assert hostlist(["h1", "h2", "h3", "h5", "db", "h9"]) == "h[1-3,5,9],db"
    assert hostlist(["n8", "n9", "n10", "n11"]) == "n[8-11]"
    assert hostlist(["a", "a"]) == "a"
