"""Running the bench: one ``dlrun.remote.bench`` process per host, driven in rounds.

The controller starts the host program on every host over the transport (the loader ships it),
tells each the address to listen on (the one the others reach it at, on the interface NCCL and
gloo would use: launch's rule), then measures: the compute check (CPU, or each GPU), a TCP ring
over all hosts and, where a link is low, pairs in rounds until the host or link at fault is
found; with torch, an all-reduce over all hosts (gloo, or NCCL on CUDA hosts) and, where that
is low, over pairs. :mod:`dlrun.topo.bench` judges what comes back.
"""

from __future__ import annotations

import contextlib
import json
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dlrun.errors import DlrunError, PreflightError
from dlrun.inventory import Host
from dlrun.remote import boot_argv, boot_payload
from dlrun.topo.bench import (
    BenchResult,
    LinkVerdict,
    Measure,
    allreduce_mib,
    budget,
    fabric_finding,
    findings_of,
    gpu_measures,
    judged,
    link_verdict,
    listen_addresses,
    retest_pairs,
    ring_round,
    rounds_of,
)
from dlrun.topo.expect import expected_network_allreduce, expected_tcp
from dlrun.topo.findings import Finding
from dlrun.topo.records import HostReport
from dlrun.transport.base import Channel, Transport, default_python

Progress = Callable[[str], None]
START_TIMEOUT = 120.0  # the host program's start (or torch's import, on a loaded host)


class HostProgram:
    """One host's bench process: request lines in, answer lines out (read by a thread)."""

    def __init__(self, host: Host, channel: Channel) -> None:
        self.host = host
        self.channel = channel
        self.lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.buffer = bytearray()
        self.dead: str | None = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            while True:
                data = self.channel.recv()
                if not data:
                    break
                self.buffer += data
                while b"\n" in self.buffer:
                    line, _, rest = bytes(self.buffer).partition(b"\n")
                    self.buffer = bytearray(rest)
                    try:
                        doc = json.loads(line.decode("utf-8", "replace"))
                    except ValueError:
                        continue
                    if isinstance(doc, dict):
                        self.lines.put(doc)
        except DlrunError:
            pass
        self.lines.put(None)

    def ask(self, request: Mapping[str, Any]) -> None:
        if self.dead:
            return
        try:
            self.channel.send((json.dumps(request) + "\n").encode())
        except DlrunError as exc:
            self.dead = exc.message

    def answer(self, timeout: float) -> dict[str, Any]:
        if self.dead:
            return {"error": self.dead}
        try:
            doc = self.lines.get(timeout=timeout)
        except queue.Empty:
            self.dead = f"no answer within {timeout:.0f} s"
            self.channel.close()
            return {"error": self.dead}
        if doc is None:
            tail = self.channel.stderr_text().strip().splitlines()[-1:]
            self.dead = "the bench program ended" + (f": {tail[0]}" if tail else "")
            return {"error": self.dead}
        return doc

    def close(self) -> None:
        """EOF ends the program (it reads its requests to the end); a stuck one is dropped."""
        with contextlib.suppress(DlrunError, OSError):
            self.channel.close_stdin()
            self.channel.wait(5)
        with contextlib.suppress(DlrunError, OSError):
            self.channel.close()


def _start(transport: Transport, host: Host, address: str, iface: str | None) -> HostProgram:
    channel = transport.open(host, boot_argv(default_python(host), "bench"))
    program = HostProgram(host, channel)
    channel.send(boot_payload("bench"))
    program.ask({"address": address, "iface": iface})
    return program


def run_bench(transport: Transport, hosts: Sequence[Host], reports: Sequence[HostReport],
              addresses: Mapping[str, str], ifaces: Mapping[str, str], seconds: float = 60.0,
              progress: Progress | None = None) -> BenchResult:
    """Measure every host (``addresses``: where the others reach it; ``ifaces``: its socket
    interface) within about ``seconds``; never raises for a host that fails (a finding)."""
    say = progress or (lambda _: None)
    began = time.monotonic()
    by_name = {r.host: r for r in reports}
    programs: dict[str, HostProgram] = {}
    hello: dict[str, dict[str, Any]] = {}
    findings: list[Finding] = []
    notes: list[str] = []
    say(f"starting the bench program on {len(hosts)} host{'s' if len(hosts) != 1 else ''}")
    for host in hosts:
        try:
            programs[host.name] = _start(transport, host, addresses[host.name], ifaces.get(host.name))
        except DlrunError as exc:
            findings.append(Finding("error", f"the bench could not start: {exc.message}", host.name))
    for name, program in programs.items():
        doc = program.answer(START_TIMEOUT)
        if "error" in doc:
            findings.append(Finding("error", f"the bench could not start: {doc['error']}", name))
        else:
            hello[name] = doc
    alive = [h.name for h in hosts if h.name in hello]
    torch_all = bool(alive) and all(hello[h].get("torch") for h in alive)
    # CUDA: the probe saw GPUs and a CUDA build of torch (the gpu request itself says if CUDA works)
    cuda_all = torch_all and all((r := by_name.get(h)) is not None and bool(r.gpus) and bool(r.torch_cuda)
                                 for h in alive)
    level = "torch-cuda" if cuda_all else "torch-cpu" if torch_all else "tcp"
    if not torch_all and alive:
        missing = [h for h in alive if not hello[h].get("torch")]
        notes.append(f"no torch on {', '.join(missing)}: TCP and the Python compute loop only")
    plan = budget(seconds, len(alive), cuda_all)
    measures: list[Measure] = []
    steps: dict[str, Any] = {"budget": plan, "hello": hello}
    verdicts: dict[str, LinkVerdict] = {}
    try:
        measures += _compute(programs, alive, plan, say)
        if cuda_all:
            gpu_measures, gpu_findings = _gpus(programs, alive, by_name, plan, say)
            measures += gpu_measures
            findings += gpu_findings
        if len(alive) > 1:
            tcp_measures, verdicts["tcp"], fabric = _tcp(programs, alive, hello, plan, say, began + seconds * 0.7)
            measures += tcp_measures
            findings += [fabric] if fabric is not None else []
        else:
            notes.append("one host: no TCP or all-reduce across hosts")
        if len(alive) > 1 and torch_all:
            slowest = min((m.value for m in measures if m.kind == "tcp" and m.value), default=None)
            mib = allreduce_mib(slowest, plan["allreduce"])
            ar_measures, ar_verdict = _allreduce(programs, alive, by_name, addresses, plan, say,
                                                 "nccl" if cuda_all else "gloo", began + seconds, mib)
            measures += ar_measures
            if ar_verdict is not None:
                verdicts["allreduce"] = ar_verdict
    finally:
        if programs:
            with ThreadPoolExecutor(max_workers=min(64, len(programs))) as pool:
                list(pool.map(HostProgram.close, programs.values()))
    tcp_or_ar = [m for m in measures if m.kind in ("tcp", "allreduce")]
    others = judged([m for m in measures if m.kind not in ("tcp", "allreduce")])
    final = others + tcp_or_ar
    findings += findings_of(final, verdicts)
    return BenchResult(level, tuple(final), tuple(findings), tuple(notes), time.monotonic() - began, steps)


def _ask_all(programs: Mapping[str, HostProgram], requests: Mapping[str, Mapping[str, Any]],
             timeout: float) -> dict[str, dict[str, Any]]:
    for name, request in requests.items():
        programs[name].ask(request)
    with ThreadPoolExecutor(max_workers=max(1, min(64, len(requests)))) as pool:
        answers = pool.map(lambda n: programs[n].answer(timeout), list(requests))
        return dict(zip(list(requests), answers, strict=True))


def _compute(programs: Mapping[str, HostProgram], alive: Sequence[str], plan: Mapping[str, float],
             say: Progress) -> list[Measure]:
    say(f"compute check on {len(alive)} hosts ({plan['compute']:.0f} s)")
    answers = _ask_all(programs, {h: {"op": "compute", "seconds": plan["compute"]} for h in alive},
                       START_TIMEOUT + plan["compute"] * 20)  # torch's import may still be running
    out = []
    for host, doc in answers.items():
        out.append(Measure("compute", host, (host,), doc.get("value"), str(doc.get("unit") or ""),
                           str(doc.get("what") or "compute check"), error=doc.get("error")))
    return out


def _gpus(programs: Mapping[str, HostProgram], alive: Sequence[str], reports: Mapping[str, HostReport],
          plan: Mapping[str, float], say: Progress) -> tuple[list[Measure], list[Finding]]:
    say(f"GPU checks on {len(alive)} hosts ({plan['gpu']:.0f} s)")
    answers = _ask_all(programs, {h: {"op": "gpu", "seconds": plan["gpu"]} for h in alive}, plan["gpu"] * 6 + 120)
    out: list[Measure] = []
    findings: list[Finding] = []
    for host, doc in answers.items():
        measures, found = gpu_measures(host, doc, reports.get(host))
        out += measures
        findings += found
    return out, findings


def _tcp_round(programs: Mapping[str, HostProgram], hello: Mapping[str, Mapping[str, Any]],
               addresses: Mapping[str, str], sends: Sequence[tuple[str, str]], seconds: float,
               ) -> list[tuple[str, str, float | None, str | None]]:
    targets: dict[str, list[str]] = {}
    for a, b in sends:
        targets.setdefault(a, []).append(b)
    requests = {a: {"op": "tcp", "seconds": seconds, "streams": 2,
                    "targets": [[addresses[b], hello[b]["port"]] for b in bs]} for a, bs in targets.items()}
    answers = _ask_all(programs, requests, seconds * 4 + 120)
    out: list[tuple[str, str, float | None, str | None]] = []
    for a, bs in targets.items():
        doc = answers[a]
        links = doc.get("links") or []
        for i, b in enumerate(bs):
            link = links[i] if i < len(links) else {"error": doc.get("error") or "no answer"}
            gbits, error = link.get("gbits"), link.get("error")
            out.append((a, b, float(gbits) if gbits is not None else None, str(error) if error else None))
    return out


def _tcp(programs: Mapping[str, HostProgram], alive: Sequence[str], hello: Mapping[str, Mapping[str, Any]],
         plan: Mapping[str, float], say: Progress,
         deadline: float) -> tuple[list[Measure], LinkVerdict, Finding | None]:
    addresses = {h: str(hello[h].get("address") or "") for h in alive}
    seconds = plan["tcp"]
    say(f"TCP ring over {len(alive)} hosts ({seconds:.0f} s)")
    samples = _tcp_round(programs, hello, addresses, ring_round(alive), seconds)
    speeds = [float(hello[h]["speed_mbits"]) for h in alive if hello[h].get("speed_mbits")]
    expected = expected_tcp(min(speeds)) if speeds and len(speeds) == len(alive) else None

    def values() -> list[tuple[str, str, float]]:
        # a failed link counts as 0: a host nobody can reach is as slow as it gets
        return [(a, b, v if v is not None else 0.0) for a, b, v, _ in samples]

    verdict = link_verdict(alive, values(), expected.value if expected else None)
    for round_no in range(int(plan["retest_rounds"])):
        pairs = retest_pairs(alive, values(), verdict)
        if not pairs or (round_no and time.monotonic() > deadline):
            break  # the first retest always runs: it is what names a host
        for group in rounds_of(pairs):
            say(f"TCP pairs, round {round_no + 1}: {', '.join(f'{a}↔{b}' for a, b in group)}")
            sends = [(a, b) for a, b in group] + [(b, a) for a, b in group]
            samples += _tcp_round(programs, hello, addresses, sends, seconds)
        verdict = link_verdict(alive, values(), expected.value if expected else None)
    fabric = fabric_finding("tcp", verdict, expected, len(alive))
    low = set(verdict.low)
    by_link: dict[tuple[str, str], list[tuple[float | None, str | None]]] = {}
    for a, b, v, err in samples:
        by_link.setdefault((a, b), []).append((v, err))
    out = []
    what = "TCP throughput, 2 streams per link, counted by the receiver"
    for (a, b), got in by_link.items():
        numbers = sorted(v for v, _ in got if v is not None)
        value = numbers[len(numbers) // 2] if numbers else None
        error = next((e for v, e in got if e), None) if value is None else None
        key = (a, b) if a <= b else (b, a)
        severity = "error" if key in low else None
        compared = ""
        if value is not None and verdict.reference:
            compared = f"{value / verdict.reference:.0%} of the reference"
        out.append(Measure("tcp", f"{a}→{b}", (a, b), value, "Gbit/s", what, expected, verdict.reference,
                           severity, compared, error))  # type: ignore[arg-type]
    return out, verdict, fabric


def _allreduce_round(programs: Mapping[str, HostProgram], groups: Sequence[Sequence[str]],
                     addresses: Mapping[str, str], backend: str, seconds: float, mib: int) -> list[dict[str, Any]]:
    ports = _ask_all(programs, {g[0]: {"op": "freeport"} for g in groups}, 60)
    requests: dict[str, dict[str, Any]] = {}
    for g in groups:
        port = ports[g[0]].get("port")
        for rank, host in enumerate(g):
            requests[host] = {"op": "allreduce", "backend": backend, "master": [addresses[g[0]], port],
                              "rank": rank, "world": len(g), "seconds": seconds, "mib": mib}
    answers = _ask_all(programs, requests, seconds * 10 + 180)
    return [answers[g[0]] | {"group": list(g)} for g in groups]


def _allreduce(programs: Mapping[str, HostProgram], alive: Sequence[str], reports: Mapping[str, HostReport],
               addresses: Mapping[str, str], plan: Mapping[str, float], say: Progress,
               backend: str, deadline: float, mib: int) -> tuple[list[Measure], LinkVerdict | None]:
    seconds = plan["allreduce"]
    say(f"{'NCCL' if backend == 'nccl' else 'gloo'} all-reduce over {len(alive)} hosts ({seconds:.0f} s)")
    (whole,) = _allreduce_round(programs, [list(alive)], addresses, backend, seconds, mib)
    expected = None
    if backend == "nccl":
        per_host = [expected_network_allreduce(r, 1) for h in alive if (r := reports.get(h)) is not None]
        known = [e for e in per_host if e is not None]
        if known and len(known) == len(alive):
            expected = min(known, key=lambda e: e.value)
    what = str(whole.get("what") or f"{backend} all-reduce across hosts, bus bandwidth GB/s")
    measure = Measure("allreduce", "all hosts", tuple(alive), whole.get("busbw"), "GB/s", what, expected,
                      error=whole.get("error"))
    (measure,) = judged([measure])
    out = [measure]
    if len(alive) < 3 or (measure.severity is None and measure.error is None) or time.monotonic() > deadline:
        return out, None
    # low: pairs in rounds (every host with its ring neighbour), then the verdict names the host
    pairs = [(a, b) if a <= b else (b, a) for a, b in ring_round(alive)]
    samples: list[tuple[str, str, float]] = []
    for group in rounds_of(dict.fromkeys(pairs)):
        say(f"all-reduce pairs: {', '.join(f'{a}+{b}' for a, b in group)}")
        for doc in _allreduce_round(programs, [list(p) for p in group], addresses, backend, seconds, mib):
            a, b = doc["group"]
            value = doc.get("busbw")
            samples.append((a, b, float(value) if value is not None else 0.0))
            out.append(Measure("allreduce", f"{a}+{b}", (a, b), value, "GB/s", what, expected, error=doc.get("error")))
    verdict = link_verdict(alive, samples, expected.value if expected else None)
    return out, verdict


def bench_hosts(transport: Transport, hosts: Sequence[Host], reports: Sequence[HostReport],
                seconds: float = 60.0, iface: str | None = None, progress: Progress | None = None) -> BenchResult:
    """The bench over connected ``hosts`` whose probe ``reports`` are in: each host listens on
    the address the others reach it at, on the interface launch would give NCCL and gloo (the
    inventory's ``iface``, else ``iface``, else the one holding that address; ``lo`` when all
    are on this machine). Hosts whose probe failed are left out (they are already findings)."""
    from dlrun.run.addresses import ipv4_of, reachable_addresses

    ok = {r.host for r in reports if r.ok}
    usable = [h for h in hosts if h.name in ok]
    reached = reachable_addresses(usable, transport.connect(usable)) if usable else {}
    reached = {name: ipv4_of(a) or a for name, a in reached.items()}
    addresses, ifaces = listen_addresses(usable, reports, reached, iface)
    return run_bench(transport, usable, reports, addresses, ifaces, seconds, progress)


def check_bench(transport: Transport, hosts: Sequence[Host], reports: Sequence[HostReport], seconds: float,
                iface: str | None = None) -> BenchResult:
    """``dlrun launch --bench``: the bench after the preflight; its table goes to stderr, and an
    error finding raises PreflightError before any rank starts."""
    import sys

    from rich.console import Console

    from dlrun.topo.bench import render_bench

    console = Console(stderr=True)
    status = console.status("bench") if console.is_terminal else None
    if status is not None:
        status.start()
    try:
        result = bench_hosts(transport, hosts, reports, seconds, iface,
                             (lambda text: status.update(f"bench: {text}")) if status is not None else None)
    finally:
        if status is not None:
            status.stop()
    console.print(render_bench(result))
    errors = [f for f in result.findings if f.severity == "error"]
    if errors:
        lines = "\n".join(f"  {f.host + ': ' if f.host else ''}{f.message}" for f in errors)
        raise PreflightError(
            f"the bench found {len(errors)} error{'s' if len(errors) != 1 else ''}; nothing was started:\n{lines}",
            hint="run `dlrun topo --bench` with the same --hosts for the whole report, or launch without --bench")
    sys.stderr.flush()
    return result
