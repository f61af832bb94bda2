"""Topology facts of one host: the frozen records and the pure parsers that build them.

This module owns the *meaning* of raw tool output: ``nvidia-smi --query-gpu`` CSV,
``nvidia-smi topo -m``, ``nvidia-smi -L``, the ``nvidia-smi`` header and ``-q`` text/XML, the
InfiniBand sysfs tree (given as a mapping of relative path to file content), ``ibstat`` and its
cousins (``ibstatus``, ``ibv_devinfo``, ``ibdev2netdev``), ``nvidia-smi nvlink -s``,
``nvidia-smi topo -p2p``, NCCL topology XML and ``ip -o -4 addr``. It runs nothing, reads no file
and imports no terminal code: :mod:`dlrun.topo.probe` gathers the raw text, this module parses it, and
:mod:`dlrun.topo.findings` judges it.

Parsers do not raise on odd input: unknown or unsupported values (``N/A``, ``[N/A]``,
``[Not Supported]``, ``[Requested functionality has been deprecated]``) become ``None``, and text
that is not what was expected (an error message, an empty capture) yields empty results.

Link cells are kept **as printed** by ``nvidia-smi topo -m``: the legacy ``SOC`` (drivers before
~384) stays ``SOC`` in :attr:`TopoMatrix.cells` and :attr:`HostReport.links`. Every consumer
compares cells through :func:`link_rank` / :func:`link_class`, which treat ``SOC`` exactly like
``SYS``. Best to worst: ``X`` (self), ``NV#`` (more links better), ``PIX``, ``PXB``, ``PHB``,
``NODE``, ``SYS``/``SOC``.

PCI bus ids are spelled ``00000000:07:00.0`` by nvidia-smi and ``0000:07:00.0`` by sysfs;
:func:`normalize_pci_bus_id` gives the one spelling (``0000:07:00.0``, lower case) used for
matching.
"""

from __future__ import annotations

import csv
import re
import textwrap
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
_PCI = re.compile(
    r"^(?:(?P<dom>[0-9a-fA-F]{1,8}):)?(?P<bus>[0-9a-fA-F]{1,2}):(?P<dev>[0-9a-fA-F]{1,2})"
    r"\.(?P<fn>[0-7])$"
)
_NA_WORDS = frozenset({"", "n/a", "na", "none", "not supported", "unknown", "-"})


def strip_ansi(text: str) -> str:
    """Remove terminal escape sequences (``nvidia-smi topo -m`` underlines its header)."""
    return _ANSI.sub("", text)


def unknown_to_none(value: str | None) -> str | None:
    """``N/A``, ``[N/A]``, ``[Not Supported]``, any ``[...]`` and empty text become ``None``."""
    if value is None:
        return None
    text = value.strip()
    if text.startswith("[") and text.endswith("]"):
        return None
    if text.lower() in _NA_WORDS:
        return None
    return text


def normalize_pci_bus_id(value: str | None) -> str | None:
    """One spelling for a PCI address: ``00000000:07:00.0`` and ``0000:07:00.0`` → ``0000:07:00.0``.

    A missing domain means domain 0; hex digits are lower-cased; a domain wider than 16 bits
    (Intel VMD: ``10000``) keeps its digits, as sysfs prints it. Anything else → ``None``.
    """
    if value is None:
        return None
    match = _PCI.match(value.strip())
    if match is None:
        return None
    domain = int(match.group("dom") or "0", 16)
    return "{:04x}:{:02x}:{:02x}.{}".format(
        domain, int(match.group("bus"), 16), int(match.group("dev"), 16), match.group("fn")
    )


def natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key that puts ``mlx5_2`` before ``mlx5_10`` (``ibstat`` sorts them as text)."""
    parts = re.split(r"(\d+)", name)
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in parts if p)


def _int(value: str | None) -> int | None:
    text = unknown_to_none(value)
    if text is None:
        return None
    match = re.match(r"^[-+]?\d+", text)
    return int(match.group()) if match else None


def _float(value: str | None) -> float | None:
    text = unknown_to_none(value)
    if text is None:
        return None
    match = re.match(r"^[-+]?\d+(?:\.\d+)?", text)
    return float(match.group()) if match else None


def _first_line(text: str) -> str | None:
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return None


# --------------------------------------------------------------------------------------------
# Link classes (cells of `nvidia-smi topo -m`)
# --------------------------------------------------------------------------------------------

_NV = re.compile(r"^NV(\d+)$")
_RANKS = {"X": 0, "PIX": 2, "PXB": 3, "PHB": 4, "NODE": 5, "SYS": 6, "SOC": 6}
UNKNOWN_RANK = 7
#: The classes from best to worst, as shown in reports and legends.
LINK_CLASSES: tuple[str, ...] = ("NV#", "PIX", "PXB", "PHB", "NODE", "SYS")
#: NCCL's default P2P / GPUDirect RDMA level: a path at PXB or better.
P2P_DEFAULT_MAX_RANK = _RANKS["PXB"]


def link_rank(cell: str | None) -> int:
    """0 for ``X``, 1 for ``NV#``, then PIX 2, PXB 3, PHB 4, NODE 5, SYS/SOC 6; unknown 7."""
    if cell is None:
        return UNKNOWN_RANK
    text = cell.strip().upper()
    if _NV.match(text):
        return 1
    return _RANKS.get(text, UNKNOWN_RANK)


def link_class(cell: str | None) -> str:
    """The class of a cell: ``NV#``, ``PIX``, ``PXB``, ``PHB``, ``NODE``, ``SYS`` (SOC too),
    ``X`` or ``?``."""
    rank = link_rank(cell)
    if rank == 0:
        return "X"
    if rank == 1:
        return "NV#"
    if rank == UNKNOWN_RANK:
        return "?"
    return LINK_CLASSES[rank - 1]


def nvlink_count(cell: str | None) -> int | None:
    """``NV12`` → 12; any other cell → ``None``."""
    if cell is None:
        return None
    match = _NV.match(cell.strip().upper())
    return int(match.group(1)) if match else None


def is_p2p_by_default(cell: str | None) -> bool:
    """True when NCCL uses P2P / GPUDirect RDMA over this path by default (PXB or better)."""
    rank = link_rank(cell)
    return 0 < rank <= P2P_DEFAULT_MAX_RANK


# --------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MigDevice:
    """One MIG instance as listed by ``nvidia-smi -L`` (``MIG 3g.40gb Device 0: (UUID: …)``)."""

    profile: str
    index: int
    uuid: str | None


@dataclass(frozen=True)
class Gpu:
    """One physical GPU. ``pci_bus_id`` is as nvidia-smi prints it; see :attr:`pci_address`."""

    index: int
    name: str
    uuid: str | None = None
    pci_bus_id: str | None = None
    memory_mib: int | None = None
    driver: str | None = None
    compute_cap: str | None = None
    mig: bool | None = None  # None: MIG not supported or unknown
    mig_devices: tuple[MigDevice, ...] = ()
    numa_node: int | None = None

    @property
    def pci_address(self) -> str | None:
        """The bus id in sysfs spelling (``0000:07:00.0``), for matching."""
        return normalize_pci_bus_id(self.pci_bus_id)

    @property
    def label(self) -> str:
        """The name ``nvidia-smi topo -m`` uses: ``GPU<index>``."""
        return f"GPU{self.index}"


@dataclass(frozen=True)
class ListedGpu:
    """One ``GPU n: NAME (UUID: …)`` line of ``nvidia-smi -L`` with its MIG children."""

    index: int
    name: str
    uuid: str | None
    mig_devices: tuple[MigDevice, ...] = ()


@dataclass(frozen=True)
class DeviceAffinity:
    """The affinity cells of one ``topo -m`` row (``None`` where empty or ``N/A``)."""

    cpus: str | None = None
    numa: str | None = None
    gpu_numa_id: str | None = None

    @property
    def numa_node(self) -> int | None:
        """The NUMA node when the cell names exactly one node."""
        if self.numa is not None and self.numa.strip().isdigit():
            return int(self.numa)
        return None


@dataclass(frozen=True)
class TopoMatrix:
    """``nvidia-smi topo -m``: devices in column order, named as the host names them.

    ``NIC#`` columns are renamed through the ``NIC Legend`` (``NIC0`` → ``mlx5_1`` where the
    legend says so); a ``NIC#`` without a legend entry keeps its ``NIC#`` name. ``cells`` holds
    every off-diagonal cell ``cells[row][column]`` as printed (``SOC`` kept). ``error`` is the
    first line of output that holds no matrix (the Windows "unsupported" message).
    """

    devices: tuple[str, ...] = ()
    gpus: tuple[str, ...] = ()
    nics: tuple[str, ...] = ()
    cells: Mapping[str, Mapping[str, str]] = field(default_factory=dict, hash=False)
    affinity: Mapping[str, DeviceAffinity] = field(default_factory=dict, hash=False)
    nic_legend: Mapping[str, str] = field(default_factory=dict, hash=False)
    error: str | None = None

    @property
    def links(self) -> dict[str, dict[str, str]]:
        """GPU↔GPU and GPU↔NIC cells, keyed by ``GPU<i>`` and RDMA device names (rows of GPUs
        first, then NIC rows with their GPU columns); NIC↔NIC cells and the diagonal are left
        out."""
        gpus = set(self.gpus)
        out: dict[str, dict[str, str]] = {}
        for row in self.gpus + self.nics:
            row_cells = self.cells.get(row, {})
            picked = {
                col: row_cells[col]
                for col in self.devices
                if col != row and col in row_cells and (row in gpus or col in gpus)
            }
            if picked:
                out[row] = picked
        return out

    def gpu_numa_node(self, gpu_label: str) -> int | None:
        """The NUMA node of ``GPU<i>`` from the ``NUMA Affinity`` column, if single."""
        aff = self.affinity.get(gpu_label)
        return aff.numa_node if aff is not None else None


@dataclass(frozen=True)
class Nic:
    """One port of an RDMA device (InfiniBand or RoCE).

    ``state`` is the sysfs word: ``ACTIVE``, ``DOWN``, ``INIT``, ``ARMED`` (``ACTIVE_DEFER``
    where the kernel says so); ``None`` when unknown. ``nearest_gpus`` are the GPU indices with
    the best ``topo -m`` path to this device (``nearest_link`` is that cell), or, without a
    matrix cell, the GPUs on the same NUMA node (``nearest_link`` is then ``"NUMA"``).
    """

    name: str
    port: int
    state: str | None = None
    rate_gbps: float | None = None
    link_layer: str | None = None
    netdev: str | None = None
    phys_state: str | None = None
    hca_type: str | None = None
    fw_ver: str | None = None
    pci_bus_id: str | None = None
    numa_node: int | None = None
    nearest_gpus: tuple[int, ...] = ()
    nearest_link: str | None = None
    source: str = "sysfs"

    @property
    def active(self) -> bool:
        """The port is up (``ACTIVE``)."""
        return self.state == "ACTIVE"


@dataclass(frozen=True)
class NetdevLink:
    """One line of ``ibdev2netdev`` (``mlx5_0 port 1 ==> ib0 (Up)``, ``-v`` adds PCI and state)."""

    device: str
    port: int
    netdev: str
    up: bool | None
    state: str | None = None
    pci_bus_id: str | None = None


@dataclass(frozen=True)
class NetInterface:
    """A network interface and its IPv4 addresses (for NCCL/Gloo socket interface choice)."""

    name: str
    ipv4: tuple[str, ...] = ()
    default_route: bool = False

    @property
    def loopback(self) -> bool:
        """``lo`` or an interface whose addresses are all 127.x."""
        if self.name == "lo":
            return True
        return bool(self.ipv4) and all(a.startswith("127.") for a in self.ipv4)


@dataclass(frozen=True)
class SmiQuery:
    """What ``nvidia-smi -q`` (text) or ``-q -x`` (XML) says about versions and GPUs."""

    driver_version: str | None = None
    cuda_version: str | None = None
    gpus: tuple[Gpu, ...] = ()
    error: str | None = None


@dataclass(frozen=True)
class NvlinkStatus:
    """``nvidia-smi nvlink -s`` for one GPU: per-link speed (GB/s, ``None`` if inactive)."""

    gpu_index: int
    name: str
    uuid: str | None
    link_gbps: tuple[float | None, ...] = ()
    note: str | None = None


@dataclass(frozen=True)
class NcclNet:
    """A ``<net>`` of an NCCL topology dump."""

    name: str
    speed_mbps: int | None
    port: int | None
    gdr: bool | None


@dataclass(frozen=True)
class NcclTopo:
    """The parts of an NCCL topology (``NCCL_TOPO_DUMP_FILE``/``NCCL_TOPO_FILE``) XML we read."""

    gpu_bus_ids: tuple[str, ...] = ()
    nic_bus_ids: tuple[str, ...] = ()
    nets: tuple[NcclNet, ...] = ()
    nvlinks: Mapping[str, int] = field(default_factory=dict, hash=False)
    graphs: int = 0
    error: str | None = None


@dataclass(frozen=True)
class HostReport:
    """Everything the probe learnt about one host; built by :func:`dlrun.topo.probe.parse_probe_output`.

    ``reachable`` is False when the host could not be reached (``error`` says why); a reachable
    host whose probe failed has ``error`` set too. ``links`` are :attr:`TopoMatrix.links`.
    ``notes`` are facts worth showing that are not problems by themselves (no nvidia-smi, no
    RDMA device, ``ibstat`` exiting 255 after valid output); ``problems`` are tool failures
    that deserve a warning (nvidia-smi failing or timing out: a broken driver or hung GPU).
    """

    host: str
    reachable: bool = True
    gpus: tuple[Gpu, ...] = ()
    cuda_version: str | None = None
    links: Mapping[str, Mapping[str, str]] = field(default_factory=dict, hash=False)
    nics: tuple[Nic, ...] = ()
    cpu_count: int | None = None
    numa_nodes: int | None = None
    os: str | None = None
    python: str | None = None
    tensorflow: str | None = None
    error: str | None = None
    hostname: str | None = None
    driver_version: str | None = None
    nvidia_smi: str | None = None  # path of the nvidia-smi that ran; None: not found
    topo: TopoMatrix = field(default_factory=TopoMatrix, hash=False)
    interfaces: tuple[NetInterface, ...] = ()
    notes: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()

    @classmethod
    def unreachable(cls, host: str, error: str) -> HostReport:
        """A host that could not be reached; ``error`` says why."""
        return cls(host=host, reachable=False, error=error)

    @property
    def ok(self) -> bool:
        """Reached and probed without error."""
        return self.reachable and self.error is None

    @property
    def driver(self) -> str | None:
        """The NVIDIA driver version (from the GPUs, else from the nvidia-smi header)."""
        for gpu in self.gpus:
            if gpu.driver:
                return gpu.driver
        return self.driver_version

    @property
    def gpu_slots(self) -> int:
        """Ranks the GPUs can hold: one per GPU, or one per MIG device where MIG is on (a GPU
        with MIG on and no MIG device holds none: CUDA sees nothing there)."""
        return sum(len(g.mig_devices) if g.mig else 1 for g in self.gpus)

    @property
    def cuda_devices(self) -> tuple[str, ...]:
        """One ``CUDA_VISIBLE_DEVICES`` value per GPU slot, for local rank *i* take item *i*.

        GPU UUIDs (``GPU-…``), or MIG device UUIDs (``MIG-…``) where MIG is on: UUIDs do not
        depend on ``CUDA_DEVICE_ORDER`` (CUDA's default order is not nvidia-smi's). A GPU whose
        UUID is unknown is given by its nvidia-smi index; a MIG device without a UUID (``-q``
        output has none) is left out.
        """
        out: list[str] = []
        for gpu in self.gpus:
            if gpu.mig:
                out.extend(m.uuid for m in gpu.mig_devices if m.uuid)
            else:
                out.append(gpu.uuid or str(gpu.index))
        return tuple(out)

    @property
    def default_interface(self) -> NetInterface | None:
        """The interface of the default route, else the first non-loopback with IPv4."""
        usable = [i for i in self.interfaces if i.ipv4 and not i.loopback]
        for iface in usable:
            if iface.default_route:
                return iface
        return usable[0] if usable else None


class FindingLike(Protocol):
    """What :func:`host_report_to_json` needs of a finding (:class:`dlrun.topo.findings.Finding`)."""

    @property
    def severity(self) -> str: ...

    @property
    def message(self) -> str: ...

    @property
    def host(self) -> str | None: ...


def gpu_to_json(gpu: Gpu) -> dict[str, Any]:
    """One GPU in the ``dlrun topo --json`` shape."""
    return {
        "index": gpu.index,
        "name": gpu.name,
        "uuid": gpu.uuid,
        "pci_bus_id": gpu.pci_bus_id,
        "memory_mib": gpu.memory_mib,
        "driver": gpu.driver,
        "mig": bool(gpu.mig),
        "compute_cap": gpu.compute_cap,
        "mig_devices": [
            {"profile": m.profile, "index": m.index, "uuid": m.uuid} for m in gpu.mig_devices
        ],
        "numa_node": gpu.numa_node,
    }


def nic_to_json(nic: Nic) -> dict[str, Any]:
    """One RDMA port in the ``dlrun topo --json`` shape."""
    return {
        "name": nic.name,
        "port": nic.port,
        "state": nic.state,
        "rate_gbps": nic.rate_gbps,
        "link_layer": nic.link_layer,
        "netdev": nic.netdev,
        "phys_state": nic.phys_state,
        "hca_type": nic.hca_type,
        "pci_bus_id": nic.pci_bus_id,
        "numa_node": nic.numa_node,
        "nearest_gpus": list(nic.nearest_gpus),
        "nearest_link": nic.nearest_link,
    }


def host_report_to_json(report: HostReport, findings: Iterable[FindingLike] = ()) -> dict[str, Any]:
    """One host of ``dlrun topo --json``; ``findings`` may hold every host's, this host's are kept.

    The keys the issue fixes come first (``host``, ``reachable``, ``gpus``, ``cuda_version``,
    ``links``, ``nics``, ``findings``); the rest are additions.
    """
    return {
        "host": report.host,
        "reachable": report.reachable,
        "gpus": [gpu_to_json(g) for g in report.gpus],
        "cuda_version": report.cuda_version,
        "links": {row: dict(cols) for row, cols in report.links.items()},
        "nics": [nic_to_json(n) for n in report.nics],
        "findings": [
            {"severity": f.severity, "message": f.message}
            for f in findings
            if f.host == report.host
        ],
        "error": report.error,
        "hostname": report.hostname,
        "driver": report.driver,
        "cpu_count": report.cpu_count,
        "numa_nodes": report.numa_nodes,
        "os": report.os,
        "python": report.python,
        "tensorflow": report.tensorflow,
        "interfaces": [
            {"name": i.name, "ipv4": list(i.ipv4), "default_route": i.default_route}
            for i in report.interfaces
        ],
        "notes": list(report.notes),
        "problems": list(report.problems),
    }


# --------------------------------------------------------------------------------------------
# nvidia-smi --query-gpu (CSV)
# --------------------------------------------------------------------------------------------

#: The fields the probe asks for, in order (also the order assumed for ``noheader`` output).
QUERY_GPU_FIELDS: tuple[str, ...] = (
    "index",
    "uuid",
    "name",
    "pci.bus_id",
    "memory.total",
    "driver_version",
    "compute_cap",
    "mig.mode.current",
)
#: Fields every driver since ~2012 knows: the probe's retry when the full query is refused.
QUERY_GPU_BASIC_FIELDS: tuple[str, ...] = QUERY_GPU_FIELDS[:6]


def _csv_header_name(raw: str) -> str:
    # "memory.total [MiB]" -> "memory.total"
    return re.sub(r"\s*\[[^\]]*\]\s*$", "", raw.strip()).strip().lower()


def _mig_mode(value: str | None) -> bool | None:
    text = unknown_to_none(value)
    if text is None:
        return None
    lowered = text.lower()
    if lowered == "enabled":
        return True
    if lowered == "disabled":
        return False
    return None


def parse_query_gpu_csv(text: str) -> tuple[Gpu, ...]:
    """``nvidia-smi --query-gpu=… --format=csv``, found by header name (any number of fields).

    Without a header line (``noheader``) the columns are taken in :data:`QUERY_GPU_FIELDS`
    order. Error text (``Field "x" is not a valid field to query.``) yields no GPU.
    """
    try:
        rows = [r for r in csv.reader(text.splitlines(), skipinitialspace=True) if r]
    except csv.Error:  # not nvidia-smi's CSV (a field over the csv module's size limit)
        return ()
    header: list[str] | None = None
    gpus: list[Gpu] = []
    for row in rows:
        names = [_csv_header_name(c) for c in row]
        if header is None and ("index" in names or "uuid" in names or "pci.bus_id" in names):
            header = names
            continue
        if header is None:
            if _int(row[0]) is None or len(row) < 3:
                continue  # not a data row (an error message)
            columns = list(QUERY_GPU_FIELDS)
        else:
            columns = header
        if len(row) < min(len(columns), 3):
            continue
        values = {name: value.strip() for name, value in zip(columns, row, strict=False)}
        index = _int(values.get("index"))
        gpus.append(
            Gpu(
                index=index if index is not None else len(gpus),
                name=unknown_to_none(values.get("name")) or "",
                uuid=unknown_to_none(values.get("uuid")),
                pci_bus_id=unknown_to_none(values.get("pci.bus_id")),
                memory_mib=_int(values.get("memory.total")),
                driver=unknown_to_none(values.get("driver_version")),
                compute_cap=unknown_to_none(values.get("compute_cap")),
                mig=_mig_mode(values.get("mig.mode.current")),
            )
        )
    return tuple(gpus)


# --------------------------------------------------------------------------------------------
# nvidia-smi -L, header, -q, -q -x, nvlink -s
# --------------------------------------------------------------------------------------------

_L_GPU = re.compile(r"^GPU\s+(\d+):\s*(.*?)\s*(?:\(UUID:\s*([^)]*)\))?\s*$")
_L_MIG = re.compile(r"^\s+MIG\s+(\S+)\s+Device\s+(\d+):\s*\(UUID:\s*([^)]*)\)")


def parse_smi_L(text: str) -> tuple[ListedGpu, ...]:
    """``nvidia-smi -L``: GPUs with name and UUID, and their MIG devices (profile, index, UUID)."""
    gpus: list[ListedGpu] = []
    migs: list[MigDevice] = []

    def flush() -> None:
        if gpus and migs:
            gpus[-1] = ListedGpu(gpus[-1].index, gpus[-1].name, gpus[-1].uuid, tuple(migs))
        migs.clear()

    for line in text.splitlines():
        gpu = _L_GPU.match(line)
        if gpu:
            flush()
            gpus.append(ListedGpu(int(gpu.group(1)), gpu.group(2), unknown_to_none(gpu.group(3))))
            continue
        mig = _L_MIG.match(line)
        if mig and gpus:
            migs.append(MigDevice(mig.group(1), int(mig.group(2)), unknown_to_none(mig.group(3))))
    flush()
    return tuple(gpus)


_CUDA = re.compile(r"CUDA Version\s*:\s*([0-9]+(?:\.[0-9]+)*)")
_DRIVER = re.compile(r"Driver Version\s*:\s*([0-9]+(?:\.[0-9]+)*)")


def parse_cuda_version(text: str) -> str | None:
    """The CUDA version from the ``nvidia-smi`` header (``CUDA Version: 12.2``) or ``-q`` text."""
    match = _CUDA.search(text)
    return match.group(1) if match else None


def parse_driver_version(text: str) -> str | None:
    """The driver version from the ``nvidia-smi`` header or ``-q`` text."""
    match = _DRIVER.search(text)
    return match.group(1) if match else None


def parse_smi_q(text: str) -> SmiQuery:
    """``nvidia-smi -q`` text: versions, and per GPU its bus id, name, UUID, memory and MIG mode
    (MIG devices are counted from ``MIG Device`` sections; their UUIDs are not in ``-q``)."""
    gpus: list[dict[str, Any]] = []
    section = ""
    for raw in text.splitlines():
        line = raw.rstrip()
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        head = re.match(r"^GPU\s+([0-9A-Fa-f]+:[0-9A-Fa-f]+:[0-9A-Fa-f]+\.[0-7])\s*$", line)
        if head:
            gpus.append({"bus": head.group(1), "migs": 0})
            section = ""
            continue
        if not gpus:
            continue
        key, sep, value = line.strip().partition(":")
        key = key.strip()
        value = value.strip()
        if indent == 4 and not sep:
            section = key
            if key == "MIG Device":
                gpus[-1]["migs"] += 1
            continue
        if not sep:
            continue
        if indent == 4:
            section = ""
            if key == "Product Name":
                gpus[-1]["name"] = value
            elif key == "GPU UUID":
                gpus[-1]["uuid"] = value
        elif indent == 8 and section == "MIG Mode" and key == "Current":
            gpus[-1]["mig"] = value
        elif indent == 8 and section == "FB Memory Usage" and key == "Total":
            gpus[-1]["memory"] = value
    return SmiQuery(
        driver_version=parse_driver_version(text),
        cuda_version=parse_cuda_version(text),
        gpus=tuple(
            Gpu(
                index=i,
                name=str(g.get("name", "")),
                uuid=unknown_to_none(g.get("uuid")),
                pci_bus_id=g["bus"],
                memory_mib=_int(g.get("memory")),
                driver=parse_driver_version(text),
                mig=_mig_mode(g.get("mig")),
                mig_devices=tuple(MigDevice("", n, None) for n in range(int(g["migs"]))),
            )
            for i, g in enumerate(gpus)
        ),
    )


def parse_smi_q_xml(text: str) -> SmiQuery:
    """``nvidia-smi -q -x``: versions and one :class:`Gpu` per ``<gpu>`` element (in order).

    ``<attached_gpus>`` is not trusted: a capture taken with ``-i`` holds fewer ``<gpu>``.
    """
    try:
        root = ET.fromstring(text)
    except ET.ParseError as exc:
        return SmiQuery(error=f"not nvidia-smi XML: {exc}")
    driver = unknown_to_none(root.findtext("driver_version"))
    gpus: list[Gpu] = []
    for i, node in enumerate(root.findall("gpu")):
        migs = node.findall("mig_devices/mig_device")
        gpus.append(
            Gpu(
                index=i,
                name=(node.findtext("product_name") or "").strip(),
                uuid=unknown_to_none(node.findtext("uuid")),
                pci_bus_id=unknown_to_none(node.findtext("pci/pci_bus_id") or node.get("id")),
                memory_mib=_int(node.findtext("fb_memory_usage/total")),
                driver=driver,
                mig=_mig_mode(node.findtext("mig_mode/current_mig")),
                mig_devices=tuple(
                    MigDevice("", _int(m.findtext("index")) or n, None) for n, m in enumerate(migs)
                ),
            )
        )
    return SmiQuery(
        driver_version=driver,
        cuda_version=unknown_to_none(root.findtext("cuda_version")),
        gpus=tuple(gpus),
    )


def parse_nvlink_status(text: str) -> tuple[NvlinkStatus, ...]:
    """``nvidia-smi nvlink -s``: per GPU the speed of each link, or the note printed instead
    (``Device does not have or support Nvlink``, MIG mode, all links inactive). Empty → ()."""
    out: list[NvlinkStatus] = []
    links: list[float | None] = []
    notes: list[str] = []

    def flush() -> None:
        if out:
            last = out[-1]
            out[-1] = NvlinkStatus(
                last.gpu_index, last.name, last.uuid, tuple(links), "; ".join(notes) or None
            )
        links.clear()
        notes.clear()

    for line in text.splitlines():
        gpu = _L_GPU.match(line)
        if gpu:
            flush()
            out.append(NvlinkStatus(int(gpu.group(1)), gpu.group(2), unknown_to_none(gpu.group(3))))
            continue
        link = re.match(r"^\s*Link\s+\d+:\s*(.*)$", line)
        if link and out:
            speed = re.match(r"([0-9]+(?:\.[0-9]+)?)\s*GB/s", link.group(1))
            links.append(float(speed.group(1)) if speed else None)
        elif line.strip() and out:
            notes.append(line.strip())
    flush()
    return tuple(out)


def parse_topo_p2p(text: str) -> dict[str, dict[str, str]]:
    """``nvidia-smi topo -p2p r|w|n|a``: ``{"GPU0": {"GPU1": "OK", …}}`` (diagonal left out)."""
    lines = [strip_ansi(line) for line in text.splitlines()]
    columns: list[str] = []
    out: dict[str, dict[str, str]] = {}
    for line in lines:
        tokens = line.split()
        if not tokens:
            if out:
                break
            continue
        if not columns:
            if all(re.fullmatch(r"GPU\d+", t) for t in tokens):
                columns = tokens
            continue
        if not re.fullmatch(r"GPU\d+", tokens[0]):
            break
        out[tokens[0]] = {
            col: cell for col, cell in zip(columns, tokens[1:], strict=False) if col != tokens[0]
        }
    return out


# --------------------------------------------------------------------------------------------
# nvidia-smi topo -m
# --------------------------------------------------------------------------------------------

_DEVICE_LABEL = re.compile(r"^(?:GPU|NIC)\d+$")
_LEGEND_NIC = re.compile(r"^\s*(NIC\d+)\s*:\s*(\S+)\s*$")
_WORD = re.compile(r"\S+")
_PHRASE = re.compile(r"\S+(?: \S+)*")  # words separated by single spaces
_TAB = 8


def _header_index(lines: Sequence[str]) -> int | None:
    for i, line in enumerate(lines):
        tokens = line.split()
        if tokens and re.fullmatch(r"GPU\d+", tokens[0]) and line[:1] in (" ", "\t"):
            return i
    return None


def _row_lines(lines: Sequence[str]) -> list[str]:
    rows: list[str] = []
    for line in lines:
        if not line.strip():
            if rows:
                break
            continue
        if line[:1] in (" ", "\t") or line.strip().startswith("Legend"):
            break
        rows.append(line)
    return rows


def _map_affinity(rest: list[str], names: Sequence[str]) -> dict[str, str | None]:
    """Give the affinity fields after the matrix cells to the header's affinity names.

    nvidia-smi writes two tabs before ``GPU NUMA ID``: with more fields than names, the last
    field belongs to the last name. Trailing empty fields are ignored.
    """
    fields = list(rest)
    while fields and not fields[-1]:
        fields.pop()
    if names and len(fields) > len(names):
        fields = [*fields[: len(names) - 1], fields[-1]]
    fields += [""] * (len(names) - len(fields))
    return {name: unknown_to_none(value) for name, value in zip(names, fields, strict=False)}


def _space_rest(
    tokens: Sequence[re.Match[str]],
    prev_end: int,
    n_names: int,
    name_pos: Sequence[int] | None,
) -> list[str]:
    """Affinity fields of a space-separated row, where empty cells left no token behind.

    Tab-expanded text (a pasted terminal) has every field starting on a tab stop: the number of
    stops between two tokens tells how many empty fields lay between them. Other spacing falls
    back to the nearest header column.
    """
    words = [t.group() for t in tokens]
    if not tokens or len(tokens) >= n_names:
        return words
    if all(t.start() % _TAB == 0 for t in tokens):
        fields: list[str] = []
        end = prev_end
        for tok in tokens:
            stops = max(1, tok.start() // _TAB - end // _TAB)
            fields.extend([""] * (stops - 1))
            fields.append(tok.group())
            end = tok.end()
        return fields
    if name_pos is not None and len(name_pos) == n_names:
        out = [""] * n_names
        for tok in tokens:
            nearest = min(range(n_names), key=lambda i: abs(name_pos[i] - tok.start()))
            out[nearest] = tok.group()
        return out
    return words


def _affinity(values: Mapping[str, str | None]) -> DeviceAffinity:
    cpus = numa = gpu_numa = None
    for name, value in values.items():
        lowered = name.lower()
        if "cpu" in lowered:
            cpus = value
        elif "gpu numa" in lowered:
            gpu_numa = value
        elif "numa" in lowered:
            numa = value
    return DeviceAffinity(cpus=cpus, numa=numa, gpu_numa_id=gpu_numa)


def parse_topo_matrix(text: str) -> TopoMatrix:
    """``nvidia-smi topo -m``, raw (tabs) or pasted (spaces), into a :class:`TopoMatrix`.

    Handles the ANSI underline in the header, the `` X `` diagonal, ``NV#``, PIX/PXB/PHB/NODE/SYS
    and the legacy ``SOC`` (kept as printed), NIC columns named ``mlx5_N`` or ``NIC#`` with a
    ``NIC Legend`` (``NIC0`` may be ``mlx5_1``), NIC rows without affinity cells, empty affinity
    cells and the CPU Affinity / NUMA Affinity / GPU NUMA ID variants. Lines with tabs are split
    on tabs; others on whitespace, with tab stops (or header positions) placing empty affinity
    cells. Output without a matrix (Windows: ``ERROR: Option -m is missing its value``) gives an
    empty matrix whose ``error`` is its first line.
    """
    # a pasted copy may be indented as a whole (a markdown code block, a quoted mail)
    lines = textwrap.dedent("\n".join(strip_ansi(line).rstrip("\r") for line in text.splitlines())).splitlines()
    head_i = _header_index(lines)
    if head_i is None:
        return TopoMatrix(error=_first_line(strip_ansi(text)))
    header = lines[head_i]
    rows = _row_lines(lines[head_i + 1 :])
    labels = {row.split()[0] for row in rows}

    def is_device(token: str) -> bool:
        return token in labels or bool(_DEVICE_LABEL.match(token))

    # Header: device columns, then affinity names (with their positions in expanded text).
    expanded = header.expandtabs(_TAB)
    words = list(_WORD.finditer(expanded))
    devices: list[str] = []
    for word in words:
        if not is_device(word.group()):
            break
        devices.append(word.group())
    after = words[len(devices) - 1].end() if devices else 0
    phrases = list(_PHRASE.finditer(expanded, after))
    if "\t" in header:
        fields = [f.strip() for f in header.split("\t")]
        names = [f for f in fields if f and not is_device(f)]
    else:
        names = [p.group() for p in phrases]
    name_pos = [p.start() for p in phrases] if len(phrases) == len(names) else None

    legend: dict[str, str] = {}
    in_legend = False
    for line in lines[head_i + 1 :]:
        if line.strip().startswith("NIC Legend"):
            in_legend = True
            continue
        match = _LEGEND_NIC.match(line) if in_legend else None
        if match:
            legend[match.group(1)] = match.group(2)

    def rename(label: str) -> str:
        return legend.get(label, label)

    n = len(devices)
    cells: dict[str, dict[str, str]] = {}
    affinity: dict[str, DeviceAffinity] = {}
    for line in rows:
        if "\t" in line:
            parts = line.split("\t")
            label = parts[0].strip()
            row_cells = [p.strip() for p in parts[1 : 1 + n]]
            rest = [p.strip() for p in parts[1 + n :]]
        else:
            toks = list(_WORD.finditer(line))
            label = toks[0].group()
            cell_toks = toks[1 : 1 + n]
            row_cells = [t.group() for t in cell_toks]
            prev_end = cell_toks[-1].end() if cell_toks else toks[0].end()
            rest = _space_rest(toks[1 + n :], prev_end, len(names), name_pos)
        if not is_device(label):
            continue
        name = rename(label)
        pairs = zip(devices, row_cells, strict=False)
        cells[name] = {rename(col): cell for col, cell in pairs if col != label and cell}
        aff = _affinity(_map_affinity(rest, names))
        if aff != DeviceAffinity() or label.startswith("GPU"):
            affinity[name] = aff

    all_devices = tuple(rename(d) for d in devices)
    gpus = tuple(d for d in all_devices if re.fullmatch(r"GPU\d+", d))
    return TopoMatrix(
        devices=all_devices,
        gpus=gpus,
        nics=tuple(d for d in all_devices if d not in gpus),
        cells=cells,
        affinity=affinity,
        nic_legend=legend,
    )


# --------------------------------------------------------------------------------------------
# InfiniBand / RoCE
# --------------------------------------------------------------------------------------------

_IB_PREFIX = re.compile(r"^(?:.*/)?class/infiniband/")
_IBSTAT_STATES = {
    "active": "ACTIVE",
    "down": "DOWN",
    "initializing": "INIT",
    "init": "INIT",
    "armed": "ARMED",
    "active_defer": "ACTIVE_DEFER",
}


def parse_ib_state(value: str | None) -> str | None:
    """A port state in the sysfs word: sysfs ``4: ACTIVE`` → ``ACTIVE``; ibstat ``Active`` →
    ``ACTIVE``, ``Initializing`` → ``INIT``; ibv_devinfo ``PORT_DOWN (1)`` → ``DOWN``."""
    text = unknown_to_none(value)
    if text is None:
        return None
    text = text.split(":", 1)[1].strip() if re.match(r"^\d+\s*:", text) else text
    text = re.sub(r"\s*\(\d+\)\s*$", "", text).strip()
    if text.upper().startswith("PORT_"):
        text = text[5:]
    return _IBSTAT_STATES.get(text.lower(), text.upper()) or None


def parse_phys_state(value: str | None) -> str | None:
    """sysfs ``5: LinkUp`` → ``LinkUp``; ibstat ``Polling`` stays ``Polling``."""
    text = unknown_to_none(value)
    if text is None:
        return None
    return text.split(":", 1)[1].strip() if re.match(r"^\d+\s*:", text) else text


def parse_ib_rate(value: str | None) -> float | None:
    """``400 Gb/sec (4X NDR)`` → 400.0; ibstat's bare ``200`` → 200.0; else ``None``."""
    return _float(value)


def _sysfs_files(files: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """Group ``…/class/infiniband/<dev>/<rest>`` keys by device: ``{dev: {rest: content}}``."""
    keys = {key: key.replace("\\", "/").lstrip("/") for key in files}
    prefixed = any(_IB_PREFIX.match(path) for path in keys.values())
    devices: dict[str, dict[str, str]] = {}
    for key, content in files.items():
        path = keys[key]
        if prefixed:
            if not _IB_PREFIX.match(path):
                continue  # another part of sysfs (PCI NUMA nodes)
            path = _IB_PREFIX.sub("", path)
        dev, _, rest = path.partition("/")
        if dev and rest:
            devices.setdefault(dev, {})[rest] = content
    return devices


def _netdev_for_port(entries: Mapping[str, str], port: int) -> str | None:
    netdevs: dict[str, dict[str, str]] = {}
    for rest, content in entries.items():
        match = re.match(r"^device/net/([^/]+)(?:/(.*))?$", rest)
        if match:
            attrs = netdevs.setdefault(match.group(1), {})
            if match.group(2):
                attrs[match.group(2)] = content.strip()
    if not netdevs:
        return None
    if len(netdevs) == 1:
        return next(iter(netdevs))
    for name, attrs in sorted(netdevs.items()):
        dev_port = _int(attrs.get("dev_port"))
        if dev_port is not None and dev_port + 1 == port:
            return name
    for name, attrs in sorted(netdevs.items()):
        dev_id = attrs.get("dev_id", "")  # older kernels: the port, 0-based, in hex
        if re.fullmatch(r"0x[0-9a-fA-F]+", dev_id) and int(dev_id, 16) + 1 == port:
            return name
    return None


def _pci_from_link(value: str | None) -> str | None:
    if not value:
        return None
    last = value.strip().rstrip("/").rsplit("/", 1)[-1]
    return normalize_pci_bus_id(last)


def parse_sysfs_ib(files: Mapping[str, str]) -> tuple[Nic, ...]:
    """RDMA ports from sysfs files collected by the probe, as ``{relative path: content}``.

    Keys look like ``sys/class/infiniband/mlx5_0/ports/1/state`` (any prefix before
    ``class/infiniband/`` is ignored; keys relative to that directory work too). Read per
    device: ``hca_type``, ``fw_ver``, ``device`` (the resolved symlink: PCI address),
    ``device/numa_node``, ``device/net/<netdev>[/dev_port]``; per port: ``state``,
    ``phys_state``, ``rate``, ``link_layer``. Contents may or may not end with a newline.
    """
    nics: list[Nic] = []
    for dev, entries in _sysfs_files(files).items():
        ports = sorted({int(m.group(1)) for r in entries if (m := re.match(r"^ports/(\d+)/", r))})
        numa = _int(entries.get("device/numa_node"))
        for port in ports:
            pre = f"ports/{port}/"
            nics.append(
                Nic(
                    name=dev,
                    port=port,
                    state=parse_ib_state(entries.get(pre + "state")),
                    rate_gbps=parse_ib_rate(entries.get(pre + "rate")),
                    link_layer=unknown_to_none(entries.get(pre + "link_layer")),
                    netdev=_netdev_for_port(entries, port),
                    phys_state=parse_phys_state(entries.get(pre + "phys_state")),
                    hca_type=unknown_to_none(entries.get("hca_type")),
                    fw_ver=unknown_to_none(entries.get("fw_ver")),
                    pci_bus_id=_pci_from_link(entries.get("device")),
                    numa_node=numa if numa is not None and numa >= 0 else None,
                    source="sysfs",
                )
            )
    return tuple(sorted(nics, key=lambda n: (natural_key(n.name), n.port)))


def parse_sysfs_pci_numa(files: Mapping[str, str]) -> dict[str, int]:
    """``sys/bus/pci/devices/<addr>/numa_node`` files → ``{normalised address: node}``.

    Devices without a node (``-1``) are left out."""
    out: dict[str, int] = {}
    for key, content in files.items():
        match = re.search(r"bus/pci/devices/([^/]+)/numa_node$", key.replace("\\", "/"))
        if not match:
            continue
        addr = normalize_pci_bus_id(match.group(1))
        node = _int(content)
        if addr is not None and node is not None and node >= 0:
            out[addr] = node
    return out


def parse_ibstat(text: str) -> tuple[Nic, ...]:
    """``ibstat`` (fallback when sysfs could not be read). Parses whatever came before a failure:
    ``ibstat`` may exit 255 after valid output (``ibpanic: … stat of IB device … failed``)."""
    nics: list[Nic] = []
    ca: str | None = None
    ca_info: dict[str, str] = {}
    port: int | None = None
    port_info: dict[str, str] = {}

    def flush_port() -> None:
        if ca is not None and port is not None:
            nics.append(
                Nic(
                    name=ca,
                    port=port,
                    state=parse_ib_state(port_info.get("state")),
                    rate_gbps=parse_ib_rate(port_info.get("rate")),
                    link_layer=unknown_to_none(port_info.get("link layer")),
                    phys_state=parse_phys_state(port_info.get("physical state")),
                    hca_type=unknown_to_none(ca_info.get("ca type")),
                    fw_ver=unknown_to_none(ca_info.get("firmware version")),
                    source="ibstat",
                )
            )
        port_info.clear()

    for line in text.splitlines():
        head = re.match(r"^CA\s+'([^']+)'", line)
        if head:
            flush_port()
            ca, port = head.group(1), None
            ca_info = {}
            continue
        if ca is None:
            continue
        port_head = re.match(r"^\s+Port\s+(\d+):\s*$", line)
        if port_head:
            flush_port()
            port = int(port_head.group(1))
            continue
        if not line[:1].isspace():
            continue  # ibpanic and other unindented noise
        key, sep, value = line.strip().partition(":")
        if not sep:
            continue
        (port_info if port is not None else ca_info)[key.strip().lower()] = value.strip()
    flush_port()
    return tuple(sorted(nics, key=lambda n: (natural_key(n.name), n.port)))


def parse_ibstatus(text: str) -> tuple[Nic, ...]:
    """``ibstatus``: ``Infiniband device 'mlx5_0' port 1 status:`` blocks."""
    nics: list[Nic] = []
    current: tuple[str, int] | None = None
    info: dict[str, str] = {}

    def flush() -> None:
        if current is not None:
            nics.append(
                Nic(
                    name=current[0],
                    port=current[1],
                    state=parse_ib_state(info.get("state")),
                    rate_gbps=parse_ib_rate(info.get("rate")),
                    link_layer=unknown_to_none(info.get("link_layer")),
                    phys_state=parse_phys_state(info.get("phys state")),
                    source="ibstatus",
                )
            )
        info.clear()

    for line in text.splitlines():
        head = re.match(r"^\S.*?device\s+'([^']+)'\s+port\s+(\d+)", line)
        if head:
            flush()
            current = (head.group(1), int(head.group(2)))
            continue
        key, sep, value = line.strip().partition(":")
        if sep and current is not None:
            info[key.strip().lower()] = value.strip()
    flush()
    return tuple(sorted(nics, key=lambda n: (natural_key(n.name), n.port)))


def parse_ibv_devinfo(text: str) -> tuple[Nic, ...]:
    """``ibv_devinfo`` (with or without ``-v``; with or without the ``Device ports:`` line).

    The rate is only known with ``-v`` (``active_width`` × ``active_speed``)."""
    nics: list[Nic] = []
    hca: str | None = None
    hca_info: dict[str, str] = {}
    port: int | None = None
    info: dict[str, str] = {}

    def flush() -> None:
        if hca is not None and port is not None:
            width = re.match(r"(\d+)X", info.get("active_width", ""))
            speed = _float(info.get("active_speed"))
            rate = int(width.group(1)) * speed if width and speed is not None else None
            part = hca_info.get("vendor_part_id")
            nics.append(
                Nic(
                    name=hca,
                    port=port,
                    state=parse_ib_state(info.get("state")),
                    rate_gbps=rate,
                    link_layer=unknown_to_none(info.get("link_layer")),
                    phys_state=parse_phys_state(
                        re.sub(r"\s*\(\d+\)$", "", info.get("phys_state", "")) or None
                    ),
                    hca_type=f"MT{part}" if part and part.isdigit() else None,
                    fw_ver=unknown_to_none(hca_info.get("fw_ver")),
                    source="ibv_devinfo",
                )
            )
        info.clear()

    for line in text.splitlines():
        key, sep, value = line.strip().partition(":")
        key = key.strip().lower()
        value = value.strip()
        if not sep:
            continue
        if key == "hca_id":
            flush()
            hca, port, hca_info = value, None, {}
        elif key == "port" and value.isdigit():
            flush()
            port = int(value)
        elif port is not None:
            info[key] = value
        else:
            hca_info[key] = value
    flush()
    return tuple(sorted(nics, key=lambda n: (natural_key(n.name), n.port)))


_IBDEV2NETDEV = re.compile(
    r"^\s*(?:(?P<pci>[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7])\s+)?"
    r"(?P<dev>\S+)\s.*?\bport\s+(?P<port>\d+)(?:\s+\((?P<state>[A-Z_]+)\s*\))?"
    r"\s+==>\s+(?P<netdev>\S+)\s+\((?P<up>[^)]*)\)"
)


def parse_ibdev2netdev(text: str) -> tuple[NetdevLink, ...]:
    """``ibdev2netdev`` and ``ibdev2netdev -v``: RDMA device/port → netdev and its up/down."""
    out: list[NetdevLink] = []
    for line in text.splitlines():
        match = _IBDEV2NETDEV.match(line)
        if not match:
            continue
        up = match.group("up").strip().lower()
        out.append(
            NetdevLink(
                device=match.group("dev"),
                port=int(match.group("port")),
                netdev=match.group("netdev"),
                up=True if up == "up" else False if up == "down" else None,
                state=parse_ib_state(match.group("state")),
                pci_bus_id=normalize_pci_bus_id(match.group("pci")),
            )
        )
    return tuple(out)


def parse_nccl_topo_xml(text: str) -> NcclTopo:
    """An NCCL topology XML (dump or static ``NCCL_TOPO_FILE``) or graph XML (``<graphs>``).

    GPUs are ``<pci>`` of class 0x03xxxx (or holding a ``<gpu>``); NICs are class 0x02xxxx;
    ``<net>`` elements and per-GPU NVLink counts are read when present."""
    try:
        root = ET.fromstring(text)
    except ET.ParseError as exc:
        return NcclTopo(error=f"not NCCL topology XML: {exc}")
    if root.tag == "graphs":
        return NcclTopo(graphs=len(root.findall("graph")))
    gpus: list[str] = []
    nics: list[str] = []
    nvlinks: dict[str, int] = {}
    for pci in root.iter("pci"):
        bus = normalize_pci_bus_id(pci.get("busid")) or (pci.get("busid") or "")
        cls = (pci.get("class") or "").lower()
        gpu = pci.find("gpu")
        if gpu is not None or cls.startswith("0x03"):
            gpus.append(bus)
            if gpu is not None:
                total = sum(_int(link.get("count")) or 0 for link in gpu.findall("nvlink"))
                if total:
                    nvlinks[bus] = total
        elif cls.startswith("0x02"):
            nics.append(bus)
    nets = tuple(
        NcclNet(
            name=net.get("name") or "",
            speed_mbps=_int(net.get("speed")),
            port=_int(net.get("port")),
            gdr=None if net.get("gdr") is None else net.get("gdr") == "1",
        )
        for net in root.iter("net")
    )
    return NcclTopo(gpu_bus_ids=tuple(gpus), nic_bus_ids=tuple(nics), nets=nets, nvlinks=nvlinks)


# --------------------------------------------------------------------------------------------
# GPU ↔ NIC affinity
# --------------------------------------------------------------------------------------------


def attach_nic_affinity(
    nics: Sequence[Nic], topo: TopoMatrix, gpus: Sequence[Gpu]
) -> tuple[Nic, ...]:
    """Fill ``nearest_gpus`` / ``nearest_link`` of each NIC.

    First from ``topo -m`` cells (the GPUs with the best cell to that device; names already
    mapped through the NIC legend), else from NUMA: the GPUs whose NUMA node (``topo -m``
    affinity or sysfs) equals the NIC's.
    """
    out: list[Nic] = []
    for nic in nics:
        cells: dict[int, str] = {}
        for gpu_label in topo.gpus:
            cell = topo.cells.get(gpu_label, {}).get(nic.name)
            if cell is None:
                cell = topo.cells.get(nic.name, {}).get(gpu_label)
            if cell is not None:
                cells[int(gpu_label[3:])] = cell
        if cells:
            best = min(link_rank(c) for c in cells.values())
            nearest = tuple(sorted(i for i, c in cells.items() if link_rank(c) == best))
            best_cell = next(c for c in cells.values() if link_rank(c) == best)
            out.append(_replace_nic(nic, nearest, best_cell))
            continue
        if nic.numa_node is not None:
            same = tuple(
                sorted(
                    g.index
                    for g in gpus
                    if (g.numa_node if g.numa_node is not None else topo.gpu_numa_node(g.label))
                    == nic.numa_node
                )
            )
            if same:
                out.append(_replace_nic(nic, same, "NUMA"))
                continue
        out.append(nic)
    return tuple(out)


def _replace_nic(nic: Nic, nearest: tuple[int, ...], link: str) -> Nic:
    return replace(nic, nearest_gpus=nearest, nearest_link=link)


# --------------------------------------------------------------------------------------------
# Host facts: OS, interfaces, routes
# --------------------------------------------------------------------------------------------


def parse_os_release(text: str) -> str | None:
    """``/etc/os-release`` → ``PRETTY_NAME`` (else ``NAME VERSION_ID``)."""
    values: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            values[key.strip()] = value.strip().strip("\"'")
    if values.get("PRETTY_NAME"):
        return values["PRETTY_NAME"]
    name = " ".join(v for v in (values.get("NAME"), values.get("VERSION_ID")) if v)
    return name or None


def parse_ip_addr(text: str) -> tuple[NetInterface, ...]:
    """``ip -o -4 addr show``: one :class:`NetInterface` per interface with its IPv4 addresses."""
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        match = re.match(r"^\s*\d+:\s+([^\s@:]+)(?:@\S+)?:?\s+inet\s+([0-9.]+)(?:/\d+)?", line)
        if match:
            found.setdefault(match.group(1), []).append(match.group(2))
    return tuple(NetInterface(name, tuple(addrs)) for name, addrs in found.items())


def parse_proc_net_route(text: str) -> str | None:
    """``/proc/net/route`` → the interface of the default route (lowest metric)."""
    best: tuple[int, str] | None = None
    for line in text.splitlines()[1:]:
        cols = line.split()
        if len(cols) < 8 or cols[1] != "00000000" or cols[7] != "00000000":
            continue
        metric = _int(cols[6]) or 0
        if best is None or metric < best[0]:
            best = (metric, cols[0])
    return best[1] if best else None
