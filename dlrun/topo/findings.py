"""Judging host reports: findings with a severity, the suggested environment, the --json document.

Pure: takes :class:`~dlrun.topo.records.HostReport` records, returns records. ``dlrun topo`` shows
the findings and exits 1 when one is an ``error`` (:func:`exit_code`); ``dlrun launch`` stops on
an error finding unless ``--no-preflight``.

Severities, on purpose:

- ``error`` — the job cannot run as asked: a host unreachable or its probe failed; more slots
  than GPUs (GPU slots count MIG devices where MIG is on) on a host that has GPUs.
- ``warning`` — it runs, but slower or fragile: GPU count or model differs across hosts; driver,
  CUDA, python (major.minor) or TensorFlow versions differ; an RDMA port not ACTIVE, or slower
  than its peers (same link layer and HCA type, on any host); GPUs whose P2P graph at NCCL's
  default level (PXB or better, NVLink included) is split, so some traffic must take a
  PHB/NODE/SYS path; on a multi-host job, a GPU with no NIC at PXB or better (no GPUDirect RDMA
  by NCCL's default); a tool that failed or timed out (``HostReport.problems``).
- ``info`` — worth knowing: PHB/NODE/SYS pairs when every GPU still reaches the others over P2P
  paths (DGX-1 hybrid cube mesh); python patch levels differ; MIG enabled; HCA names that differ
  across hosts (which is why ``NCCL_IB_HCA`` lists them all).

The socket interface follows ``dlrun launch``'s one rule (``dlrun.run.addresses.host_ifaces``):
the caller passes launch's choice per host, and ``socket_note`` says what launch will do.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from dlrun.topo.records import (
    HostReport,
    Nic,
    host_report_to_json,
    is_p2p_by_default,
    link_class,
    link_rank,
    natural_key,
)

if TYPE_CHECKING:
    from dlrun.render import SocketIface

Severity = Literal["error", "warning", "info"]
SEVERITIES: tuple[Severity, ...] = ("error", "warning", "info")

_MAX_LISTED = 8


@dataclass(frozen=True)
class Finding:
    """One judgement about the hosts; ``host`` is None for a cross-host finding."""

    severity: Severity
    message: str
    host: str | None = None


def has_errors(findings: Iterable[Finding]) -> bool:
    """True when any finding is an ``error``."""
    return any(f.severity == "error" for f in findings)


def exit_code(findings: Iterable[Finding]) -> int:
    """``dlrun topo``'s exit status: 1 with error findings, else 0."""
    return 1 if has_errors(findings) else 0


def _listed(items: Sequence[str]) -> str:
    shown = ", ".join(items[:_MAX_LISTED])
    if len(items) > _MAX_LISTED:
        shown += f" and {len(items) - _MAX_LISTED} more"
    return shown


def _by_value(values: Mapping[str, str]) -> str:
    """``{"h1": "a", "h2": "b", "h3": "a"}`` → ``a on h1, h3; b on h2``."""
    groups: dict[str, list[str]] = {}
    for host, value in values.items():
        groups.setdefault(value, []).append(host)
    return "; ".join(f"{value} on {_listed(hosts)}" for value, hosts in groups.items())


def _differs(what: str, values: Mapping[str, str], severity: Severity = "warning") -> list[Finding]:
    if len(set(values.values())) <= 1:
        return []
    return [Finding(severity, f"{what} differ across hosts: {_by_value(values)}")]


def _major_minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def _cross_host(ok: Sequence[HostReport], torch_severity: Severity = "warning") -> list[Finding]:
    found: list[Finding] = []
    if len(ok) < 2:
        return found
    found += _differs("GPU counts", {r.host: str(len(r.gpus)) for r in ok})
    models = {r.host: " + ".join(sorted({g.name for g in r.gpus})) for r in ok if r.gpus}
    found += _differs("GPU models", models)
    found += _differs("NVIDIA driver versions", {r.host: r.driver for r in ok if r.driver})
    found += _differs("CUDA versions", {r.host: r.cuda_version for r in ok if r.cuda_version})
    pythons = {r.host: r.python for r in ok if r.python}
    minor = _differs("Python versions", {h: _major_minor(v) for h, v in pythons.items()})
    found += minor or _differs("Python patch levels", pythons, "info")
    if any(r.tensorflow for r in ok):
        found += _differs(
            "TensorFlow versions", {r.host: r.tensorflow or "not installed" for r in ok}
        )
    if any(r.torch for r in ok):  # the classic multi-node hang: ranks that disagree on NCCL or torch
        found += _differs("torch versions", {r.host: r.torch or "not installed" for r in ok}, torch_severity)
        found += _differs("torch CUDA builds", {r.host: r.torch_cuda or "none (CPU build)" for r in ok if r.torch},
                          torch_severity)
        found += _differs("NCCL versions", {r.host: r.nccl or "not installed" for r in ok if r.torch}, torch_severity)
    return found


def _per_host_gpus(report: HostReport, multi_host: bool) -> list[Finding]:
    found: list[Finding] = []
    host = report.host
    names = sorted({g.name for g in report.gpus})
    if len(names) > 1:
        found.append(Finding("warning", f"mixed GPU models on one host: {', '.join(names)}", host))
    for gpu in report.gpus:
        if gpu.mig and gpu.mig_devices:
            count = f" ({len(gpu.mig_devices)} MIG devices)"
            found.append(Finding("info", f"MIG is enabled on GPU{gpu.index}{count}", host))
        elif gpu.mig:
            found.append(
                Finding(
                    "warning",
                    f"MIG is enabled on GPU{gpu.index} but no MIG device is listed: "
                    "CUDA sees no device there",
                    host,
                )
            )
    found += _p2p(report)
    found += _gpu_nic(report, multi_host)
    return found


def _p2p(report: HostReport) -> list[Finding]:
    labels = [g.label for g in report.gpus] or [k for k in report.links if k.startswith("GPU")]
    bad: list[str] = []
    adjacent: dict[str, set[str]] = {label: set() for label in labels}
    for i, a in enumerate(labels):
        for b in labels[i + 1 :]:
            cell = report.links.get(a, {}).get(b) or report.links.get(b, {}).get(a)
            if cell is None or link_class(cell) == "?":
                continue
            if is_p2p_by_default(cell):
                adjacent[a].add(b)
                adjacent[b].add(a)
            else:
                bad.append(f"{a}-{b} ({cell})")
    if not bad:
        return []
    # Is the P2P graph connected? Then NCCL's rings still find P2P paths (DGX-1 cube mesh).
    seen = {labels[0]}
    todo = [labels[0]]
    while todo:
        for nxt in adjacent[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    split = len(seen) < len(labels)
    severity: Severity = "warning" if split else "info"
    tail = (
        "NCCL will route some traffic through host memory"
        if split
        else "every GPU still reaches the others over P2P paths"
    )
    return [
        Finding(
            severity,
            f"{len(bad)} GPU pair(s) without NVLink and with only a PHB/NODE/SYS path (no P2P "
            f"by NCCL's default): {_listed(bad)}; {tail}",
            report.host,
        )
    ]


def _gpu_nic(report: HostReport, multi_host: bool) -> list[Finding]:
    topo_nics = set(report.topo.nics) or {
        col for cols in report.links.values() for col in cols if not col.startswith("GPU")
    }
    if not topo_nics:
        return []
    active = {n.name for n in report.nics if n.active} & topo_nics
    candidates = active or topo_nics
    lonely: list[str] = []
    for gpu_label in sorted(report.links, key=natural_key):
        if not gpu_label.startswith("GPU"):
            continue
        cells = [c for col, c in report.links[gpu_label].items() if col in candidates]
        if cells and not any(is_p2p_by_default(c) for c in cells):
            best = min(cells, key=link_rank)
            lonely.append(f"{gpu_label} (best {best})")
    if not lonely:
        return []
    which = "active NIC" if active else "NIC"
    severity: Severity = "warning" if multi_host else "info"
    return [
        Finding(
            severity,
            f"{len(lonely)} GPU(s) with no {which} at PXB or better (no GPUDirect RDMA by NCCL's "
            f"default): {_listed(lonely)}",
            report.host,
        )
    ]


def _ports(ok: Sequence[HostReport]) -> list[Finding]:
    found: list[Finding] = []
    for report in ok:
        down = [
            f"{n.name} port {n.port} {n.state or 'state unknown'}"
            + (f" ({n.phys_state})" if n.phys_state else "")
            for n in report.nics
            if not n.active
        ]
        if down:
            found.append(
                Finding("warning", f"RDMA port(s) not ACTIVE: {_listed(down)}", report.host)
            )
    peers: dict[tuple[str, str], list[tuple[str, Nic]]] = {}
    for report in ok:
        for nic in report.nics:
            if nic.active and nic.rate_gbps is not None:
                key = (nic.link_layer or "?", nic.hca_type or "?")
                peers.setdefault(key, []).append((report.host, nic))
    for (layer, hca), members in peers.items():
        best = max(n.rate_gbps or 0.0 for _, n in members)
        slow: dict[str, list[str]] = {}
        for host, nic in members:
            if (nic.rate_gbps or 0.0) < best:
                slow.setdefault(host, []).append(f"{nic.name} port {nic.port} at {nic.rate_gbps:g}")
        kind = layer if hca == "?" else f"{layer} {hca}"
        for host, ports in slow.items():
            found.append(
                Finding(
                    "warning",
                    f"RDMA port(s) slower than their peers ({kind} at {best:g} Gb/s): "
                    f"{_listed(ports)} Gb/s",
                    host,
                )
            )
    return found


def _slots(ok: Sequence[HostReport], slots_by_host: Mapping[str, int] | None) -> list[Finding]:
    found: list[Finding] = []
    for report in ok:
        slots = (slots_by_host or {}).get(report.host)
        if slots is None or not report.gpus:
            continue
        capacity = report.gpu_slots
        if capacity == 0 and report.cuda_visible is not None:
            continue  # the host's CUDA_VISIBLE_DEVICES leaves no GPU (hidden on purpose): a CPU host for jobs
        if slots > capacity:
            unit = "GPU slots (MIG devices counted)" if capacity != len(report.gpus) else "GPUs"
            if report.cuda_visible is not None:
                unit = f"GPUs that the host's CUDA_VISIBLE_DEVICES={report.cuda_visible!r} leaves"
            found.append(
                Finding(
                    "error",
                    f"{slots} slots but only {capacity} {unit}: ranks would have to share a GPU",
                    report.host,
                )
            )
    return found


def analyse(
    reports: Sequence[HostReport], slots_by_host: Mapping[str, int] | None = None, *, torch_job: bool = False
) -> tuple[Finding, ...]:
    """All findings for these hosts, errors first, then warnings, then infos (stable within).
    ``torch_job``: a torch or Horovod job is about to start, so a torch, CUDA-build or NCCL
    difference across its hosts is an error, not a warning."""
    found: list[Finding] = []
    for report in reports:
        if not report.reachable:
            reason = report.error or "no reason given"
            found.append(Finding("error", f"unreachable: {reason}", report.host))
        elif report.error:
            found.append(Finding("error", f"probe failed: {report.error}", report.host))
    ok = [r for r in reports if r.ok]
    found += _cross_host(ok, "error" if torch_job else "warning")
    multi_host = len(reports) > 1
    for report in ok:
        found += _per_host_gpus(report, multi_host)
        found += [Finding("warning", problem, report.host) for problem in report.problems]
    found += _ports(ok)
    found += _slots(ok, slots_by_host)
    found += _env_plan(ok)[1]
    order = {s: i for i, s in enumerate(SEVERITIES)}
    return tuple(sorted(found, key=lambda f: order[f.severity]))


# --------------------------------------------------------------------------------------------
# Suggested environment
# --------------------------------------------------------------------------------------------


def _hcas(report: HostReport) -> list[str]:
    """``name:port`` of the host's active HCAs: InfiniBand if any, else RoCE; the fastest only
    (a 100 Gb/s front-end port next to 400 Gb/s back-end ports is left out)."""
    active = [n for n in report.nics if n.active]
    chosen = [n for n in active if n.link_layer == "InfiniBand"] or [
        n for n in active if n.link_layer == "Ethernet"
    ]
    rates = [n.rate_gbps for n in chosen if n.rate_gbps is not None]
    if rates:
        chosen = [n for n in chosen if n.rate_gbps is None or n.rate_gbps == max(rates)]
    chosen.sort(key=lambda n: (natural_key(n.name), n.port))
    return [f"{n.name}:{n.port}" for n in chosen]


def interface_with_address(report: HostReport, ipv4: str) -> str | None:
    """The probed host's interface that holds this IPv4 address (the one its peers reach it at)."""
    return next((i.name for i in report.interfaces if ipv4 in i.ipv4), None)


def _env_plan(ok: Sequence[HostReport]) -> tuple[dict[str, str], list[Finding]]:
    env: dict[str, str] = {}
    notes: list[Finding] = []

    per_host = {r.host: _hcas(r) for r in ok}
    with_hcas = {h: v for h, v in per_host.items() if v}
    if with_hcas:
        lists = list(with_hcas.values())
        common = [e for e in lists[0] if all(e in other for other in lists[1:])]
        if common:
            env["NCCL_IB_HCA"] = "=" + ",".join(common)
        else:
            union = sorted({e for v in lists for e in v}, key=natural_key)
            env["NCCL_IB_HCA"] = "=" + ",".join(union)
            notes.append(
                Finding(
                    "info",
                    "the active HCAs differ across hosts, so NCCL_IB_HCA lists all of them: "
                    + _by_value({h: ",".join(v) for h, v in with_hcas.items()}),
                )
            )

    return env, notes


def suggested_env(reports: Sequence[HostReport], ifaces: Mapping[str, SocketIface] | None = None) -> dict[str, str]:
    """Environment worth setting for NCCL/Gloo on these hosts.

    ``NCCL_IB_HCA`` lists the active HCA ports (``=mlx5_0:1,…``: the ``=`` makes NCCL match
    names exactly, so ``mlx5_1`` does not also pick ``mlx5_10``), those common to every host
    that has one. ``ifaces``: the interface ``dlrun launch`` gives each host's sockets
    (``dlrun.run.addresses.host_ifaces``); when every reachable host has the same one it is
    ``GLOO_SOCKET_IFNAME``, and ``NCCL_SOCKET_IFNAME`` too where launch names it for NCCL
    (``--iface``, the inventory's ``iface``, ``lo``). No other interface is suggested: one that
    launch would not choose overrides its choice once pasted (``socket_note`` says why there is
    none). Unreachable hosts are ignored.
    """
    ok = [r for r in reports if r.ok]
    env = _env_plan(ok)[0]
    chosen = [ifaces[r.host] for r in ok if ifaces and r.host in ifaces]
    if ok and len(chosen) == len(ok) and len({c.name for c in chosen}) == 1:
        env["GLOO_SOCKET_IFNAME"] = chosen[0].name
        if all(c.named for c in chosen):
            env["NCCL_SOCKET_IFNAME"] = chosen[0].name
    return env


def socket_note(reports: Sequence[HostReport], ifaces: Mapping[str, SocketIface] | None) -> str:
    """What ``dlrun launch`` does about the socket interfaces of these hosts, under the suggested
    environment; ``ifaces`` as for :func:`suggested_env` (None: no host was reached over the
    network, so launch's choice is not known yet)."""
    rule = "the interface holding the address it reaches the host at"
    nccl = "NCCL picks its own unless --iface or the inventory's iface names one."
    ok = [r.host for r in reports if r.ok]
    if ifaces is None or not ok:
        return (f"dlrun launch sets GLOO_SOCKET_IFNAME on each host itself: {rule} (lo for a job on this machine"
                f" alone; dlrun topo --hosts ... names it). {nccl}")
    chosen = {h: ifaces[h].name for h in ok if h in ifaces}
    missing = [h for h in ok if h not in ifaces]
    names = sorted(set(chosen.values()))
    named = bool(chosen) and all(ifaces[h].named for h in chosen)
    why = "the inventory's iface, or lo for a job on this machine alone" if named else rule
    parts = []
    if len(names) == 1:
        where = "" if len(ok) == 1 else " on every host" if not missing else f" on {', '.join(chosen)}"
        parts.append(f"dlrun launch sets GLOO_SOCKET_IFNAME={names[0]} itself{where}: {why}.")
    elif names:
        parts.append(f"dlrun launch sets each host's GLOO_SOCKET_IFNAME itself ({_by_value(chosen)}): {why}.")
    if missing:
        parts.append(f"No interface of {', '.join(missing)} holds the address dlrun reached it at (NAT, a jump host):"
                     " Gloo picks one there; name it with --iface or the inventory's iface.")
    parts.append("NCCL uses the same." if named else nccl)
    return " ".join(parts)


def finding_to_json(finding: Finding) -> dict[str, Any]:
    """A finding in the ``dlrun topo --json`` shape (``host`` is null for cross-host ones)."""
    return {"severity": finding.severity, "message": finding.message, "host": finding.host}


def topo_document(
    reports: Sequence[HostReport],
    findings: Sequence[Finding],
    env: Mapping[str, str] | None = None,
    ifaces: Mapping[str, str] | None = None,
    note: str = "",
) -> dict[str, Any]:
    """The whole ``dlrun topo --json`` document: ``{"hosts": [...], "findings": [...], "env"}``,
    and, when given, ``"launch_ifaces"`` (host → the socket interface ``dlrun launch`` gives it)
    and ``"launch_note"`` (``socket_note``).

    Each host carries its own findings (``severity``, ``message``); the top-level list holds
    every finding, with ``host`` (null for cross-host findings).
    """
    doc: dict[str, Any] = {
        "hosts": [host_report_to_json(r, findings) for r in reports],
        "findings": [finding_to_json(f) for f in findings],
        "env": dict(env) if env is not None else suggested_env(reports),
    }
    if ifaces is not None:
        doc["launch_ifaces"] = dict(ifaces)
    if note:
        doc["launch_note"] = note
    return doc
