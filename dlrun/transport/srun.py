"""Slurm steps as the transport: inside an allocation, each command on a node (the agent, a
control command) runs as a one-task step, ``srun --overlap --nodes=1 --ntasks=1 -w NODE …``,
and the step's stdin and stdout are the channel. No sshd, keys or known_hosts are involved,
and whatever runs stays inside the job: Slurm accounts it and ends it with the allocation.

The agent is started exactly as on any host (``dlrun.remote.boot_argv``, its source first on
stdin), through the same start as over SSH (``dlrun.transport.shell``): the step runs
``/bin/sh -s``, which prints a random marker and execs the argv, so whatever the step printed
first (a site's TaskProlog ``print`` lines) is dropped, not read as the agent's frames. Why the
step options are what they are is in ``docs/slurm.md``.
"""

from __future__ import annotations

import os
import re
import select
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence

from dlrun.errors import HostUnreachable, UsageError
from dlrun.inventory import Host
from dlrun.transport import shell
from dlrun.transport.base import Channel, CommandResult, Transport
from dlrun.transport.local import LocalChannel

START_TIMEOUT = 120.0  # seconds for a step to start its program (slurmctld may be busy)

#: What slurmstepd sets for the agent's one-task step. They describe that step (task 0 of 1),
#: not the job's ranks: a rank seeing SLURM_NTASKS=1 or SLURM_PROCID=0 would take them for its
#: own (PyTorch Lightning's SLURMEnvironment does), so the agent runs without them.
STEP_VARIABLES = (
    "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_GTIDS", "SLURM_TASK_PID", "SLURM_PRIO_PROCESS",
    "SLURM_NTASKS", "SLURM_NPROCS", "SLURM_NNODES", "SLURM_NODELIST", "SLURM_TASKS_PER_NODE",
    "SLURM_STEP_ID", "SLURM_STEPID", "SLURM_STEP_NODELIST", "SLURM_STEP_NUM_NODES", "SLURM_STEP_NUM_TASKS",
    "SLURM_STEP_TASKS_PER_NODE", "SLURM_STEP_LAUNCHER_PORT", "SLURM_SRUN_COMM_HOST", "SLURM_SRUN_COMM_PORT",
    "SLURM_LAUNCH_NODE_IPADDR", "SLURM_DISTRIBUTION", "SLURM_CPU_BIND", "SLURM_CPU_BIND_LIST",
    "SLURM_CPU_BIND_TYPE", "SLURM_CPU_BIND_VERBOSE", "SLURM_UMASK", "SLURM_UNBUFFEREDIO",
    "SLURM_TOPOLOGY_ADDR", "SLURM_TOPOLOGY_ADDR_PATTERN", "SLURM_CPUS_ON_NODE",
)
#: srun reads these as options: a job's per-task requests (``-c 8``, ``--gpus-per-task 1``)
#: would size the agent's step, and so confine every rank it starts to one task's share.
REQUEST_VARIABLES = (
    "SLURM_NTASKS", "SLURM_NPROCS", "SLURM_NTASKS_PER_NODE", "SLURM_NTASKS_PER_SOCKET", "SLURM_NTASKS_PER_CORE",
    "SLURM_NTASKS_PER_GPU", "SLURM_CPUS_PER_TASK", "SLURM_GPUS_PER_TASK", "SLURM_TRES_PER_TASK",
    "SLURM_CPUS_PER_GPU", "SLURM_MEM_PER_CPU", "SLURM_DISTRIBUTION", "SLURM_CPU_BIND", "SLURM_EXACT",
    "SLURM_EXCLUSIVE", "SLURM_GPU_BIND",
)
_NODE_FIELD = re.compile(r"(?:^|\s)(NodeName|NodeAddr)=(\S+)")


def step_argv(node: str, argv: Sequence[str], *, job_id: str, het_group: int | None = None,
              srun: str = "srun") -> list[str]:
    """The ``srun`` command line that runs ``argv`` as a one-task step on ``node``.

    ``--overlap``: the step shares the job's resources with its other steps (the ranks' own
    ``srun``, other hosts' agents). ``--unbuffered``: slurmstepd forwards output as it comes,
    not line by line (the agent's frames are binary); ``--cpu-bind=none``: the agent and its
    ranks keep every CPU the job holds on the node.
    """
    group = [f"--het-group={het_group}"] if het_group is not None else []
    unset = [word for name in STEP_VARIABLES for word in ("-u", name)]
    return [srun, "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={node}", f"--jobid={job_id}", *group,
            "--unbuffered", "--cpu-bind=none", "--quiet", "--job-name=dlrun", "--",
            "env", *unset, *argv]


def srun_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment ``srun`` runs with: dlrun's (srun hands it to the step, as Slurm users
    expect), less the job's per-task requests (``REQUEST_VARIABLES``)."""
    return {k: v for k, v in environ.items() if k not in REQUEST_VARIABLES}


def parse_node_addresses(text: str) -> dict[str, str]:
    """``scontrol -o show node`` output → node name → its ``NodeAddr``."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        fields = dict(_NODE_FIELD.findall(line))
        if "NodeName" in fields:
            found[fields["NodeName"]] = fields.get("NodeAddr") or fields["NodeName"]
    return found


class StepChannel(LocalChannel):
    """A step's stdin and stdout. ``await_start`` drops what the step printed before the start
    marker; ``stderr_text`` leaves out the marker and what preceded it."""

    def __init__(self, host: str, argv: Sequence[str], *, env: Mapping[str, str], what: str) -> None:
        super().__init__(host, argv, env=env, what=what)
        self._pending = b""  # stdout that came with the marker, for the first recv
        self._mark = b""

    def await_start(self, mark: bytes, timeout: float) -> bytes:
        """Read stdout up to the marker; what came before it. Raises ``HostUnreachable`` with
        srun's words if the step ends or stays silent for ``timeout`` seconds."""
        assert self.proc.stdout is not None
        self._mark = mark
        fd = self.proc.stdout.fileno()
        out = bytearray()
        deadline = time.monotonic() + timeout
        while (split := shell.split_at_marker(bytes(out), mark)) is None:
            left = deadline - time.monotonic()
            if left <= 0 or len(out) > shell.MAX_NOISE:
                self.close()
                raise HostUnreachable(self._why(f"the Slurm step did not start dlrun's program within {timeout:g} s"
                                                if left <= 0 else "the Slurm step printed too much before starting"
                                                " dlrun's program", bytes(out)), host=self.host)
            ready, _, _ = select.select([fd], [], [], min(left, 0.25))
            if not ready:
                continue
            data = os.read(fd, 65536)
            if not data:
                code = self.wait(5)
                raise HostUnreachable(self._why("the Slurm step ended before starting dlrun's program"
                                                + ("" if code is None else f" (exit {code})"), bytes(out)),
                                      host=self.host)
            out += data
        before, self._pending = split
        return before

    def _why(self, what: str, printed: bytes) -> str:
        lines = shell.noise_lines(printed, bytes(self._stderr))
        return what + (": " + " / ".join(line.strip() for line in lines[-3:]) if lines else "")

    def recv(self, max_bytes: int = 65536) -> bytes:
        if self._pending:
            data, self._pending = self._pending[:max_bytes], self._pending[max_bytes:]
            return data
        return super().recv(max_bytes)

    def stderr_text(self) -> str:
        text = bytes(self._stderr)
        split = shell.split_at_marker(text, self._mark) if self._mark else None
        return (split[1] if split is not None else text).decode(errors="replace")


class SrunTransport(Transport):
    """The nodes of Slurm job ``job_id``, reached through ``srun`` steps (run inside the job).

    ``het_groups``: a heterogeneous job's node → component (``--het-group``).
    """

    def __init__(self, job_id: str, environ: Mapping[str, str], *, het_groups: Mapping[str, int] | None = None,
                 srun: str | None = None, scontrol: str | None = None) -> None:
        found = srun or shutil.which("srun")
        if not job_id:
            raise UsageError("--transport srun runs inside a Slurm allocation (SLURM_JOB_ID is not set)",
                             hint="run dlrun inside salloc or an sbatch script, or use --transport ssh")
        if found is None:
            raise UsageError("--transport srun: no srun on PATH", hint="load Slurm's module, or use --transport ssh")
        self.job_id = job_id
        self.srun = found
        self.scontrol = scontrol or shutil.which("scontrol")
        self.env = srun_env(environ)
        self.het_groups = dict(het_groups or {})

    def connect(self, hosts: Sequence[Host]) -> Mapping[str, str]:
        """Each node's address, as Slurm knows it (``NodeAddr``); nothing to connect. A node
        Slurm does not know is named here, before any step."""
        names = [h.address for h in hosts]
        addresses: dict[str, str] = {}
        if self.scontrol is not None and names:
            argv = [self.scontrol, "-o", "show", "node", ",".join(names)]
            try:
                found = subprocess.run(argv, capture_output=True, text=True, env=self.env, timeout=60, check=False)
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise HostUnreachable(f"cannot ask Slurm for the nodes' addresses: {exc}", host=hosts[0].name) from exc
            addresses = parse_node_addresses(found.stdout)
            for host in hosts:
                if host.address not in addresses and found.returncode != 0:
                    raise HostUnreachable(f"Slurm does not know node {host.address}: "
                                          f"{found.stderr.strip() or found.stdout.strip()}", host=host.name)
        return {h.name: addresses.get(h.address, h.address) for h in hosts}

    def open(self, host: Host, argv: Sequence[str]) -> Channel:
        """Start ``argv`` in a step through ``/bin/sh -s`` and the start marker, as over SSH."""
        command = step_argv(host.address, ["/bin/sh", "-s"], job_id=self.job_id,
                            het_group=self.het_groups.get(host.address), srun=self.srun)
        token = shell.new_token()
        channel = StepChannel(host.name, command, env=self.env, what=f"the Slurm step on {host.address}")
        channel.send(shell.boot_script(argv, token))
        channel.await_start(shell.marker(token), START_TIMEOUT)
        return channel

    def holds_programs(self, host: Host) -> bool:
        return True

    def start(self, host: Host, argv: Sequence[str], stdin: bytes = b"", timeout: float = 60.0) -> CommandResult:
        """Run ``argv`` as a step that outlives dlrun: ``srun`` in a session of its own, its
        output into files (a pipe would break when dlrun exits, and a killed ``srun`` ends its
        step); the start marker first, as in ``open``, then ``stdin`` sent and closed. Returns
        once the program printed a line (its answer) or ended; the step then lives as long as
        the program, or the allocation."""
        command = step_argv(host.address, ["/bin/sh", "-s"], job_id=self.job_id,
                            het_group=self.het_groups.get(host.address), srun=self.srun)
        token = shell.new_token()
        mark = shell.marker(token)
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            try:
                proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=out, stderr=err, env=self.env,
                                        start_new_session=True)
            except OSError as exc:
                raise HostUnreachable(f"cannot start {command[0]}: {exc}", host=host.name) from exc
            assert proc.stdin is not None
            deadline = time.monotonic() + timeout
            sent = False
            try:
                proc.stdin.write(shell.boot_script(argv, token))
                proc.stdin.flush()
            except OSError:
                sent = True  # it ended: its exit code and stderr say why
            while True:
                code = proc.poll()
                out.seek(0)
                split = shell.split_at_marker(out.read(), mark)
                if split is not None and not sent:  # sh reads its script in blocks: the rest only now
                    sent = True
                    try:
                        proc.stdin.write(stdin)
                        proc.stdin.close()
                    except OSError:
                        pass
                answered = split is not None and b"\n" in split[1]
                if answered or code is not None or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            err.seek(0)
            errors = err.read()
            if not answered:
                if code is None:
                    proc.kill()
                why = f"exit {code}" if code is not None else f"no answer within {timeout:.0f} s"
                detail = " / ".join(shell.noise_lines(errors)[-3:])
                raise HostUnreachable(f"the Slurm step on {host.address} gave no answer ({why})"
                                      + (f": {detail}" if detail else ""), host=host.name)
            assert split is not None
            after = shell.split_at_marker(errors, mark)
            return CommandResult(host=host.name, argv=tuple(argv), exit_code=code or 0, stdout=split[1],
                                 stderr=after[1] if after is not None else errors)
