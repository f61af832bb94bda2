"""The bench's model: what was measured, beside what was expected, and who is at fault.

Pure: the controller (:mod:`dlrun.topo.benchrun`) feeds it the host program's answers; this
module turns them into :class:`Measure` records with an expected value
(:mod:`dlrun.topo.expect`) and the median of the peers, finds the host or link at fault from
pair measurements (:func:`link_verdict`), plans the rounds (:func:`ring_round`,
:func:`retest_pairs`, :func:`rounds_of`, :func:`budget`), and renders the table (80 columns)
and the ``--json`` document. The method and its numbers are in ``docs/bench.md``.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from dlrun.inventory import Host
from dlrun.plan import is_loopback
from dlrun.topo.expect import (
    FAR_BELOW,
    Expected,
    expected_copy,
    expected_gemm,
    expected_host_allreduce,
    expected_memory,
    judge,
    peer_median,
)
from dlrun.topo.findings import Finding, Severity, finding_to_json, interface_with_address
from dlrun.topo.records import HostReport

#: What to check when a measurement of this kind is low.
HINTS: Mapping[str, str] = {
    "tcp": "check its cable and switch port (ethtool: speed, errors) and that"
           " NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME name this interface",
    "compute": "check its CPU limit (cgroup cpu.max / cfs quota, a container's --cpus),"
               " frequency scaling and other load",
    "gemm": "a throttled GPU? check clocks, power cap and temperature"
            " (nvidia-smi -q -d PERFORMANCE,CLOCK,POWER) and other processes on it",
    "memory": "a throttled GPU? check clocks, ECC errors and other processes on it (nvidia-smi -q)",
    "h2d": "check the PCIe link (lspci -vv: LnkSta against LnkCap, PCIe width x16?), the slot"
           " and the NUMA binding",
    "d2h": "check the PCIe link (lspci -vv: LnkSta against LnkCap, PCIe width x16?), the slot"
           " and the NUMA binding",
    "host_allreduce": "check NVLink (nvidia-smi nvlink -s), the fabric manager on NVSwitch"
                      " systems, NCCL_P2P_DISABLE / NCCL_P2P_LEVEL",
    "allreduce": "check the NICs' cables and state (ibstat: rate, Active), that NCCL_IB_HCA"
                 " names the active ports (a wrong NCCL_IB_HCA), and NCCL_SOCKET_IFNAME",
}
#: Short names of the kinds in the table.
LABELS: Mapping[str, str] = {
    "tcp": "TCP", "compute": "CPU", "gemm": "GEMM", "memory": "HBM", "h2d": "H2D", "d2h": "D2H",
    "host_allreduce": "GPU AR", "allreduce": "net AR",
}
LEVELS: Mapping[str, str] = {
    "tcp": "TCP only (no torch on some host)",
    "torch-cpu": "torch on the CPU (gloo)",
    "torch-cuda": "torch with CUDA (NCCL)",
}


@dataclass(frozen=True)
class Measure:
    """One measured number: ``subject`` names the host, GPU, link (``a→b``) or group it was
    measured on; ``hosts`` are the hosts it involved. ``peers`` is the median of the other
    subjects' values of the same kind; ``compared`` says how it stood (``38% of expected``)."""

    kind: str
    subject: str
    hosts: tuple[str, ...]
    value: float | None
    unit: str
    what: str
    expected: Expected | None = None
    peers: float | None = None
    severity: Severity | None = None
    compared: str = ""
    error: str | None = None


@dataclass(frozen=True)
class BenchResult:
    """Everything the bench measured and judged."""

    level: str
    measures: tuple[Measure, ...]
    findings: tuple[Finding, ...]
    notes: tuple[str, ...] = ()
    seconds: float = 0.0
    steps: Mapping[str, Any] = field(default_factory=dict, hash=False)

    @property
    def exit_code(self) -> int:
        return 1 if any(f.severity == "error" for f in self.findings) else 0


# --------------------------------------------------------------------------------------------
# Rounds
# --------------------------------------------------------------------------------------------


def listen_addresses(hosts: Sequence[Host], reports: Sequence[HostReport], reached: Mapping[str, str],
                     iface: str | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """Where each host's bench listens and sends from, and on which interface: launch's rule for
    NCCL and gloo. The inventory's ``iface``, else ``iface`` (``--iface``), with that
    interface's own address; else the address dlrun reached the host at (``reached``: IPv4) and
    the interface holding it; ``lo`` when every host is this machine; a host reached at an address
    none of its interfaces holds (a public IP in front of a private one) uses its default route's
    interface and address."""
    by_report = {r.host: r for r in reports}
    all_here = all(is_loopback(a) for a in reached.values())
    addresses: dict[str, str] = {}
    ifaces: dict[str, str] = {}
    for host in hosts:
        report = by_report[host.name]
        address = reached[host.name]
        found = interface_with_address(report, address)
        name = host.iface or iface or found or ("lo" if all_here else None)
        default = report.default_interface
        if host.iface or iface:
            own = next((i.ipv4[0] for i in report.interfaces if i.name == name and i.ipv4), None)
            address = own or address
        elif found is None and not all_here and default is not None:
            name, address = default.name, default.ipv4[0]
        addresses[host.name] = address
        if name:
            ifaces[host.name] = name
    return addresses, ifaces


def budget(seconds: float, hosts: int, cuda: bool) -> dict[str, float]:
    """Seconds of measuring per step, out of ``seconds`` for the whole bench: start-up and
    process-group set-up take the rest (about a minute on 16 hosts by default)."""
    unit = max(1.0, seconds / 12)
    return {
        "compute": unit,
        "gpu": max(2.0, seconds / 3) if cuda else 0.0,
        "tcp": unit if hosts > 1 else 0.0,
        "retest_rounds": 3 if hosts > 1 else 0,
        "allreduce": unit if hosts > 1 else 0.0,
    }


def allreduce_mib(slowest_gbits: float | None, seconds: float, largest: int = 64) -> int:
    """The all-reduce's size in MiB: ``largest`` (64 MiB: nccl-tests' plateau), smaller where the
    slowest TCP link measured would take longer than ``seconds`` for the warm-up and five steps
    (each moves about twice the size over that link), so a slow network keeps the time bound."""
    if not slowest_gbits:
        return largest
    fits = slowest_gbits * 1e9 / 8 * seconds / 12 / (1 << 20)
    return max(1, min(largest, int(fits)))


def ring_round(hosts: Sequence[str], shift: int = 1) -> list[tuple[str, str]]:
    """Every host sends to the host ``shift`` places on: (sender, receiver) pairs, all at once."""
    n = len(hosts)
    if n < 2:
        return []
    return [(hosts[i], hosts[(i + shift) % n]) for i in range(n) if hosts[i] != hosts[(i + shift) % n]]


def rounds_of(pairs: Iterable[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    """Pairs split into rounds in which no host appears twice (first fit, order kept)."""
    rounds: list[list[tuple[str, str]]] = []
    busy: list[set[str]] = []
    for a, b in pairs:
        for i, used in enumerate(busy):
            if a not in used and b not in used:
                rounds[i].append((a, b))
                used |= {a, b}
                break
        else:
            rounds.append([(a, b)])
            busy.append({a, b})
    return rounds


def _key(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a <= b else (b, a)


def pair_values(links: Iterable[tuple[str, str, float]]) -> dict[tuple[str, str], float]:
    """Each unordered pair's median of its measurements (both directions, every round)."""
    values: dict[tuple[str, str], list[float]] = {}
    for a, b, v in links:
        values.setdefault(_key(a, b), []).append(v)
    return {k: statistics.median(v) for k, v in values.items()}


@dataclass(frozen=True)
class LinkVerdict:
    """Who is at fault from pair measurements: ``reference`` is what a good link carries (with
    three hosts or more the median over hosts of each host's best pair: the peers decide who is
    at fault; with fewer, the expected value); ``low`` the pairs below ``FAR_BELOW`` of it;
    ``hosts`` those low with most of their partners; ``links`` the low pairs neither of whose
    hosts is at fault. Whether the whole fabric falls short of the expected value is
    :func:`fabric_finding`'s question."""

    reference: float | None
    low: tuple[tuple[str, str], ...]
    hosts: tuple[str, ...]
    links: tuple[tuple[str, str], ...]


def link_verdict(hosts: Sequence[str], links: Iterable[tuple[str, str, float]],
                 expected: float | None = None) -> LinkVerdict:
    """Judge pair measurements ``(a, b, value)``: see :class:`LinkVerdict`."""
    pairs = pair_values(links)
    best: dict[str, float] = {}
    for (a, b), v in pairs.items():
        for h in (a, b):
            best[h] = max(best.get(h, 0.0), v)
    reference = statistics.median(best.values()) if len(best) >= 3 else expected
    if reference is None:
        return LinkVerdict(None, (), (), ())
    low = tuple(sorted(k for k, v in pairs.items() if v < FAR_BELOW * reference))
    at_fault = []
    for h in hosts:
        partners = {b if a == h else a for a, b in pairs if h in (a, b)}
        bad = {b if a == h else a for a, b in low if h in (a, b)}
        if bad and len(bad) * 2 > len(partners) and len(partners) >= 2:
            at_fault.append(h)
    if len(hosts) == 2 and low:
        at_fault = []  # two hosts: the link is at fault, no peer says which end
    lone = tuple(k for k in low if k[0] not in at_fault and k[1] not in at_fault)
    return LinkVerdict(reference, low, tuple(at_fault), lone)


def fabric_finding(kind: str, verdict: LinkVerdict, expected: Expected | None, hosts: int) -> Finding | None:
    """A warning when the links that are not at fault still fall short of what is expected: no
    host to name (the peers agree), but the fabric, a setting or the hosts' CPUs hold every
    link back."""
    if expected is None or verdict.reference is None or hosts < 3:
        return None
    share = verdict.reference / expected.value
    if share >= FAR_BELOW:
        return None
    label = LABELS.get(kind, kind)
    return Finding("warning", f"{label} between hosts is about {_fmt(verdict.reference, expected.unit)}, {share:.0%}"
                              f" of the expected {_fmt(expected.value, expected.unit)} ({expected.basis}) on every"
                              " link: check the MTU, NIC offloads, the switch, and whether the hosts' CPUs keep up")


def retest_pairs(hosts: Sequence[str], links: Iterable[tuple[str, str, float]],
                 verdict: LinkVerdict, partners: int = 2) -> list[tuple[str, str]]:
    """Pairs to measure next where something was low: each low pair again (once: up to two
    rounds of measurements in all), and each host of a low pair with up to ``partners`` hosts it
    was not measured with (hosts of no low pair first). Empty when nothing new is left."""
    if not verdict.low:
        return []
    links = list(links)
    tested = {_key(a, b) for a, b, _ in links}
    directed = {(a, b) for a, b, _ in links}
    suspects = [h for h in hosts if any(h in k for k in verdict.low)]
    clean = [h for h in hosts if h not in suspects]
    # a pair measured one way only (a ring) is measured again both ways; one measured both ways is done
    out = [k for k in verdict.low if not ((k[0], k[1]) in directed and (k[1], k[0]) in directed)]
    for h in suspects:
        fresh = [o for o in clean + suspects if o != h and _key(h, o) not in tested and _key(h, o) not in out]
        for other in fresh[:partners]:
            out.append(_key(h, other))
    return out


# --------------------------------------------------------------------------------------------
# Judging
# --------------------------------------------------------------------------------------------


def judged(measures: Sequence[Measure]) -> list[Measure]:
    """Each measure with its peers' median (the other subjects of its kind) and its verdict
    against that and its expected value."""
    out = []
    for m in measures:
        if m.value is None:
            out.append(m)
            continue
        others = [o.value for o in measures
                  if o.kind == m.kind and o.subject != m.subject and o.value is not None and o.unit == m.unit]
        severity, compared = judge(m.value, m.expected.value if m.expected else None, others)
        out.append(Measure(m.kind, m.subject, m.hosts, m.value, m.unit, m.what, m.expected, peer_median(others),
                           severity, compared, m.error))  # type: ignore[arg-type]
    return out


def gpu_measures(host: str, doc: Mapping[str, Any], report: HostReport | None) -> tuple[list[Measure], list[Finding]]:
    """The host program's ``gpu`` answer as measures with their expected values (the GPU model's
    peaks; the PCIe link's maximum generation and width from sysfs; NVLink or PCIe for the
    all-reduce across the host's GPUs), and a finding for a PCIe link narrower than it can be."""
    if "error" in doc:
        return [Measure("gemm", host, (host,), None, "TFLOP/s", "GPU checks", error=str(doc["error"]))], []
    out: list[Measure] = []
    findings: list[Finding] = []
    what = doc.get("what") or {}
    for g in doc.get("gpus") or []:
        subject = f"{host} GPU{g.get('index')}"
        name = str(g.get("name") or "")
        if g.get("error"):
            out.append(Measure("gemm", subject, (host,), None, "TFLOP/s", str(what.get("gemm", "")),
                               error=str(g["error"])))
            continue
        pcie = g.get("pcie") or {}
        copy = expected_copy(name, pcie.get("max_gen"), pcie.get("max_width"))
        out += [
            Measure("gemm", subject, (host,), g.get("gemm"), "TFLOP/s", str(what.get("gemm", "")),
                    expected_gemm(name)),
            Measure("memory", subject, (host,), g.get("memory"), "GB/s", str(what.get("memory", "")),
                    expected_memory(name)),
            Measure("h2d", subject, (host,), g.get("h2d"), "GB/s", str(what.get("h2d", "")), copy),
            Measure("d2h", subject, (host,), g.get("d2h"), "GB/s", str(what.get("d2h", "")), copy),
        ]
        width, max_width = pcie.get("width"), pcie.get("max_width")
        if width and max_width and width < max_width:
            findings.append(Finding("error", f"GPU{g.get('index')}'s PCIe link runs at x{width} of x{max_width}:"
                                             " reseat the card or check the slot and riser (PCIe width)", host))
    ar = doc.get("allreduce")
    if isinstance(ar, dict):
        expected = expected_host_allreduce(report) if report is not None else None
        out.append(Measure("host_allreduce", host, (host,), ar.get("busbw"), "GB/s",
                           str(ar.get("what") or "NCCL all-reduce across the host's GPUs"), expected,
                           error=ar.get("error")))
    return out, findings


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "—"
    digits = 0 if value >= 100 else 1 if value >= 10 else 2
    return f"{value:.{digits}f} {unit}"


def findings_of(measures: Sequence[Measure], verdicts: Mapping[str, LinkVerdict] | None = None) -> list[Finding]:
    """Error and warning findings: a host named by a link verdict; a link at fault; a
    measure far below what is expected or its peers; a measure that failed."""
    found: list[Finding] = []
    named: set[tuple[str, str]] = set()
    decided = {kind for kind, v in (verdicts or {}).items() if v.hosts or v.links}
    for kind, verdict in (verdicts or {}).items():
        label = LABELS.get(kind, kind)
        ref = f"{verdict.reference:.3g}" if verdict.reference else "?"
        for name in verdict.hosts:
            found.append(Finding("error", f"{label} to and from {name} is far below its peers (under"
                                          f" {FAR_BELOW:.0%} of {ref} with most partners): {HINTS.get(kind, '')}",
                                 name))
            named.add((kind, name))
        for a, b in verdict.links:
            found.append(Finding("error", f"{label} between {a} and {b} is far below the other links (reference"
                                          f" {ref}): check the cable, switch ports and routes between them", None))
            named |= {(kind, a), (kind, b)}
    for m in measures:
        if m.error:
            found.append(Finding("error", f"{LABELS.get(m.kind, m.kind)} on {m.subject} failed: {m.error}",
                                 m.hosts[0] if len(m.hosts) == 1 else None))
            continue
        if m.severity is None or m.kind in decided:
            continue
        host = m.hosts[0] if len(m.hosts) == 1 else None
        expected = f", expected {_fmt(m.expected.value, m.unit)} ({m.expected.basis})" if m.expected else ""
        peers = f", peers {_fmt(m.peers, m.unit)}" if m.peers is not None else ""
        found.append(Finding(m.severity, f"{LABELS.get(m.kind, m.kind)} on {m.subject}: {_fmt(m.value, m.unit)} is"
                                         f" {m.compared}{expected}{peers}: {HINTS.get(m.kind, '')}", host))
    return found


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------


def measure_to_json(m: Measure) -> dict[str, Any]:
    return {
        "kind": m.kind, "subject": m.subject, "hosts": list(m.hosts), "value": m.value, "unit": m.unit,
        "what": m.what,
        "expected": None if m.expected is None else {"value": m.expected.value, "unit": m.expected.unit,
                                                     "basis": m.expected.basis},
        "peers_median": m.peers, "severity": m.severity, "compared": m.compared, "error": m.error,
    }


def bench_document(result: BenchResult) -> dict[str, Any]:
    """``dlrun topo --bench --json``'s ``bench`` entry."""
    return {
        "level": result.level,
        "level_text": LEVELS.get(result.level, result.level),
        "seconds": round(result.seconds, 1),
        "measures": [measure_to_json(m) for m in result.measures],
        "findings": [finding_to_json(f) for f in result.findings],
        "notes": list(result.notes),
        "steps": dict(result.steps),
    }


def _verdict_cell(m: Measure) -> Text:
    if m.error:
        return Text("failed", style="bold red")
    share = m.compared.split(" ", 1)[0] if m.compared else ""
    if m.severity == "error":
        return Text(f"✗ {share}".strip(), style="bold red")
    if m.severity == "warning":
        return Text(f"! {share}".strip(), style="yellow")
    return Text(f"ok {share}".strip(), style="green")


def render_bench(result: BenchResult) -> RenderableType:
    """The bench table (reads well at 80 columns), what each check measured, and the findings."""
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, expand=False)
    table.add_column("check", no_wrap=True)
    table.add_column("on", overflow="fold", max_width=22)
    table.add_column("measured", justify="right", no_wrap=True)
    table.add_column("expected", justify="right", no_wrap=True)
    table.add_column("peers", justify="right", no_wrap=True)
    table.add_column("verdict", no_wrap=True)
    for m in result.measures:
        table.add_row(LABELS.get(m.kind, m.kind), m.subject, _fmt(m.value, m.unit),
                      _fmt(m.expected.value, "") if m.expected else "—",
                      _fmt(m.peers, "") if m.peers is not None else "—", _verdict_cell(m))
    parts: list[RenderableType] = [Text(f"bench: {LEVELS.get(result.level, result.level)},"
                                        f" {result.seconds:.0f} s", style="bold"), table]
    whats = dict.fromkeys(f"{LABELS.get(m.kind, m.kind)}: {m.what}" for m in result.measures)
    bases = dict.fromkeys(f"{LABELS.get(m.kind, m.kind)} expected: {m.expected.basis}"
                          for m in result.measures if m.expected)
    parts += [Text(line, style="dim") for line in list(whats) + list(bases)]
    parts += [Text(f"note: {n}", style="dim") for n in result.notes]
    styles = {"error": "bold red", "warning": "yellow", "info": "cyan"}
    for f in result.findings:
        who = f"{f.host}: " if f.host else ""
        parts.append(Text(f"{f.severity}: {who}{f.message}", style=styles.get(f.severity, "")))
    if not any(f.severity == "error" for f in result.findings):
        parts.append(Text("bench: no host or link far below what is expected", style="green"))
    return Group(*parts)
