"""The host probe: a stdlib-only program that gathers raw facts, and the pure parser of its output.

:data:`PROBE_SOURCE` is run as ``[python, "-c", PROBE_SOURCE]`` on each host (over SSH, or
locally by :func:`probe_local`): one round trip per host. It needs python3 ≥ 3.8 and nothing
installed; it runs every tool with a timeout, in parallel where they are independent, and prints
exactly one JSON document (one line) to stdout, even when something inside it fails. A missing
tool (no ``nvidia-smi``, no ``ibstat``, no ``ip``) is recorded as missing, not as an error.

What it gathers, raw (parsing is :mod:`dlrun.topo.records`'s job, here in :func:`parse_probe_output`):

- ``nvidia-smi --query-gpu=…`` (retried with the basic fields when a driver refuses a field),
  ``nvidia-smi topo -m``, ``nvidia-smi -L`` and plain ``nvidia-smi`` (CUDA version), where
  ``nvidia-smi`` is whatever comes first on ``PATH``;
- every command with a timeout: ``$DLRUN_PROBE_TIMEOUT`` seconds (default 30) for nvidia-smi,
  less for ``ip`` and ``ibstat``;
- sysfs under ``$DLRUN_SYSFS_ROOT`` (default ``/``): ``sys/class/infiniband/*/ports/*/{state,
  phys_state,rate,link_layer}``, ``hca_type``, ``fw_ver``, the ``device`` link resolved to its
  PCI address, ``device/numa_node``, ``device/net/*/{dev_port,dev_id}``, each GPU's
  ``sys/bus/pci/devices/<addr>/numa_node`` and the NUMA nodes; ``ibstat`` only when sysfs shows
  no RDMA device;
- CPU count, ``/etc/os-release``, python version, TensorFlow version (the name of its
  ``*.dist-info`` folder on ``sys.path``, never ``import tensorflow``), hostname, IPv4
  interfaces (``ip -o -4 addr show``, and ``if_nameindex`` + ``SIOCGIFADDR`` as fallback) and
  ``/proc/net/route`` for the default route.

Output schema (``version`` 1): ``{"version", "hostname", "python", "executable", "cpu_count",
"cpu_usable", "numa_nodes", "os_release", "platform", "tensorflow", "sysfs_root", "sysfs":
{path: content}, "commands": {name: {"argv", "path", "rc", "stdout", "stderr", "missing",
"timed_out", "error", "seconds"}}, "interfaces_ioctl", "proc_net_route", "fatal"}``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from dlrun.topo.records import (
    Gpu,
    HostReport,
    NetInterface,
    TopoMatrix,
    attach_nic_affinity,
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

PROBE_VERSION = 1

#: The probe program. Keep it runnable on python3.8: no annotations, no 3.9+ library calls.
PROBE_SOURCE = r"""
import json, os, re, subprocess, sys, threading, time

VERSION = 1
ROOT = os.environ.get("DLRUN_SYSFS_ROOT") or "/"
try:
    TIMEOUT = float(os.environ.get("DLRUN_PROBE_TIMEOUT") or 30)
except ValueError:
    TIMEOUT = 30.0
QUERY = "index,uuid,name,pci.bus_id,memory.total,driver_version,compute_cap,mig.mode.current"
BASIC = "index,uuid,name,pci.bus_id,memory.total,driver_version"
TF_DISTS = ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tensorflow-macos",
            "tensorflow-intel", "tf-nightly", "tf-nightly-cpu")
DIST_INFO = re.compile(r"^([A-Za-z0-9_.]+)-([^-/]+)\.(?:dist-info|egg-info)$")
PCI = re.compile(r"([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])")


def text(data):
    if data is None:
        return ""
    if isinstance(data, bytes):
        return data.decode("utf-8", "replace")
    return data


def which(name):
    # shutil.which for a bare name, without importing shutil (the probe runs on every launch)
    for folder in os.environ.get("PATH", os.defpath).split(os.pathsep):
        path = os.path.join(folder or ".", name)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def run(argv, timeout):
    result = {"argv": list(argv), "missing": False, "timed_out": False}
    path = which(argv[0])
    if path is None:
        result["missing"] = True
        return result
    result["path"] = path
    env = dict(os.environ)
    env["LC_ALL"] = "C"
    start = time.time()
    try:
        proc = subprocess.run([path] + list(argv[1:]), stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              timeout=timeout, env=env)
        result["rc"] = proc.returncode
        result["stdout"] = text(proc.stdout)
        result["stderr"] = text(proc.stderr)
    except subprocess.TimeoutExpired as exc:
        result["timed_out"] = True
        result["timeout"] = timeout
        result["stdout"] = text(exc.stdout)
        result["stderr"] = text(exc.stderr)
    except (OSError, ValueError) as exc:
        result["error"] = "%s: %s" % (type(exc).__name__, exc)
    result["seconds"] = round(time.time() - start, 3)
    return result


def run_all(jobs):
    out = {}
    threads = []
    for name, argv, timeout in jobs:
        def work(name=name, argv=argv, timeout=timeout):
            out[name] = run(argv, timeout)
        thread = threading.Thread(target=work)
        thread.daemon = True
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    return out


def rel(path):
    return os.path.relpath(path, ROOT).replace(os.sep, "/")


def read(path, limit=65536):
    try:
        with open(path, "rb") as handle:
            return text(handle.read(limit))
    except (OSError, ValueError):
        return None


def listdir(path):
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def collect_ib(sysfs):
    base = os.path.join(ROOT, "sys", "class", "infiniband")
    devices = listdir(base)
    for dev in devices:
        ddir = os.path.join(base, dev)
        for name in ("hca_type", "fw_ver", "board_id", "node_guid", "device/numa_node"):
            content = read(os.path.join(ddir, name))
            if content is not None:
                sysfs[rel(os.path.join(ddir, name))] = content
        link = os.path.join(ddir, "device")
        if os.path.exists(link):
            sysfs[rel(link)] = os.path.realpath(link)
        netdir = os.path.join(ddir, "device", "net")
        for netdev in listdir(netdir):
            sysfs[rel(os.path.join(netdir, netdev))] = ""
            for attr in ("dev_port", "dev_id"):
                content = read(os.path.join(netdir, netdev, attr))
                if content is not None:
                    sysfs[rel(os.path.join(netdir, netdev, attr))] = content
        for port in listdir(os.path.join(ddir, "ports")):
            for attr in ("state", "phys_state", "rate", "link_layer"):
                path = os.path.join(ddir, "ports", port, attr)
                content = read(path)
                sysfs[rel(path)] = content if content is not None else ""
    return devices


def collect_gpu_numa(sysfs, query_stdout):
    for match in PCI.finditer(query_stdout or ""):
        dom, bus, dev, fn = match.groups()
        addr = "%04x:%s:%s.%s" % (int(dom, 16), bus.lower(), dev.lower(), fn)
        path = os.path.join(ROOT, "sys", "bus", "pci", "devices", addr, "numa_node")
        content = read(path)
        if content is not None:
            sysfs[rel(path)] = content


def numa_nodes():
    nodes = []
    for name in listdir(os.path.join(ROOT, "sys", "devices", "system", "node")):
        if name.startswith("node") and name[4:].isdigit():
            nodes.append(int(name[4:]))
    return sorted(nodes)


def tensorflow_version():
    # the installed distributions' metadata folders, read off sys.path: the same answer as
    # importlib.metadata.version(dist) in TF_DISTS order, without its ~30 ms scan of every dist
    wanted = dict((d.replace("-", "_"), d) for d in TF_DISTS)
    found = {}
    for entry in sys.path:
        for name in listdir(entry or "."):
            match = DIST_INFO.match(name)
            if match:
                dist = wanted.get(match.group(1).lower().replace("-", "_").replace(".", "_"))
                if dist is not None and dist not in found:
                    found[dist] = match.group(2)
    for dist in TF_DISTS:
        if dist in found:
            return {"dist": dist, "version": found[dist]}
    return None


def interfaces_ioctl():
    out = []
    try:
        import fcntl
        import socket
        import struct
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    except (ImportError, OSError):
        return out
    try:
        for _, name in socket.if_nameindex():
            addrs = []
            try:
                packed = struct.pack("256s", name.encode("utf-8")[:15])
                res = fcntl.ioctl(sock.fileno(), 0x8915, packed)
                addrs.append(socket.inet_ntoa(res[20:24]))
            except OSError:
                pass
            out.append({"name": name, "ipv4": addrs})
    except (AttributeError, OSError):
        pass
    finally:
        sock.close()
    return out


def main():
    doc = {"version": VERSION, "sysfs_root": ROOT}
    try:
        uname = os.uname()
        doc["hostname"] = uname.nodename
        doc["python"] = "%d.%d.%d" % tuple(sys.version_info[:3])
        doc["executable"] = sys.executable
        doc["platform"] = "%s-%s-%s" % (uname.sysname, uname.release, uname.machine)
        doc["cpu_count"] = os.cpu_count()
        try:
            doc["cpu_usable"] = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            doc["cpu_usable"] = None
        doc["os_release"] = read("/etc/os-release") or read("/usr/lib/os-release")
        doc["proc_net_route"] = read("/proc/net/route")
        doc["numa_nodes"] = numa_nodes()
        sysfs = {}
        doc["sysfs"] = sysfs
        ib_devices = collect_ib(sysfs)
        jobs = [
            ("query_gpu", ["nvidia-smi", "--query-gpu=" + QUERY, "--format=csv"], TIMEOUT),
            ("topo", ["nvidia-smi", "topo", "-m"], TIMEOUT),
            ("list", ["nvidia-smi", "-L"], TIMEOUT),
            ("header", ["nvidia-smi"], TIMEOUT),
            ("ip_addr", ["ip", "-o", "-4", "addr", "show"], min(TIMEOUT, 5)),
        ]
        if not ib_devices:
            jobs.append(("ibstat", ["ibstat"], min(TIMEOUT, 10)))
        commands = run_all(jobs)
        query = commands["query_gpu"]
        if not query["missing"] and query.get("rc") not in (0, None):
            commands["query_gpu_full"] = query
            query = run(["nvidia-smi", "--query-gpu=" + BASIC, "--format=csv"], TIMEOUT)
            commands["query_gpu"] = query
        doc["commands"] = commands
        collect_gpu_numa(sysfs, query.get("stdout"))
        doc["tensorflow"] = tensorflow_version()
        ip_addr = commands["ip_addr"]
        if ip_addr.get("rc") != 0 or not (ip_addr.get("stdout") or "").strip():
            doc["interfaces_ioctl"] = interfaces_ioctl()  # no usable `ip`: ask the kernel directly
    except Exception as exc:  # the caller must always get a document
        import traceback
        doc["fatal"] = "%s: %s\n%s" % (type(exc).__name__, exc, traceback.format_exc())
    sys.stdout.write(json.dumps(doc, sort_keys=True) + "\n")
    sys.stdout.flush()


main()
"""


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


def _interfaces(doc: Mapping[str, Any], ip_cmd: Mapping[str, Any]) -> tuple[NetInterface, ...]:
    found = parse_ip_addr(_command_stdout(ip_cmd)) if ip_cmd.get("rc") == 0 else ()
    if not found:
        raw = doc.get("interfaces_ioctl")
        items: list[NetInterface] = []
        if isinstance(raw, list):
            for item in raw:
                if isinstance(item, dict) and isinstance(item.get("name"), str):
                    addrs = item.get("ipv4")
                    listed = addrs if isinstance(addrs, list) else []
                    ipv4 = tuple(a for a in listed if isinstance(a, str))
                    items.append(NetInterface(item["name"], ipv4))
        found = tuple(items)
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

    numa = doc.get("numa_nodes")
    tf = doc.get("tensorflow")
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
        error=error,
        hostname=_str(doc.get("hostname")),
        driver_version=driver,
        nvidia_smi=nvidia_smi,
        topo=topo,
        interfaces=_interfaces(doc, _command(commands, "ip_addr")),
        notes=tuple(notes),
        problems=tuple(problems),
    )


# --- the one impure part: run the probe on this machine (``dlrun topo`` without --hosts) -----


def probe_local(
    host: str = "localhost", python: str | None = None, timeout: float = 120.0
) -> HostReport:
    """Run :data:`PROBE_SOURCE` here with ``python`` (default: this interpreter) and parse it.

    A probe that cannot start, times out or exits non-zero without a document gives a report
    with ``error`` set; nothing is raised.
    """
    import subprocess
    import sys

    argv = [python or sys.executable, "-c", PROBE_SOURCE]
    try:
        proc = subprocess.run(
            argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return HostReport(host=host, error=f"the probe timed out after {timeout:g} s")
    except OSError as exc:
        return HostReport(host=host, error=f"the probe could not start ({argv[0]}): {exc}")
    report = parse_probe_output(host, proc.stdout)
    if report.error and proc.returncode != 0:
        stderr = proc.stderr.strip().splitlines()[-1:] or [""]
        error = f"{report.error} (exit {proc.returncode}) {stderr[0]}".strip()
        report = replace(report, error=error)
    return report
