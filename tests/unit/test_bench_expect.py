"""The bench's pure parts: expected values from real captures, the rounds, the verdict that
names a host or a link, the findings and the 80-column table."""

from __future__ import annotations

import io
import json

from rich.console import Console

from dlrun.topo.bench import (
    BenchResult,
    Measure,
    bench_document,
    fabric_finding,
    findings_of,
    judged,
    link_verdict,
    render_bench,
    retest_pairs,
    ring_round,
    rounds_of,
)
from dlrun.topo.expect import (
    Expected,
    expected_copy,
    expected_gemm,
    expected_host_allreduce,
    expected_memory,
    expected_network_allreduce,
    expected_tcp,
    gpu_model,
    judge,
    nvlinks_per_gpu,
)
from dlrun.topo.parse import parse_ibstat, parse_sysfs_ib, parse_topo_matrix
from dlrun.topo.records import Gpu, HostReport, attach_nic_affinity

from support.topo_fixtures import fixture, sysfs_tree

DGX1 = "topo-m/dgx1-v100-hybrid-cube-mesh-nv1-nv2-4nic-raw-tabs.txt"
ASUS = "topo-m/asus-esc8000a-4x-rtx6000ada-4nic-cx7-node-sys-gpu-numa-id.txt"
PUGET = "topo-m/puget-threadripper-2gpu-phb-2nic-pix.txt"


def captured(topo: str, model: str, ibstat: str | None = None, sysfs: str | None = None) -> HostReport:
    m = parse_topo_matrix(fixture(topo))
    gpus = tuple(Gpu(int(label[3:]), model) for label in m.gpus)
    nics = parse_ibstat(fixture(f"ibstat/{ibstat}")) if ibstat else ()
    if sysfs:
        nics = parse_sysfs_ib(sysfs_tree(f"sysfs-ib/{sysfs}"))
    return HostReport(host="h", gpus=gpus, links=m.links, nics=attach_nic_affinity(nics, m, gpus), topo=m)


def nvswitch(model: str, links: int, gpus: int = 8) -> HostReport:
    """An NVSwitch board: every GPU pair at NV<links> (no such capture is licensed; see
    tests/unit/test_findings.py's nv18_twelve_nics)."""
    labels = [f"GPU{i}" for i in range(gpus)]
    cells = {a: {b: f"NV{links}" for b in labels if b != a} for a in labels}
    return HostReport(host="h", gpus=tuple(Gpu(i, model) for i in range(gpus)), links=cells)


# --------------------------------------------------------------------------------------------
# expected values


def test_gpu_models_by_their_nvidia_smi_names() -> None:
    names = {
        "NVIDIA H100 80GB HBM3": "H100 SXM", "NVIDIA H100 PCIe": "H100 PCIe", "NVIDIA H100 NVL": "H100 NVL",
        "NVIDIA H200": "H200", "NVIDIA A100-SXM4-80GB": "A100 SXM 80GB", "NVIDIA A100 80GB PCIe": "A100 80GB PCIe",
        "NVIDIA A100-PCIE-40GB": "A100 40GB PCIe", "NVIDIA L40S": "L40S", "NVIDIA L40": "L40", "NVIDIA L4": "L4",
        "NVIDIA RTX 6000 Ada Generation": "RTX 6000 Ada", "Tesla V100-SXM2-32GB": "V100",
    }
    for name, model in names.items():
        found = gpu_model(name)
        assert found is not None and found.name == model, name
    assert gpu_model("NVIDIA GeForce RTX 2080 SUPER") is None  # unknown: the peers decide


def test_gpu_peaks_give_gemm_memory_and_copy_expectations() -> None:
    gemm = expected_gemm("NVIDIA H100 80GB HBM3")
    assert gemm is not None and gemm.value == 741.8 and "989" in gemm.basis
    memory = expected_memory("NVIDIA H200")
    assert memory is not None and memory.value == 3840
    assert expected_gemm("Tesla V100-SXM2-32GB") is None  # no bf16 on a V100
    copy = expected_copy("NVIDIA H100 80GB HBM3")
    assert copy is not None and copy.basis == "80% of PCIe Gen5 x16" and 50 < copy.value < 51
    narrow = expected_copy("NVIDIA H100 80GB HBM3", gen=4, width=8)
    assert narrow is not None and narrow.basis == "80% of PCIe Gen4 x8" and 12 < narrow.value < 13


def test_nvlink_generation_times_links_on_an_nvswitch_board_is_the_370_reference() -> None:
    expected = expected_host_allreduce(nvswitch("NVIDIA H100 80GB HBM3", 18))
    assert expected is not None and expected.value == 369 and "18 NVLinks × 25 GB/s" in expected.basis
    a100 = expected_host_allreduce(nvswitch("NVIDIA A100-SXM4-80GB", 12))
    assert a100 is not None and a100.value == 246


def test_dgx1_cube_mesh_counts_each_gpus_links() -> None:
    # each V100 of the hybrid cube mesh has 6 NVLinks (NV1 + NV1 + NV2 + NV2), but some GPU pairs
    # are SYS: no all-NVLink ring is promised, the PCIe Gen3 expectation holds
    report = captured(DGX1, "Tesla V100-SXM2-32GB")
    assert nvlinks_per_gpu(report) is None
    expected = expected_host_allreduce(report)
    assert expected is not None and expected.basis == "80% of PCIe Gen3 x16"


def test_pcie_only_hosts_expect_their_pcie_generation() -> None:
    asus = expected_host_allreduce(captured(ASUS, "NVIDIA RTX 6000 Ada Generation"))
    assert asus is not None and asus.basis == "80% of PCIe Gen4 x16" and 25 < asus.value < 26
    assert expected_host_allreduce(captured(PUGET, "NVIDIA GeForce RTX 2080 SUPER")) is None  # unknown model


def test_network_expectation_from_active_ports() -> None:
    hdr = expected_network_allreduce(captured(DGX1, "NVIDIA A100-SXM4-80GB",
                                              ibstat="gpud-a100-8x-hdr200-all-active.txt"))
    assert hdr is not None and hdr.value == 184.0 and hdr.basis == "92% of 8× 200 Gb/s active ports"  # IB only
    down = expected_network_allreduce(captured(DGX1, "NVIDIA H100 80GB HBM3",
                                               ibstat="gpud-h100-some-ports-down.txt"))
    assert down is not None and down.value == 368.0  # 8 active 400G IB ports; the 40G Ethernet ones are down
    roce = expected_network_allreduce(captured(DGX1, "NVIDIA H100 80GB HBM3", ibstat="gpud-h100-all-active.txt"))
    assert roce is not None and roce.basis == "92% of 8× 400 Gb/s active ports"  # the 100G front end left out
    one = expected_network_allreduce(captured(DGX1, "NVIDIA H100 80GB HBM3", sysfs="gpud-h100-testdata"), 1)
    assert one is not None and one.value == 46.0  # one rank per host: one 400G NIC, the reference 46-48 GB/s
    assert expected_network_allreduce(captured(PUGET, "x")) is None


def test_tcp_expectation_from_the_link_speed() -> None:
    assert expected_tcp(None) is None and expected_tcp(-1) is None  # lo: the kernel does not know
    ten = expected_tcp(10000)
    assert ten is not None and ten.value == 9.0
    fast = expected_tcp(400000)
    assert fast is not None and fast.value == 25.0 and "cap" in fast.basis


def test_judge_against_expected_and_peers() -> None:
    assert judge(38.0, 100.0, [])[0] == "error"
    assert judge(70.0, 100.0, [])[0] == "warning"
    assert judge(95.0, 100.0, [90.0, 100.0]) == (None, "95% of expected")
    assert judge(10.0, None, [50.0, 60.0, 55.0])[0] == "error"
    assert judge(10.0, None, []) == (None, "")


# --------------------------------------------------------------------------------------------
# rounds and verdicts


def test_the_all_reduce_shrinks_on_a_slow_network() -> None:
    from dlrun.topo.bench import allreduce_mib

    assert allreduce_mib(None, 5) == 64 and allreduce_mib(100.0, 5) == 64
    assert allreduce_mib(0.03, 5) == 1  # 30 Mbit/s: the smallest, about 4 s for six steps
    assert 1 < allreduce_mib(1.0, 5) < 64


def test_ring_and_rounds() -> None:
    assert ring_round(["a", "b", "c"]) == [("a", "b"), ("b", "c"), ("c", "a")]
    assert ring_round(["a"]) == []
    assert rounds_of([("a", "b"), ("b", "c"), ("c", "d"), ("a", "c")]) == [[("a", "b"), ("c", "d")],
                                                                          [("b", "c")], [("a", "c")]]


def test_one_slow_host_of_three_is_named_and_no_other() -> None:
    hosts = ["h0", "h1", "h2"]
    ring = [("h0", "h1", 0.03), ("h1", "h2", 0.03), ("h2", "h0", 8.0)]
    verdict = link_verdict(hosts, ring)
    assert verdict.hosts == ("h1",) and verdict.links == () and verdict.reference == 8.0
    again = retest_pairs(hosts, ring, verdict)
    assert sorted(again) == [("h0", "h1"), ("h1", "h2")]
    done = [*ring, ("h1", "h0", 0.02), ("h0", "h1", 0.02), ("h1", "h2", 0.02), ("h2", "h1", 0.02)]
    assert link_verdict(hosts, done).hosts == ("h1",)
    assert retest_pairs(hosts, done, link_verdict(hosts, done)) == []  # nothing new to measure


def test_a_slow_link_between_two_good_hosts_names_the_link() -> None:
    hosts = [f"h{i}" for i in range(6)]
    links = [(a, b, 0.1 if {a, b} == {"h1", "h2"} else 9.0) for a, b in ring_round(hosts)]
    verdict = link_verdict(hosts, links)
    assert verdict.hosts == () and verdict.links == (("h1", "h2"),)
    more = retest_pairs(hosts, links, verdict)
    assert ("h1", "h2") in more and len(more) > 1


def test_one_slow_host_of_sixteen_is_found_by_the_retests() -> None:
    hosts = [f"n{i:02d}" for i in range(16)]

    def measure(a: str, b: str) -> float:
        return 1.0 if "n07" in (a, b) else 40.0

    links = [(a, b, measure(a, b)) for a, b in ring_round(hosts)]
    verdict = link_verdict(hosts, links)
    assert verdict.hosts == ("n07",)
    for _ in range(3):
        pairs = retest_pairs(hosts, links, verdict)
        links += [(a, b, measure(a, b)) for a, b in pairs] + [(b, a, measure(a, b)) for a, b in pairs]
        verdict = link_verdict(hosts, links)
    assert verdict.hosts == ("n07",) and verdict.links == ()


def test_healthy_hosts_name_nobody() -> None:
    hosts = ["a", "b", "c", "d"]
    verdict = link_verdict(hosts, [(a, b, 5.0 + i) for i, (a, b) in enumerate(ring_round(hosts))])
    assert verdict.low == () and verdict.hosts == () and retest_pairs(hosts, [], verdict) == []


def test_two_hosts_blame_the_link_against_the_expected_value() -> None:
    verdict = link_verdict(["a", "b"], [("a", "b", 1.0), ("b", "a", 1.0)], expected=9.0)
    assert verdict.hosts == () and verdict.links == (("a", "b"),)
    assert link_verdict(["a", "b"], [("a", "b", 1.0)]).low == ()  # no peers, no expectation: no verdict


# --------------------------------------------------------------------------------------------
# findings and output


def sample() -> BenchResult:
    gemm = expected_gemm("NVIDIA H100 80GB HBM3")
    measures = judged([
        Measure("compute", "node01", ("node01",), 60.0, "GFLOP/s", "fp32 matmul"),
        Measure("compute", "node02", ("node02",), 61.0, "GFLOP/s", "fp32 matmul"),
        Measure("compute", "node03", ("node03",), 3.0, "GFLOP/s", "fp32 matmul"),
        Measure("gemm", "node01 GPU0", ("node01",), 300.0, "TFLOP/s", "bf16 GEMM", gemm),
        Measure("h2d", "node02 GPU3", ("node02",), 25.0, "GB/s", "pinned H2D",
                expected_copy("NVIDIA H100 80GB HBM3")),
        Measure("allreduce", "all hosts", ("node01", "node02", "node03"), 40.0, "GB/s", "NCCL all-reduce",
                Expected(46.0, "GB/s", "92% of 1× 400 Gb/s active port")),
    ])
    verdict = link_verdict(["node01", "node02", "node03"],
                           [("node01", "node02", 9.0), ("node02", "node03", 0.03), ("node03", "node01", 0.03)])
    tcp = [Measure("tcp", "node02→node03", ("node02", "node03"), 0.03, "Gbit/s", "TCP", None, 9.0, "error",
                   "0% of the reference")]
    findings = findings_of(measures + tcp, {"tcp": verdict})
    return BenchResult("torch-cuda", tuple(measures + tcp), tuple(findings), ("a note",), 58.0)


def test_findings_name_the_slow_host_and_say_what_to_check() -> None:
    result = sample()
    errors = {(f.host, f.message.split(":")[0]) for f in result.findings if f.severity == "error"}
    assert ("node03", "TCP to and from node03 is far below its peers (under 50% of 9 with most partners)") in errors
    assert any(h == "node03" and m.startswith("CPU on node03") for h, m in errors)
    assert any(h == "node01" and m.startswith("GEMM on node01 GPU0") for h, m in errors)
    assert any(h == "node02" and m.startswith("H2D on node02 GPU3") for h, m in errors)
    texts = " ".join(f.message for f in result.findings)
    assert "throttled GPU" in texts and "PCIe width" in texts and "cable" in texts and "CPU limit" in texts
    assert result.exit_code == 1
    assert not any(f.severity == "error" and f.host in ("node01", "node02") and "TCP" in f.message
                   for f in result.findings)


def test_table_reads_at_80_columns_and_json_has_everything() -> None:
    result = sample()
    console = Console(width=80, color_system=None, record=True, file=io.StringIO())
    console.print(render_bench(result))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "node03" in text and "742" in text and "bf16 GEMM" in text
    doc = json.loads(json.dumps(bench_document(result)))
    assert doc["level"] == "torch-cuda" and len(doc["measures"]) == len(result.measures)
    gemm = next(m for m in doc["measures"] if m["kind"] == "gemm")
    assert gemm["expected"]["basis"].startswith("75% of H100 SXM peak") and gemm["severity"] == "error"
    assert doc["findings"] and doc["notes"] == ["a note"]


def test_a_slow_fabric_names_no_host_but_warns() -> None:
    hosts = ["a", "b", "c", "d"]
    links = [(x, y, 4.0) for x, y in ring_round(hosts)]  # every link at 4 of an expected 9 Gbit/s
    verdict = link_verdict(hosts, links, expected=9.0)
    assert verdict.hosts == () and verdict.links == () and verdict.reference == 4.0  # the peers decide
    warning = fabric_finding("tcp", verdict, Expected(9.0, "Gbit/s", "90% of 10 Gb/s link"), len(hosts))
    assert warning is not None and warning.severity == "warning" and warning.host is None
    assert "44%" in warning.message and "MTU" in warning.message
    assert fabric_finding("tcp", verdict, Expected(6.0, "Gbit/s", "x"), len(hosts)) is None


def test_a_low_all_reduce_that_no_pair_explains_is_still_an_error() -> None:
    measure = judged([Measure("allreduce", "all hosts", ("a", "b", "c"), 10.0, "GB/s", "NCCL all-reduce",
                              Expected(46.0, "GB/s", "92% of 1× 400 Gb/s active port"))])[0]
    pairs = link_verdict(["a", "b", "c"], [("a", "b", 11.0), ("b", "c", 10.0), ("a", "c", 10.5)])
    found = findings_of([measure], {"allreduce": pairs})
    assert [f.severity for f in found] == ["error"] and found[0].host is None
    assert "NCCL_IB_HCA" in found[0].message and "22% of expected" in found[0].message


def test_the_bench_listens_where_nccl_and_gloo_would_talk() -> None:
    from dlrun.inventory import Host
    from dlrun.topo.bench import listen_addresses
    from dlrun.topo.records import NetInterface

    def report(name: str, *ifaces: NetInterface) -> HostReport:
        return HostReport(name, interfaces=(NetInterface("lo", ("127.0.0.1",)), *ifaces))

    reports = [report("a", NetInterface("eth0", ("10.0.0.1",), True), NetInterface("ib0", ("192.168.0.1",))),
               report("b", NetInterface("ens5", ("172.31.0.7",), True)),  # reached at its public IP
               report("c", NetInterface("eth0", ("10.0.0.3",), True), NetInterface("ib0", ("192.168.0.3",)))]
    hosts = [Host("10.0.0.1", "a"), Host("54.1.2.3", "b"), Host("10.0.0.3", "c", iface="ib0")]
    reached = {"a": "10.0.0.1", "b": "54.1.2.3", "c": "10.0.0.3"}
    addresses, ifaces = listen_addresses(hosts, reports, reached)
    assert addresses == {"a": "10.0.0.1", "b": "172.31.0.7", "c": "192.168.0.3"}
    assert ifaces == {"a": "eth0", "b": "ens5", "c": "ib0"}
    addresses, ifaces = listen_addresses(hosts, reports, reached, iface="ib0")  # --iface for every host
    assert addresses["a"] == "192.168.0.1" and ifaces["a"] == "ib0"
    # every host on this machine (loopback aliases, as the test clusters): lo, each its own address
    local = [report(n) for n in "xyz"]
    addresses, ifaces = listen_addresses([Host(f"127.0.0.{i}", n) for i, n in enumerate("xyz", 2)], local,
                                         {n: f"127.0.0.{i}" for i, n in enumerate("xyz", 2)})
    assert addresses == {"x": "127.0.0.2", "y": "127.0.0.3", "z": "127.0.0.4"} and set(ifaces.values()) == {"lo"}


def test_the_listen_rule_names_launchs_interfaces() -> None:
    """The bench measures the interface launch gives gloo/NCCL (dlrun.run.addresses.host_ifaces)."""
    from dlrun.inventory import Host
    from dlrun.run.addresses import host_ifaces, interfaces_at
    from dlrun.topo.bench import listen_addresses
    from dlrun.topo.records import NetInterface

    reports = [HostReport(n, interfaces=(NetInterface("lo", ("127.0.0.1",)), NetInterface("eth0", (a,), True),
                                         NetInterface("ib0", (f"192.168.0.{i}",))))
               for i, (n, a) in enumerate([("a", "10.0.0.1"), ("b", "10.0.0.2"), ("c", "10.0.0.3")], 1)]
    hosts = [Host("10.0.0.1", "a"), Host("10.0.0.2", "b", iface="ib0"), Host("10.0.0.3", "c")]
    reached = {"a": "10.0.0.1", "b": "10.0.0.2", "c": "10.0.0.3"}
    for iface in (None, "ib0"):
        launch = host_ifaces(hosts, reached, iface, interfaces_at(reports, reached))
        _, mine = listen_addresses(hosts, reports, reached, iface)
        assert mine == {name: i.name for name, i in launch.items()}
