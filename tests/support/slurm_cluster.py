"""A real Slurm cluster on this machine, for tests: one ``slurmctld -D`` and one ``slurmd -D -N
<name>`` per node, each on its own loopback port, with ``auth/none`` and ``cred/none`` (as root).

``start_slurm(names, base_dir)`` writes a ``slurm.conf`` (nodes named as given, e.g. the sshd
test hosts ``host0``, ``host1``; every ``NodeAddr`` is 127.0.0.1), starts the daemons and waits
until every node is idle::

    with start_slurm(["host0", "host1"], tmp_path) as slurm:
        slurm.run(["srun", "-N2", "hostname"])          # SLURM_CONF points at its config
        subprocess.run(["salloc", "-N2", "env"], env=slurm.env())

Debian's ``slurm-wlm`` (22.05) provides the binaries (``.ci/run`` installs it). Daemons get
``PR_SET_PDEATHSIG`` through ``setpriv``, so they end with the test run that started them even
if it is killed. Each cluster has its own folder, ports and cluster name: clusters started by
test runs side by side do not meet.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Self

DAEMONS = ("slurmctld", "slurmd", "slurmstepd")
CLIENTS = ("srun", "salloc", "sbatch", "scontrol", "sinfo", "squeue", "scancel")
NODE_CPUS = 8  # what each node claims (config_overrides): enough for several --overlap steps


class SlurmClusterError(RuntimeError):
    """The cluster did not come up (the message carries the daemons' last log lines)."""


def find_slurm() -> str | None:
    """Why Slurm cannot run here (a missing binary, not root), or None when it can."""
    missing = [name for name in (*DAEMONS, *CLIENTS)
               if shutil.which(name) is None and not os.access(f"/usr/sbin/{name}", os.X_OK)]
    if missing:
        return f"no {', '.join(missing)} (install slurm-wlm; .ci/run does)"
    if os.geteuid() != 0:
        return "slurmd runs jobs as their users only as root"
    return None


def in_ci() -> bool:
    """On CI (``.ci/run`` sets ``DLRUN_CI``; most CI services set ``CI``) Slurm must be there."""
    return bool(os.environ.get("DLRUN_CI") or os.environ.get("CI"))


def require_slurm() -> None:
    """Skip the calling test where Slurm cannot run, unless on CI: there it fails."""
    import pytest

    why = find_slurm()
    if why is None:
        return
    if in_ci():
        pytest.fail(f"Slurm is required on CI: {why}")
    pytest.skip(why)


def _binary(name: str) -> str:
    found = shutil.which(name)
    return found or f"/usr/sbin/{name}"


def _free_ports(count: int) -> list[int]:
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@dataclass
class SlurmCluster:
    """A running cluster: ``conf`` (its slurm.conf), ``names`` (its nodes), ``root`` (its folder)."""

    names: tuple[str, ...]
    root: Path
    conf: Path = field(init=False)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.conf = self.root / "slurm.conf"

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) without any allocation's variables,
        with ``SLURM_CONF`` set to this cluster's config."""
        env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = str(self.conf)
        return env

    def run(self, argv: Sequence[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(argv), env=self.env(), capture_output=True, text=True, timeout=timeout,
                              check=False)

    def jobs(self) -> list[str]:
        """The ids of this cluster's jobs that have not ended."""
        found = self.run(["squeue", "-h", "-o", "%i"], timeout=30)
        return found.stdout.split()

    @staticmethod
    def step_daemon_of(pid: int) -> int | None:
        """The ``slurmstepd`` that ``pid`` runs under (its nearest such ancestor), or None."""
        while pid > 1:
            try:
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                return None
            if comm == "slurmstepd":
                return pid
            pid = int(stat.rpartition(")")[2].split()[1])
        return None

    def log_tail(self, lines: int = 20) -> str:
        out = []
        for log in sorted(self.root.glob("*.log")):
            text = log.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {log.name}\n" + "\n".join(text))
        return "\n".join(out)

    # ----------------------------------------------------------------------- lifecycle

    def write_config(self) -> None:
        ctl_port, *node_ports = _free_ports(1 + len(self.names))
        host = socket.gethostname()
        lines = [
            f"ClusterName=dlrun{secrets.token_hex(3)}",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctl_port}",
            "AuthType=auth/none",
            "CredType=cred/none",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/backfill",  # heterogeneous jobs need it; every second, not every 30 s
            "SchedulerParameters=bf_interval=1",
            "MpiDefault=none",
            "ReturnToService=2",
            "SlurmUser=root",
            "SlurmdUser=root",
            "SlurmdParameters=config_overrides",
            "KillWait=2",
            "InactiveLimit=0",
            "MessageTimeout=20",
            f"StateSaveLocation={self.root}/state",
            f"SlurmdSpoolDir={self.root}/spool-%n",
            f"SlurmctldPidFile={self.root}/slurmctld.pid",
            f"SlurmdPidFile={self.root}/slurmd-%n.pid",
            f"SlurmctldLogFile={self.root}/slurmctld.log",
            f"SlurmdLogFile={self.root}/slurmd-%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
        ]
        for name, port in zip(self.names, node_ports, strict=True):
            lines.append(f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port}"
                         f" CPUs={NODE_CPUS} RealMemory=1000 State=UNKNOWN")
        lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO")
        # as on sites that greet every task: "print" lines of a TaskProlog go to the task's stdout
        # first, where dlrun's agent protocol would otherwise read them as frames
        prolog = self.root / "task_prolog.sh"
        prolog.write_text("#!/bin/sh\necho 'print Welcome to the test cluster'\n")
        prolog.chmod(0o755)
        lines.append(f"TaskProlog={prolog}")
        (self.root / "state").mkdir(parents=True, exist_ok=True)
        self.conf.write_text("\n".join(lines) + "\n")

    def _daemon(self, key: str, argv: list[str]) -> None:
        # setpriv --pdeathsig: the daemon ends with this process, even after a kill -9 of pytest
        prefix = ["setpriv", "--pdeathsig", "KILL"] if shutil.which("setpriv") else []
        log = (self.root / f"{key}.out").open("ab")
        self.procs[key] = subprocess.Popen([*prefix, *argv], stdin=subprocess.DEVNULL, stdout=log,
                                           stderr=subprocess.STDOUT, env=self.env(), start_new_session=True)
        log.close()

    def start(self, timeout: float = 60.0) -> SlurmCluster:
        self.write_config()
        self._daemon("slurmctld", [_binary("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        for name in self.names:
            self._daemon(f"slurmd-{name}", [_binary("slurmd"), "-D", "-N", name, "-f", str(self.conf)])
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            for key, proc in self.procs.items():
                if proc.poll() is not None:
                    self.stop()
                    raise SlurmClusterError(f"{key} exited with {proc.returncode}:\n{self.log_tail()}")
            found = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=20)
            state = found.stdout + found.stderr
            states = dict(line.split() for line in found.stdout.splitlines() if len(line.split()) == 2)
            if found.returncode == 0 and all(states.get(n) == "idle" for n in self.names):
                return self
            time.sleep(0.5)
        self.stop()
        raise SlurmClusterError(f"nodes not idle within {timeout:.0f} s: {state.strip()}\n{self.log_tail()}")

    def stop(self) -> None:
        """End every job, then the daemons (slurmd's steps end with their slurmstepd)."""
        if self.procs.get("slurmctld") is not None and self.procs["slurmctld"].poll() is None:
            self.run(["scancel", "--full", "--user", "root"], timeout=20)
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        # a step daemon whose job ended as the cluster stopped can wait for ever to report it
        for pid in self.step_daemons():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def step_daemons(self) -> list[int]:
        """This cluster's ``slurmstepd`` processes (their environment names its config)."""
        needle = f"SLURM_CONF={self.conf}".encode()
        found = []
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                if Path(f"/proc/{entry.name}/comm").read_text().strip() != "slurmstepd":
                    continue
                if needle in Path(f"/proc/{entry.name}/environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
        return found


def start_slurm(names: Sequence[str], base_dir: Path, timeout: float = 60.0) -> SlurmCluster:
    """Start a cluster of nodes ``names`` with its files under ``base_dir`` (made if missing)."""
    base_dir.mkdir(parents=True, exist_ok=True)
    return SlurmCluster(tuple(names), base_dir).start(timeout)
