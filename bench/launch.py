#!/usr/bin/env python3
"""Launch latency: ``dlrun launch`` against ``pdsh -R ssh`` and plain parallel OpenSSH.

Starts one real sshd per fixture host (``tests/support/sshd_cluster.py``, 127.0.0.2… port 2222 as
root) and times, on the first 4, 8 and 16 hosts (one rank each), the wall clock of:

* ``dlrun launch --plain --hosts hosts-N.toml --ssh-config <cfg> --log-dir <dir> trivial.py``
* ``pdsh -R ssh -l <user> -w host0,…`` running ``<python> trivial.py`` with
  ``PDSH_SSH_ARGS_APPEND="-F <cfg> -o BatchMode=yes -o KexAlgorithms=curve25519-sha256"``
* ``ssh -F <cfg> -o BatchMode=yes hostI <python> trivial.py`` for every host at once, then wait

``trivial.py`` prints one line (``hello <login user>``); every run's output is checked. Runs are
interleaved (each repeat visits every host count and every tool in a shuffled order) so that
background load hits all tools alike; the table shows medians. Besides wall time it reports CPU
seconds per launch: the client's (``RUSAGE_CHILDREN``) and the hosts' (every sshd listener's
reaped children: sessions, agents, ranks; and the host programs that outlived their session,
re-parented to the bench, a child subreaper), because on a 2-core machine a 16-host launch is
CPU-bound and CPU is far less disturbed by other load than wall time.

Extras: ``--trace`` runs dlrun once more per host count with timestamps on its phases (imports,
connect, channel open, agent HELLO, rank start/exit, teardown); ``--agent-costs`` times the
remote side of one host (interpreter, agent startup with and without the PID-namespace
re-exec, and prototypes of cheaper agent starts); ``--proto NAME=DIR`` runs a prototype copy
of the dlrun package (``PYTHONPATH=DIR``) as an extra column NAME; ``--tools`` takes
``dlrun+OPTION`` (or ``NAME+OPTION``) for dlrun with extra options, e.g. ``dlrun+--no-preflight``.

    python bench/launch.py                      # --hosts 4,8,16 --repeat 5
    python bench/launch.py --hosts 2 --repeat 1 # smoke
    python bench/launch.py --trace --agent-costs --json /tmp/launch.json

Run as root (the hosts log in as the clean user ``dlrun-test``) or as a plain user (hosts on
127.0.0.1 with distinct ports). Needs sshd, ssh and pdsh.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CLIENT_KEX = "curve25519-sha256"
TRIVIAL = 'import os, pwd\nprint("hello", pwd.getpwuid(os.getuid()).pw_name)\n'
TARGET_RATIO = 0.8


# --------------------------------------------------------------------------- shared helpers
# (bench/logs.py imports these)


def sshd_cluster_module() -> Any:
    sys.path.insert(0, str(REPO / "tests"))
    from support import sshd_cluster

    return sshd_cluster


def make_base_dir() -> Path:
    base = Path(tempfile.mkdtemp(prefix="dlrun-bench-", dir="/tmp"))
    base.chmod(0o755)
    return base


def start_bench_cluster(n: int, base: Path, python: str) -> Any:
    """``n`` sshd hosts under ``base`` (0755) whose login user runs ``python``."""
    cluster = sshd_cluster_module().start_cluster(n, base / "cluster", python=python)
    if cluster.notes:
        print("cluster notes: " + "; ".join(cluster.notes), file=sys.stderr)
    return cluster


def scripts_dir(base: Path) -> Path:
    d = base / "scripts"
    d.mkdir(exist_ok=True)
    d.chmod(0o755)
    return d


def write_script(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.write_text(text)
    path.chmod(0o644)
    return path


def write_hosts_toml(cluster: Any, path: Path, n: int, python: str) -> Path:
    lines = [f"[defaults]\npython = {json.dumps(python)}\n"]
    for h in cluster.hosts[:n]:
        lines.append(f'[[hosts]]\naddress = "{h.name}"\nslots = 1\nworkdir = {json.dumps(str(h.workdir))}\n')
    path.write_text("\n".join(lines))
    return path


# Inherited by the tools, these would change what is measured: PYTHONUNBUFFERED makes dlrun's own stdout
# write(2) every line; PYTHONDONTWRITEBYTECODE makes a prototype copy recompile every module on every run.
STRIPPED_ENV = ("PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE")


def dlrun_env(dlrun_path: str | None = None) -> dict[str, str]:
    """The environment dlrun (or the raw reader) runs with: ours, less STRIPPED_ENV unless DLRUN_BENCH_KEEP_ENV=1."""
    keep = os.environ.get("DLRUN_BENCH_KEEP_ENV") == "1"
    env = {k: v for k, v in os.environ.items() if keep or k not in STRIPPED_ENV}
    return {**env, "PYTHONPATH": dlrun_path or str(REPO)}


def client_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def host_cpu(cluster: Any) -> float:
    """CPU seconds of everything the sshd listeners have reaped (sessions and what they ran)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for h in cluster.hosts:
        if h.pid is None:
            continue
        try:
            data = Path(f"/proc/{h.pid}/stat").read_bytes()
        except OSError:
            continue
        fields = data[data.rfind(b")") + 2 :].split()
        total += int(fields[13]) + int(fields[14])  # cutime, cstime
    return total / tick


def become_subreaper() -> bool:
    """Make this process a child subreaper: a host program that outlives its sshd session (the
    client hung up first, as dlrun does right after the last DONE while the agent is still
    exiting) is re-parented here, not to init, so ``reap_orphans`` can count its CPU."""
    import ctypes

    try:
        return int(ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def _orphans(cluster: Any) -> dict[int, tuple[int, bool]]:
    """Processes re-parented to this one (not the sshd listeners): pid -> (uid, exited)."""
    me, listeners = str(os.getpid()), {h.pid for h in cluster.hosts}
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) not in listeners:
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()
                uid = int(next(line for line in Path(f"/proc/{entry}/status").read_text().splitlines()
                               if line.startswith("Uid:")).split()[1])
            except (OSError, StopIteration, ValueError, IndexError):
                continue
            if fields[1] == me:
                found[int(entry)] = (uid, fields[0] == "Z")
    return found


def reap_orphans(cluster: Any, timeout: float = 5.0) -> tuple[float, float]:
    """CPU seconds of the processes re-parented here, waited for until none is left: (the
    login user's: host programs, everyone else's: the client's, such as pdsh's ssh processes).
    A zombie still shows its owner, so each is told apart before it is reaped; where the login
    user is the bench's own user, everything counts as the hosts'.

    Without this the hosts' CPU missed every agent that was still exiting when its sshd session
    ended: in one run of 4 repeats, 1 to 4 of 16 agents per launch (4-20 ms per host), and the
    whole agent in most 1-host launches."""
    import pwd

    login = pwd.getpwnam(cluster.user).pw_uid
    hosts = client = 0.0
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = _orphans(cluster)
        if not left:
            break
        for pid, (uid, exited) in left.items():
            if not exited:
                continue
            try:
                _pid, _status, usage = os.wait4(pid, os.WNOHANG)
            except ChildProcessError:
                continue
            if _pid:
                cpu = usage.ru_utime + usage.ru_stime
                if uid == login or login == os.getuid():
                    hosts += cpu
                else:
                    client += cpu
        time.sleep(0.01)
    return hosts, client


class HostCgroup:
    """A cgroup-v1 ``cpuacct`` group holding every sshd listener: each process a session starts
    stays in it (re-parented or not) and the kernel sums their CPU in nanoseconds, the listener's
    own accept and fork included; the reaped-children count above rounds to clock ticks per
    process and misses the listener's part. ``None`` where the group cannot be made (not root,
    no cpuacct hierarchy)."""

    ROOT = Path("/sys/fs/cgroup/cpuacct")

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def make(cls, cluster: Any) -> HostCgroup | None:
        path = cls.ROOT / f"dlrun-bench-{os.getpid()}"
        try:
            path.mkdir()
            for h in cluster.hosts:
                if h.pid is not None:
                    (path / "cgroup.procs").write_text(str(h.pid))
        except OSError:
            return None
        return cls(path)

    def usage(self) -> float:
        return int((self.path / "cpuacct.usage").read_text()) / 1e9

    def remove(self) -> None:
        try:
            for pid in (self.path / "cgroup.procs").read_text().split():
                (self.ROOT / "cgroup.procs").write_text(pid)
            self.path.rmdir()
        except OSError:
            pass


def settle(cluster: Any, timeout: float = 5.0) -> None:
    """Wait until no sshd session of the cluster is left (their CPU is then counted)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(cluster.session_pids(i) for i in range(len(cluster.hosts))):
            return
        time.sleep(0.02)


def load1() -> float:
    return os.getloadavg()[0]


def _first_line(argv: Sequence[str]) -> str:
    try:
        out = subprocess.run(list(argv), capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    text = (out.stdout + out.stderr).strip()
    return text.splitlines()[0] if text else "?"


def machine_info(cluster: Any | None = None, remote_python: str | None = None) -> dict[str, str]:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import paramiko

        paramiko_version = paramiko.__version__
    except ImportError:
        paramiko_version = "?"
    info = {
        "cores": str(os.cpu_count()),
        "cpu": cpu,
        "kernel": platform.release(),
        "openssh": _first_line(["ssh", "-V"]),
        "pdsh": _first_line(["pdsh", "-V"]) if shutil.which("pdsh") else "missing",
        "python (dlrun side)": f"{platform.python_version()} ({sys.executable})",
        "paramiko": paramiko_version,
        "network": "loopback (127.0.0.x)",
        "load average at start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }
    stripped = [k for k in STRIPPED_ENV if k in os.environ]
    if stripped and os.environ.get("DLRUN_BENCH_KEEP_ENV") != "1":
        info["environment"] = f"{', '.join(stripped)} removed from the environment dlrun runs with"
    if cluster is not None and remote_python:
        info["python (hosts)"] = f"{_first_line([remote_python, '-V']).split()[-1]} ({remote_python})"
        info["login user"] = cluster.user
    return info


def print_machine(info: dict[str, str]) -> None:
    print("| machine | |\n|---|---|")
    for k, v in info.items():
        print(f"| {k} | {v} |")
    print()


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


# --------------------------------------------------------------------------- tools


@dataclass
class Sample:
    tool: str
    hosts: int
    wall: float
    client_cpu: float
    host_cpu: float
    load1: float
    host_cpu_cg: float = float("nan")  # the hosts' cpuacct cgroup (every process a listener started), when there is one


@dataclass
class Bench:
    cluster: Any
    base: Path
    python: str
    trivial: Path
    protos: dict[str, str] = field(default_factory=dict)  # column name → PYTHONPATH of a dlrun copy
    tomls: dict[int, Path] = field(default_factory=dict)
    cgroup: HostCgroup | None = None

    @property
    def cfg(self) -> str:
        return str(self.cluster.ssh_config)

    def names(self, n: int) -> list[str]:
        return [h.name for h in self.cluster.hosts[:n]]

    def toml(self, n: int) -> Path:
        if n not in self.tomls:
            self.tomls[n] = write_hosts_toml(self.cluster, self.base / f"hosts-{n}.toml", n, self.python)
        return self.tomls[n]

    def expected(self) -> str:
        return f"hello {self.cluster.user}"

    # each returns the output lines it checked, raising if the run failed
    def dlrun_variant(self, tool: str) -> tuple[str, list[str]] | None:
        """(PYTHONPATH, extra options) when ``tool`` is dlrun, a prototype, or either with +OPTIONs."""
        base, *flags = tool.split("+")
        if base == "dlrun":
            return str(REPO), flags
        if base in self.protos:
            return self.protos[base], flags
        return None

    def dlrun_argv(self, n: int, *extra: str) -> list[str]:
        return [sys.executable, "-m", "dlrun", "launch", "--plain", "--hosts", str(self.toml(n)), "--ssh-config",
                self.cfg, "--log-dir", str(self.base / "dlrun-logs"), *extra, str(self.trivial)]

    def run_dlrun(self, n: int, *extra: str, path: str | None = None) -> None:
        out = subprocess.run(self.dlrun_argv(n, *extra), capture_output=True, text=True, cwd=self.base,
                             env=dlrun_env(path), timeout=120)
        got = re.findall(r"^\[\d+ host\d+\] (.*)$", out.stdout, re.M)
        if out.returncode != 0 or sorted(got) != [self.expected()] * n:
            raise RuntimeError(f"dlrun failed (exit {out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")

    def pdsh_env(self) -> dict[str, str]:
        return {**os.environ, "PDSH_SSH_ARGS_APPEND": f"-F {self.cfg} -o BatchMode=yes -o KexAlgorithms={CLIENT_KEX}"}

    def pdsh_argv(self, n: int) -> list[str]:
        # -l: pdsh's ssh module passes "-l <user>" (default: the local user), overriding ssh_config's User
        return ["pdsh", "-R", "ssh", "-l", self.cluster.user, "-w", ",".join(self.names(n)), self.python,
                str(self.trivial)]

    def run_pdsh(self, n: int) -> None:
        out = subprocess.run(self.pdsh_argv(n), capture_output=True, text=True, env=self.pdsh_env(), timeout=120)
        got = sorted(line.split(": ", 1)[1] for line in out.stdout.splitlines() if ": " in line)
        if out.returncode != 0 or got != [self.expected()] * n:
            raise RuntimeError(f"pdsh failed (exit {out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")

    def ssh_argv(self, host: str) -> list[str]:
        return ["ssh", "-F", self.cfg, "-o", "BatchMode=yes", host, self.python, str(self.trivial)]

    def run_ssh(self, n: int) -> None:
        procs = [subprocess.Popen(self.ssh_argv(h), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for h in self.names(n)]
        for p in procs:
            out, err = p.communicate(timeout=120)
            if p.returncode != 0 or out.strip() != self.expected():
                raise RuntimeError(f"ssh failed (exit {p.returncode}): {out[-500:]} {err[-500:]}")

    def tools(self, names: Sequence[str]) -> dict[str, Callable[[int], None]]:
        known: dict[str, Callable[[int], None]] = {
            "pdsh": self.run_pdsh,
            "ssh": self.run_ssh,
        }
        for name in names:
            variant = self.dlrun_variant(name)
            if variant is not None:
                path, flags = variant
                known[name] = lambda n, flags=flags, path=path: self.run_dlrun(n, *flags, path=path)
        return {name: known[name] for name in names}

    def measure(self, name: str, run: Callable[[int], None], n: int) -> Sample:
        settle(self.cluster)
        load = load1()
        cpu0, hcpu0 = client_cpu(), host_cpu(self.cluster)
        cg0 = self.cgroup.usage() if self.cgroup else float("nan")
        t0 = time.perf_counter()
        run(n)
        wall = time.perf_counter() - t0
        cpu1 = client_cpu()
        settle(self.cluster)
        on_hosts, on_client = reap_orphans(self.cluster)  # after cpu1, which never has their CPU
        cg = self.cgroup.usage() - cg0 if self.cgroup else float("nan")
        return Sample(name, n, wall, cpu1 - cpu0 + on_client, host_cpu(self.cluster) - hcpu0 + on_hosts, load, cg)


def _ratio(wall: dict[str, float], a: str, b: str) -> str:
    return f"{wall[a] / wall[b]:.2f}×" if a in wall and b in wall else "-"


def results_table(samples: Sequence[Sample], tools: Sequence[str], host_counts: Sequence[int]) -> str:
    def med(tool: str, n: int, attr: str) -> float:
        return median([getattr(s, attr) for s in samples if s.tool == tool and s.hosts == n])

    others = [t for t in tools if t not in ("dlrun", "pdsh", "ssh")]
    head = ["hosts", "dlrun s", "pdsh s", "ssh s", *[f"{t} s" for t in others], "dlrun/pdsh", "dlrun/ssh",
            *[f"{t}/pdsh" for t in others], "CPU s dlrun (client+hosts)", "CPU s pdsh", "CPU s ssh",
            *[f"CPU s {t}" for t in others]]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n in host_counts:
        wall = {t: med(t, n, "wall") for t in tools}
        cpu = {t: (med(t, n, "client_cpu"), med(t, n, "host_cpu")) for t in tools}
        order = ("dlrun", "pdsh", "ssh", *others)
        ratios = [_ratio(wall, "dlrun", b) for b in ("pdsh", "ssh")] + [_ratio(wall, t, "pdsh") for t in others]
        cells = [str(n), *[f"{wall[t]:.3f}" if t in wall else "-" for t in order], *ratios,
                 *[f"{cpu[t][0]:.2f}+{cpu[t][1]:.2f}" if t in cpu else "-" for t in order]]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


# --------------------------------------------------------------------------- --trace: dlrun's phases
# The child runs dlrun's CLI in-process with timestamps (ms since the parent's T0) at each phase; it is
# a -c string so that nothing but dlrun is imported before the first mark.


TRACE_CHILD = r"""
import atexit, json, os, sys, time
T0 = float(os.environ["DLRUN_BENCH_T0"])
EVENTS = []
def mark(kind, what=""):
    EVENTS.append(((time.time() - T0) * 1000, kind, what))
mark("interpreter")
import dlrun.cli as cli
mark("import dlrun.cli")
import dlrun.run.pipeline as launch_mod
import dlrun.run.hosts as hosts_mod
mark("import dlrun.run.pipeline")
import dlrun.transport.ssh as ssh_mod
import dlrun.run.supervisor as sup
mark("import dlrun.transport.ssh")
def wrap(owner, name, label, host_arg=False):
    original = getattr(owner, name, None)
    if original is None:
        return
    def wrapper(*args, **kwargs):
        host = str(getattr(args[1], "name", args[1])) if host_arg and len(args) > 1 else ""
        mark("> " + label, host)
        try:
            return original(*args, **kwargs)
        finally:
            mark("< " + label, host)
    setattr(owner, name, wrapper)
wrap(launch_mod, "keras_warning", "keras check")
wrap(hosts_mod, "keras_warning", "keras check")
wrap(sup.HostAgents, "start", "agents start")
wrap(sup.HostAgents, "answers", "preflight + survey")
wrap(hosts_mod, "push_for_launch", "push")
wrap(ssh_mod.SSHTransport, "connect", "connect")
wrap(ssh_mod.SSHTransport, "_client", "handshake", host_arg=True)
wrap(ssh_mod.SSHTransport, "open", "open channel", host_arg=True)
wrap(ssh_mod.SSHTransport, "close", "transport close")
wrap(sup.Supervisor, "_start_all", "start all")
wrap(sup.Supervisor, "_loop", "supervise loop")
NAMES = {1: "HELLO", 2: "STARTED", 3: "STDOUT", 4: "STDERR", 5: "EXIT", 6: "ERROR", 7: "DONE", 8: "PROBE", 9: "SURVEY",
         10: "PONG"}
import dlrun.run.agents as agents_mod
from dlrun.run.events import Closed, Frames
def reader(self, link, channel):  # HostAgents._reader, marking HELLO and PROBE as they arrive
    host = link.host.name
    decoder = agents_mod.agent.FrameDecoder()
    while True:
        data = channel.recv(65536)
        if not data:
            break
        link.heard = time.monotonic()
        frames = decoder.feed(data)
        for kind, _rank, _payload in frames:
            if kind in (1, 8, 9):
                mark(NAMES[kind], host)
        if frames:
            self.events.put(Frames(host, frames))
    link.ended = True
    code = channel.wait(5)
    self.events.put(Closed(host, code, channel.stderr_text()))
agents_mod.HostAgents._reader = reader
_frame = sup.Supervisor._frame
def frame(self, host, kind, rank, payload):
    if kind not in (1, 8, 9):
        mark(NAMES.get(kind, str(kind)), host)
    _frame(self, host, kind, rank, payload)
sup.Supervisor._frame = frame
_closed = sup.Supervisor._closed
def closed(self, host, *rest):
    mark("closed", host)
    _closed(self, host, *rest)
sup.Supervisor._closed = closed
def dump():
    if not os.path.exists(os.environ["DLRUN_BENCH_TRACE"]):
        mark("exit")
        with open(os.environ["DLRUN_BENCH_TRACE"], "w") as fh:
            json.dump(EVENTS, fh)
atexit.register(dump)
sys.argv = ["dlrun", *sys.argv[1:]]
cli.main()
"""


def traceable(bench: Bench, tool: str) -> bool:
    """Can TRACE_CHILD trace this dlrun (a copy older than the split of ``run/launch.py`` cannot)?"""
    variant = bench.dlrun_variant(tool)
    return variant is not None and (Path(variant[0]) / "dlrun" / "run" / "pipeline.py").exists()


def run_trace(bench: Bench, tool: str, n: int) -> dict[str, Any]:
    variant = bench.dlrun_variant(tool)
    assert variant is not None
    path, flags = variant
    safe = re.sub(r"[^\w-]+", "_", tool)
    trace_file = bench.base / f"trace-{safe}-{n}.json"
    trace_file.unlink(missing_ok=True)
    argv = bench.dlrun_argv(n, *flags)[3:]  # drop "python -m dlrun"
    env = {**dlrun_env(path), "DLRUN_BENCH_TRACE": str(trace_file)}
    settle(bench.cluster)
    env["DLRUN_BENCH_T0"] = repr(time.time())
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", TRACE_CHILD, *argv], capture_output=True, text=True,
                         cwd=bench.base, env=env, timeout=120)
    wall = (time.perf_counter() - t0) * 1000
    if out.returncode != 0:
        raise RuntimeError(f"traced dlrun failed: {out.stdout[-1500:]} {out.stderr[-1500:]}")
    events = [tuple(e) for e in json.loads(trace_file.read_text())]
    return {"tool": tool, "hosts": n, "wall_ms": wall, "events": events}


def summarize_trace(trace: dict[str, Any]) -> list[tuple[str, float]]:
    """(phase, ms) rows; 'at' rows are times since the parent spawned dlrun."""
    ev: list[tuple[float, str, str]] = trace["events"]

    def first(kind: str) -> float:
        return min((t for t, k, _ in ev if k == kind), default=float("nan"))

    def last(kind: str) -> float:
        return max((t for t, k, _ in ev if k == kind), default=float("nan"))

    def per_host(a: str, b: str, nth: int = -1) -> float:
        """Median over hosts of (b − a), pairing each host's k-th a with its k-th b (nth: only that pair)."""
        starts: dict[str, list[float]] = {}
        ends: dict[str, list[float]] = {}
        for t, k, h in ev:
            if k == a:
                starts.setdefault(h, []).append(t)
            elif k == b:
                ends.setdefault(h, []).append(t)
        pairs = [list(zip(starts[h], ends.get(h, []), strict=False)) for h in starts]
        picked = [p[nth] for p in pairs if len(p) > (nth if nth >= 0 else -nth - 1)]
        return median([e - s for s, e in picked])

    return [
        ("interpreter up (python + site)", first("interpreter")),
        ("import click + dlrun.cli", first("import dlrun.cli") - first("interpreter")),
        ("import dlrun.run.pipeline (view→rich, supervisor, importlib.metadata)",
         first("import dlrun.run.pipeline") - first("import dlrun.cli")),
        ("import dlrun.transport.ssh (paramiko→invoke, cryptography)",
         first("import dlrun.transport.ssh") - first("import dlrun.run.pipeline")),
        ("inventory, keras check, plan, render", first("> connect") - first("import dlrun.transport.ssh")),
        ("connect: all hosts (parallel)", first("< connect") - first("> connect")),
        ("  one handshake, median", per_host("> handshake", "< handshake")),
        ("start agents: open channels + send probe request (parallel)",
         first("< agents start") - first("> agents start")),
        ("  one open (agent channel), median", per_host("> open channel", "< open channel", nth=0)),
        ("agents start → first HELLO", first("HELLO") - first("> agents start")),
        ("agents start → last HELLO", last("HELLO") - first("> agents start")),
        ("agents start → last PROBE answer", last("PROBE") - first("> agents start")),
        ("  HELLO → PROBE, median per host", per_host("HELLO", "PROBE")),
        ("preflight: wait for answers + checks", first("> push") - first("> preflight")),
        ("push (manifest round trip; nothing changed)", first("< push") - first("> push")),
        ("push end → spec sent to every agent", first("< start all") - first("< push")),
        ("start all → last STARTED", last("STARTED") - first("> start all")),
        ("  STARTED → EXIT (rank runs trivial.py), median", per_host("STARTED", "EXIT")),
        ("  EXIT → channel closed, median", per_host("EXIT", "closed")),
        ("last HELLO → last closed", last("closed") - last("HELLO")),
        ("supervise loop end → process exit", trace["wall_ms"] - first("< supervise loop")),
        ("total wall (parent)", trace["wall_ms"]),
    ]


# --------------------------------------------------------------------------- --agent-costs: the remote side

AGENT_COSTS = r'''
import json, os, resource, struct, subprocess, sys, time
HERE = os.path.dirname(os.path.abspath(__file__))
PY = sys.argv[1]
N = int(sys.argv[2])
SRC = open(os.path.join(HERE, "agent_src.py")).read()
SRC_MIN = open(os.path.join(HERE, "agent_min.py")).read()
WRAPPER = open(os.path.join(HERE, "pidns_wrapper.sh")).read()
TRIVIAL = os.path.join(HERE, "trivial.py")
SPEC = json.dumps({"job_id": "bench", "eof_grace": 2.0, "ranks": [
    {"rank": 0, "argv": [PY, TRIVIAL], "env": {"DLRUN_RANK": "0"}, "cwd": HERE}]}).encode() + b"\n"
US = ["unshare", "--user", "--map-current-user", "--pid", "--fork", "--kill-child"]
if os.geteuid() == 0:
    US = ["unshare", "--pid", "--fork", "--kill-child"]
HDR = struct.Struct(">BiI")

def agent_run(argv):
    """Wall and per-frame times of one agent running trivial.py; stdin stays open until it exits."""
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    p.stdin.write(SPEC); p.stdin.flush()
    buf, marks = b"", {}
    fd = p.stdout.fileno()
    while True:
        data = os.read(fd, 65536)
        if not data:
            break
        buf += data
        while len(buf) >= HDR.size:
            kind, rank, length = HDR.unpack_from(buf)
            if len(buf) < HDR.size + length:
                break
            marks.setdefault(kind, time.perf_counter() - t0)
            buf = buf[HDR.size + length:]
    p.wait(); p.stdin.close()
    return time.perf_counter() - t0, marks

def plain_run(argv):
    t0 = time.perf_counter()
    subprocess.run(argv, input=b"", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0, {}

CASES = [
    ("python -c pass (interpreter floor)", plain_run, [PY, "-c", "pass"]),
    ("python -S -c pass", plain_run, [PY, "-S", "-c", "pass"]),
    ("python trivial.py (what pdsh/ssh run)", plain_run, [PY, TRIVIAL]),
    ("unshare probe (unshare ... true)", plain_run, [*US, "true"]),
    ("import json,selectors,signal,socket,struct,subprocess", plain_run,
     [PY, "-c", "import json, os, selectors, signal, socket, struct, subprocess, sys, time"]),
    ("compile(agent source) x1", plain_run, [PY, "-c", "compile(open(%r).read(), '<s>', 'exec')" %
                                             os.path.join(HERE, "agent_src.py")]),
    ("dlrun: sh wrapper -> unshare -> python -c SRC --in-pidns (+trivial.py)", agent_run,
     ["sh", "-c", WRAPPER, "dlrun-agent", PY, "-c", SRC]),
    ("--no-pidns: python -c SRC (+trivial.py)", agent_run, [PY, "-c", SRC]),
    ("unshare ... python -S -c <docstring-free SRC> --in-pidns", agent_run,
     [*US, PY, "-S", "-c", SRC_MIN, "--in-pidns"]),
]
for fname in sorted(os.listdir(HERE)):
    if fname.startswith("agent_proto_") and fname.endswith(".py"):
        PROTO = open(os.path.join(HERE, fname)).read()
        CASES.append(("proto " + fname[12:-3] + ": A with that prototype's agent source", agent_run,
                      [*US, PY, "-c", PROTO, "--in-pidns"]))
if os.path.exists(os.path.join(HERE, "probe_src.py")):
    PROBE = open(os.path.join(HERE, "probe_src.py")).read()
    CASES.insert(6, ("preflight probe: python -c <the probe's source>", plain_run, [PY, "-c", PROBE]))
out = []
for name, fn, argv in CASES:
    walls, cpus, marks = [], [], []
    for _ in range(N):
        c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        wall, m = fn(argv)
        c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        walls.append(wall); marks.append(m)
        cpus.append(c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime)
    row = {"case": name, "wall": sorted(walls)[N // 2], "cpu": sorted(cpus)[N // 2]}
    for kind, label in ((1, "hello"), (2, "started"), (5, "exit"), (7, "done")):
        vals = sorted(m[kind] for m in marks if kind in m)
        if vals:
            row[label] = vals[len(vals) // 2]
    out.append(row)
print(json.dumps(out))
'''


def minify_source(source: str) -> str:
    """The agent's source without docstrings (what compile() would have to chew through)."""
    import ast

    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                node.body = node.body[1:] or [ast.Pass()]
    return ast.unparse(tree)


def agent_costs(bench: Bench, repeat: int) -> list[dict[str, Any]]:
    sys.path.insert(0, str(REPO))
    from dlrun.remote import agent, source_of

    d = bench.trivial.parent
    source = source_of("agent")
    write_script(d, "agent_src.py", source)
    write_script(d, "agent_min.py", minify_source(source))
    write_script(d, "pidns_wrapper.sh", agent.PIDNS_WRAPPER)
    write_script(d, "probe_src.py", source_of("probe"))
    for name, path in bench.protos.items():  # prototypes whose agent differs from the repo's
        proto_agent = Path(path) / "dlrun" / "agent.py"
        if proto_agent.exists() and proto_agent.read_text() != source:
            safe = re.sub(r"\W+", "_", name)
            write_script(d, f"agent_proto_{safe}.py", proto_agent.read_text())
    script = write_script(d, "agent_costs.py", AGENT_COSTS)
    settle(bench.cluster)
    out = subprocess.run(["ssh", "-F", bench.cfg, "-o", "BatchMode=yes", bench.cluster.hosts[0].name, bench.python,
                          str(script), bench.python, str(repeat)], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"agent costs failed: {out.stderr[-2000:]}")
    rows: list[dict[str, Any]] = json.loads(out.stdout)
    for row in rows:
        row["source_bytes"] = len(source)
    return rows


def agent_costs_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["| remote step (one host, sequential, median) | wall ms | CPU ms | HELLO ms | STARTED ms | EXIT ms | "
             "DONE ms |", "|---|---|---|---|---|---|---|"]

    def ms(row: dict[str, Any], key: str) -> str:
        return f"{row[key] * 1000:.1f}" if key in row else ""

    for row in rows:
        lines.append(f"| {row['case']} | {ms(row, 'wall')} | {ms(row, 'cpu')} | {ms(row, 'hello')} | "
                     f"{ms(row, 'started')} | {ms(row, 'exit')} | {ms(row, 'done')} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hosts", default="4,8,16", help="host counts, comma-separated (default 4,8,16)")
    p.add_argument("--repeat", type=int, default=5, help="runs per tool and host count (median; default 5)")
    p.add_argument("--tools", default="dlrun,pdsh,ssh",
                   help="dlrun,pdsh,ssh; also dlrun+OPTION[+OPTION]: dlrun with extra options, e.g.\n"
                        "dlrun+--no-pidns, dlrun+--no-preflight (default dlrun,pdsh,ssh)")
    p.add_argument("--python", default=shutil.which("python3", path="/usr/bin:/bin") or "python3",
                   help="interpreter on the hosts, for the agent and trivial.py (default /usr/bin/python3)")
    p.add_argument("--proto", action="append", default=[], metavar="NAME=DIR",
                   help="a prototype copy of dlrun (PYTHONPATH=DIR) as an extra column NAME (repeatable)")
    p.add_argument("--trace", action="store_true", help="one extra traced dlrun run per host count: phase times")
    p.add_argument("--agent-costs", action="store_true", help="time the remote agent's startup steps on one host")
    p.add_argument("--json", help="write every sample (and traces) to this file")
    p.add_argument("--keep", action="store_true", help="keep the /tmp/dlrun-bench-* directory")
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    host_counts = [int(x) for x in args.hosts.split(",") if x.strip()]
    tool_names = [t for t in args.tools.split(",") if t]
    protos = dict(item.split("=", 1) for item in args.proto)
    tool_names += [name for name in protos if name not in tool_names]
    if "pdsh" in tool_names and shutil.which("pdsh") is None:
        print("pdsh is not installed: apt-get install pdsh", file=sys.stderr)
        return 2
    base = make_base_dir()
    cluster = None
    bench: Bench | None = None
    if not become_subreaper():
        print("note: not a child subreaper here: the hosts' CPU misses host programs that outlive their"
              " sshd session", file=sys.stderr)
    try:
        cluster = start_bench_cluster(max(host_counts), base, args.python)
        trivial = write_script(scripts_dir(base), "trivial.py", TRIVIAL)
        bench = Bench(cluster, base, args.python, trivial, protos=protos, cgroup=HostCgroup.make(cluster))
        info = machine_info(cluster, args.python)
        tools = bench.tools(tool_names)
        print(f"# dlrun launch benchmark: {', '.join(tools)} on {host_counts} hosts, median of {args.repeat}\n")
        print_machine(info)
        for run in tools.values():  # warm-up (page cache, .pyc), not counted
            run(host_counts[0])
        rng = random.Random(args.seed)
        samples: list[Sample] = []
        for rep in range(args.repeat):
            for n in host_counts:
                order = list(tools.items())
                rng.shuffle(order)
                for name, run in order:
                    samples.append(bench.measure(name, run, n))
            done = [s for s in samples if s.hosts == host_counts[-1] and s.tool == "dlrun"]
            if done:
                print(f"repeat {rep + 1}/{args.repeat}: dlrun {done[-1].wall:.2f} s at {host_counts[-1]} hosts, "
                      f"load {load1():.2f}", file=sys.stderr)
        loads = [s.load1 for s in samples]
        print(results_table(samples, list(tools), host_counts))
        print(f"\nwall: seconds from spawn to exit; CPU: client (dlrun / pdsh+ssh / ssh processes) + hosts (sshd "
              f"sessions and what they ran). 1-min load average during the runs: min {min(loads):.2f}, median "
              f"{median(loads):.2f}, max {max(loads):.2f}; at the end {load1():.2f}.")
        top = max(host_counts)
        if {"dlrun", "pdsh"} <= set(tools):
            ratio = median([s.wall for s in samples if s.tool == "dlrun" and s.hosts == top]) / median(
                [s.wall for s in samples if s.tool == "pdsh" and s.hosts == top])
            verdict = "met" if ratio <= TARGET_RATIO else "NOT met"
            print(f"target dlrun ≤ {TARGET_RATIO}× pdsh at {top} hosts: {ratio:.2f}× — {verdict}")
        traces = []
        if args.trace:
            print("\n## dlrun phases (one traced run each, ms since spawn or durations)\n")
            traces = [run_trace(bench, t, n) for t in tools if traceable(bench, t) for n in host_counts]
            print("| phase | " + " | ".join(f"{t['tool']} {t['hosts']}" for t in traces) + " |")
            print("|---|" + "---|" * len(traces))
            summaries = [summarize_trace(t) for t in traces]
            for i, (label, _) in enumerate(summaries[0] if summaries else ()):
                print(f"| {label} | " + " | ".join(f"{s[i][1]:.0f}" for s in summaries) + " |")
        costs: list[dict[str, Any]] = []
        if args.agent_costs:
            costs = agent_costs(bench, max(9, args.repeat * 4))
            print(f"\n## remote side of one host ({costs[0]['source_bytes']} B agent source; times from spawn)\n")
            print(agent_costs_table(costs))
        if args.json:
            Path(args.json).write_text(json.dumps({"machine": info, "samples": [asdict(s) for s in samples],
                                                   "traces": traces, "agent_costs": costs}, indent=1))
        return 0
    finally:
        if cluster is not None:
            cluster.stop(remove=True)
        if bench is not None and bench.cgroup is not None:
            bench.cgroup.remove()
        if args.keep:
            print(f"kept {base}", file=sys.stderr)
        else:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
