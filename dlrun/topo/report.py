"""The ``dlrun topo`` report as rich renderables: built here, printed by the CLI's console.

Per host: a header line (hostname, OS, python, TensorFlow, CUDA, driver, CPUs, NUMA nodes), a
GPU table, the ``topo -m`` link matrix colored by class (NV# best … SYS worst, legacy SOC drawn
as SYS), the RDMA NIC table (name, port, state, rate Gb/s, link layer, netdev, nearest GPUs) and
the host's notes. Then the findings, then the suggested environment as ``export`` lines.
Nothing here creates a Console or prints.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence

from rich import box
from rich.console import Group, RenderableType
from rich.rule import Rule
from rich.table import Table
from rich.text import Text

from dlrun.topo.findings import Finding
from dlrun.topo.records import HostReport, link_class

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


def link_cell(cell: str | None) -> Text:
    """One matrix cell, styled by its class (``SOC`` is styled as ``SYS``)."""
    if cell is None:
        return Text("")
    return Text(cell, style=LINK_STYLES[link_class(cell)])


def _host_line(report: HostReport) -> Text:
    parts = [
        ("host", report.hostname if report.hostname and report.hostname != report.host else None),
        ("os", report.os),
        ("python", report.python),
        ("tensorflow", report.tensorflow),
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


def gpu_table(report: HostReport) -> Table:
    """GPU index, model, memory, PCI bus id, NUMA node, MIG, UUID."""
    table = Table(title="GPUs", box=box.SIMPLE, title_justify="left")
    for col in ("GPU", "name", "memory", "bus id", "NUMA", "MIG", "uuid"):
        table.add_column(col, justify="right" if col in ("GPU", "memory", "NUMA") else "left")
    for gpu in report.gpus:
        mig = "-"
        if gpu.mig is not None:
            mig = "on" if gpu.mig else "off"
            if gpu.mig_devices:
                profiles = ", ".join(m.profile for m in gpu.mig_devices if m.profile)
                mig += f" ({len(gpu.mig_devices)}{': ' + profiles if profiles else ''})"
        _row(
            table,
            str(gpu.index),
            gpu.name,
            "" if gpu.memory_mib is None else f"{gpu.memory_mib / 1024:.0f} GiB",
            gpu.pci_bus_id or "",
            "" if gpu.numa_node is None else str(gpu.numa_node),
            mig,
            gpu.uuid or "",
        )
    return table


def _row(table: Table, *cells: RenderableType) -> None:
    """A row whose plain strings are shown as written: host, GPU and NIC names come from the
    hosts and must not be read as rich markup (``a[/]b`` would raise)."""
    table.add_row(*(Text(c) if isinstance(c, str) else c for c in cells))


def link_matrix(report: HostReport) -> Table:
    """The ``topo -m`` matrix of GPUs and NICs with CPU/NUMA affinity, cells colored by class."""
    topo = report.topo
    devices = list(topo.devices) or list(report.links)
    table = Table(title="Links (nvidia-smi topo -m)", box=box.SIMPLE, title_justify="left")
    table.add_column("")
    for device in devices:
        table.add_column(Text(device), justify="center")
    table.add_column("CPU affinity")
    table.add_column("NUMA")
    for row in devices:
        row_cells = topo.cells.get(row) or report.links.get(row, {})
        aff = topo.affinity.get(row)
        _row(
            table,
            Text(row, style="bold"),
            *[link_cell("X" if col == row else row_cells.get(col)) for col in devices],
            (aff.cpus or "") if aff else "",
            (aff.numa or "") if aff else "",
        )
    return table


def nic_table(report: HostReport) -> Table:
    """RDMA ports: name, port, state, rate, link layer, netdev, nearest GPUs."""
    table = Table(title="RDMA NICs", box=box.SIMPLE, title_justify="left")
    for col in ("name", "port", "state", "rate Gb/s", "link layer", "netdev", "nearest GPUs"):
        table.add_column(col, justify="right" if col in ("port", "rate Gb/s") else "left")
    for nic in report.nics:
        state = Text(nic.state or "?", style="green" if nic.active else "bold red")
        if nic.phys_state and not nic.active:
            state.append(f" ({nic.phys_state})", style="dim")
        nearest = Text(", ".join(f"GPU{i}" for i in nic.nearest_gpus))
        if nic.nearest_link:
            nearest.append(" ")
            numa = nic.nearest_link == "NUMA"
            style = "dim" if numa else LINK_STYLES[link_class(nic.nearest_link)]
            nearest.append(nic.nearest_link, style=style)
        _row(
            table,
            nic.name,
            str(nic.port),
            state,
            "" if nic.rate_gbps is None else f"{nic.rate_gbps:g}",
            nic.link_layer or "",
            nic.netdev or "",
            nearest,
        )
    return table


def interfaces_line(report: HostReport) -> Text:
    """``interfaces eth0 192.0.2.2 (default route)  lo 127.0.0.1``: what --iface and the
    inventory's ``iface`` can name (the names differ from host to host)."""
    text = Text("interfaces", style="dim")
    for iface in report.interfaces:
        text.append("  ").append(iface.name, style="bold")
        if iface.ipv4:
            text.append(" " + " ".join(iface.ipv4))
        if iface.default_route:
            text.append(" (default route)", style="dim")
    return text


def host_section(report: HostReport) -> RenderableType:
    """Everything about one host."""
    parts: list[RenderableType] = [Rule(Text(report.host, style="bold"), align="left")]
    if not report.reachable:
        parts.append(Text(f"unreachable: {report.error or 'no reason given'}", style="bold red"))
        return Group(*parts)
    if report.error:
        parts.append(Text(f"probe failed: {report.error}", style="bold red"))
    line = _host_line(report)
    if line:
        parts.append(line)
    if report.gpus:
        parts.append(gpu_table(report))
    if report.topo.devices or report.links:
        parts.append(link_matrix(report))
    elif report.topo.error:
        parts.append(Text(f"topo -m: {report.topo.error}", style="dim"))
    if report.nics:
        parts.append(nic_table(report))
    if report.interfaces:
        parts.append(interfaces_line(report))
    for problem in report.problems:
        parts.append(Text(f"problem: {problem}", style="yellow"))
    for note in report.notes:
        parts.append(Text(f"note: {note}", style="dim"))
    return Group(*parts)


def findings_table(findings: Sequence[Finding]) -> RenderableType:
    """Findings with their severity and host; a plain line when there are none."""
    if not findings:
        return Text("No findings.", style="green")
    table = Table(title="Findings", box=box.SIMPLE, title_justify="left")
    table.add_column("severity")
    table.add_column("host")
    table.add_column("finding", overflow="fold")
    for finding in findings:
        _row(
            table,
            Text(finding.severity, style=SEVERITY_STYLES.get(finding.severity, "")),
            finding.host or "all",
            finding.message,
        )
    return table


def env_lines(env: Mapping[str, str]) -> RenderableType:
    """The suggested environment as shell ``export`` lines (values quoted)."""
    if not env:
        return Text("No environment to suggest.", style="dim")
    text = Text("Suggested environment:\n", style="bold")
    for key, value in env.items():
        text.append(f"  export {key}={shlex.quote(value)}\n")
    text.rstrip()
    return text


def link_legend() -> Text:
    """One line naming the classes in their colors, best to worst."""
    text = Text("links, best to worst: ", style="dim")
    for name in ("NV#", "PIX", "PXB", "PHB", "NODE", "SYS"):
        text.append(name, style=LINK_STYLES[name])
        text.append(" ")
    text.append("(SOC = SYS; NCCL P2P/GPUDirect RDMA by default at PXB or better)", style="dim")
    return text


def render_topo(
    reports: Sequence[HostReport], findings: Sequence[Finding], env: Mapping[str, str]
) -> RenderableType:
    """The whole ``dlrun topo`` report as one :class:`rich.console.Group`."""
    parts: list[RenderableType] = [host_section(r) for r in reports]
    if any(r.topo.devices or r.links for r in reports):
        parts.append(link_legend())
    parts.append(findings_table(findings))
    parts.append(env_lines(env))
    return Group(*parts)
