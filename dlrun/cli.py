"""The ``dlrun`` command line: thin click wiring over ``dlrun.run.launch`` and friends.

Each command parses its options into a config record and calls domain code. Every
``DlrunError`` becomes one ``dlrun: error: …`` message on stderr and its exit code, never a
traceback. Heavy imports (paramiko, TensorFlow, pyspark) happen only inside the command
that needs them, so ``dlrun --help`` stays fast.

Exit codes: 0 success; a failed rank's own exit code; 1 topo/preflight error findings;
2 usage or inventory error; 130/143 interrupted (SIGINT/SIGTERM); 255 a host unreachable
or lost (as ssh does).
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Callable
from functools import wraps
from typing import Any, NoReturn, TypeVar

import click

from dlrun import __version__
from dlrun.errors import DlrunError
from dlrun.plan import DEFAULT_BASE_PORT, DEFAULT_HOST_TIMEOUT, FRAMEWORKS

SHARD_POLICIES = ("files", "contiguous", "size", "replicate")  # dlrun.push.session.SHARD_POLICIES, without its import

F = TypeVar("F", bound=Callable[..., Any])


def _reports_errors(func: F) -> F:
    @wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except DlrunError as exc:
            click.echo(f"dlrun: error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("dlrun: interrupted", err=True)
            sys.exit(130)

    return wrapper  # type: ignore[return-value]


def _exit_now(code: int) -> NoReturn:
    """End ``dlrun launch`` without the interpreter's teardown of paramiko and friends (50-110 ms).

    Everything that matters is written by now: the logs are closed, the hosts disconnected.
    Under click's test runner (stdout swapped) it exits the normal way.
    """
    if sys.stdout is not sys.__stdout__ or sys.stdout is None:
        sys.exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _parse_env(pairs: tuple[str, ...], option: str = "--env") -> dict[str, str]:
    env = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:  # not echoed: the argument may hold a secret
            raise click.BadParameter("expected NAME=VALUE (an argument without '=' or without a name)",
                                     param_hint=option)
        if "\0" in value:
            raise click.BadParameter(f"the value of {name} contains a NUL byte", param_hint=option)
        env[name] = value
    return env


def _parse_ranks(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise click.BadParameter(f"expected rank numbers like 0,2, got {text!r}", param_hint="--ranks") from None


ssh_options = [
    click.option("--ssh-config", type=click.Path(dir_okay=False), help="OpenSSH config file (default ~/.ssh/config)."),
    click.option("--known-hosts", type=click.Path(dir_okay=False), help="known_hosts file (default from ssh config)."),
    click.option(
        "--accept-new-host-keys", is_flag=True, help="Add unknown host keys to known_hosts (never changed ones)."
    ),
    click.option("--connect-timeout", type=click.FloatRange(min=0, min_open=True), default=10.0, show_default=True,
                 help="Seconds to reach each host."),
    click.option("--host-timeout", type=click.FloatRange(min=0), default=DEFAULT_HOST_TIMEOUT, show_default=True,
                 help="Seconds of silence after which a host (or Spark task) counts as lost: quiet hosts are"
                 " asked for a reply every few seconds. A job's agents stop their ranks after the same"
                 " silence. 0: never."),
]


def _with_ssh_options(func: F) -> F:
    for option in reversed(ssh_options):
        func = option(func)
    return func


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="dlrun")
def main() -> None:
    """Launch distributed deep-learning jobs on localhost workers, SSH hosts or Spark."""


class _LaunchCommand(click.Command):
    """``dlrun launch [OPTIONS] SCRIPT [OPTIONS] [--] [ARGS]...``: dlrun's own options may also
    come right after the script (``dlrun launch train.py --hosts hosts.toml``), up to the first
    argument that is not one of them, or ``--``; the rest is the script's, untouched."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        takes_value: dict[str, bool] = {}
        for param in self.params:
            if isinstance(param, click.Option):
                for name in (*param.opts, *param.secondary_opts):
                    takes_value[name] = not (param.is_flag or param.count)
        args = _dlrun_options_first(list(args), takes_value)
        return super().parse_args(ctx, args)


def _dlrun_options_first(args: list[str], takes_value: dict[str, bool]) -> list[str]:
    """Move dlrun's options that follow SCRIPT in front of it (see ``_LaunchCommand``); warn
    when one of them appears later, among the script's arguments, where the script gets it."""

    def option_at(i: int) -> int:  # how many tokens dlrun's option at i takes, 0 if none
        name, eq, _ = args[i].partition("=")
        if name not in takes_value:
            return 0
        return 2 if takes_value[name] and not eq and i + 1 < len(args) else 1

    i = 0
    while i < len(args) and args[i] != "--" and (size := option_at(i)):
        i += size
    if i >= len(args) or args[i] == "--" or args[i].startswith("-"):
        return args  # no script yet (click reports it), or an unknown option before it
    script, j, moved = i, i + 1, []
    while j < len(args) and (size := option_at(j)):
        moved += args[j:j + size]
        j += size
    rest = args[j:]
    if rest[:1] == ["--"]:
        rest = rest[1:]  # the explicit end of dlrun's options
    else:
        mine = rest[:rest.index("--")] if "--" in rest else rest  # after a "--" the user was explicit
        late = sorted({a.partition("=")[0] for a in mine if a.startswith("--") and a.partition("=")[0] in takes_value})
        if late:
            click.echo(f"dlrun: warning: {', '.join(late)} after the script's own arguments goes to the script;"
                       " dlrun's options go before them (or use -- before the script's arguments)", err=True)
    # after SCRIPT click parses nothing more (no interspersed args): the rest is the script's
    return [*args[:script], *moved, args[script], *rest]


@main.command(cls=_LaunchCommand, context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.argument("script")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.option("--hosts", "-H", help="hosts.toml, an MPI hostfile, or 'h1:2,h2:4' (default: localhost).")
@click.option("--np", "-n", "np_", type=int, help="Number of ranks (default: every slot; 2 on localhost).")
@click.option("--framework", type=click.Choice(FRAMEWORKS), default="tf", show_default=True)
@click.option("--base-port", type=click.IntRange(1, 65535),
              help=f"Port of local rank 0 (default {DEFAULT_BASE_PORT}; on this machine alone, the first free run "
              "of ports from there, so that jobs side by side do not collide).")
@click.option("--dry-run", is_flag=True,
              help="Print each rank's host, env and argv, and what the push would send and delete per host;"
              " start nothing, write nothing.")
@click.option("--json", "json_output", is_flag=True, help="With --dry-run: print the plan as JSON.")
@click.option("--log-dir", type=click.Path(file_okay=False), help="Where rank-N.log files go (default dlrun-logs/).")
@click.option("--grace", type=click.FloatRange(min=0), default=10.0, show_default=True,
              help="Seconds between SIGTERM and SIGKILL.")
@click.option("--ranks", "ranks_text", help="Show only these ranks on screen, e.g. 0,2 (files keep all).")
@click.option("--env", "-e", "env_pairs", multiple=True, help="NAME=VALUE for every rank (repeatable).")
@click.option("--iface", help="Network interface for Gloo/NCCL sockets on every host (default: per host, see README).")
@click.option("--plain", is_flag=True, help="Plain prefixed lines even on a terminal.")
@click.option("--no-pidns", is_flag=True, help="Do not run each host's ranks in a PID namespace.")
@click.option("--no-preflight", is_flag=True, help="Skip the topology probe (slots, GPUs, error findings).")
@click.option("--push/--no-push", default=True, show_default=True,
              help="Push the script's directory to <workdir>/<dir name> on remote hosts and run there.")
@click.option("--code", "code_dir", type=click.Path(exists=True, file_okay=False),
              help="Push this folder (it holds the script) instead of the script's own directory.")
@click.option("--max-push-size", metavar="SIZE",
              help="Stop a code push over SIZE (e.g. 500M, 2G; none: no limit). Default 200M and 20000 files.")
@click.option("--setup", "setup_command", metavar="CMD",
              help="Run `sh -c CMD` on every host in the pushed folder before any rank (overrides the"
              " inventory's setup); again only when CMD or the pushed files changed.")
@click.option("--setup-always", is_flag=True, help="Run the setup even when nothing changed since its last success.")
@click.option("--data", type=click.Path(exists=True), help="Dataset directory (or file): each host gets its shard.")
@click.option("--shard", type=click.Choice(SHARD_POLICIES), default="files", show_default=True)
@click.option("--split-lines", is_flag=True, help="Split a single text/CSV dataset file into per-host parts.")
@click.option("--backend", type=click.Choice(["ssh", "spark"]), default="ssh", show_default=True,
              help="ssh: the inventory's hosts (or localhost); spark: a barrier stage of --np tasks.")
@click.option("--master", help="Spark master URL (with --backend spark), e.g. spark://head:7077 or local[4].")
@click.option("--cores-per-worker", type=int, default=1, show_default=True, help="Spark: CPUs per task.")
@click.option("--gpus-per-worker", type=int, default=0, show_default=True, help="Spark: GPUs per task.")
@click.option("--conf", "conf_pairs", multiple=True, help="Spark: k=v configuration (repeatable).")
@click.option("--max-restarts", type=int, default=0, show_default=True,
              help="Spark: relaunch the barrier stage (fresh ports) this many times after a failure.")
@click.option("--start-timeout", type=click.FloatRange(min=0, min_open=True), default=120.0, show_default=True,
              help="Spark: seconds for every task to start and report (slow clusters, busy slots).")
@_with_ssh_options
@_reports_errors
def launch(
    script: str,
    args: tuple[str, ...],
    hosts: str | None,
    np_: int | None,
    framework: str,
    base_port: int | None,
    dry_run: bool,
    json_output: bool,
    log_dir: str | None,
    grace: float,
    ranks_text: str | None,
    env_pairs: tuple[str, ...],
    iface: str | None,
    plain: bool,
    no_pidns: bool,
    no_preflight: bool,
    push: bool,
    code_dir: str | None,
    max_push_size: str | None,
    setup_command: str | None,
    setup_always: bool,
    data: str | None,
    shard: str,
    split_lines: bool,
    backend: str,
    master: str | None,
    cores_per_worker: int,
    gpus_per_worker: int,
    conf_pairs: tuple[str, ...],
    max_restarts: int,
    start_timeout: float,
    ssh_config: str | None,
    known_hosts: str | None,
    accept_new_host_keys: bool,
    connect_timeout: float,
    host_timeout: float,
) -> None:
    """Run SCRIPT [ARGS]... on every rank: `dlrun launch train.py --hosts hosts.toml`.

    dlrun's options go before SCRIPT or right after it; from the first argument that is not
    one of them (or after --), the arguments are the script's.
    """
    from dlrun.run.launch import LaunchConfig, SSHOptions
    from dlrun.run.launch import launch as run_launch

    if json_output and not dry_run:
        raise click.UsageError("--json goes with --dry-run")
    _refuse_unused({"--shard": "shard", "--split-lines": "split_lines"}, data is None, "--data DIR")
    _refuse_unused({"--master": "master", "--cores-per-worker": "cores_per_worker", "--gpus-per-worker":
                    "gpus_per_worker", "--conf": "conf_pairs", "--max-restarts": "max_restarts",
                    "--start-timeout": "start_timeout"},
                   backend != "spark", "--backend spark")
    _refuse_unused({"--code": "code_dir", "--max-push-size": "max_push_size"}, not push, "--push (not --no-push)")
    _refuse_unused({"--data": "data", "--shard": "shard", "--split-lines": "split_lines", "--push/--no-push": "push",
                    "--code": "code_dir", "--max-push-size": "max_push_size", "--setup": "setup_command",
                    "--setup-always": "setup_always",
                    "--base-port": "base_port", "--no-preflight": "no_preflight", "--ssh-config": "ssh_config",
                    "--known-hosts": "known_hosts", "--accept-new-host-keys": "accept_new_host_keys",
                    "--connect-timeout": "connect_timeout"},
                   backend == "spark", "the SSH backend, not --backend spark (Spark places tasks and ships the code)")
    config = LaunchConfig(
        script=script,
        args=args,
        hosts=hosts,
        np=np_,
        base_port=base_port,
        framework=framework,
        dry_run=dry_run,
        json_output=json_output,
        log_dir=log_dir,
        grace=grace,
        ranks_shown=_parse_ranks(ranks_text),
        env=_parse_env(env_pairs),
        iface=iface,
        plain=plain,
        pidns=not no_pidns,
        preflight=not no_preflight,
        push=push,
        data=data,
        shard=shard,
        split_lines=split_lines,
        code=code_dir,
        max_push_size=max_push_size,
        setup=setup_command,
        setup_always=setup_always,
        ssh=SSHOptions(
            config_file=ssh_config,
            accept_new_host_keys=accept_new_host_keys,
            connect_timeout=connect_timeout,
            host_timeout=host_timeout,
            known_hosts=known_hosts,
        ),
    )
    if backend == "spark":
        from dlrun.spark.driver import SparkConfig, run_spark

        if master is None:
            raise click.UsageError("--backend spark needs --master URL")
        if hosts is not None:
            raise click.UsageError("--backend spark takes its workers from Spark: drop --hosts")
        spark = SparkConfig(
            master=master,
            num_workers=2 if np_ is None else np_,
            cores_per_worker=cores_per_worker,
            gpus_per_worker=gpus_per_worker,
            conf=_parse_env(conf_pairs, "--conf"),
            max_restarts=max_restarts,
            start_timeout=start_timeout,
        )
        sys.exit(run_spark(config, spark))
    _exit_now(run_launch(config))


def _refuse_unused(options: dict[str, str], unused: bool, needs: str) -> None:
    """An option given on the command line that would have no effect is a usage error."""
    if not unused:
        return
    ctx = click.get_current_context()
    given = [flag for flag, name in options.items()
             if ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE]
    if given:
        raise click.UsageError(f"{', '.join(given)} {'goes' if len(given) == 1 else 'go'} with {needs}")


@main.command()
@click.option("--hosts", "-H", help="hosts.toml, an MPI hostfile, or 'h1:2,h2:4' (default: this machine).")
@click.option("--json", "json_output", is_flag=True, help="Print the report as JSON.")
@_with_ssh_options
@_reports_errors
def topo(
    hosts: str | None,
    json_output: bool,
    ssh_config: str | None,
    known_hosts: str | None,
    accept_new_host_keys: bool,
    connect_timeout: float,
    host_timeout: float,
) -> None:
    """Probe GPUs, NVLink/PCIe links and InfiniBand/RoCE NICs on every host; exit 1 on errors."""
    import json

    from rich.console import Console

    from dlrun.inventory import load_inventory
    from dlrun.run.launch import SSHOptions, make_transport
    from dlrun.topo.findings import analyse, exit_code, suggested_env, topo_document
    from dlrun.topo.preflight import probe_hosts
    from dlrun.topo.probe import probe_local
    from dlrun.topo.records import HostReport
    from dlrun.topo.report import render_topo

    reports: tuple[HostReport, ...]
    if hosts is None:
        reports = (probe_local(),)
        slots = None
    else:
        inventory = load_inventory(hosts)
        transport = make_transport(
            inventory,
            SSHOptions(ssh_config, accept_new_host_keys, connect_timeout, known_hosts, host_timeout),
        )
        try:
            reports = probe_hosts(transport, inventory.hosts)
        finally:
            transport.close()
        slots = {h.name: h.slots for h in inventory.hosts if h.slots is not None}
    findings = analyse(reports, slots)
    env = suggested_env(reports)
    if json_output:
        click.echo(json.dumps(topo_document(reports, findings, env), indent=2))
    else:
        Console().print(render_topo(reports, findings, env))
    sys.exit(exit_code(findings))


@main.command()
@click.argument("directory", default=".", type=click.Path(file_okay=False))
@click.option("--framework", type=click.Choice(["tf", "tf-ps", "horovod", "torch"]), default="tf", show_default=True)
@click.option("--force", is_flag=True, help="Overwrite existing files.")
@_reports_errors
def init(directory: str, framework: str, force: bool) -> None:
    """Write hosts.toml (every key commented) and a train.py for FRAMEWORK into DIRECTORY."""
    from pathlib import Path

    from dlrun.scaffold import write_project

    for path in write_project(Path(directory), framework, force=force):
        click.echo(f"wrote {path}")
    flag = "" if framework == "tf" else f" --framework {framework}"
    hosts, train = (str(Path(directory) / name) for name in ("hosts.toml", "train.py"))
    click.echo(f"next: edit {hosts}, then: dlrun launch{flag} --hosts {shlex.quote(hosts)} {shlex.quote(train)}")


@main.command("push")
@click.option("--hosts", "-H", required=True, help="hosts.toml, an MPI hostfile, or 'h1:2,h2:4'.")
@click.option("--code", "code_dir", type=click.Path(exists=True, file_okay=False), help="Code directory to push.")
@click.option("--data", type=click.Path(exists=True), help="Dataset directory (or file): each host gets its shard.")
@click.option("--shard", type=click.Choice(SHARD_POLICIES), default="files", show_default=True)
@click.option("--split-lines", is_flag=True, help="Split a single text/CSV dataset file into per-host parts.")
@click.option("--project", help="Remote directory name under workdir (default: the code directory's name).")
@click.option("--no-delete", is_flag=True,
              help="Keep remote code files that were deleted locally (a data shard always drops what left it).")
@click.option("--max-push-size", metavar="SIZE",
              help="Stop a code push over SIZE (e.g. 500M, 2G; none: no limit). Default 200M and 20000 files.")
@click.option("--dry-run", is_flag=True, help="Show per host what would be sent and deleted; write nothing.")
@click.option("--json", "json_output", is_flag=True, help="Print the per-host summary as JSON.")
@_with_ssh_options
@_reports_errors
def push_command(
    hosts: str,
    code_dir: str | None,
    data: str | None,
    shard: str,
    split_lines: bool,
    project: str | None,
    no_delete: bool,
    max_push_size: str | None,
    dry_run: bool,
    json_output: bool,
    ssh_config: str | None,
    known_hosts: str | None,
    accept_new_host_keys: bool,
    connect_timeout: float,
    host_timeout: float,
) -> None:
    """Push code (only what changed) and each host's data shard, verified and atomic."""
    import json
    from pathlib import Path

    from dlrun.errors import UsageError
    from dlrun.inventory import load_inventory
    from dlrun.push.session import push
    from dlrun.push.tree import PushLimit, parse_size
    from dlrun.push.view import PushView, summary_json
    from dlrun.run.launch import SSHOptions, make_transport

    if code_dir is None and data is None:
        raise UsageError("nothing to push: give --code DIR and/or --data DIR")
    _refuse_unused({"--shard": "shard", "--split-lines": "split_lines"}, data is None, "--data DIR")
    _refuse_unused({"--project": "project", "--no-delete": "no_delete", "--max-push-size": "max_push_size"},
                   code_dir is None, "--code DIR")
    limit = parse_size(max_push_size) if max_push_size is not None else PushLimit()
    inventory = load_inventory(hosts)
    ssh = SSHOptions(ssh_config, accept_new_host_keys, connect_timeout, known_hosts, host_timeout)
    transport = make_transport(inventory, ssh)
    try:
        transport.connect(inventory.hosts)
        live = False if json_output or dry_run else None  # a dry run prints what it would send
        with PushView([h.name for h in inventory.hosts], live=live) as view:
            summaries = push(
                transport,
                inventory.hosts,
                code_dir=Path(code_dir) if code_dir else None,
                data_dir=Path(data) if data else None,
                shard=shard,
                split_lines=split_lines,
                project=project,
                delete=not no_delete,
                progress=view.progress,
                file_progress=view.files,
                limit=limit,
                dry_run=dry_run,
            )
            if not json_output:
                view.finish(summaries)
    finally:
        transport.close()
    if json_output:
        click.echo(json.dumps(summary_json(summaries), indent=2))
