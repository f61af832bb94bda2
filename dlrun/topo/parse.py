"""Pure parsers of raw tool output into :mod:`dlrun.topo.records`: what the probe gathers.

``nvidia-smi --query-gpu`` CSV, ``nvidia-smi topo -m``, ``nvidia-smi -L``, the ``nvidia-smi``
header, the InfiniBand sysfs tree (a mapping of relative path to file content), ``ibstat`` (when
sysfs shows no RDMA device), ``/etc/os-release``, ``ip -o -4 addr`` and ``/proc/net/route``. Nothing
here runs a command or reads a file: :mod:`dlrun.remote.probe` gathers the text on the host,
:func:`dlrun.topo.probe.parse_probe_output` feeds it here.

Parsers do not raise on odd input: unknown values (``N/A``, ``[N/A]``, ``[Not Supported]``,
``[Requested functionality has been deprecated]``) become ``None``, and text that is not what was
expected (an error message, an empty capture) yields empty results.
"""

from __future__ import annotations

import csv
import re
import textwrap
from collections.abc import Mapping, Sequence

from dlrun.topo.records import (
    DeviceAffinity,
    Gpu,
    ListedGpu,
    MigDevice,
    NetInterface,
    Nic,
    TopoMatrix,
    natural_key,
    normalize_pci_bus_id,
)

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
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
