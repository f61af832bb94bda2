"""Topology facts of one host as frozen records: GPUs, the link matrix, RDMA NICs, interfaces.

Also what every consumer needs to compare links (:func:`link_rank`, :func:`link_class`,
:func:`is_p2p_by_default`), the GPU↔NIC affinity drawn from the matrix
(:func:`attach_nic_affinity`) and the ``dlrun topo --json`` shape of a host
(:func:`host_report_to_json`). :mod:`dlrun.topo.parse` builds these records from raw tool output.

Link cells are kept **as printed** by ``nvidia-smi topo -m``: the legacy ``SOC`` stays ``SOC``;
:func:`link_rank` treats it exactly like ``SYS``. Best to worst: ``X`` (self), ``NV#`` (more links
better), ``PIX``, ``PXB``, ``PHB``, ``NODE``, ``SYS``/``SOC``. PCI bus ids are matched in one
spelling (:func:`normalize_pci_bus_id`: ``0000:07:00.0``, lower case).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

_PCI = re.compile(
    r"^(?:(?P<dom>[0-9a-fA-F]{1,8}):)?(?P<bus>[0-9a-fA-F]{1,2}):(?P<dev>[0-9a-fA-F]{1,2})"
    r"\.(?P<fn>[0-7])$"
)


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


def visible_subset(gpus: Sequence[Gpu], cuda_visible: str) -> tuple[str, ...]:
    """The slots (as :attr:`HostReport.cuda_devices` names them) that ``CUDA_VISIBLE_DEVICES``
    leaves, read as CUDA reads it: comma-separated nvidia-smi indices, ``GPU-`` or ``MIG-``
    UUIDs or unique prefixes of them, up to the first entry that names no device or one named
    already (CUDA ignores the rest); ``""`` or ``-1`` leave none. An index is nvidia-smi's, which
    is CUDA's own where ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or the GPUs are all one model. A GPU
    with MIG on stands for its first MIG device."""
    def slot(gpu: Gpu) -> str | None:
        if gpu.mig:
            return next((m.uuid for m in gpu.mig_devices if m.uuid), None)
        return gpu.uuid or str(gpu.index)

    chosen: list[str] = []
    for entry in (e.strip() for e in cuda_visible.split(",")):
        found: str | None = None
        if entry.isdigit():
            found = next((slot(g) for g in gpus if g.index == int(entry)), None)
        elif entry.startswith("GPU-") and len(entry) > 4:
            named = [g for g in gpus if g.uuid and g.uuid.startswith(entry)]
            found = slot(named[0]) if len(named) == 1 else None
        elif entry.startswith("MIG-") and len(entry) > 4:
            named_mig = [m.uuid for g in gpus for m in g.mig_devices if m.uuid and m.uuid.startswith(entry)]
            found = named_mig[0] if len(named_mig) == 1 else None
        if found is None or found in chosen:
            break
        chosen.append(found)
    return tuple(chosen)


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
    torch: str | None = None  # the installed torch's version, e.g. 2.11.0+cu130
    torch_cuda: str | None = None  # the CUDA it was built with (None: a CPU build)
    nccl: str | None = None  # the NCCL package beside it
    keras: str | None = None
    tf_keras: str | None = None
    error: str | None = None
    hostname: str | None = None
    driver_version: str | None = None
    nvidia_smi: str | None = None  # path of the nvidia-smi that ran; None: not found
    topo: TopoMatrix = field(default_factory=TopoMatrix, hash=False)
    interfaces: tuple[NetInterface, ...] = ()
    notes: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()
    cuda_visible: str | None = None  # the host's own CUDA_VISIBLE_DEVICES (None: not set there)

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
        with MIG on and no MIG device holds none: CUDA sees nothing there); where the host sets
        ``CUDA_VISIBLE_DEVICES``, the devices it names."""
        if self.cuda_visible is not None:
            return len(self.cuda_devices)
        return sum(len(g.mig_devices) if g.mig else 1 for g in self.gpus)

    @property
    def cuda_devices(self) -> tuple[str, ...]:
        """One ``CUDA_VISIBLE_DEVICES`` value per GPU slot, for local rank *i* take item *i*.

        GPU UUIDs (``GPU-…``), or MIG device UUIDs (``MIG-…``) where MIG is on: UUIDs do not
        depend on ``CUDA_DEVICE_ORDER`` (CUDA's default order is not nvidia-smi's). A GPU whose
        UUID is unknown is given by its nvidia-smi index; a MIG device without a UUID (``-q``
        output has none) is left out. Where the host sets ``CUDA_VISIBLE_DEVICES`` (a user kept
        to some GPUs of a shared machine), only the devices it names, in its order
        (:func:`visible_subset`), as torchrun's ranks, which inherit it, would see.
        """
        if self.cuda_visible is not None:
            return visible_subset(self.gpus, self.cuda_visible)
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
        "torch": report.torch,
        "torch_cuda": report.torch_cuda,
        "nccl": report.nccl,
        "keras": report.keras,
        "tf_keras": report.tf_keras,
        "interfaces": [
            {"name": i.name, "ipv4": list(i.ipv4), "default_route": i.default_route}
            for i in report.interfaces
        ],
        "notes": list(report.notes),
        "problems": list(report.problems),
    }


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
