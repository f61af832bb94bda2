"""The probe's output, parsed: :func:`parse_probe_output` turns what ``dlrun.remote.probe``
printed on a host into a :class:`~dlrun.topo.records.HostReport`; :func:`probe_local` runs that
probe on this machine (``dlrun topo`` without hosts).

The probe's JSON document (``version`` 1) carries raw tool output; the pure parsers of
:mod:`dlrun.topo.parse` give it meaning here. Missing tools become notes, failing or hung ones
problems (a broken driver or a hung GPU), and output that holds no document an error.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from dlrun.remote import boot_argv, boot_payload
from dlrun.topo.parse import (
    parse_cuda_version,
    parse_driver_version,
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
from dlrun.topo.records import Gpu, HostReport, NetInterface, TopoMatrix, attach_nic_affinity, visible_subset

PROBE_VERSION = 1

#: The probe program's source, for the agent's ``probe`` op (it runs the program inside itself).


def _load_document(stdout: str) -> dict[str, Any] | None:
    """The probe's JSON document: the whole stdout, else its last line that is a JSON object
    (a noisy login shell may print before it)."""
    candidates = [stdout.strip()] + [
        line.strip() for line in reversed(stdout.splitlines()) if line.strip().startswith("{")
    ]
    for candidate in candidates:
        try:
            doc = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(doc, dict):
            return doc
    return None


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _command(commands: Mapping[str, Any], name: str) -> dict[str, Any]:
    value = commands.get(name)
    return value if isinstance(value, dict) else {"missing": True, "argv": [name]}


def _command_stdout(cmd: Mapping[str, Any]) -> str:
    return _str(cmd.get("stdout")) or ""


def _command_note(cmd: Mapping[str, Any]) -> str | None:
    """A note for a command that did not simply succeed (missing tools are noted by the caller)."""
    argv = cmd.get("argv")
    shown = " ".join(str(a) for a in argv) if isinstance(argv, list) else "command"
    if cmd.get("missing"):
        return None
    if cmd.get("timed_out"):
        limit = cmd.get("timeout")
        after = f" after {limit:g} s" if isinstance(limit, int | float) else ""
        return f"{shown}: timed out{after}"
    if cmd.get("error"):
        return f"{shown}: {cmd.get('error')}"
    rc = cmd.get("rc")
    if rc not in (0, None):
        first = (_str(cmd.get("stderr")) or _command_stdout(cmd)).strip().splitlines()
        detail = f": {first[0]}" if first else ""
        return f"{shown}: exit {rc}{detail}"
    return None


def _merge_listed(gpus: tuple[Gpu, ...], listed_text: str) -> tuple[Gpu, ...]:
    """Add MIG devices from ``nvidia-smi -L`` (by UUID, else index); without query output, the
    GPUs of ``-L`` themselves."""
    listed = parse_smi_L(listed_text)
    if not gpus:
        return tuple(
            Gpu(
                index=g.index,
                name=g.name,
                uuid=g.uuid,
                mig=True if g.mig_devices else None,
                mig_devices=g.mig_devices,
            )
            for g in listed
        )
    by_uuid = {g.uuid: g for g in listed if g.uuid}
    by_index = {g.index: g for g in listed}
    out = []
    for gpu in gpus:
        match = by_uuid.get(gpu.uuid) if gpu.uuid else None
        match = match or by_index.get(gpu.index)
        if match is not None and match.mig_devices:
            mig = True if gpu.mig is None else gpu.mig
            gpu = replace(gpu, mig_devices=match.mig_devices, mig=mig)
        out.append(gpu)
    return tuple(out)


def _listed_interfaces(raw: Any) -> tuple[NetInterface, ...]:
    """The probe's own list of interfaces (``interfaces_netlink``, ``interfaces_ioctl``):
    ``[{"name", "ipv4": [...]}]``, wrong types skipped."""
    items: list[NetInterface] = []
    if isinstance(raw, list):
        for item in raw:
            if isinstance(item, dict) and isinstance(item.get("name"), str):
                addrs = item.get("ipv4")
                listed = addrs if isinstance(addrs, list) else []
                items.append(NetInterface(item["name"], tuple(a for a in listed if isinstance(a, str))))
    return tuple(items)


def _interfaces(doc: Mapping[str, Any], ip_cmd: Mapping[str, Any]) -> tuple[NetInterface, ...]:
    """From the kernel's netlink dump, or where the probe fell back, ``ip``'s output, then the ioctl list."""
    found = _listed_interfaces(doc.get("interfaces_netlink"))
    if not found and ip_cmd.get("rc") == 0:
        found = parse_ip_addr(_command_stdout(ip_cmd))
    if not found:
        found = _listed_interfaces(doc.get("interfaces_ioctl"))
    default = parse_proc_net_route(_str(doc.get("proc_net_route")) or "")
    return tuple(replace(i, default_route=i.name == default) for i in found)


def parse_probe_output(host: str, stdout: str) -> HostReport:
    """Turn the probe's stdout into a :class:`HostReport` (pure; never raises on bad input).

    Output that holds no probe document gives a reachable report with ``error`` set.
    """
    doc = _load_document(stdout)
    if doc is None:
        tail = stdout.strip().splitlines()[-3:]
        detail = f": {' | '.join(tail)}" if tail else " (empty output)"
        return HostReport(host=host, error=f"the probe printed no JSON document{detail}")
    notes: list[str] = []
    problems: list[str] = []
    error: str | None = None
    if doc.get("version") != PROBE_VERSION:
        notes.append(f"probe document version {doc.get('version')!r}, expected {PROBE_VERSION}")
    fatal = _str(doc.get("fatal"))
    if fatal:
        error = "the probe failed: " + fatal.strip().splitlines()[0]

    raw_commands = doc.get("commands")
    commands: Mapping[str, Any] = raw_commands if isinstance(raw_commands, dict) else {}
    query = _command(commands, "query_gpu")
    topo_cmd = _command(commands, "topo")
    list_cmd = _command(commands, "list")
    header = _command(commands, "header")
    nvidia_smi = _str(query.get("path")) or _str(header.get("path"))
    if nvidia_smi is None and commands:
        notes.append("nvidia-smi: not found on PATH (no NVIDIA GPU facts)")
    smi_failures = [
        note
        for name in ("query_gpu", "topo", "list", "header")
        if name in commands and (note := _command_note(_command(commands, name)))
    ]
    details = {note.split(": ", 1)[-1] for note in smi_failures}
    if len(smi_failures) > 1 and len(details) == 1:
        smi_failures = [f"nvidia-smi: {details.pop()}"]  # one broken driver, said once
    problems += smi_failures
    refused = _command_note(_command(commands, "query_gpu_full"))
    if refused and query.get("rc") == 0:
        notes.append(f"{refused} (retried with the basic fields)")
    for name in ("ibstat", "ip_addr"):
        note = _command_note(_command(commands, name)) if name in commands else None
        if note:
            (problems if "timed out" in note else notes).append(note)

    gpus = parse_query_gpu_csv(_command_stdout(query))
    gpus = _merge_listed(gpus, _command_stdout(list_cmd))
    topo = parse_topo_matrix(_command_stdout(topo_cmd)) if nvidia_smi else TopoMatrix()
    header_text = _command_stdout(header)
    cuda = parse_cuda_version(header_text)
    driver = parse_driver_version(header_text)

    raw_sysfs = doc.get("sysfs")
    sysfs = (
        {k: v for k, v in raw_sysfs.items() if isinstance(k, str) and isinstance(v, str)}
        if isinstance(raw_sysfs, dict)
        else {}
    )
    pci_numa = parse_sysfs_pci_numa(sysfs)
    gpus = tuple(
        replace(
            g,
            numa_node=topo.gpu_numa_node(g.label)
            if topo.gpu_numa_node(g.label) is not None
            else pci_numa.get(g.pci_address or ""),
        )
        for g in gpus
    )
    nics = parse_sysfs_ib(sysfs)
    if not nics and "ibstat" in commands:
        nics = parse_ibstat(_command_stdout(_command(commands, "ibstat")))
    nics = attach_nic_affinity(nics, topo, gpus)
    if not nics:
        notes.append("no RDMA (InfiniBand/RoCE) device")

    cuda_visible = doc.get("cuda_visible_devices")
    cuda_visible = cuda_visible if isinstance(cuda_visible, str) else None
    if cuda_visible is not None and gpus:
        kept = len(visible_subset(gpus, cuda_visible))
        notes.append(f"CUDA_VISIBLE_DEVICES={cuda_visible!r} on this host: jobs use {kept} of its GPUs")
    numa = doc.get("numa_nodes")
    tf = doc.get("tensorflow")
    fw_doc = doc.get("frameworks")
    fw: dict[str, Any] = fw_doc if isinstance(fw_doc, dict) else {}
    torch_doc = fw.get("torch")
    torch: dict[str, Any] = torch_doc if isinstance(torch_doc, dict) else {}
    return HostReport(
        host=host,
        reachable=True,
        gpus=gpus,
        cuda_version=cuda,
        links=topo.links,
        nics=nics,
        cpu_count=_int(doc.get("cpu_count")),
        numa_nodes=len(numa) if isinstance(numa, list) and numa else None,
        os=parse_os_release(_str(doc.get("os_release")) or "") or _str(doc.get("platform")),
        python=_str(doc.get("python")),
        tensorflow=_str(tf.get("version")) if isinstance(tf, dict) else None,
        torch=_str(torch.get("version")),
        torch_cuda=_str(torch.get("cuda")),
        nccl=_str(torch.get("nccl")),
        keras=_str(fw.get("keras")),
        tf_keras=_str(fw.get("tf_keras")),
        error=error,
        hostname=_str(doc.get("hostname")),
        driver_version=driver,
        nvidia_smi=nvidia_smi,
        topo=topo,
        interfaces=_interfaces(doc, _command(commands, "ip_addr")),
        notes=tuple(notes),
        problems=tuple(problems),
        cuda_visible=cuda_visible,
    )


# --- the one impure part: run the probe on this machine (``dlrun topo`` without --hosts) -----


def probe_local(
    host: str = "localhost", python: str | None = None, timeout: float = 120.0
) -> HostReport:
    """Run the probe here with ``python`` (default: this interpreter) and parse what it printed.

    A probe that cannot start, times out or exits non-zero without a document gives a report
    with ``error`` set; nothing is raised.
    """
    import subprocess
    import sys

    argv = boot_argv([python or sys.executable], "probe")
    try:
        proc = subprocess.run(argv, input=boot_payload("probe"), capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return HostReport(host=host, error=f"the probe timed out after {timeout:g} s")
    except OSError as exc:
        return HostReport(host=host, error=f"the probe could not start ({argv[0]}): {exc}")
    report = parse_probe_output(host, proc.stdout.decode(errors="replace"))
    if report.error and proc.returncode != 0:
        stderr = proc.stderr.decode(errors="replace").strip().splitlines()[-1:] or [""]
        error = f"{report.error} (exit {proc.returncode}) {stderr[0]}".strip()
        report = replace(report, error=error)
    return report
