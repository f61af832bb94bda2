"""Probing hosts over the transport: ``dlrun topo`` and the preflight of ``dlrun launch``.

One round trip per host: for ``dlrun topo`` the stdlib probe program (``dlrun.remote.probe``)
runs as its own program, started by the remote bootstrap over the host's already-open connection
(or locally); for ``dlrun launch`` the host's agent runs the same program inside itself before
it is given any rank (``report_from_answer`` turns its answer into a report). Either way the
JSON is parsed by pure functions. A host that cannot be reached becomes an unreachable
``HostReport`` — a finding, not an exception — so ``dlrun topo`` reports every host. The
launch preflight (``check_preflight``) turns the reports into slots (GPU count where the
inventory left slots unset), per-rank ``CUDA_VISIBLE_DEVICES`` and, on error findings, a
``PreflightError`` before anything starts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from dlrun.errors import DlrunError, PreflightError
from dlrun.inventory import Host, Inventory
from dlrun.remote import boot_argv, boot_payload
from dlrun.topo.findings import Finding, analyse, has_errors, suggested_env
from dlrun.topo.probe import parse_probe_output
from dlrun.topo.records import HostReport
from dlrun.transport.base import Transport, default_python

PROBE_TIMEOUT = 120.0


def probe_host(transport: Transport, host: Host, timeout: float = PROBE_TIMEOUT) -> HostReport:
    """Probe one host; never raises for an unreachable host or a failing probe."""
    try:
        transport.connect([host])
        argv = boot_argv(default_python(host), "probe")
        result = transport.run(host, argv, stdin=boot_payload("probe"), timeout=timeout)
    except DlrunError as exc:
        return HostReport.unreachable(host.name, exc.message)
    report = parse_probe_output(host.name, result.stdout.decode(errors="replace"))
    if report.error and result.exit_code != 0:
        tail = result.stderr.decode(errors="replace").strip().splitlines()[-1:]
        return HostReport(host=host.name, error=f"{report.error} (exit {result.exit_code}) {' '.join(tail)}".strip())
    return report


def probe_hosts(transport: Transport, hosts: Sequence[Host], timeout: float = PROBE_TIMEOUT) -> tuple[HostReport, ...]:
    """Probe every host in parallel, in inventory order."""
    if not hosts:
        return ()
    with ThreadPoolExecutor(max_workers=min(64, len(hosts))) as pool:
        return tuple(pool.map(lambda h: probe_host(transport, h, timeout), hosts))


@dataclass(frozen=True)
class Preflight:
    """What the probe tells the launch: slots per host, GPUs per local rank, findings."""

    reports: tuple[HostReport, ...]
    findings: tuple[Finding, ...]
    env: Mapping[str, str]

    def gpu_slots(self) -> dict[str, int]:
        return {r.host: r.gpu_slots for r in self.reports if r.reachable and r.gpu_slots}

    def devices(self) -> dict[str, tuple[str, ...]]:
        """host name → one CUDA_VISIBLE_DEVICES value per local rank (hosts with GPUs only)."""
        return {r.host: r.cuda_devices for r in self.reports if r.reachable and r.cuda_devices}


def report_from_answer(host: str, stdout: str | None, error: str | None) -> HostReport:
    """The report of a probe that a host's agent ran (``stdout``), or of why it could not."""
    if stdout is None:
        return HostReport.unreachable(host, error or "no probe answer")
    return parse_probe_output(host, stdout)


def check_preflight(inventory: Inventory, hosts: Sequence[Host], reports: Sequence[HostReport],
                    framework: str | None = None) -> Preflight:
    """Check the probe reports of ``hosts`` (in order); raise PreflightError on error findings."""
    reports = tuple(reports)
    slots = {h.name: s for h, s in zip(hosts, _slots(inventory, reports), strict=True)}
    findings = analyse(reports, slots, torch_job=framework in ("torch", "horovod"))
    if has_errors(findings):
        errors = [f for f in findings if f.severity == "error"]
        lines = "\n".join(f"  {f.host + ': ' if f.host else ''}{f.message}" for f in errors)
        raise PreflightError(
            f"preflight found {len(errors)} error{'s' if len(errors) != 1 else ''}; nothing was started:\n{lines}",
            hint="run `dlrun topo` with the same --hosts for the full report, or pass --no-preflight",
        )
    return Preflight(reports=reports, findings=findings, env=suggested_env(reports))


def _slots(inventory: Inventory, reports: Sequence[HostReport]) -> list[int]:
    by_name = {h.name: h for h in inventory.hosts}
    out = []
    for report in reports:
        host = by_name[report.host]
        out.append(host.slots if host.slots is not None else max(1, report.gpu_slots))
    return out
