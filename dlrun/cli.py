"""The ``dlrun`` command line: thin click wiring over the Python API (``dlrun.api``).

Each command hands its options, named as the API's keyword arguments and the fields of its
option records (``dlrun.options``), to the API function of the same name and shows or exits
with what it returns; option groups (SSH, data, Spark) are defined once and shown in sections
of ``--help``, and ``launch_arguments`` maps ``dlrun launch``'s onto the records of those sections. Every
``DlrunError`` becomes one ``dlrun: error: …`` message on stderr and its exit code, never a
traceback. Heavy imports (paramiko, TensorFlow, pyspark) happen only inside the command
that needs them, so ``dlrun --help`` stays fast.

Exit codes: 0 success; a failed rank's own exit code; 1 topo/preflight error findings (and a
``--base-port`` port taken on a host, and a detached job that did not start: ``JobStartError``);
2 usage or inventory error; 130/143 interrupted (SIGINT/SIGTERM); 255 a host unreachable
or lost (as ssh does).
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields
from functools import wraps
from typing import TYPE_CHECKING, Any, TypeVar

import click

from dlrun import __version__
from dlrun.errors import DlrunError
from dlrun.plan import AUTO, DEFAULT_BASE_PORT, DEFAULT_HOST_TIMEOUT, FRAMEWORKS

if TYPE_CHECKING:
    from dlrun.options import SSHOptions

#: dlrun.push.session.SHARD_POLICIES: importing that module would cost ``dlrun --help`` 50 ms
#: (tests/integration/test_launch_local.py checks that both say the same)
SHARD_POLICIES = ("files", "contiguous", "size", "replicate")

F = TypeVar("F", bound=Callable[..., Any])


def _reports_errors(func: F) -> F:
    @wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except DlrunError as exc:
            from dlrun.render import printable  # a name from a file or a host cannot drive the terminal

            click.echo(f"dlrun: error: {chr(10).join(printable(line) for line in str(exc).split(chr(10)))}", err=True)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("dlrun: interrupted", err=True)
            sys.exit(130)

    return wrapper  # type: ignore[return-value]


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


class GroupedOption(click.Option):
    """An option shown under a section of ``--help`` (``group``: "SSH", "Push" …)."""

    def __init__(self, *args: Any, group: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group = group


#: The sections of ``--help``, in order; an option of no group goes last, under "Other".
SECTIONS = ("Job", "Hosts", "Bench", "Output", "SSH", "Push", "Spark")


class GroupedCommand(click.Command):
    """A command whose ``--help`` shows its options in sections (click has none of its own)."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        sections: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx) if isinstance(param, click.Option) else None
            if record is not None:
                sections.setdefault(getattr(param, "group", "") or "Other", []).append(record)
        for name in sorted(sections, key=lambda s: SECTIONS.index(s) if s in SECTIONS else len(SECTIONS)):
            with formatter.section(f"{name} options"):
                formatter.write_dl(sections[name])


def option(group: str, *decls: str, **attrs: Any) -> Callable[[F], F]:
    """``click.option`` under ``--help``'s section ``group``."""
    return click.option(*decls, cls=GroupedOption, group=group, **attrs)


def options(*decorators: Callable[[F], F]) -> Callable[[F], F]:
    """Several options as one decorator, in the order given."""

    def apply(func: F) -> F:
        for decorator in reversed(decorators):
            func = decorator(func)
        return func

    return apply


def _env_option(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> dict[str, str]:
    return _parse_env(value, f"--{param.name}")


def _rank_env_option(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> dict[str, str]:
    """``-e NAME=VALUE`` or ``-e NAME`` (this process's value: no secret on dlrun's command line)."""
    from dlrun.userenv import parse_env_args

    try:
        return parse_env_args(value)
    except DlrunError as exc:
        raise click.UsageError(str(exc)) from None


def _ranks_option(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, ...] | None:
    return _parse_ranks(value)


#: How every command reaches its hosts: the fields of ``dlrun.options.SSHOptions`` (``_ssh`` builds it).
ssh_options = options(
    option("SSH", "--ssh-config", type=click.Path(dir_okay=False), help="OpenSSH config file (default ~/.ssh/config)."),
    option("SSH", "--known-hosts", type=click.Path(dir_okay=False),
           help="known_hosts file (default from ssh config)."),
    option("SSH", "--accept-new-host-keys", is_flag=True,
           help="Add unknown host keys to known_hosts (never changed ones)."),
    option("SSH", "--connect-timeout", type=click.FloatRange(min=0, min_open=True),
           help="Seconds to reach each host (default: the ssh config's ConnectTimeout, else 10)."),
    option("SSH", "--host-timeout", type=click.FloatRange(min=0),
           help="Seconds of silence after which a host (or Spark task) counts as lost: quiet hosts are"
           " asked for a reply every few seconds. A job's agents stop their ranks after the same"
           f" silence. 0: never. Default: the ssh config's ServerAliveInterval x ServerAliveCountMax,"
           f" else {DEFAULT_HOST_TIMEOUT:g}."),
    option("SSH", "--transport", type=click.Choice(["auto", "ssh", "srun"]), default="auto", show_default=True,
           help="How hosts are reached: ssh; srun (each host's commands as steps of the Slurm job dlrun"
           " runs in); auto: srun for the allocation's own nodes, else ssh."),
)

#: The dataset each host gets its shard of (``dlrun launch`` and ``dlrun push``).
data_options = options(
    option("Push", "--data", type=click.Path(exists=True),
           help="Dataset directory (or file): each host gets its shard."),
    option("Push", "--shard", type=click.Choice(SHARD_POLICIES), default="files", show_default=True,
           help="How --data is split among the hosts: files (sorted files dealt round-robin), contiguous (equal"
           " contiguous ranges), size (balanced by bytes), replicate (every host gets all of it)."),
    option("Push", "--split-lines", is_flag=True, help="Split a single text/CSV dataset file into per-host parts."),
)

#: The code push's size guard (``dlrun launch`` and ``dlrun push``).
max_push_size_option = option(
    "Push", "--max-push-size", metavar="SIZE",
    help="Stop a code push over SIZE (e.g. 500M, 2G; none: no limit). Default 200M and 20000 files.")

#: ``dlrun launch --backend spark``.
spark_options = options(
    option("Spark", "--master", help="Spark master URL (with --backend spark), e.g. spark://head:7077 or local[4]."),
    option("Spark", "--cores-per-worker", type=int, default=1, show_default=True, help="CPUs per task."),
    option("Spark", "--gpus-per-worker", type=int, default=0, show_default=True, help="GPUs per task."),
    option("Spark", "--conf", multiple=True, callback=_env_option, help="k=v configuration (repeatable)."),
    option("Spark", "--start-timeout", type=click.FloatRange(min=0, min_open=True), default=120.0, show_default=True,
           help="Seconds for every task to start and report (slow clusters, busy slots)."),
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="dlrun")
def main() -> None:
    """Launch distributed deep-learning jobs on localhost workers, SSH hosts or Spark."""


class _LaunchCommand(GroupedCommand):
    """``dlrun launch [OPTIONS] SCRIPT [OPTIONS] [--] [ARGS]...``: dlrun's own options may also
    come right after the script (``dlrun launch train.py --hosts hosts.toml``), up to the first
    argument that is not one of them, or ``--``; the rest is the script's, untouched."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        takes_value: dict[str, bool] = {}
        for param in self.params:
            if isinstance(param, click.Option):
                for name in (*param.opts, *param.secondary_opts):
                    takes_value[name] = not (param.is_flag or param.count)
        args = _dlrun_options_first(list(args), takes_value, before_script=SCRIPT_FORM_OPTIONS)
        return super().parse_args(ctx, args)


#: Options that say what SCRIPT is: they count only before it, so that ``python -m pkg.train``
#: keeps its ``-m``.
SCRIPT_FORM_OPTIONS = frozenset({"-m", "--module", "--no-python"})


def _dlrun_options_first(args: list[str], takes_value: dict[str, bool],
                         before_script: frozenset[str] = frozenset()) -> list[str]:
    """Move dlrun's options that follow SCRIPT in front of it (see ``_LaunchCommand``); warn
    when one of them appears later, among the script's arguments, where the script gets it.
    ``before_script``: options that are dlrun's only before SCRIPT (after it, the script's)."""
    script = len(args)  # set once SCRIPT is found: from there on, before_script options are the script's

    def option_at(i: int) -> int:  # how many tokens dlrun's option at i takes, 0 if none
        name, eq, _ = args[i].partition("=")
        if name not in takes_value or (i > script and name in before_script):
            return 0
        return 2 if takes_value[name] and not eq and i + 1 < len(args) else 1

    i = 0
    while i < len(args) and args[i] != "--" and (size := option_at(i)):
        i += size
    if i >= len(args) or args[i] == "--" or args[i].startswith("-"):
        return args  # no script yet, or an option of a form click parses itself (-n2, -dn 2; a typo: click's error)
    script, j, moved = i, i + 1, []
    while j < len(args) and (size := option_at(j)):
        moved += args[j:j + size]
        j += size
    rest = args[j:]
    if rest[:1] == ["--"]:
        rest = rest[1:]  # the explicit end of dlrun's options
    else:
        mine = rest[:rest.index("--")] if "--" in rest else rest  # after a "--" the user was explicit
        late = sorted({a.partition("=")[0] for a in mine if a.startswith("--") and a.partition("=")[0] in takes_value
                       and a.partition("=")[0] not in before_script})
        if late:
            click.echo(f"dlrun: warning: {', '.join(late)} after the script's own arguments goes to the script;"
                       " dlrun's options go before them (or use -- before the script's arguments)", err=True)
    # after SCRIPT click parses nothing more (no interspersed args): the rest is the script's
    return [*args[:script], *moved, args[script], *rest]


@main.command(cls=_LaunchCommand, context_settings={"allow_interspersed_args": False})
@click.argument("script")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@option("Job", "--module", "-m", "module", is_flag=True,
        help="SCRIPT is a Python module (pkg.train): each host runs its python -m SCRIPT in the pushed project"
        " (the current folder, or --code), as torchrun -m. Before SCRIPT only.")
@option("Job", "--no-python", is_flag=True,
        help="Run SCRIPT [ARGS] exactly as given: no host python for python or .py, no Rscript for .R, no bash"
        " for .sh (torchrun's --no-python). Before SCRIPT only.")
@option("Job", "--hosts", "-H", help="hosts.toml, an MPI hostfile, 'h1:2,h2:4', or slurm: the allocation's nodes"
        " (default: those inside a Slurm allocation, else localhost).")
@option("Job", "--np", "-n", "np", type=int, help="Number of ranks (default: every slot; 2 on localhost).")
@option("Job", "--framework", type=click.Choice((AUTO, *FRAMEWORKS)), default=AUTO, show_default=True,
        help="The rank contract; auto: from the script's imports (never run), both tf and torch when"
        " they name none. tf-ps is never guessed.")
@option("Job", "--env", "-e", multiple=True, callback=_rank_env_option, metavar="NAME[=VALUE]",
        help="NAME=VALUE for every rank, or NAME: its value here, kept off the command line (repeatable).")
@option("Job", "--env-file", multiple=True, type=click.Path(dir_okay=False), metavar="FILE",
        help="NAME=VALUE lines for every rank (repeatable; -e wins). Only you may read the file (chmod 600).")
@option("Job", "--base-port", type=click.IntRange(1, 65535),
        help=f"Port of local rank 0 (default {DEFAULT_BASE_PORT}; on this machine alone, the first free run "
        "of ports from there that no other launch has claimed, so that jobs side by side do not collide).")
@option("Job", "--iface", help="Network interface for Gloo/NCCL sockets on every host (default: per host, see README).")
@option("Job", "--grace", type=click.FloatRange(min=0), default=10.0, show_default=True,
        help="Seconds between SIGTERM and SIGKILL.")
@option("Job", "--max-restarts", type=click.IntRange(min=0), default=0, show_default=True,
        help="Run a failed job again (a new job id; Spark: a fresh barrier stage) this many times.")
@option("Job", "--min-hosts", type=click.IntRange(min=1),
        help="With --max-restarts: a restart after a lost host runs on the hosts left, if at least this many"
        " (default: the same hosts, the lost one reconnected).")
@option("Job", "--checkpoint-dir", multiple=True, metavar="DIR",
        help="Make DIR (relative to the job's folder on each host) the same on every host before every"
        " attempt: per file, the newest copy written before a failure wins (repeatable).")
@option("Job", "--detach", "-d", is_flag=True,
        help="Hand the job to the hosts and return once every rank started; it runs on without dlrun"
        " (dlrun ps, logs, attach, stop).")
@option("Job", "--no-pidns", "pidns", is_flag=True, flag_value=False, default=True,
        help="Do not run each host's ranks in a PID namespace.")
@option("Job", "--no-preflight", "preflight", is_flag=True, flag_value=False, default=True,
        help="Skip the topology probe (slots, GPUs, error findings).")
@option("Job", "--bench", is_flag=True,
        help="After the preflight, measure the hosts as `dlrun topo --bench` does; stop on a host or link far below.")
@option("Job", "--bench-seconds", type=click.FloatRange(min=1), default=60.0, show_default=True, metavar="SECONDS",
        help="With --bench: about how long it takes.")
@option("Job", "--backend", type=click.Choice(["ssh", "spark"]), default="ssh", show_default=True,
        help="ssh: the inventory's hosts (or localhost); spark: a barrier stage of --np tasks.")
@option("Output", "--dry-run", is_flag=True,
        help="Print each rank's host, env and argv, and what the push would send and delete per host;"
        " start nothing, write nothing.")
@option("Output", "--json", "json_output", is_flag=True, help="With --dry-run: print the plan as JSON.")
@option("Output", "--log-dir", type=click.Path(file_okay=False),
        help="Where rank-N.log files go (default dlrun-logs/).")
@option("Output", "--ranks", callback=_ranks_option, help="Show only these ranks on screen, e.g. 0,2 (files keep all).")
@option("Output", "--plain", is_flag=True, help="Plain prefixed lines even on a terminal.")
@option("Output", "--gpu-every", type=click.FloatRange(min=0), default=2.0, show_default=True, metavar="SECONDS",
        help="Sample every host's GPUs (nvidia-smi) this often while the job runs; 0: never.")
@option("Output", "--gpu-idle-after", type=click.FloatRange(min=0), default=60.0, show_default=True,
        metavar="SECONDS", help="Warn when a GPU the ranks can see is idle this long while another is busy.")
@option("Job", "--hang-timeout", type=click.FloatRange(min=0), default=0.0, metavar="SECONDS",
        help="When no rank writes anything and no GPU is busy this long: print where every rank is"
        " stuck (its stack), stop the job, exit 124. Default 0: off.")
@ssh_options
@option("Push", "--push/--no-push", default=True, show_default=True,
        help="Push the script's directory to <workdir>/<dir name> on remote hosts and run there.")
@option("Push", "--code", type=click.Path(exists=True, file_okay=False),
        help="Push this folder (it holds the script) instead of the script's own directory.")
@max_push_size_option
@option("Push", "--setup", metavar="CMD",
        help="Run `sh -c CMD` on every host in the pushed folder before any rank (overrides the"
        " inventory's setup); again only when CMD or the pushed files changed.")
@option("Push", "--insecure-workdir", is_flag=True,
        help="Push and run even where another user owns, or may write, the workdir or project folder on a host.")
@option("Push", "--setup-always", is_flag=True, help="Run the setup even when nothing changed since its last success.")
@data_options
@spark_options
@_reports_errors
def launch(script: str, args: tuple[str, ...], **settings: Any) -> None:
    """Run SCRIPT [ARGS]... on every rank: `dlrun launch train.py --hosts hosts.toml`.

    SCRIPT is a script (train.py, train.R), a module with -m (-m pkg.train), or a command
    (python -m pkg.train, Rscript train.R), run in the pushed project on every host.

    dlrun's options go before SCRIPT or right after it; from the first argument that is not
    one of them (or after --), the arguments are the script's.
    """
    from dlrun.api import launch as run

    spark = settings["backend"] == "spark"
    _refuse_unused({"--shard": "shard", "--split-lines": "split_lines"}, settings["data"] is None, "--data DIR")
    _refuse_unused({"--master": "master", "--cores-per-worker": "cores_per_worker", "--gpus-per-worker":
                    "gpus_per_worker", "--conf": "conf", "--start-timeout": "start_timeout"},
                   not spark, "--backend spark")
    _refuse_unused({"--code": "code", "--max-push-size": "max_push_size"}, not settings["push"],
                   "--push (not --no-push)")
    sys.exit(run(**launch_arguments(script, args, settings)).exit_code)


#: ``dlrun launch``'s options that ``dlrun.launch`` takes as they are; the others go into the
#: records of their ``--help`` sections (``launch_arguments``).
LAUNCH_KEYWORDS = ("hosts", "np", "framework", "env")


def launch_arguments(script: str, args: Sequence[str], settings: Mapping[str, Any]) -> dict[str, Any]:
    """``dlrun.launch``'s arguments from ``dlrun launch``'s parsed options: the common ones as
    keywords, the rest as the records of ``dlrun.options`` (each option is named as its field);
    ``--backend spark`` is the presence of the Spark record."""
    from dlrun.errors import UsageError
    from dlrun.options import JobOptions, OutputOptions, PushOptions, SparkOptions, SSHOptions, from_settings

    spark = None
    if settings["backend"] == "spark":
        if settings["master"] is None:
            raise UsageError("--backend spark needs --master URL")
        spark = from_settings(SparkOptions, settings)
    return {"script": script, "args": tuple(args), **{name: settings[name] for name in LAUNCH_KEYWORDS},
            "job": from_settings(JobOptions, settings), "output": from_settings(OutputOptions, settings),
            "ssh": from_settings(SSHOptions, settings), "push": from_settings(PushOptions, settings), "spark": spark}


def _ssh(settings: dict[str, Any]) -> SSHOptions:
    """The SSH record of a command's options, taken out of ``settings``."""
    from dlrun.options import SSHOptions

    names = [f.name for f in fields(SSHOptions)]
    return SSHOptions(**{name: settings.pop(name) for name in names if name in settings})


def _refuse_unused(options: dict[str, str], unused: bool, needs: str) -> None:
    """An option given on the command line that would have no effect is a usage error."""
    if not unused:
        return
    ctx = click.get_current_context()
    given = [flag for flag, name in options.items()
             if ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE]
    if given:
        raise click.UsageError(f"{', '.join(given)} {'goes' if len(given) == 1 else 'go'} with {needs}")


@main.command(cls=GroupedCommand)
@option("Hosts", "--hosts", "-H", help="hosts.toml, an MPI hostfile, or 'h1:2,h2:4' (default: this machine).")
@option("Bench", "--bench", is_flag=True,
        help="Then measure the hosts: TCP between them, CPU or GPU compute, all-reduce (gloo/NCCL) where"
        " torch is installed; each number beside what the topology promises; exit 1 on a host or link far below.")
@option("Bench", "--bench-seconds", type=click.FloatRange(min=1), default=60.0, show_default=True, metavar="SECONDS",
        help="About how long the bench takes in all.")
@option("Bench", "--iface", help="Network interface the bench's TCP and all-reduce use on every host"
        " (default: launch's rule, see README).")
@option("Output", "--json", "json_output", is_flag=True, help="Print the report as JSON.")
@ssh_options
@_reports_errors
def topo(hosts: str | None, json_output: bool, bench: bool, bench_seconds: float, iface: str | None,
         **ssh: Any) -> None:
    """Probe GPUs, NVLink/PCIe links and InfiniBand/RoCE NICs on every host; exit 1 on errors."""
    import json

    from rich.console import Console

    from dlrun.api import topo as probe
    from dlrun.topo.findings import topo_document
    from dlrun.topo.report import render_topo

    if iface and not bench:
        raise click.UsageError("--iface goes with --bench")
    console = Console(stderr=True)
    status = console.status("bench") if bench and console.is_terminal and not json_output else None

    def progress(text: str) -> None:
        if status is not None:
            status.update(f"bench: {text}")

    if status is not None:
        status.start()
    try:
        result = probe(hosts, bench=bench, bench_seconds=bench_seconds, iface=iface, progress=progress, ssh=_ssh(ssh))
    finally:
        if status is not None:
            status.stop()
    if json_output:
        doc = topo_document(result.reports, result.findings, result.env, result.ifaces, result.note)
        if result.bench is not None:
            from dlrun.topo.bench import bench_document

            doc["bench"] = bench_document(result.bench)
        click.echo(json.dumps(doc, indent=2))
    else:
        out = Console()
        out.print(render_topo(result.reports, result.findings, result.env, result.note))
        if result.bench is not None:
            from dlrun.topo.bench import render_bench

            out.print(render_bench(result.bench))
    sys.exit(result.exit_code)


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


@main.command("push", cls=GroupedCommand)
@option("Hosts", "--hosts", "-H", required=True, help="hosts.toml, an MPI hostfile, or 'h1:2,h2:4'.")
@option("Push", "--code", type=click.Path(exists=True, file_okay=False), help="Code directory to push.")
@data_options
@option("Push", "--project", help="Remote directory name under workdir (default: the code directory's name).")
@option("Push", "--no-delete", "delete", is_flag=True, flag_value=False, default=True,
        help="Keep remote code files that were deleted locally (a data shard always drops what left it).")
@max_push_size_option
@option("Push", "--insecure-workdir", is_flag=True,
        help="Push and run even where another user owns, or may write, the workdir or project folder on a host.")
@option("Output", "--dry-run", is_flag=True, help="Show per host what would be sent and deleted; write nothing.")
@option("Output", "--json", "json_output", is_flag=True, help="Print the per-host summary as JSON.")
@ssh_options
@_reports_errors
def push_command(hosts: str, json_output: bool, **settings: Any) -> None:
    """Push code (only what changed) and each host's data shard, verified and atomic."""
    import json

    from dlrun.api import push
    from dlrun.push.view import summary_json

    _refuse_unused({"--shard": "shard", "--split-lines": "split_lines"}, settings["data"] is None, "--data DIR")
    _refuse_unused({"--project": "project", "--no-delete": "delete", "--max-push-size": "max_push_size"},
                   settings["code"] is None, "--code DIR")
    ssh = _ssh(settings)
    summaries = push(hosts, live=False if json_output else None, summary=not json_output, ssh=ssh, **settings)
    if json_output:
        click.echo(json.dumps(summary_json(summaries), indent=2))


@main.command("pull", cls=GroupedCommand)
@click.argument("remote")
@click.argument("local", default=".", type=click.Path(file_okay=False))
@option("Hosts", "--hosts", "-H", required=True, help="hosts.toml, an MPI hostfile, or 'h1:2,h2:4'.")
@option("Push", "--project", help="The project folder under workdir that REMOTE is relative to"
        " (default: the current folder's name).")
@option("Push", "--max-size", metavar="SIZE",
        help="Stop a pull that would write over SIZE (e.g. 500M, 2G; none: no limit). Default 200M and 20000 files.")
@option("Output", "--dry-run", is_flag=True, help="Show per host what would be received; write nothing.")
@option("Output", "--json", "json_output", is_flag=True, help="Print the per-host summary as JSON.")
@ssh_options
@_reports_errors
def pull_command(remote: str, local: str, hosts: str, json_output: bool, **settings: Any) -> None:
    """Copy REMOTE from every host into LOCAL (default .): files the same on every host once,
    the rest into LOCAL/<host>/; only what changed moves, each file verified by sha256.

    REMOTE is relative to the project folder on each host, or absolute; `out` arrives as
    LOCAL/out, `out/` as its contents. Local files are never deleted.
    """
    import json

    from dlrun.api import pull
    from dlrun.push.pull import summary_json

    ssh = _ssh(settings)
    summaries = pull(remote, local, hosts=hosts, live=False if json_output else None, summary=not json_output,
                     ssh=ssh, **settings)
    if json_output:
        click.echo(json.dumps(summary_json(summaries), indent=2))


#: The hosts of ``ps``, ``logs``, ``attach`` and ``stop``: the ones the job was launched on.
job_hosts_option = option("Hosts", "--hosts", "-H",
                          help="The hosts the job runs on, as given to launch (default: this machine).")


#: ``logs`` and ``attach`` from a while ago rather than from the start.
since_option = option("Output", "--since", metavar="DURATION",
                      help="Start each rank's lines this long ago (90, 30s, 10m, 2h, 1d; default: from the start).")


@main.command(cls=GroupedCommand)
@job_hosts_option
@ssh_options
@_reports_errors
def ps(hosts: str | None, **ssh: Any) -> None:
    """List the detached jobs on the hosts: id, state, ranks, age, exit code, script."""
    import time

    from dlrun.api import ps as list_jobs
    from dlrun.run.detach import ps_lines

    for line in ps_lines(list_jobs(hosts, ssh=_ssh(ssh)), time.time()):
        click.echo(line)


@main.command(cls=GroupedCommand)
@click.argument("job")
@job_hosts_option
@option("Output", "--follow", "-f", is_flag=True, help="Keep printing new lines until the job ends.")
@option("Output", "--delete", is_flag=True, help="Then remove the job's folder (logs, result) on every host.")
@since_option
@ssh_options
@_reports_errors
def logs(job: str, hosts: str | None, follow: bool, delete: bool, since: str | None, **ssh: Any) -> None:
    """Print every rank's output of detached JOB so far, as [<rank> <host>] lines."""
    from dlrun.api import logs as print_logs
    from dlrun.run.detach import parse_duration

    print_logs(job, hosts, follow=follow, delete=delete, since=None if since is None else parse_duration(since),
               ssh=_ssh(ssh))


@main.command(cls=GroupedCommand)
@click.argument("job")
@job_hosts_option
@since_option
@ssh_options
@_reports_errors
def attach(job: str, hosts: str | None, since: str | None, **ssh: Any) -> None:
    """Follow detached JOB's lines to its end, then its summary; exit with its exit code.
    Ctrl-C detaches again (the job goes on)."""
    from dlrun.api import attach as follow
    from dlrun.run.detach import parse_duration

    sys.exit(follow(job, hosts, since=None if since is None else parse_duration(since), ssh=_ssh(ssh)))


@main.command(cls=GroupedCommand)
@click.argument("job")
@job_hosts_option
@ssh_options
@_reports_errors
def stop(job: str, hosts: str | None, **ssh: Any) -> None:
    """Stop every rank of detached JOB; exit with its exit code (143: stopped)."""
    from dlrun.api import stop as stop_job
    from dlrun.run.detach import summary_lines

    record = stop_job(job, hosts, ssh=_ssh(ssh))
    for line in summary_lines(record):
        click.echo(line)
    sys.exit(1 if record.exit_code is None else record.exit_code)


@main.command(cls=GroupedCommand)
@click.argument("job")
@job_hosts_option
@ssh_options
@_reports_errors
def stack(job: str, hosts: str | None, **ssh: Any) -> None:
    """Print where every rank of running JOB is: ranks grouped by their Python stacks (two
    samples a few seconds apart), the odd group first. Full stacks go to the job's log folder;
    the job goes on. JOB: an attached job on this machine, or a detached one on --hosts."""
    from dlrun.api import stack as take

    report = take(job, hosts, ssh=_ssh(ssh))
    for line in report.summary:
        click.echo(line)
    for host, note in report.notes.items():
        click.echo(f"dlrun: {host}: {note}", err=True)
    if report.methods:
        click.echo(f"dlrun: taken by {', '.join(report.methods)}")
    for folder in report.folders:
        click.echo(f"dlrun: full stacks in {folder}/")
    if not report.summary:
        sys.exit(1)
