"""The option records of dlrun's Python API, one per section of ``dlrun launch --help``:
``JobOptions``, ``OutputOptions``, ``SSHOptions``, ``PushOptions`` and ``SparkOptions``.

Each field is named as its command-line option (``--no-pidns`` is ``pidns=False``), so the
command line builds the same records from its parsed options (``from_settings``). A launch is
on the SSH backend (the inventory's hosts, or this machine) unless it is given a
``SparkOptions``; ``check_backend`` is the one check of options that only one backend takes.
Pure: no I/O, and cheap to import.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

from dlrun.errors import UsageError

#: How hosts are reached (``--transport``).
TRANSPORTS = ("auto", "ssh", "srun")


@dataclass(frozen=True)
class JobOptions:
    """Job options: how the ranks run, restart and stop (``dlrun launch --help``, Job)."""

    module: bool = False  # -m: the script is a Python module, run with each host's python -m
    no_python: bool = False  # the command runs exactly as given (no python, Rscript or bash from dlrun)
    env_file: tuple[str | Path, ...] = ()  # NAME=VALUE files only their owner may read; env wins over them
    base_port: int | None = None  # port of local rank 0 (None: the default, or a free run on this machine)
    iface: str | None = None  # the Gloo/NCCL socket interface on every host (None: each host's own)
    grace: float = 10.0  # seconds between SIGTERM and SIGKILL
    max_restarts: int = 0  # run a failed job again this many times
    min_hosts: int | None = None  # a restart after a lost host runs on the hosts left, if at least this many
    checkpoint_dir: tuple[str, ...] = ()  # folders made the same on every host before every attempt
    detach: bool = False  # hand the job to the hosts' keepers and return once every rank started
    pidns: bool = True  # run each host's ranks in a PID namespace
    preflight: bool = True  # probe the hosts (slots, GPUs, error findings) before anything starts
    bench: bool = False  # after the preflight, measure the hosts as ``dlrun topo --bench`` does
    bench_seconds: float = 60.0  # about how long the bench takes
    hang_timeout: float = 0.0  # no output and no busy GPU this long: stacks, stop, exit 124 (0: off)


@dataclass(frozen=True)
class OutputOptions:
    """Output options: what dlrun shows and writes (``dlrun launch --help``, Output)."""

    dry_run: bool = False  # print each rank's host, env and argv and what the push would do; start nothing
    json_output: bool = False  # with dry_run: the plan as JSON
    log_dir: str | Path | None = None  # where rank-N.log files go (None: dlrun-logs/)
    ranks: tuple[int, ...] | None = None  # the ranks shown on screen (the log files keep all)
    plain: bool = False  # plain prefixed lines even on a terminal
    gpu_every: float = 2.0  # seconds between GPU samples on every host (0: none)
    gpu_idle_after: float = 60.0  # name a GPU the ranks see that is idle this long while another is busy


@dataclass(frozen=True)
class SSHOptions:
    """SSH options: how every command reaches its hosts (each ``--help``'s SSH section).

    A timeout left None follows each host's ssh config (``ConnectTimeout``,
    ``ServerAliveInterval`` × ``ServerAliveCountMax``), else 10 s and 30 s. ``transport``:
    ``ssh``, ``srun`` (Slurm steps, inside an allocation) or ``auto`` (srun for the
    allocation's own nodes, else ssh)."""

    ssh_config: str | None = None
    known_hosts: str | None = None
    accept_new_host_keys: bool = False
    connect_timeout: float | None = None
    host_timeout: float | None = None  # seconds of silence before a host (or Spark task) is lost; 0: never
    transport: str = "auto"

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise UsageError(f"--transport {self.transport}: expected one of {', '.join(TRANSPORTS)}")


@dataclass(frozen=True)
class PushOptions:
    """Push options: the code and data each host gets (``dlrun launch --help``, Push)."""

    push: bool = True  # push the script's folder (or ``code``) to <workdir>/<name> on remote hosts
    code: str | Path | None = None  # push this folder (it holds the script) instead of the script's own
    max_push_size: str | None = None  # the code push's limit (500M, 2G, none)
    setup: str | None = None  # `sh -c CMD` on every host before any rank, again when CMD or the files changed
    setup_always: bool = False  # run the setup even when nothing changed since its last success
    insecure_workdir: bool = False  # push and run where another user owns, or may write, the folders
    data: str | Path | None = None  # dataset folder (or file): each host gets its shard
    shard: str = "files"  # how data is split: files, contiguous, size, replicate
    split_lines: bool = False  # split a single text/CSV dataset file into per-host parts


@dataclass(frozen=True)
class SparkOptions:
    """Spark options: run the job as a Spark barrier stage of ``np`` tasks (default 2) instead
    of on hosts (``dlrun launch --backend spark``)."""

    master: str  # Spark master URL: spark://head:7077, local[4]
    cores_per_worker: int = 1
    gpus_per_worker: int = 0
    conf: Mapping[str, str] = field(default_factory=dict)  # k=v Spark configuration
    start_timeout: float = 120.0  # seconds for every task to start and report


#: The command-line flag of each field that only the SSH backend takes, in the order a usage
#: error names them.
SSH_BACKEND_ONLY: tuple[tuple[type[Any], str, str], ...] = (
    (PushOptions, "data", "--data"), (PushOptions, "shard", "--shard"),
    (PushOptions, "split_lines", "--split-lines"), (PushOptions, "push", "--push/--no-push"),
    (PushOptions, "code", "--code"), (PushOptions, "max_push_size", "--max-push-size"),
    (PushOptions, "setup", "--setup"), (PushOptions, "setup_always", "--setup-always"),
    (PushOptions, "insecure_workdir", "--insecure-workdir"),
    (JobOptions, "base_port", "--base-port"), (JobOptions, "preflight", "--no-preflight"),
    (JobOptions, "bench", "--bench"), (JobOptions, "bench_seconds", "--bench-seconds"),
    (JobOptions, "module", "--module"),
    (SSHOptions, "ssh_config", "--ssh-config"), (SSHOptions, "known_hosts", "--known-hosts"),
    (SSHOptions, "accept_new_host_keys", "--accept-new-host-keys"),
    (SSHOptions, "connect_timeout", "--connect-timeout"),
    (JobOptions, "min_hosts", "--min-hosts"), (JobOptions, "detach", "--detach"),
    (JobOptions, "checkpoint_dir", "--checkpoint-dir"), (SSHOptions, "transport", "--transport"),
)


def check_backend(hosts: str | None, job: JobOptions, ssh: SSHOptions, push: PushOptions,
                  spark: SparkOptions | None) -> None:
    """Refuse options the chosen backend would ignore: with Spark (which places the tasks and
    ships one script), the hosts, the push, SSH and the host-only job options. The Spark
    options cannot be given without Spark: they are its record."""
    if spark is None:
        return
    if hosts is not None:
        raise UsageError("--backend spark takes its workers from Spark: drop --hosts")
    records: dict[type[Any], Any] = {JobOptions: job, SSHOptions: ssh, PushOptions: push}
    defaults: dict[type[Any], Any] = {JobOptions: JobOptions(), SSHOptions: SSHOptions(), PushOptions: PushOptions()}
    given = [flag for kind, name, flag in SSH_BACKEND_ONLY
             if getattr(records[kind], name) != getattr(defaults[kind], name)]
    if given:
        raise UsageError(f"{', '.join(given)} {'goes' if len(given) == 1 else 'go'} with the SSH backend,"
                         " not --backend spark (Spark places tasks and ships the code)")


R = TypeVar("R")


def from_settings(record: type[R], settings: Mapping[str, Any]) -> R:
    """The record built from the named settings that are its fields (the command line's parsed
    options, named as the fields); the others are left out."""
    names = {f.name for f in fields(record)}  # type: ignore[arg-type]
    return record(**{name: value for name, value in settings.items() if name in names})
