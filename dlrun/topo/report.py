"""The ``dlrun topo`` report as rich renderables: built here, printed by the CLI's console.

Hosts whose GPUs, links, NICs, driver and versions are the same share one section headed by
their names in hostlist form (``node[01-64]``); a section that differs from the largest one says
how. A section opens with a one-line summary (GPUs, NVLink, NICs, GPUDirect RDMA), then the host
facts, the GPU table, the ``topo -m`` matrix with compact labels (``GPU0``…, ``NIC0``… and a NIC
legend) and the RDMA NIC table. Then the findings, each once with its hosts, and the suggested
environment. The layout follows the console's width and never cuts a value: the matrix is whole
where it fits, else GPU↔GPU and GPU↔NIC apart, in column blocks where still too wide; columns
that cannot fit (UUID) are dropped (``--json`` has every field). Nothing here prints.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable, Mapping, Sequence

from rich import box
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.measure import Measurement
from rich.rule import Rule
from rich.table import Table
from rich.text import Text

from dlrun.topo.findings import Finding
from dlrun.topo.records import (
    LINK_CLASSES,
    HostReport,
    gpu_to_json,
    host_report_to_json,
    is_p2p_by_default,
    link_class,
    link_rank,
    natural_key,
)

#: Style of each link class, best to worst.
LINK_STYLES: Mapping[str, str] = {
    "X": "dim",
    "NV#": "bold green",
    "PIX": "green",
    "PXB": "cyan",
    "PHB": "yellow",
    "NODE": "dark_orange",
    "SYS": "red",
    "?": "magenta",
}
SEVERITY_STYLES: Mapping[str, str] = {"error": "bold red", "warning": "yellow", "info": "cyan"}
_GPU = re.compile(r"^GPU\d+$")
_TRAILING_NUMBER = re.compile(r"^(.*?)(\d+)$")
_WIDE = 100_000  # a width no table reaches: measures a table's natural width


def hostlist(names: Sequence[str]) -> str:
    """Host names in hostlist form: ``node01``…``node64`` → ``node[01-64]``, ``h1,h2,h3,h5`` →
    ``h[1-3,5]``; two names with one prefix stay listed (``h1,h2``). First-seen order."""
    groups: dict[str, list[str]] = {}
    order: list[tuple[str, str | None]] = []
    for name in dict.fromkeys(names):
        match = _TRAILING_NUMBER.match(name)
        if match is None:
            order.append((name, None))
            continue
        prefix = match.group(1)
        if prefix not in groups:
            groups[prefix] = []
            order.append((prefix, prefix))
        groups[prefix].append(match.group(2))
    out: list[str] = []
    for name, prefix in order:
        if prefix is None:
            out.append(name)
            continue
        numbers = groups[prefix]
        if len(numbers) < 3:
            out += [prefix + n for n in numbers]
        else:
            out.append(f"{prefix}[{','.join(_runs(numbers))}]")
    return ",".join(out)


def _runs(numbers: Sequence[str]) -> list[str]:
    """``["1", "2", "3", "5"]`` → ``["1-3", "5"]``; zero-padded numbers keep their width."""
    ordered = sorted(numbers, key=lambda n: (int(n), len(n)))
    runs: list[list[str]] = []
    for number in ordered:
        last = runs[-1][-1] if runs else None
        same_width = last is not None and (len(last) == len(number) or not number.startswith("0"))
        if last is not None and int(number) == int(last) + 1 and same_width:
            runs[-1].append(number)
        else:
            runs.append([number])
    return [run[0] if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs]


def link_cell(cell: str | None) -> Text:
    """One matrix cell, styled by its class (``SOC`` is styled as ``SYS``)."""
    if cell is None:
        return Text("")
    return Text(cell, style=LINK_STYLES[link_class(cell)])


# --------------------------------------------------------------------------------------------
# Grouping hosts, summaries, differences
# --------------------------------------------------------------------------------------------


def _profile(report: HostReport) -> str:
    """Everything that makes two hosts' sections the same, as one comparable string: the --json
    entry without the host's name, interfaces and GPU UUIDs, plus the whole matrix."""
    doc = host_report_to_json(report)
    for key in ("host", "hostname", "interfaces", "findings"):
        doc.pop(key, None)
    doc["gpus"] = _without_uuids(report)
    topo = report.topo
    doc["cells"] = {row: dict(cols) for row, cols in topo.cells.items()}
    doc["affinity"] = {d: [a.cpus, a.numa, a.gpu_numa_id] for d, a in topo.affinity.items()}
    doc["nic_legend"] = dict(topo.nic_legend)
    doc["topo_error"] = topo.error
    return json.dumps(doc, sort_keys=True, default=str)


def _without_uuids(report: HostReport) -> list[dict[str, object]]:
    gpus = [gpu_to_json(g) for g in report.gpus]
    for gpu in gpus:
        gpu.pop("uuid", None)
        gpu["mig_devices"] = [m.get("profile") for m in gpu["mig_devices"]]
    return gpus


def host_groups(reports: Sequence[HostReport]) -> list[list[HostReport]]:
    """Reports grouped by identical sections, in the order their first host appears."""
    groups: dict[str, list[HostReport]] = {}
    for report in reports:
        groups.setdefault(_profile(report), []).append(report)
    return list(groups.values())


def _gpu_labels(report: HostReport) -> list[str]:
    return [g.label for g in report.gpus] or sorted(
        (k for k in report.links if _GPU.match(k)), key=natural_key
    )


def _link(report: HostReport, a: str, b: str) -> str | None:
    return report.links.get(a, {}).get(b) or report.links.get(b, {}).get(a)


def _matrix_nics(report: HostReport) -> list[str]:
    if report.topo.nics:
        return list(report.topo.nics)
    cols = (col for cols in report.links.values() for col in cols if not _GPU.match(col))
    return list(dict.fromkeys(cols))


def gpu_summary(report: HostReport) -> str:
    """``8× H100 80GB HBM3`` (``4× A + 4× B`` when mixed; ``no GPU``)."""
    if not report.gpus:
        return "no GPU"
    counts: dict[str, int] = {}
    for gpu in report.gpus:
        name = gpu.name.removeprefix("NVIDIA ").strip() or "GPU"
        counts[name] = counts.get(name, 0) + 1
    return " + ".join(f"{n}× {name}" for name, n in counts.items())


def _nv_order(cell: str) -> int:
    digits = re.sub(r"\D", "", cell)
    return int(digits) if digits else 0


def link_summary(report: HostReport) -> str | None:
    """How the GPUs reach each other: ``NVLink all-to-all (NV18)``, ``NVLink on 16 of 28 GPU
    pairs (NV1/NV2), the rest SYS``, ``no NVLink: GPU pairs at NODE/SYS``; None for one GPU."""
    labels = _gpu_labels(report)
    cells = [c for i, a in enumerate(labels) for b in labels[i + 1 :] if (c := _link(report, a, b))]
    if not cells:
        return None
    nvlinks = sorted({c.strip().upper() for c in cells if link_class(c) == "NV#"}, key=_nv_order)
    others = [k for k in LINK_CLASSES if k != "NV#" and any(link_class(c) == k for c in cells)]
    if not others:
        return f"NVLink all-to-all ({'/'.join(nvlinks)})"
    rest = "/".join(others)
    if nvlinks:
        count = sum(1 for c in cells if link_class(c) == "NV#")
        return f"NVLink on {count} of {len(cells)} GPU pairs ({'/'.join(nvlinks)}), the rest {rest}"
    return f"no NVLink: GPU pairs at {rest}"


def _nearest_nics(report: HostReport) -> dict[str, tuple[str, list[str]]]:
    """For each GPU in the matrix: its best cell to a NIC (active ones where any is active) and
    the NICs at that cell."""
    nics = _matrix_nics(report)
    active = {n.name for n in report.nics if n.active} & set(nics)
    usable = [n for n in nics if n in active] or nics
    out: dict[str, tuple[str, list[str]]] = {}
    for gpu in _gpu_labels(report):
        cells = {nic: c for nic in usable if (c := _link(report, gpu, nic))}
        if cells:
            best = min(cells.values(), key=link_rank)
            out[gpu] = (best, [n for n, c in cells.items() if link_rank(c) == link_rank(best)])
    return out


def nic_summary(report: HostReport) -> list[str]:
    """``8 NICs at PIX, one per GPU`` and ``GPUDirect RDMA: yes``, or what there is instead."""
    nics = _matrix_nics(report)
    down = sum(1 for n in report.nics if not n.active)
    down_text = f" ({down} port{'s' if down != 1 else ''} not ACTIVE)" if down else ""
    if not nics:
        if not report.nics:
            return ["no RDMA NIC"]
        return [f"{len(report.nics)} RDMA port{'s' if len(report.nics) != 1 else ''}, not in the matrix{down_text}"]
    nearest = _nearest_nics(report)
    text = f"{len(nics)} NIC{'s' if len(nics) != 1 else ''}"
    if not nearest:
        return [text + down_text]
    classes = [k for k in (*LINK_CLASSES, "?") if any(link_class(c) == k for c, _ in nearest.values())]
    chosen = {nic for _, best in nearest.values() for nic in best}
    at = "/".join(classes)
    text += f" at {at}" if len(chosen) == len(nics) else f", {len(chosen)} at {at}"
    if all(len(best) == 1 for _, best in nearest.values()):
        per_nic: dict[str, int] = {}
        for _, (nic,) in nearest.values():
            per_nic[nic] = per_nic.get(nic, 0) + 1
        shares = set(per_nic.values())
        if shares == {1}:
            text += ", one per GPU"
        elif len(shares) == 1:
            text += f", one per {shares.pop()} GPUs"
    ok = sum(1 for cell, _ in nearest.values() if is_p2p_by_default(cell))
    gpus = len(nearest)
    gdr = "yes" if ok == gpus else "no" if ok == 0 else f"{ok} of {gpus} GPUs"
    return [text + down_text, f"GPUDirect RDMA: {gdr}"]


def summary_line(report: HostReport) -> Text:
    """The section's first line: GPUs · links · NICs · GPUDirect RDMA."""
    parts = [gpu_summary(report)]
    links = link_summary(report)
    if links:
        parts.append(links)
    parts += nic_summary(report)
    return Text(" · ".join(parts), style="bold")


def _facts(report: HostReport) -> dict[str, str]:
    return {
        "GPUs": gpu_summary(report),
        "links": link_summary(report) or "none",
        "NICs": "; ".join(nic_summary(report)),
        "driver": report.driver or "none",
        "CUDA": report.cuda_version or "none",
        "python": report.python or "unknown",
        "TensorFlow": report.tensorflow or "not installed",
        "torch": report.torch or "not installed",
        "NCCL": report.nccl or "none",
        "OS": report.os or "unknown",
        "CPUs": "unknown" if report.cpu_count is None else str(report.cpu_count),
        "NUMA nodes": "unknown" if report.numa_nodes is None else str(report.numa_nodes),
    }


def differences(report: HostReport, reference: HostReport) -> list[str]:
    """How ``report``'s section differs from ``reference``'s: ``driver 550.54.14 (not
    535.161.08)``; a difference no fact shows is named by the part where it lies."""
    mine, theirs = _facts(report), _facts(reference)
    found = [f"{key} {mine[key]} (not {theirs[key]})" for key in mine if mine[key] != theirs[key]]
    if found:
        return found
    if report.topo != reference.topo or report.links != reference.links:
        return ["the link matrix"]
    if report.nics != reference.nics:
        return ["the RDMA ports (see their table)"]
    if _without_uuids(report) != _without_uuids(reference):
        return ["the GPU details (see their table)"]
    return ["details shown below (--json has them all)"]


# --------------------------------------------------------------------------------------------
# Tables that fit the width
# --------------------------------------------------------------------------------------------


def _fits(console: Console, options: ConsoleOptions, renderable: RenderableType) -> bool:
    return Measurement.get(console, options.update_width(_WIDE), renderable).maximum <= options.max_width


def _table(title: str | None) -> Table:
    return Table(title=title, box=box.SIMPLE, title_justify="left", pad_edge=False)


def _row(table: Table, *cells: RenderableType) -> None:
    """A row whose plain strings are shown as written: host, GPU and NIC names come from the
    hosts and must not be read as rich markup (``a[/]b`` would raise)."""
    table.add_row(*(Text(c) if isinstance(c, str) else c for c in cells))


Column = tuple[str, str, Callable[[int], RenderableType]]  # header, justify, cell of row i


def _fitted_table(
    console: Console,
    options: ConsoleOptions,
    title: str,
    rows: int,
    columns: Sequence[Column],
    droppable: Sequence[str],
) -> Table:
    """The table with every column that fits: ``droppable`` headers go first, in that order."""
    dropped: set[str] = set()

    def build() -> Table:
        table = _table(title)
        kept = [c for c in columns if c[0] not in dropped]
        for header, justify, _ in kept:
            table.add_column(header, justify=justify, overflow="fold")  # type: ignore[arg-type]
        for i in range(rows):
            _row(table, *(cell(i) for _, _, cell in kept))
        return table

    table = build()
    for header in droppable:
        if _fits(console, options, table):
            break
        dropped.add(header)
        table = build()
    return table


def gpu_table(console: Console, options: ConsoleOptions, report: HostReport, one_host: bool) -> Table:
    """GPU index, model, memory, PCI bus id, NUMA node, MIG and (for one host, where it fits) UUID."""
    gpus = report.gpus

    def memory(i: int) -> str:
        mib = gpus[i].memory_mib
        return "" if mib is None else f"{mib / 1024:.0f} GiB"

    def mig(i: int) -> str:
        gpu = gpus[i]
        if gpu.mig is None:
            return "-"
        text = "on" if gpu.mig else "off"
        if gpu.mig_devices:
            profiles = ", ".join(m.profile for m in gpu.mig_devices if m.profile)
            text += f" ({len(gpu.mig_devices)}{': ' + profiles if profiles else ''})"
        return text

    columns: list[Column] = [
        ("GPU", "right", lambda i: str(gpus[i].index)),
        ("name", "left", lambda i: gpus[i].name),
        ("memory", "right", memory),
        ("bus id", "left", lambda i: gpus[i].pci_bus_id or ""),
        ("NUMA", "right", lambda i: "" if gpus[i].numa_node is None else str(gpus[i].numa_node)),
        ("MIG", "left", mig),
    ]
    if one_host:
        columns.append(("uuid", "left", lambda i: gpus[i].uuid or ""))
    return _fitted_table(console, options, "GPUs", len(gpus), columns, ("uuid", "bus id"))


def nic_table(console: Console, options: ConsoleOptions, report: HostReport) -> Table:
    """RDMA ports: name, port, state, rate, link layer, netdev, nearest GPUs."""
    nics = report.nics

    def state(i: int) -> Text:
        nic = nics[i]
        text = Text(nic.state or "?", style="green" if nic.active else "bold red")
        if nic.phys_state and not nic.active:
            text.append(f" ({nic.phys_state})", style="dim")
        return text

    def nearest(i: int) -> Text:
        nic = nics[i]
        text = Text(", ".join(f"GPU{g}" for g in nic.nearest_gpus))
        if nic.nearest_link:
            numa = nic.nearest_link == "NUMA"
            style = "dim" if numa else LINK_STYLES[link_class(nic.nearest_link)]
            text.append(" ").append(nic.nearest_link, style=style)
        return text

    columns: list[Column] = [
        ("name", "left", lambda i: nics[i].name),
        ("port", "right", lambda i: str(nics[i].port)),
        ("state", "left", state),
        ("rate Gb/s", "right", lambda i: "" if nics[i].rate_gbps is None else f"{nics[i].rate_gbps:g}"),
        ("link layer", "left", lambda i: nics[i].link_layer or ""),
        ("netdev", "left", lambda i: nics[i].netdev or ""),
        ("nearest GPUs", "left", nearest),
    ]
    return _fitted_table(console, options, "RDMA NICs", len(nics), columns, ("netdev",))


class LinkMatrix:
    """The ``topo -m`` matrix with compact labels, laid out for the width it is given."""

    def __init__(self, report: HostReport) -> None:
        topo = report.topo
        self.report = report
        devices = list(topo.devices) or list(report.links)
        self.gpus = [d for d in devices if _GPU.match(d)]
        self.nics = [d for d in devices if d not in self.gpus]
        by_name = {name: label for label, name in topo.nic_legend.items()}
        self.label = {g: g for g in self.gpus}
        for i, nic in enumerate(self.nics):
            self.label[nic] = by_name.get(nic, f"NIC{i}")
        values = [a for d in devices if (a := topo.affinity.get(d)) is not None]
        #: the affinity columns with a value on some row: header, DeviceAffinity attribute
        self.affinity_columns = [
            (header, attr) for header, attr in (("CPU affinity", "cpus"), ("NUMA", "numa"))
            if any(getattr(a, attr) for a in values)
        ]
        self.affinity = bool(self.affinity_columns)

    def cell(self, row: str, col: str) -> str | None:
        if row == col:
            return "X"
        return self.report.topo.cells.get(row, {}).get(col) or self.report.links.get(row, {}).get(col)

    def table(self, title: str | None, rows: Sequence[str], cols: Sequence[str], affinity: bool) -> Table:
        table = _table(title)
        table.add_column("", no_wrap=True, overflow="fold")
        for col in cols:
            table.add_column(Text(self.label[col]), justify="center", overflow="fold")
        shown = self.affinity_columns if affinity else []
        for header, _ in shown:
            table.add_column(header, overflow="fold")
        for row in rows:
            aff = self.report.topo.affinity.get(row)
            extra = [(getattr(aff, attr) or "") if aff else "" for _, attr in shown]
            _row(table, Text(self.label[row], style="bold"), *(link_cell(self.cell(row, c)) for c in cols), *extra)
        return table

    def blocks(
        self,
        console: Console,
        options: ConsoleOptions,
        title: str,
        cols: Sequence[str],
        affinity: bool,
    ) -> tuple[list[Table], bool]:
        """GPU rows × ``cols`` in as few column blocks as fit. With ``affinity``, the affinity
        columns go beside the last block where they fit; the second value says whether they did."""
        rows = self.gpus
        groups: list[list[str]] = [[]]
        for col in cols:
            trial = [*groups[-1], col]
            if groups[-1] and not _fits(console, options, self.table(None, rows, trial, False)):
                groups.append([col])
            else:
                groups[-1] = trial
        tables = [self.table(title if i == 0 else None, rows, g, False) for i, g in enumerate(groups)]
        if affinity:
            last = self.table(title if len(groups) == 1 else None, rows, groups[-1], True)
            if _fits(console, options, last):
                tables[-1] = last
                return tables, True
        return tables, False

    def legend(self, width: int) -> list[Text]:
        """``NIC0 = mlx5_0  NIC1 = mlx5_1 …`` in lines of at most ``width`` columns."""
        entries = [f"{self.label[n]} = {n}" for n in self.nics if self.label[n] != n]
        lines: list[str] = []
        for entry in entries:
            if lines and len(lines[-1]) + 2 + len(entry) <= width:
                lines[-1] += "  " + entry
            else:
                lines.append(entry)
        return [Text(line, style="dim") for line in lines]

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        devices = self.gpus + self.nics
        whole = self.table("Links (nvidia-smi topo -m)", devices, devices, self.affinity)
        if _fits(console, options, whole) or not self.gpus:
            yield whole
        else:
            title = "GPU↔GPU links (nvidia-smi topo -m)"
            tables, placed = self.blocks(console, options, title, self.gpus, self.affinity)
            if self.nics:
                title = "GPU↔NIC links"
                nic_tables, placed_here = self.blocks(console, options, title, self.nics, self.affinity and not placed)
                tables += nic_tables
                placed = placed or placed_here
            if self.affinity and not placed:
                tables.append(self.table(None, self.gpus, [], True))
            yield from tables
        yield from self.legend(options.max_width)


# --------------------------------------------------------------------------------------------
# Sections, findings, environment
# --------------------------------------------------------------------------------------------


def _host_line(report: HostReport, one_host: bool) -> Text:
    parts = [
        ("host", report.hostname if one_host and report.hostname and report.hostname != report.host else None),
        ("os", report.os),
        ("python", report.python),
        ("tensorflow", report.tensorflow),
        ("torch", report.torch),
        ("cuda", report.cuda_version),
        ("driver", report.driver),
        ("cpus", None if report.cpu_count is None else str(report.cpu_count)),
        ("numa nodes", None if report.numa_nodes is None else str(report.numa_nodes)),
    ]
    text = Text()
    for name, value in parts:
        if value is None:
            continue
        if text:
            text.append("  ")
        text.append(f"{name} ", style="dim")
        text.append(value)
    return text


def interfaces_line(reports: Sequence[HostReport]) -> Text:
    """``interfaces eth0 192.0.2.2 (default route)  lo 127.0.0.1``: what --iface and the
    inventory's ``iface`` can name. For several hosts: the names, where all hosts share them."""
    first = reports[0]
    text = Text("interfaces", style="dim")
    names = {tuple((i.name, i.default_route) for i in r.interfaces) for r in reports}
    if len(names) > 1:
        return text.append(" differ from host to host (--json has them)", style="dim")
    for iface in first.interfaces:
        text.append("  ").append(iface.name, style="bold")
        if iface.ipv4 and len(reports) == 1:
            text.append(" " + " ".join(iface.ipv4))
        if iface.default_route:
            text.append(" (default route)", style="dim")
    if len(reports) > 1:
        text.append("  (addresses: --json)", style="dim")
    return text


class TopoReport:
    """The whole ``dlrun topo`` report; laid out when printed, for the console's width."""

    def __init__(self, reports: Sequence[HostReport], findings: Sequence[Finding], env: Mapping[str, str],
                 note: str = "") -> None:
        self.groups = host_groups(reports)
        self.findings = findings
        self.env = env
        self.note = note
        probed = [g for g in self.groups if g[0].ok]
        self.reference = max(probed, key=len) if len(probed) > 1 else None

    def header(self, names: str, width: int) -> list[RenderableType]:
        title = Text(names, style="bold")
        if len(names) + 6 <= width:
            return [Rule(title, align="left")]
        return [Rule(), title]  # a Rule would cut a long title

    def section(self, console: Console, options: ConsoleOptions, group: Sequence[HostReport]) -> RenderResult:
        report = group[0]
        one = len(group) == 1
        yield from self.header(hostlist([r.host for r in group]), options.max_width)
        if not report.reachable:
            yield Text(f"unreachable: {report.error or 'no reason given'}", style="bold red")
            return
        if report.error:
            yield Text(f"probe failed: {report.error}", style="bold red")
        else:
            yield summary_line(report)
        if self.reference is not None and group is not self.reference and report.ok:
            ref = self.reference[0]
            text = Text(f"differs from {hostlist([r.host for r in self.reference])}: ", style="yellow")
            yield text.append("; ".join(differences(report, ref)))
        line = _host_line(report, one)
        if line:
            yield line
        if report.gpus:
            yield gpu_table(console, options, report, one)
        if report.topo.devices or report.links:
            yield LinkMatrix(report)
        elif report.topo.error:
            yield Text(f"topo -m: {report.topo.error}", style="dim")
        if report.nics:
            yield nic_table(console, options, report)
        if any(r.interfaces for r in group):
            yield interfaces_line(group)
        for problem in report.problems:
            yield Text(f"problem: {problem}", style="yellow")
        for note in report.notes:
            yield Text(f"note: {note}", style="dim")

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        for group in self.groups:
            yield from self.section(console, options, group)
        if any(g[0].topo.devices or g[0].links for g in self.groups):
            yield link_legend()
        yield findings_table(self.findings)
        yield env_lines(self.env, options.max_width)
        if self.note:
            yield Text(self.note, style="dim")


def merged_findings(findings: Sequence[Finding]) -> list[tuple[Finding, str]]:
    """Each finding once with the hosts it holds on, in hostlist form (``all`` for cross-host
    ones); the order (errors first) is kept."""
    hosts: dict[tuple[str, str, bool], list[str]] = {}
    first: dict[tuple[str, str, bool], Finding] = {}
    for finding in findings:
        key = (finding.severity, finding.message, finding.host is None)
        first.setdefault(key, finding)
        if finding.host is not None:
            hosts.setdefault(key, []).append(finding.host)
    return [(f, hostlist(hosts[k]) if k in hosts else "all") for k, f in first.items()]


def findings_table(findings: Sequence[Finding]) -> RenderableType:
    """Findings with their severity and hosts, each once; a plain line when there are none."""
    if not findings:
        return Text("No findings.", style="green")
    table = _table("Findings")
    table.add_column("severity", no_wrap=True)
    table.add_column("host", overflow="fold")
    table.add_column("finding", overflow="fold", ratio=1)
    for finding, hosts in merged_findings(findings):
        _row(table, Text(finding.severity, style=SEVERITY_STYLES.get(finding.severity, "")), hosts, finding.message)
    return table


def env_lines(env: Mapping[str, str], width: int = 80) -> RenderableType:
    """The suggested environment as shell ``export`` lines (values quoted); a line wider than
    ``width`` runs on at the edge, as a terminal wraps it, never broken after ``export``."""
    if not env:
        return Text("No environment to suggest.", style="dim")
    lines: list[RenderableType] = [Text("Suggested environment:", style="bold")]
    for key, value in env.items():
        line = f"  export {key}={shlex.quote(value)}"
        lines += [Text(line[i : i + width]) for i in range(0, len(line), max(1, width))]
    return Group(*lines)


def link_legend() -> Text:
    """One line naming the classes in their colors, best to worst."""
    text = Text("links, best to worst: ", style="dim")
    for name in ("NV#", "PIX", "PXB", "PHB", "NODE", "SYS"):
        text.append(name, style=LINK_STYLES[name])
        text.append(" ")
    text.append("(SOC = SYS; NCCL P2P/GPUDirect RDMA by default at PXB or better)", style="dim")
    return text


def render_topo(
    reports: Sequence[HostReport], findings: Sequence[Finding], env: Mapping[str, str], note: str = ""
) -> RenderableType:
    """The whole ``dlrun topo`` report, laid out for the console that prints it; ``note``: what
    ``dlrun launch`` does about the socket interfaces (``findings.socket_note``), under the env."""
    return TopoReport(reports, findings, env, note)
