"""What a host should measure, from its topology: the expected value beside every bench number.

Pure functions over :class:`~dlrun.topo.records.HostReport` records. Each rule returns an
:class:`Expected` (a number, its unit and the basis it came from, e.g. ``4× 400 Gb/s active
ports``) or None when nothing is known; then the bench compares with the median of the peers
(:func:`peer_median`). The tables hold published peaks; the efficiency factors turn a peak into
what a healthy machine reaches (numbers and sources: ``docs/bench.md``).
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from dlrun.topo.records import Gpu, HostReport, link_class


@dataclass(frozen=True)
class GpuModel:
    """Published peaks of one GPU model: dense bf16 tensor TFLOP/s (None: no bf16), memory
    GB/s, the PCIe generation of its host link, NVLink GB/s per link and direction, and how
    many NVLinks one GPU has (0: none)."""

    name: str
    bf16_tflops: float | None
    memory_gbps: float
    pcie_gen: int
    nvlink_gbps_per_link: float = 0.0
    nvlinks: int = 0


#: Most specific pattern first; matched against the lower-cased ``nvidia-smi`` name.
GPU_MODELS: tuple[tuple[str, GpuModel], ...] = (
    (r"gh200", GpuModel("GH200", 989.0, 4000.0, 5, 25.0, 18)),
    (r"h200", GpuModel("H200", 989.0, 4800.0, 5, 25.0, 18)),
    (r"h100 nvl", GpuModel("H100 NVL", 835.0, 3900.0, 5, 25.0, 12)),
    (r"h100 pcie", GpuModel("H100 PCIe", 756.0, 2000.0, 5)),
    (r"h100|h800", GpuModel("H100 SXM", 989.0, 3350.0, 5, 25.0, 18)),
    (r"b200", GpuModel("B200", 2250.0, 8000.0, 6, 50.0, 18)),
    (r"a100.*pcie.*80|a100 80gb pcie", GpuModel("A100 80GB PCIe", 312.0, 1935.0, 4, 25.0, 12)),
    (r"a100.*pcie", GpuModel("A100 40GB PCIe", 312.0, 1555.0, 4, 25.0, 12)),
    (r"a100.*80", GpuModel("A100 SXM 80GB", 312.0, 2039.0, 4, 25.0, 12)),
    (r"a100", GpuModel("A100 SXM 40GB", 312.0, 1555.0, 4, 25.0, 12)),
    (r"l40s", GpuModel("L40S", 362.0, 864.0, 4)),
    (r"\bl40\b", GpuModel("L40", 181.0, 864.0, 4)),
    (r"\bl4\b", GpuModel("L4", 121.0, 300.0, 4)),
    (r"rtx 6000 ada", GpuModel("RTX 6000 Ada", 364.0, 960.0, 4)),
    (r"\ba40\b", GpuModel("A40", 150.0, 696.0, 4)),
    (r"\ba30\b", GpuModel("A30", 165.0, 933.0, 4, 25.0, 4)),
    (r"\ba10\b", GpuModel("A10", 125.0, 600.0, 4)),
    (r"v100", GpuModel("V100", None, 900.0, 3, 25.0, 6)),
    (r"k40", GpuModel("K40", None, 288.0, 3)),
)

#: GB/s per lane and direction after line coding, by PCIe generation.
PCIE_GBPS_PER_LANE = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}

#: What a healthy machine reaches of a peak.
GEMM_EFFICIENCY = 0.75  # large bf16 GEMM vs the dense tensor peak
MEMORY_EFFICIENCY = 0.8  # device-to-device copy vs the memory peak
PCIE_EFFICIENCY = 0.8  # pinned host<->device copy vs the link
NVLINK_RING_EFFICIENCY = 0.82  # ring all-reduce bus bandwidth vs one GPU's NVLink, one direction
NIC_EFFICIENCY = 0.92  # all-reduce bus bandwidth vs the ports' line rate (400G → 46 GB/s)
TCP_STREAM_CAP_GBITS = 25.0  # a few TCP streams rarely carry more, whatever the link

#: A measurement below this share of its expected value (or of its peers' median) is an error.
FAR_BELOW = 0.5
#: Below this share it is a warning.
BELOW = 0.75


@dataclass(frozen=True)
class Expected:
    """An expected value, its unit and the basis it came from (shown beside the number)."""

    value: float
    unit: str
    basis: str


def gpu_model(gpu: Gpu | str) -> GpuModel | None:
    """The table entry for a GPU (or its ``nvidia-smi`` name), None when unknown."""
    name = (gpu if isinstance(gpu, str) else gpu.name).lower()
    for pattern, model in GPU_MODELS:
        if re.search(pattern, name):
            return model
    return None


def expected_gemm(gpu: Gpu | str) -> Expected | None:
    """bf16 GEMM TFLOP/s one GPU should reach."""
    model = gpu_model(gpu)
    if model is None or model.bf16_tflops is None:
        return None
    return Expected(round(model.bf16_tflops * GEMM_EFFICIENCY, 1), "TFLOP/s",
                    f"{GEMM_EFFICIENCY:.0%} of {model.name} peak {model.bf16_tflops:g}")


def expected_memory(gpu: Gpu | str) -> Expected | None:
    """Device memory copy GB/s one GPU should reach (read + write counted)."""
    model = gpu_model(gpu)
    if model is None:
        return None
    return Expected(round(model.memory_gbps * MEMORY_EFFICIENCY), "GB/s",
                    f"{MEMORY_EFFICIENCY:.0%} of {model.name} peak {model.memory_gbps:g}")


def pcie_gbps(gen: int, width: int) -> float | None:
    """Raw PCIe GB/s in one direction for a generation and lane count."""
    per_lane = PCIE_GBPS_PER_LANE.get(gen)
    return None if per_lane is None or width <= 0 else per_lane * width


def expected_copy(gpu: Gpu | str, gen: int | None = None, width: int | None = None) -> Expected | None:
    """Host↔device copy GB/s (pinned memory): the PCIe link's ``gen`` × ``width`` where known
    (sysfs on the host), else the model's generation at x16."""
    model = gpu_model(gpu)
    gen = gen or (model.pcie_gen if model else None)
    if gen is None:
        return None
    width = width or 16
    raw = pcie_gbps(gen, width)
    if raw is None:
        return None
    return Expected(round(raw * PCIE_EFFICIENCY, 1), "GB/s", f"{PCIE_EFFICIENCY:.0%} of PCIe Gen{gen} x{width}")


def _nv_links(cell: str) -> int:
    digits = re.sub(r"\D", "", cell)
    return int(digits) if digits else 0


def nvlinks_per_gpu(report: HostReport) -> int | None:
    """NVLinks of the host's worst-connected GPU, from ``topo -m``: the sum of its ``NV#``
    cells, capped at the model's link count (behind an NVSwitch every pair shows all of a
    GPU's links: ``NV18``); None when some GPU pair has no NVLink path or nothing is known."""
    labels = [g.label for g in report.gpus]
    if len(labels) < 2:
        return None
    model = gpu_model(report.gpus[0])
    cap = model.nvlinks if model and model.nvlinks else None
    worst: int | None = None
    for a in labels:
        cells = [report.links.get(a, {}).get(b) or report.links.get(b, {}).get(a) for b in labels if b != a]
        if any(c is None or link_class(c) != "NV#" for c in cells):
            return None
        total = sum(_nv_links(c) for c in cells if c is not None)
        total = min(total, cap) if cap else total
        worst = total if worst is None else min(worst, total)
    return worst


def expected_host_allreduce(report: HostReport) -> Expected | None:
    """All-reduce bus bandwidth (ring) across one host's GPUs: NVLink generation × links where
    every GPU pair has NVLink, else the PCIe link of the model's generation (x16)."""
    if len(report.gpus) < 2:
        return None
    model = gpu_model(report.gpus[0])
    if model is None:
        return None
    links = nvlinks_per_gpu(report)
    if links and model.nvlink_gbps_per_link:
        raw = links * model.nvlink_gbps_per_link
        return Expected(round(raw * NVLINK_RING_EFFICIENCY), "GB/s",
                        f"{NVLINK_RING_EFFICIENCY:.0%} of {links} NVLinks × {model.nvlink_gbps_per_link:g} GB/s")
    raw_pcie = pcie_gbps(model.pcie_gen, 16)
    if raw_pcie is None:
        return None
    return Expected(round(raw_pcie * PCIE_EFFICIENCY, 1), "GB/s",
                    f"{PCIE_EFFICIENCY:.0%} of PCIe Gen{model.pcie_gen} x16")


def compute_ports(report: HostReport) -> list[float]:
    """Rates (Gb/s) of the active RDMA ports NCCL would use across hosts: InfiniBand ports where
    any is active, else all; of those, the fastest rate only (a slower front-end or storage
    port is left out)."""
    active = [n for n in report.nics if n.active and n.rate_gbps]
    ib = [n for n in active if (n.link_layer or "").lower() == "infiniband"]
    chosen = ib or active
    top = max((n.rate_gbps or 0.0 for n in chosen), default=0.0)
    return [float(n.rate_gbps or 0.0) for n in chosen if n.rate_gbps == top]


def expected_network_allreduce(report: HostReport, ranks_per_host: int | None = None) -> Expected | None:
    """All-reduce bus bandwidth across hosts that this host's NICs should carry: IB/RoCE rate ×
    active ports (sysfs, :func:`compute_ports`). With ``ranks_per_host`` below the port count
    (one rank per host uses one NIC) that many ports count."""
    rates = compute_ports(report)
    if not rates:
        return None
    used = rates[:ranks_per_host] if ranks_per_host else rates
    total = sum(used)
    plural = "s" if len(used) > 1 else ""
    return Expected(round(total / 8 * NIC_EFFICIENCY, 1), "GB/s",
                    f"{NIC_EFFICIENCY:.0%} of {len(used)}× {used[0]:g} Gb/s active port{plural}")


def expected_tcp(speed_mbits: float | None) -> Expected | None:
    """Gbit/s a few TCP streams should carry over an interface of ``speed_mbits`` (sysfs
    ``/sys/class/net/<if>/speed``; None or ≤ 0 where the kernel does not know, as on ``lo``)."""
    if not speed_mbits or speed_mbits <= 0:
        return None
    line = speed_mbits / 1000
    value = min(line * 0.9, TCP_STREAM_CAP_GBITS)
    capped = value >= TCP_STREAM_CAP_GBITS
    basis = f"TCP streams' cap on a {line:g} Gb/s link" if capped else f"90% of {line:g} Gb/s link"
    return Expected(round(value, 2), "Gbit/s", basis)


def peer_median(values: Iterable[float]) -> float | None:
    """The median of the peers' values, None without any."""
    items = [v for v in values if v is not None]
    return statistics.median(items) if items else None


def ratio(measured: float, reference: float | None) -> float | None:
    """measured / reference, None without a positive reference."""
    if reference is None or reference <= 0:
        return None
    return measured / reference


def judge(measured: float, expected: float | None, peers: Sequence[float]) -> tuple[str | None, str]:
    """Severity (``error``, ``warning`` or None) of one measurement against its expected value
    and the median of its peers (the others' values), and what it was compared with."""
    worst: tuple[float, str] | None = None
    exp_ratio = ratio(measured, expected)
    if exp_ratio is not None:
        worst = (exp_ratio, "of expected")
    peer = peer_median(peers)
    peer_ratio = ratio(measured, peer)
    if peer_ratio is not None and (worst is None or peer_ratio < worst[0]):
        worst = (peer_ratio, "of the peers' median")
    if worst is None:
        return None, ""
    share, what = worst
    text = f"{share:.0%} {what}"
    if share < FAR_BELOW:
        return "error", text
    if share < BELOW:
        return "warning", text
    return None, text
