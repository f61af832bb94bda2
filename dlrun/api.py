"""dlrun from Python: ``launch``, ``topo``, ``push``, ``pull`` and the detached jobs' ``ps``,
``logs``, ``attach``, ``stack`` and ``stop`` take the commands' settings and return result records.

Settings are named as the options (``--no-X`` flags as ``X=False``); ``launch`` takes the
common ones as keywords and the rest in the records of ``dlrun.options``, one per section of
``--help``, and every function takes the same ``ssh`` record. The ``dlrun`` command line is a
thin layer over these functions. The pipeline's own records (``LaunchConfig``, the transport's
SSH settings, ``SparkConfig``) are built from the API's here and nowhere else. Heavy modules
are imported inside the functions, so ``import dlrun`` stays cheap.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from dlrun.errors import UsageError
from dlrun.options import JobOptions, OutputOptions, PushOptions, SparkOptions, SSHOptions, check_backend
from dlrun.plan import DEFAULT_HOST_TIMEOUT
from dlrun.run.result import RunResult

if TYPE_CHECKING:
    from dlrun.inventory import Host
    from dlrun.push.pull import HostPullSummary
    from dlrun.push.session import HostPushSummary
    from dlrun.run.config import LaunchConfig
    from dlrun.run.detach import JobHosts, JobRecord
    from dlrun.run.stackcmd import StackReport
    from dlrun.run.supervisor import View
    from dlrun.spark.driver import SparkConfig
    from dlrun.topo.bench import BenchResult
    from dlrun.topo.findings import Finding
    from dlrun.topo.records import HostReport
    from dlrun.transport.base import Transport
    from dlrun.transport.factory import SSHOptions as SSHSettings


@dataclass(frozen=True)
class TopoResult:
    """What ``topo`` found: each host's report, the findings across hosts, the env dlrun
    suggests, the exit code (1 when a finding, the bench's too, is an error), the socket
    interface ``launch`` gives each host (``ifaces``; empty without ``hosts``), what launch
    does about them (``note``) and the bench's measurements where asked (``bench``)."""

    reports: tuple[HostReport, ...]
    findings: tuple[Finding, ...]
    env: Mapping[str, str]
    exit_code: int
    ifaces: Mapping[str, str] = field(default_factory=dict)
    note: str = ""
    bench: BenchResult | None = None


def ssh_settings(ssh: SSHOptions | None) -> SSHSettings:
    """The transport's SSH settings from the API's record (a host timeout left None: the
    default, and SSH liveness follows each host's ssh config)."""
    from dlrun.transport.factory import SSHOptions as SSHSettings

    ssh = ssh or SSHOptions()
    return SSHSettings(config_file=ssh.ssh_config, accept_new_host_keys=ssh.accept_new_host_keys,
                       connect_timeout=ssh.connect_timeout, known_hosts=ssh.known_hosts,
                       host_timeout=DEFAULT_HOST_TIMEOUT if ssh.host_timeout is None else ssh.host_timeout,
                       host_timeout_given=ssh.host_timeout is not None, transport=ssh.transport)


def launch(
    script: str | Path,
    args: Sequence[str] = (),
    *,
    hosts: str | None = None,
    np: int | None = None,
    framework: str = "auto",
    env: Mapping[str, str] | None = None,
    job: JobOptions | None = None,
    output: OutputOptions | None = None,
    ssh: SSHOptions | None = None,
    push: PushOptions | None = None,
    spark: SparkOptions | None = None,
    view: View | None = None,
) -> RunResult:
    """Run ``script`` on every rank, as ``dlrun launch`` does; how the job ended.

    The result has the exit code, every rank's ``RankResult`` and the root cause; a dry run's
    has the rendered ``commands``. ``framework``: ``auto`` (the script's imports choose) or one
    of ``tf``, ``tf-ps``, ``horovod``, ``torch``, ``none``; ``env``: NAME=VALUE for every rank.
    The other options come in records named as ``dlrun launch --help``'s sections
    (``dlrun.options``): ``job`` (``JobOptions``: ``detach=True`` hands the job to the hosts and
    returns once every rank started), ``output``, ``ssh``, ``push``; ``spark`` (``SparkOptions``)
    runs the job as a Spark barrier stage of ``np`` tasks instead of on ``hosts``. ``view``:
    where the ranks' lines go (default: the terminal's live view, plain lines elsewhere).
    """
    config = launch_config(script, args, hosts=hosts, np=np, framework=framework, env=env, job=job,
                           output=output, ssh=ssh, push=push, spark=spark)
    from dlrun.run.hosts import HostsEngine
    from dlrun.run.pipeline import run_job

    if spark is None:
        return run_job(config, HostsEngine(), view=view)
    from dlrun.spark.driver import SparkEngine

    return run_job(config, SparkEngine(spark_config(spark, np)), view=view)


def spark_config(spark: SparkOptions, np: int | None) -> SparkConfig:
    """The Spark engine's config: a stage of ``np`` tasks (default 2)."""
    from dlrun.spark.driver import SparkConfig

    return SparkConfig(master=spark.master, num_workers=2 if np is None else np,
                       cores_per_worker=spark.cores_per_worker, gpus_per_worker=spark.gpus_per_worker,
                       conf=dict(spark.conf), start_timeout=spark.start_timeout)


def launch_config(
    script: str | Path,
    args: Sequence[str] = (),
    *,
    hosts: str | None = None,
    np: int | None = None,
    framework: str = "auto",
    env: Mapping[str, str] | None = None,
    job: JobOptions | None = None,
    output: OutputOptions | None = None,
    ssh: SSHOptions | None = None,
    push: PushOptions | None = None,
    spark: SparkOptions | None = None,
) -> LaunchConfig:
    """The launch pipeline's config from ``launch``'s arguments, after the checks that need no
    host (``--env-file`` files are read here)."""
    from dlrun.run.config import LaunchConfig
    from dlrun.userenv import rank_env

    job, output, push = job or JobOptions(), output or OutputOptions(), push or PushOptions()
    if str(script).startswith("-"):  # an option dlrun lacks would run as the command on every rank
        raise UsageError(f"{script}: a script or command never starts with '-'",
                         hint="dlrun's options are listed by dlrun launch --help; the script comes before its own")
    if output.json_output and not output.dry_run:
        raise UsageError("--json goes with --dry-run")
    if job.module and job.no_python:
        raise UsageError("-m and --no-python exclude each other: -m runs the module with each host's python")
    if job.bench and (not job.preflight or output.dry_run or spark is not None):
        raise UsageError("--bench runs after the preflight: not with --no-preflight, --dry-run or --backend spark")
    if job.bench_seconds <= 0:
        raise UsageError("--bench-seconds takes a positive number of seconds")
    if job.hang_timeout < 0:
        raise UsageError("--hang-timeout takes seconds, 0 (off) or more")
    if output.gpu_every < 0 or output.gpu_idle_after < 0:
        raise UsageError("--gpu-every and --gpu-idle-after take seconds, 0 or more")
    check_backend(hosts, job, ssh or SSHOptions(), push, spark)
    env = rank_env(env, [job.env_file] if isinstance(job.env_file, (str, Path)) else job.env_file)
    return LaunchConfig(
        script=str(script), args=tuple(str(a) for a in args), hosts=hosts, np=np, base_port=job.base_port,
        framework=framework, dry_run=output.dry_run, json_output=output.json_output,
        log_dir=None if output.log_dir is None else str(output.log_dir), grace=job.grace,
        ranks_shown=None if output.ranks is None else tuple(output.ranks), env=dict(env or {}),
        iface=job.iface, plain=output.plain, pidns=job.pidns, preflight=job.preflight,
        bench=job.bench_seconds if job.bench else 0.0, push=push.push,
        data=None if push.data is None else str(push.data), shard=push.shard, split_lines=push.split_lines,
        max_restarts=job.max_restarts, code=None if push.code is None else str(push.code), min_hosts=job.min_hosts,
        max_push_size=push.max_push_size, setup=push.setup, setup_always=push.setup_always,
        gpu_every=output.gpu_every, gpu_idle_after=output.gpu_idle_after, detach=job.detach, module=job.module,
        no_python=job.no_python, insecure_workdir=push.insecure_workdir,
        checkpoint_dirs=tuple(job.checkpoint_dir), hang_timeout=job.hang_timeout, ssh=ssh_settings(ssh),
    )


def topo(
    hosts: str | None = None,
    *,
    ssh: SSHOptions | None = None,
    bench: bool = False,
    bench_seconds: float = 60.0,
    iface: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> TopoResult:
    """Probe every host (this machine without ``hosts``, or the allocation's nodes inside a Slurm
    allocation), as ``dlrun topo`` does; with ``bench``, then measure them for about
    ``bench_seconds`` (``dlrun topo --bench``; ``progress`` hears what it is doing)."""
    from dlrun.inventory import load_inventory
    from dlrun.run.addresses import host_ifaces, interfaces_at, reachable_addresses
    from dlrun.topo.findings import analyse, exit_code, socket_note, suggested_env
    from dlrun.topo.preflight import probe_hosts
    from dlrun.topo.probe import probe_local
    from dlrun.transport.factory import default_hosts, make_transport, resolve_inventory

    if bench_seconds <= 0:
        raise UsageError("--bench-seconds takes a positive number of seconds")
    reports: tuple[HostReport, ...]
    hosts = default_hosts(hosts)
    ifaces = None
    measured = None
    if hosts is None and not bench:
        reports = (probe_local(),)
        slots = None
    else:
        inventory = resolve_inventory(hosts, None) if hosts is not None else load_inventory("localhost")
        reach = make_transport(inventory, ssh_settings(ssh))
        try:
            reports = probe_hosts(reach, inventory.hosts)
            reached = [h for h, r in zip(inventory.hosts, reports, strict=True) if r.reachable]
            # where launch reaches each host (connected already: no new connection), and so launch's interfaces
            addresses = reachable_addresses(reached, reach.connect(reached)) if reached else {}
            if bench:
                from dlrun.topo.benchrun import bench_hosts

                measured = bench_hosts(reach, inventory.hosts, reports, bench_seconds, iface, progress)
        finally:
            reach.close()
        if hosts is not None:  # this machine alone (--bench without hosts) suggests as plain `dlrun topo`
            ifaces = host_ifaces(reached, addresses, None, interfaces_at(reports, addresses))
        slots = {h.name: h.slots for h in inventory.hosts if h.slots is not None}
    findings = tuple(analyse(reports, slots))
    code = max(exit_code(findings), measured.exit_code if measured else 0)
    return TopoResult(reports, findings, suggested_env(reports, ifaces), code,
                      {name: i.name for name, i in (ifaces or {}).items()}, socket_note(reports, ifaces), measured)


def push(
    hosts: str,
    *,
    code: str | Path | None = None,
    data: str | Path | None = None,
    shard: str = "files",
    split_lines: bool = False,
    project: str | None = None,
    delete: bool = True,
    max_push_size: str | None = None,
    dry_run: bool = False,
    insecure_workdir: bool = False,
    live: bool | None = None,
    summary: bool = True,
    ssh: SSHOptions | None = None,
) -> tuple[HostPushSummary, ...]:
    """Push ``code`` and each host's shard of ``data``, as ``dlrun push`` does; one summary per
    host. ``live``: progress bars (default: on a terminal); ``summary``: print the closing table.
    ``max_push_size``: the code push's limit (``500M``, ``none``); ``dry_run``: survey the hosts and
    say what would be sent and deleted, writing nothing."""
    from dlrun.push.session import push as push_to
    from dlrun.push.tree import PushLimit, parse_size
    from dlrun.push.view import PushView
    from dlrun.transport.factory import make_transport, resolve_inventory

    limit = parse_size(max_push_size) if max_push_size is not None else PushLimit()
    if code is None and data is None:
        raise UsageError("nothing to push: give --code DIR and/or --data DIR")
    inventory = resolve_inventory(hosts, None)
    reach = make_transport(inventory, ssh_settings(ssh))
    try:
        reach.connect(inventory.hosts)
        with PushView([h.name for h in inventory.hosts], live=False if dry_run else live) as view:
            summaries = push_to(
                reach,
                inventory.hosts,
                code_dir=Path(code) if code else None,
                data_dir=Path(data) if data else None,
                shard=shard,
                split_lines=split_lines,
                project=project,
                delete=delete,
                progress=view.progress,
                file_progress=view.files,
                limit=limit,
                dry_run=dry_run,
                insecure_workdir=insecure_workdir,
            )
            if summary:
                view.finish(summaries)
    finally:
        reach.close()
    return summaries


def pull(
    remote: str,
    local: str | Path = ".",
    *,
    hosts: str,
    project: str | None = None,
    max_size: str | None = None,
    dry_run: bool = False,
    live: bool | None = None,
    summary: bool = True,
    ssh: SSHOptions | None = None,
) -> tuple[HostPullSummary, ...]:
    """Copy ``remote`` from every host into ``local``, as ``dlrun pull`` does; one summary per
    host. ``remote``: relative to the project folder on each host (``<workdir>/<project>``,
    ``project`` defaulting to the current folder's name), or absolute; a trailing ``/`` pulls
    its contents rather than the folder. Files the same on every host are written once, the
    rest under ``local/<host>/``; only what differs from the local copy moves, and every file
    is verified by sha256. ``max_size``: what the pull may write (``500M``, ``none``; default
    200M and 20000 files); ``dry_run``: list the hosts and say what would be written."""
    import sys

    from dlrun.push.pull import pull as pull_from
    from dlrun.push.pull import summary_line
    from dlrun.push.tree import PushLimit, parse_size
    from dlrun.push.view import PushView
    from dlrun.transport.factory import make_transport, resolve_inventory

    limit = parse_size(max_size) if max_size is not None else PushLimit()
    inventory = resolve_inventory(hosts, None)  # a hosts file, a list, or the Slurm allocation
    reach = make_transport(inventory, ssh_settings(ssh))

    def notice(text: str) -> None:
        print(f"dlrun: {text}", file=sys.stderr, flush=True)

    try:
        with PushView([h.name for h in inventory.hosts], live=False if dry_run else live) as view:
            summaries = pull_from(reach, inventory.hosts, remote, Path(local), project=project, limit=limit,
                                  dry_run=dry_run, progress=view.progress, file_progress=view.files, notice=notice)
            view.stop()
        if summary:
            for line in map(summary_line, summaries):
                print(line, file=sys.stderr, flush=True)
    finally:
        reach.close()
    return summaries


# --------------------------------------------------------------------------- detached jobs


@contextmanager
def _job_hosts(hosts: str | None, ssh: SSHOptions | None) -> Iterator[JobHosts]:
    from dlrun.run.detach import JobHosts
    from dlrun.transport.factory import default_hosts, make_transport, resolve_inventory

    inventory = resolve_inventory(default_hosts(hosts), 1)
    transport = make_transport(inventory, ssh_settings(ssh))
    try:
        yield JobHosts(transport, inventory.hosts, unreachable=connect_reachable(transport, inventory.hosts))
    finally:
        transport.close()


def connect_reachable(transport: Transport, hosts: Sequence[Host]) -> dict[str, str]:
    """Connect to every host that can be reached (``ps``, ``logs`` and ``stop`` go on without
    the others); the others by name, with the reason."""
    from concurrent.futures import ThreadPoolExecutor

    from dlrun.errors import TransportError

    try:
        transport.connect(hosts)
        return {}
    except TransportError:
        pass

    def one(host: Host) -> str | None:
        try:
            transport.connect([host])
        except TransportError as exc:
            return str(exc.message)
        return None

    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        reasons = list(pool.map(one, hosts))
    return {h.name: why for h, why in zip(hosts, reasons, strict=True) if why is not None}


def ps(hosts: str | None = None, *, ssh: SSHOptions | None = None) -> list[JobRecord]:
    """The detached jobs on ``hosts`` (this machine without), as ``dlrun ps`` lists them."""
    with _job_hosts(hosts, ssh) as job_hosts:
        return job_hosts.ps()


def logs(job: str, hosts: str | None = None, *, follow: bool = False, delete: bool = False,
         since: float | None = None, out: TextIO | None = None, ssh: SSHOptions | None = None) -> JobRecord | None:
    """Print every rank's output of detached job ``job`` (``follow``: until it ends; ``since``:
    from that many seconds ago); with ``delete``, remove its folder on every host afterwards.
    Its record (None once deleted)."""
    import sys
    import time

    from dlrun.run.detach import LogFollower

    with _job_hosts(hosts, ssh) as job_hosts:
        stream = out or sys.stdout
        follower = LogFollower(job_hosts, job, stream, since)
        if delete and since is not None:
            raise UsageError("--delete goes without --since: it deletes only what was shown, to the end")
        record = follower.follow() if follow else follower.poll(whole=True)
        if record is None:
            raise UsageError(f"no job {job} on {', '.join(h.name for h in job_hosts.hosts)}")
        missing = [n for n in job_hosts.unreachable if n not in follower.covered]  # covered: read through a shared home
        if missing:  # what those hosts hold was not shown: not a complete answer
            from dlrun.errors import HostUnreachable

            stream.flush()
            raise HostUnreachable(f"the logs on {', '.join(missing)} were not read (see above)")
        if delete:
            if follow and record.ended:  # the keepers finish writing their records right after the end
                deadline = time.monotonic() + 30
                while record.alive and time.monotonic() < deadline:
                    time.sleep(0.5)
                    record = job_hosts.record(job)
            if not record.ended or record.alive:  # a keeper of it may still run, even on a shared home
                raise UsageError(f"job {job} is {record.state}: dlrun stop {job} first, then delete its logs")
            stream.flush()  # written out (a full disk or a closed pipe raises here, and nothing is deleted)
            job_hosts.delete(job, follower.offsets)
            return None
        return record


def attach(job: str, hosts: str | None = None, *, since: float | None = None, out: TextIO | None = None,
           ssh: SSHOptions | None = None) -> int:
    """Follow detached job ``job``'s lines (from ``since`` seconds ago, else from its start)
    until it ends, then its summary; its exit code.
    Ctrl-C (KeyboardInterrupt) detaches again: the job goes on, and 0 is returned."""
    import sys

    from dlrun.run.detach import LogFollower, closing_notices, job_line
    from dlrun.run.screen import ScreenFeed, make_view
    from dlrun.run.view import PlainView

    stream = out or sys.stdout
    shown = PlainView(out) if out is not None else make_view()
    with _job_hosts(hosts, ssh) as job_hosts:
        follower = LogFollower(job_hosts, job, stream, since, view=shown)
        try:
            record = follower.follow()
        except KeyboardInterrupt:
            if isinstance(shown, ScreenFeed):
                shown.drain()
            shown.notice(f"detached from job {job}; it goes on (dlrun attach {job} to come back)")
            return 0
        result = follower.result(record)
        for text in closing_notices(record, result):  # what detach.summary_lines writes, on the view
            shown.notice(text)
        shown.finish(result)
        stream.write(job_line(record) + "\n")
        return 1 if record.exit_code is None else record.exit_code


def stack(job: str, hosts: str | None = None, *, ssh: SSHOptions | None = None) -> StackReport:
    """Where every rank of running job ``job`` is (``dlrun stack``): an attached job on this
    machine answers through its control socket, else the detached job on ``hosts`` is asked.
    The job goes on."""
    from dlrun.run.stackcmd import attached_stacks, detached_stacks, stack_report

    answer = attached_stacks(job)
    if answer is not None:
        return stack_report(answer)
    with _job_hosts(hosts, ssh) as job_hosts:
        return stack_report(detached_stacks(job_hosts, job))


def stop(job: str, hosts: str | None = None, *, timeout: float = 60.0, ssh: SSHOptions | None = None) -> JobRecord:
    """Stop every rank of detached job ``job`` (SIGTERM to its keepers) and wait up to
    ``timeout`` seconds for the end; its record (exit code 143 for a stopped job)."""
    with _job_hosts(hosts, ssh) as job_hosts:
        return job_hosts.stop(job, timeout)
