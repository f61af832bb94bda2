"""``dlrun launch``: the job pipeline from options to exit code, once for every engine.

``LaunchConfig`` holds what the user asked for. ``run_job`` checks it, asks the engine
(``dlrun.run.engine``) to place each attempt's ranks, supervises them, shows them, restarts a
failed job (``max_restarts``) and returns the ``RunResult``; ``--dry-run`` stops after render
(on SSH hosts after the same session as a launch, with a push that writes nothing).
``run_job`` first resolves ``--framework auto`` from the script's imports (``resolve_framework``).
``HostsEngine`` places ranks on the inventory's hosts: inventory → connect → start agents
(each runs the preflight probe, answers the code push's survey and says which ports are
free) → plan (listening ranks on free ports) → push → render.
The agents start before the plan so that the probe and the survey cost no extra round trip or
interpreter per host: the ranks' spec goes to the same agents once the plan is known, and an
error finding closes them before anything starts. A host whose survey finds the code already
in place gets no push session; the others get the push helper (``dlrun.push.session.push``).
The Spark engine is ``dlrun.spark.driver.SparkEngine``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from dlrun.allocation import SLURM_HOSTS, allocation_inventory, in_allocation
from dlrun.allocation import SOURCE as ALLOCATION_SOURCE
from dlrun.command import SOURCE_SUFFIXES, entry_point, interpreter_for, module_paths, runs_directly
from dlrun.errors import DlrunError, RendezvousError, UsageError
from dlrun.inventory import Host, Inventory, load_inventory, localhost_inventory
from dlrun.plan import (
    AUTO,
    DEFAULT_BASE_PORT,
    DEFAULT_HOST_TIMEOUT,
    TF_AND_TORCH,
    Detected,
    Plan,
    choose_ports,
    detect_framework,
    is_tf,
    is_torch,
    listening_ranks,
    make_plan,
)
from dlrun.remote.tf_server import server_source
from dlrun.render import Rendezvous, WorkerCommand, mask_argv, mask_env, plan_to_json, printable, worker_commands
from dlrun.run.addresses import facing_address, interfaces_at, local_base_port, reachable_addresses, socket_ifaces
from dlrun.run.agents import AgentAnswer, HostAgents
from dlrun.run.engine import Engine, HeldView, Placement
from dlrun.run.result import Attempt, RunResult
from dlrun.run.screen import make_view
from dlrun.run.supervisor import Supervisor, View
from dlrun.transport.base import Transport, default_python
from dlrun.transport.local import HostRouter

if TYPE_CHECKING:
    from dlrun.push.session import HostPushSummary, Manifest, PushTarget
    from dlrun.push.tree import PushLimit
    from dlrun.topo.records import HostReport

DEFAULT_LOG_DIR = "dlrun-logs"  # dlrun.push.tree.DEFAULT_LOG_DIR (importing it would load the push code)


@dataclass(frozen=True)
class SSHOptions:
    config_file: str | None = None
    accept_new_host_keys: bool = False
    connect_timeout: float | None = None  # None: the ssh config's ConnectTimeout, else 10 s
    known_hosts: str | None = None
    host_timeout: float = DEFAULT_HOST_TIMEOUT  # seconds of silence before a host is lost (0: never)
    host_timeout_given: bool = False  # on dlrun's command line: else SSH liveness follows the ssh config
    transport: str = "auto"  # ssh, srun (Slurm steps) or auto: srun for the allocation's own nodes (make_transport)


@dataclass(frozen=True)
class LaunchConfig:
    script: str
    args: tuple[str, ...] = ()
    hosts: str | None = None
    np: int | None = None
    base_port: int | None = None  # None: DEFAULT_BASE_PORT, or the first free run here (local_base_port)
    framework: str = "tf"  # the CLI and dlrun.launch default to auto: the script's imports choose (resolve_framework)
    dry_run: bool = False
    json_output: bool = False
    log_dir: str | None = None
    grace: float = 10.0
    ranks_shown: tuple[int, ...] | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    ssh: SSHOptions = field(default_factory=SSHOptions)
    pidns: bool = True
    plain: bool = False
    iface: str | None = None
    preflight: bool = True
    bench: float = 0.0  # --bench: seconds of `dlrun topo --bench` after the preflight (0: none)
    push: bool = True
    data: str | None = None
    shard: str = "files"
    split_lines: bool = False
    max_restarts: int = 0  # a failed job runs again (new job id) this many times
    min_hosts: int | None = None  # --min-hosts: a restart goes on without lost hosts while this many remain
    attempt: int = 0  # which attempt this config runs (0: the first; set by run_job)
    run_id: str = ""  # the job's id, the same for every attempt (set by run_job; "": the attempt's)
    code: str | None = None  # --code DIR: the folder to push (holding the script), not the script's own
    max_push_size: str | None = None  # --max-push-size: the code push's limit (dlrun.push.tree.parse_size)
    setup: str | None = None  # --setup CMD: for every host, instead of the inventory's setup
    setup_always: bool = False
    gpu_every: float = 2.0  # --gpu-every: seconds between each host's GPU samples (0: none)
    gpu_idle_after: float = 60.0  # --gpu-idle-after: an idle GPU beside a busy one is named after this long
    detected: Detected | None = None  # what --framework auto found in the script (resolve_framework)
    detach: bool = False  # --detach: the hosts' keepers run the job (dlrun.run.detach)
    insecure_workdir: bool = False  # push and run even where another user owns or may write the folders
    module: bool = False  # -m: script is a Python module, run with each host's python -m in the project
    no_python: bool = False  # --no-python: the command runs exactly as given (no python, Rscript, bash)
    checkpoint_dirs: tuple[str, ...] = ()  # --checkpoint-dir: the same on every host before each attempt
    hang_timeout: float = 0.0  # --hang-timeout: no output and no busy GPU this long: stacks, then stop (0: off)


def resolve_framework(config: LaunchConfig) -> LaunchConfig:
    """``--framework auto``: read the imports of the job's code (the script, the module's source,
    or the ``.py``/``.R`` file a command names; never running it) and pick the contract
    (``say_framework`` tells it once the usage checks passed); an explicit framework stays as given."""
    if config.framework != AUTO:
        return config
    entry = entry_point(config.script, config.args, module=config.module)
    source = source_file(config)
    if source is not None and source.name.endswith(SOURCE_SUFFIXES):
        shown = source.as_posix() if config.module else source.name
        try:
            detected = detect_framework(shown, source.read_text(encoding="utf-8", errors="replace"))
        except OSError:
            detected = Detected(TF_AND_TORCH, f"{source.name} cannot be read here: both the tf and the torch contracts")
    elif entry.kind == "file" and entry.name.endswith(SOURCE_SUFFIXES):
        detected = Detected(TF_AND_TORCH, f"{Path(entry.name).name} cannot be read here:"
                            " both the tf and the torch contracts")
    elif entry.kind == "module":
        detected = Detected(TF_AND_TORCH, f"module {entry.name} is not in {project_root(config)}:"
                            " both the tf and the torch contracts")
    else:
        detected = detect_framework(config.script, None)
    return replace(config, framework=detected.framework, detected=detected)


def say_framework(config: LaunchConfig) -> None:
    """dlrun's first line, for ``--framework auto``: the contract the script's imports chose.
    Said after the usage checks, so that a usage error is the only thing printed."""
    if config.detected is not None:
        print(f"dlrun: framework {config.detected.framework} ({printable(config.detected.reason)})", file=sys.stderr)


def project_root(config: LaunchConfig) -> Path:
    """Where a module or a command (not a script given alone) finds its files: ``--code``, else
    the current folder. The command runs there (on every host: the pushed copy)."""
    return Path(config.code).resolve() if config.code is not None else Path.cwd()


def in_place_folders(config: LaunchConfig, hosts: Sequence[Host]) -> dict[str, list[str]]:
    """``--no-push``: per remote host, the folder Python puts first on the ranks' ``sys.path``,
    as on the host (relative: to the home folder): the script's folder, or for a module or a
    command the folder they run in (the workdir)."""
    folders = {}
    for host in hosts:
        if not host.is_local:
            workdir = host.workdir or "~"
            folder = "" if config.module else os.path.dirname(config.script)
            folders[host.name] = [os.path.join(workdir, folder) if folder else workdir]  # an absolute one wins
    return folders


def script_given_alone(config: LaunchConfig) -> bool:
    """Is the job a script file named as the program (``train.py``, ``./run.sh``), not a module
    or a command (``python -m pkg.train``, ``Rscript train.R``)?"""
    return not config.module and Path(config.script).is_file()


def source_file(config: LaunchConfig) -> Path | None:
    """The local file holding the job's code: the script, the module's source under the
    project (``pkg/train.py``, ``pkg/train/__main__.py``), or the file a command names; None
    when there is none here."""
    entry = entry_point(config.script, config.args, module=config.module)
    if entry.kind == "file" and script_given_alone(config):
        return Path(config.script)
    root = project_root(config)
    if entry.kind == "module":
        found = (root / path for path in module_paths(entry.name))
        return next((path.relative_to(root) if root == Path.cwd() else path for path in found if path.is_file()),
                    None)
    if entry.kind == "file":
        path = root / entry.name
        return (Path(entry.name) if root == Path.cwd() else path) if path.is_file() else None
    return None


def names_project_files(config: LaunchConfig, root: Path) -> bool:
    """Does the module or command name something in ``root``: the module's package (or file),
    or an argument that is a relative path to a file or folder inside it?"""
    entry = entry_point(config.script, config.args, module=config.module)
    if entry.kind == "module":
        top = entry.name.split(".")[0]
        return (root / top).is_dir() or (root / f"{top}.py").is_file()
    for arg in (config.script, *config.args):
        if not arg or arg.startswith("-") or Path(arg).is_absolute() or "\0" in arg:
            continue
        try:
            path = (root / arg).resolve()
        except (OSError, ValueError):
            continue
        if path != root and path.is_relative_to(root) and path.exists():
            return True
    return False


def new_job_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def default_hosts(hosts: str | None) -> str | None:
    """``--hosts`` as given; when not given, ``slurm`` inside a Slurm allocation (its nodes are
    the inventory), else None (this machine)."""
    if hosts is None and in_allocation(os.environ):
        return SLURM_HOSTS
    return hosts


def resolve_inventory(hosts: str | None, np: int | None) -> Inventory:
    if hosts is None:
        return localhost_inventory(2 if np is None else np)
    if hosts == SLURM_HOSTS:
        allocation = allocation_inventory(os.environ)
        print(f"dlrun: {allocation.describe()}", file=sys.stderr)
        return allocation.inventory
    return load_inventory(hosts)


TRANSPORTS = ("auto", "ssh", "srun")


def transport_kind(inventory: Inventory, ssh: SSHOptions) -> str:
    """``ssh`` or ``srun``: ``auto`` is srun for the allocation's own nodes where ``srun`` is on
    PATH (docs/slurm.md says why), else ssh."""
    if ssh.transport != "auto":
        return ssh.transport
    return "srun" if inventory.source == ALLOCATION_SOURCE and shutil.which("srun") else "ssh"


def make_transport(inventory: Inventory, ssh: SSHOptions) -> Transport:
    """Local hosts need no SSH (and dlrun does not import paramiko for them); ``srun`` runs
    every other host's commands as steps of the Slurm job dlrun runs in."""
    if transport_kind(inventory, ssh) == "srun":
        from dlrun.transport.srun import SrunTransport

        environ = os.environ
        groups = allocation_inventory(environ).het_groups if in_allocation(environ) else {}
        job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID", "")
        return HostRouter(remote=SrunTransport(job_id, environ, het_groups=groups))
    if inventory.all_local:
        return HostRouter(remote=None)
    from dlrun.transport.ssh import SSHTransport

    return HostRouter(
        remote=SSHTransport(
            config_file=ssh.config_file,
            accept_new_host_keys=ssh.accept_new_host_keys,
            connect_timeout=ssh.connect_timeout,
            known_hosts=ssh.known_hosts,
            host_timeout=ssh.host_timeout if ssh.host_timeout_given else None,
        )
    )


def job_plan(config: LaunchConfig, inventory: Inventory, job_id: str,
             addresses: Mapping[str, str] | None = None, ports: Mapping[int, int] | None = None) -> Plan:
    """The rank plan of this launch (``make_plan`` with the options that shape it); ``ports``:
    rank → port where dlrun chose them (free on the rank's host)."""
    return make_plan(inventory, job_id=job_id, np=config.np, base_port=config.base_port or DEFAULT_BASE_PORT,
                     framework=config.framework, addresses=addresses, ports=ports, restart_count=config.attempt,
                     max_restarts=config.max_restarts, run_id=config.run_id)


def render_commands(
    config: LaunchConfig,
    inventory: Inventory,
    job_id: str,
    addresses: Mapping[str, str] | None = None,
    cwd_for: Mapping[str, str | None] | None = None,
    rendezvous: Rendezvous | None = None,
    gpus_for: Mapping[str, Sequence[str]] | None = None,
    found_ifaces: Mapping[str, str] | None = None,
    ports: Mapping[int, int] | None = None,
) -> tuple[Plan, tuple[WorkerCommand, ...]]:
    plan = job_plan(config, inventory, job_id, addresses, ports)
    if cwd_for is None:
        cwd_for = {h.name: (os.getcwd() if h.is_local else h.workdir) for h in plan.hosts}
    commands = worker_commands(
        plan,
        config.script,
        config.args,
        python_for={h.name: default_python(h) for h in plan.hosts},
        cwd_for=cwd_for,
        extra_env=config.env,
        rendezvous=rendezvous or (("127.0.0.1", 0) if config.framework == "horovod" else None),
        ifaces=socket_ifaces(plan, config.iface, found_ifaces or {}),
        server_argv=["-c", server_source()] if config.framework == "tf-ps" else None,
        gpus_for=gpus_for,
        module=config.module,
        no_python=config.no_python,
    )
    return plan, commands


def check_ranks_shown(config: LaunchConfig, world_size: int) -> None:
    """``--ranks`` names ranks of the job: nothing would be shown for others (a typo, not a wish)."""
    unknown = sorted(set(config.ranks_shown or ()) - set(range(world_size)))
    if unknown:
        raise UsageError(f"--ranks {','.join(map(str, unknown))}: the job has ranks 0 to {world_size - 1}")


def warn_replaced_env(config: LaunchConfig, commands: Sequence[WorkerCommand]) -> None:
    """Say which ``--env`` values the ranks do not get (dlrun sets them: TF_CONFIG, RANK …)."""
    for name in sorted(n for n in config.env if any(c.env.get(n) != config.env[n] for c in commands)):
        print(f"dlrun: warning: --env {name} is set by dlrun for each rank; yours is replaced", file=sys.stderr)


def tf_job(config: LaunchConfig) -> bool:
    """Does the job run TensorFlow: ``tf``/``tf-ps``, or both contracts for a script that imports TF?"""
    if config.framework == TF_AND_TORCH:
        return config.detected is not None and "tf" in config.detected.imports
    return is_tf(config.framework)


def keras_warning(config: LaunchConfig, inventory: Inventory,
                  reports: Sequence[HostReport] | None = None) -> str | None:
    """Keras 3 cannot model.fit under MultiWorkerMirroredStrategy (keras-team/keras#20585), and a
    custom training loop written for tf.keras (Keras 2: TensorFlow's own tutorials) fails on
    Keras 3's changed API; legacy Keras (``TF_USE_LEGACY_KERAS=1`` with tf_keras) runs both.

    ``reports``: the preflight's, whose per-host Keras and tf_keras versions decide (the hosts'
    Pythons run the job, not this machine's); without them, this machine's Keras does."""
    if not tf_job(config):
        return None
    if "TF_USE_LEGACY_KERAS" in config.env:
        return None
    try:  # a script that opts in itself (as examples/train_digits.py does) needs no warning
        source = source_file(config)
        if source is not None and "TF_USE_LEGACY_KERAS" in source.read_text(encoding="utf-8", errors="replace"):
            return None
    except OSError:
        pass
    unset = [h for h in inventory.hosts if "TF_USE_LEGACY_KERAS" not in h.env
             and not (h.is_local and "TF_USE_LEGACY_KERAS" in os.environ)]
    if not unset:
        return None
    if reports is not None:
        by_host = {r.host: r for r in reports if r.reachable}
        keras3 = {h.name: by_host[h.name] for h in unset
                  if h.name in by_host and (by_host[h.name].keras or "").startswith("3.")}
        if not keras3:
            return None
        versions = sorted({r.keras or "" for r in keras3.values()})
        where = f" on {', '.join(keras3)}"
        no_tf_keras = [name for name, r in keras3.items() if not r.tf_keras]
        lack = "lacks" if len(no_tf_keras) == 1 else "lack"
        install = f"Install tf_keras ({', '.join(no_tf_keras)} {lack} it) and pass" if no_tf_keras else "Pass"
    else:
        from importlib import metadata

        try:
            versions = [metadata.version("keras")]
        except metadata.PackageNotFoundError:
            return None
        if not versions[0].startswith("3."):
            return None
        where, install = "", "Install tf_keras and pass"
    return (
        f"Keras {', '.join(versions)} is installed{where} and TF_USE_LEGACY_KERAS is unset. Under"
        " MultiWorkerMirroredStrategy, Keras 3 cannot model.fit (keras-team/keras#20585), and a custom training"
        " loop written for tf.keras (as in TensorFlow's tutorials) fails on Keras 3's changed API"
        f" (e.g. metric.reset_states). Legacy Keras runs both. {install} --env TF_USE_LEGACY_KERAS=1"
        " (or set it in the script before it imports TensorFlow)."
    )


@dataclass(frozen=True)
class Pushed:
    """What the push changed for the launch: env per host, where ranks run, the script path."""

    env_for: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    cwd_for: Mapping[str, str | None] | None = None
    script: str | None = None
    summaries: tuple[HostPushSummary, ...] = ()  # the data push's, then the code push's

    def apply(self, inventory: Inventory) -> Inventory:
        """The inventory with each host's shard env (``DLRUN_DATA_DIR`` …) added."""
        hosts = tuple(replace(h, env={**h.env, **self.env_for.get(h.name, {})}) for h in inventory.hosts)
        return replace(inventory, hosts=hosts)


def code_dir_to_push(config: LaunchConfig, *, strict: bool = False) -> Path | None:
    """The folder ``launch`` pushes (with ``--push``). A script given alone: ``--code DIR``,
    else the script's directory, unless the script is an installed program (``/usr/bin/…``, a
    ``site-packages``: nothing pushed). A script directly in the home folder or ``/`` has
    none: with ``strict`` (remote hosts to push to) that is a ``UsageError``
    (``dlrun.push.tree.push_root_for``). A module or a command: ``--code DIR``, else the
    current folder when the module is there or an argument names a file in it (else nothing)."""
    from dlrun.push.tree import push_root_for, system_folders

    script = Path(config.script)
    if not config.push:
        return None
    if not script_given_alone(config):
        return command_project(config, strict=strict)
    if config.code is not None:
        code = Path(config.code).resolve()
        if not script.resolve().is_relative_to(code):
            raise UsageError(f"--code {config.code}: the script {config.script} is not inside it",
                             hint="--code names the project folder that holds the script")
        return code
    try:
        return push_root_for(script.absolute(), home=Path.home(), system=system_folders())
    except UsageError:
        if strict:
            raise
        return None


def command_project(config: LaunchConfig, *, strict: bool) -> Path | None:
    """The project a module or a command pushes: ``--code`` (always), else the current folder
    when the command names something in it (``names_project_files``). The home folder or ``/``
    is not a project: with ``strict`` that is a ``UsageError``, else nothing is pushed."""
    if config.code is not None:
        return Path(config.code).resolve()
    root = Path.cwd().resolve()
    if not names_project_files(config, root):
        return None
    if root == Path(root.anchor) or root == Path.home().resolve():
        if not strict:
            return None
        where = "the home folder" if root != Path(root.anchor) else "/"
        raise UsageError(f"the command names files in {where} ({root}): dlrun pushes the current folder, and that"
                         " would be all of it; nothing was pushed",
                         hint="run dlrun from a project folder, name the folder to push with --code DIR, "
                         "or run what is already on the hosts with --no-push")
    return root


def script_in_push(config: LaunchConfig, code_dir: Path) -> str:
    """The script as the ranks name it, relative to the pushed folder (a link: its target); a
    program the system runs itself keeps a ``./``. A module or a command stays as given: it
    runs in the pushed folder, where its arguments name the same files."""
    if not script_given_alone(config):
        return config.script
    name = Path(config.script).resolve().relative_to(code_dir).as_posix()
    if "/" not in name and runs_directly(name, no_python=config.no_python):
        return f"./{name}"
    return name


def push_limit(config: LaunchConfig) -> PushLimit:
    from dlrun.push.tree import PushLimit, parse_size

    return parse_size(config.max_push_size) if config.max_push_size is not None else PushLimit()


def push_for_launch(config: LaunchConfig, transport: Transport, hosts: Sequence[Host],
                    settled: Mapping[str, HostPushSummary] | None = None, *, dry_run: bool = False) -> Pushed:
    """Push each host's data shard (``--data``) and the script's directory (remote hosts).

    With code pushed, every rank runs in ``<workdir>/<script dir name>`` on its host and the
    script is named relative to it; local hosts run in the script's directory for the same
    relative name. ``settled``: hosts whose agent's survey found the code already in place
    (``dlrun.push.session.settled_push``); no push session is opened there. ``dry_run``: each
    host is surveyed and what would be sent is shown; nothing is written.
    """
    from dlrun.push.session import push, shard_env
    from dlrun.push.view import PushView

    env_for: dict[str, dict[str, str]] = {}
    shown: list[HostPushSummary] = []
    live = False if dry_run else None  # a dry run prints what it would send, line by line
    if config.data:
        with PushView([h.name for h in hosts], live=live) as view:
            summaries = push(transport, hosts, code_dir=None, data_dir=Path(config.data), shard=config.shard,
                             split_lines=config.split_lines, progress=view.progress, file_progress=view.files,
                             dry_run=dry_run, insecure_workdir=config.insecure_workdir)
            view.finish(summaries)
            shown += summaries
        for index, (host, summary) in enumerate(zip(hosts, summaries, strict=True)):
            env_for[host.name] = shard_env(index, len(hosts), host, data_dir=summary.data_dir)
    code_dir = code_dir_to_push(config)
    remote = [h for h in hosts if not h.is_local]
    if code_dir is None or not remote:
        return Pushed(env_for, local_cwd(config, code_dir, hosts), summaries=tuple(shown))
    done = dict(settled or {})
    pending = [h for h in remote if h.name not in done]
    with PushView([h.name for h in remote], live=live) as view:
        if pending:
            fresh = push(transport, pending, code_dir=code_dir, progress=view.progress, file_progress=view.files,
                         leave_out=Path(config.data) if config.data else None,  # the data went as shards
                         log_dir=config.log_dir or DEFAULT_LOG_DIR, limit=push_limit(config), dry_run=dry_run,
                         insecure_workdir=config.insecure_workdir)
            done.update((s.host, s) for s in fresh)
        view.finish([done[h.name] for h in remote])
    shown += [done[h.name] for h in remote]
    cwd_for: dict[str, str | None] = {h.name: str(code_dir) for h in hosts if h.is_local}
    cwd_for.update({h.name: done[h.name].code_dir for h in remote})
    return Pushed(env_for, cwd_for, script_in_push(config, code_dir), tuple(shown))


def dry_run_push(config: LaunchConfig, inventory: Inventory, hosts: Sequence[Host]) -> Pushed:
    """``--dry-run``: survey each host and show what the push would send and delete (nothing is
    written); where the hosts cannot be reached, what ``planned_push`` says, with a warning."""
    from dlrun.errors import TransportError

    code_dir = code_dir_to_push(config, strict=any(not h.is_local for h in hosts))
    if not config.data and (code_dir is None or all(h.is_local for h in hosts)):
        return planned_push(config, hosts)
    transport = make_transport(inventory, config.ssh)
    try:
        transport.connect(hosts)
        return push_for_launch(config, transport, hosts, dry_run=True)
    except TransportError as exc:
        print(f"dlrun: warning: cannot survey the hosts for the push ({exc}); showing the plan only",
              file=sys.stderr)
        return planned_push(config, hosts)
    finally:
        transport.close()


def run_setup_step(config: LaunchConfig, transport: Transport, hosts: Sequence[Host], pushed: Pushed, job_id: str,
                   manifest: Manifest | None) -> None:
    """The setup command (``--setup`` or the inventory's ``setup``) on every host, in its run
    folder, after the push and before any rank (``dlrun.push.setup``); a failure raises."""
    from dlrun.push.setup import run_setup, setup_commands, setup_key

    commands = setup_commands(hosts, config.setup)
    if not commands:
        return
    code_dir = code_dir_to_push(config)
    if manifest is None and code_dir is not None:
        from dlrun.push.session import scan_code

        manifest = scan_code(code_dir, Path(config.data) if config.data else None,  # only for the key:
                             log_dir=config.log_dir or DEFAULT_LOG_DIR, limit=None)  # nothing is sent
    folders = {h.name: (pushed.cwd_for or {}).get(h.name) or (os.getcwd() if h.is_local else h.workdir or "")
               for h in hosts}
    keys = {name: setup_key(command, manifest) for name, command in commands.items()}
    run_setup(transport, hosts, commands, folders, keys, Path(config.log_dir or DEFAULT_LOG_DIR) / job_id,
              always=config.setup_always)


def planned_push(config: LaunchConfig, hosts: Sequence[Host]) -> Pushed:
    """What ``push_for_launch`` would change, without pushing (``--dry-run``): the shard env
    and, for a pushed script, each host's run directory as written (``~`` as on the host)."""
    from dlrun.push.session import code_dir_on, shard_env

    env_for = {h.name: shard_env(i, len(hosts), h) for i, h in enumerate(hosts)} if config.data else {}
    code_dir = code_dir_to_push(config)
    if code_dir is None or all(h.is_local for h in hosts):
        return Pushed(env_for, local_cwd(config, code_dir, hosts))
    cwd_for = {h.name: str(code_dir) if h.is_local else code_dir_on(h, code_dir) for h in hosts}
    return Pushed(env_for, cwd_for, script_in_push(config, code_dir))


def local_cwd(config: LaunchConfig, code_dir: Path | None, hosts: Sequence[Host]) -> dict[str, str | None] | None:
    """Where ranks run when nothing goes to remote hosts: a module or a command with ``--code``
    runs in that folder (its arguments name files there); else the default (None)."""
    if code_dir is None or config.code is None or script_given_alone(config):
        return None
    return {h.name: str(code_dir) if h.is_local else None for h in hosts}


def survey_code(code_dir: Path, hosts: Sequence[Host], manifest: Manifest) -> dict[str, PushTarget]:
    """The code push's target on each remote host, for the agents' survey."""
    from dlrun.push.session import code_target

    return {h.name: code_target(h, code_dir, manifest) for h in hosts if not h.is_local}


def settled_hosts(targets: Mapping[str, PushTarget], answers: Mapping[str, AgentAnswer]) -> dict[str, HostPushSummary]:
    """The hosts whose survey answer says the code push has nothing to do."""
    from dlrun.push.session import settled_push

    settled = {}
    for name, target in targets.items():
        answer = answers.get(name)
        summary = settled_push(name, [target], answer.survey) if answer and answer.survey else None
        if summary is not None:
            settled[name] = summary
    return settled


def claiming(request: dict[str, Any], token: str, host: str) -> dict[str, Any]:
    """A survey request that also asks the host to claim its code folder for this launch
    (``dlrun.remote.push_helper.claim``): hosts that share the folder name the same claimant."""
    return {**request, "targets": [{**t, "claim": {"token": token, "host": host}} for t in request["targets"]]}


def sharing_hosts(targets: Mapping[str, PushTarget], answers: Mapping[str, AgentAnswer],
                  settled: Mapping[str, HostPushSummary], planned: Sequence[str]) -> dict[str, HostPushSummary]:
    """Hosts whose code folder another planned host claimed (one folder, e.g. an NFS home):
    that host's push fills it, so they get none of their own. Said in one line per folder."""
    from dlrun.push.session import HostPushSummary

    shared: dict[str, HostPushSummary] = {}
    by_owner: dict[str, list[str]] = {}
    for name, target in targets.items():
        reply = ((answers.get(name) or AgentAnswer(name, None)).survey or {}).get("targets") or [{}]
        owner, root = reply[0].get("claimed_by"), reply[0].get("root")
        if name in settled or owner in (None, name) or owner not in planned or owner not in targets \
                or not isinstance(root, str) or name not in planned:
            continue
        shared[name] = HostPushSummary(host=name, files_sent=0, bytes_sent=0,
                                       files_unchanged=len(target.manifest.paths()), files_deleted=0, seconds=0.0,
                                       code_dir=root)
        by_owner.setdefault(str(owner), []).append(name)
    for owner, names in by_owner.items():
        print(f"dlrun: {', '.join(names)} share{'s' if len(names) == 1 else ''} {owner}'s code folder"
              f" ({targets[owner].root}): pushed once, by {owner}", file=sys.stderr)
    return shared


@contextmanager
def horovod_rendezvous(plan: Plan) -> Iterator[tuple[str, int, str]]:
    """dlrun's Horovod rendezvous server for this plan, stopped when the attempt ends; every
    request must carry a key of this attempt's own (``dlrun.remote.rendezvous``)."""
    from dlrun.remote.rendezvous import rendezvous_key
    from dlrun.run.rendezvous import RendezvousServer, scope_sizes

    key = rendezvous_key(secrets.token_hex(32))
    server = RendezvousServer(
        scope_sizes([(r.address, r.local_rank) for r in plan.ranks]),
        host=facing_address([r.address for r in plan.ranks]), key=key,
    )
    with server:
        address = server.address
        assert address is not None
        yield address[0], address[1], key


def dry_run_text(commands: Sequence[WorkerCommand]) -> str:
    """``--dry-run``'s text: secrets masked (env and the script's arguments), control characters
    escaped (the argv is JSON, which escapes them itself)."""
    lines = []
    for c in commands:
        s = c.spec
        lines.append(
            f"rank {s.rank}: host {printable(s.host.name)} ({printable(s.address)}) local_rank"
            f" {s.local_rank}/{s.local_size} cross_rank {s.cross_rank}/{s.cross_size}"
            f" task {s.task_type}:{s.task_index} port {s.port}"
        )
        shown = [a if len(a) <= 200 else f"<inline program, {len(a)} bytes>" for a in mask_argv(c.argv)]
        lines.append(f"  argv: {json.dumps(shown)}")
        if c.cwd:
            lines.append(f"  cwd:  {printable(c.cwd)}")
        for name, value in sorted(mask_env(c.env).items()):
            lines.append(f"  env:  {printable(name)}={printable(value)}")
    return "\n".join(lines)


@contextmanager
def forward_signals(supervisor: Supervisor) -> Iterator[None]:
    """SIGINT/SIGTERM to dlrun → the supervisor stops every rank (no process is left).

    Ctrl-Z (SIGTSTP) is refused with a notice: a stopped dlrun reads no output, so the ranks
    stall on their next print, and after the host timeout every agent stops the job.
    """

    def handler(signum: int, _frame: FrameType | None) -> None:
        supervisor.interrupt(signum)

    def no_suspend(_signum: int, _frame: FrameType | None) -> None:
        supervisor.notify("Ctrl-Z ignored: a suspended dlrun stalls the ranks' output, and its hosts stop the"
                          " job after --host-timeout; Ctrl-C stops the job")

    if threading.current_thread() is not threading.main_thread():  # the API, called from a thread:
        yield  # only the main thread may set handlers: signals stay the caller's
        return
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    previous[signal.SIGTSTP] = signal.signal(signal.SIGTSTP, no_suspend)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def default_ranks_for_gpus(inventory: Inventory, reports: Sequence[HostReport]) -> Inventory:
    """The default job (no --hosts, no --np: 2 ranks here) on a machine with one GPU: 1 rank,
    with a notice. Two would share the GPU, which the preflight refuses for a job that asks for
    it; the default asked for nothing (a CPU smoke test on a one-GPU laptop)."""
    (host,) = inventory.hosts
    gpus = next((r.gpu_slots for r in reports if r.host == host.name and r.reachable), 0)
    if not 0 < gpus < (host.slots or 1):
        return inventory
    print(f"dlrun: {gpus} GPU here: starting {gpus} rank, not {host.slots}, so that ranks do not share it"
          f" (-n {host.slots} --no-preflight starts {host.slots} that do)", file=sys.stderr)
    return localhost_inventory(gpus)


#: Linux's limits on a path and on each of its names (bytes): a longer script name is a usage error
PATH_MAX, NAME_MAX = 4095, 255


def check_script(config: LaunchConfig) -> None:
    """The script names a program: not too long a path, not a folder, no NUL byte. Checked first,
    for every engine (a dry run too): the hosts would fail each rank with 126 or 127 instead."""
    raw = os.fsencode(config.script)
    if not raw.strip() or b"\0" in raw:
        raise UsageError("the script is empty or holds a NUL byte")
    if len(raw) > PATH_MAX or any(len(part) > NAME_MAX for part in raw.split(b"/")):
        raise UsageError(f"the script's name is too long ({len(raw)} bytes; a path may have {PATH_MAX},"
                         f" each name in it {NAME_MAX})")
    here = config.push or (config.hosts is None)
    if here and not config.module and Path(config.script).is_dir():
        raise UsageError(f"{printable(config.script)} is a folder, not a script",
                         hint=f"name the program in it (dlrun launch {printable(config.script).rstrip('/')}/train.py);"
                         " --code DIR pushes a folder that holds the script")


def check_local_inputs(config: LaunchConfig, inventory: Inventory) -> None:
    """Before any connection: a ``.py`` script that must be here (a local rank runs it, or its
    directory is pushed) exists, its push root is a project (not the home folder), and the log
    directory can be written."""
    code_dir = code_dir_to_push(config, strict=not inventory.all_local)
    if code_dir is not None and config.data and code_dir.is_relative_to(Path(config.data).resolve()):
        raise UsageError(f"--data {config.data} holds the script's directory {code_dir}, which is pushed as code:"
                         " every file would go twice", hint="keep the dataset in a directory of its own")
    if config.module and (config.script.endswith(".py") or "/" in config.script):
        raise UsageError(f"-m {config.script}: -m takes a module name (pkg.train), not a file",
                         hint=f"dlrun launch {config.script} runs a script file")
    here = config.push or any(h.is_local for h in inventory.hosts)
    if (here and not config.module and (config.script.endswith(".py") or interpreter_for(config.script))
            and not Path(config.script).is_file()):
        raise UsageError(f"script not found: {printable(config.script)}",
                         hint="with --no-push, a path on the hosts is not checked here")
    log_root = Path(config.log_dir or DEFAULT_LOG_DIR)
    try:
        log_root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create the log directory {log_root}: {exc.strerror or exc}",
                         hint="pass --log-dir DIR") from exc
    if not os.access(log_root, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write to the log directory {log_root}", hint="pass --log-dir DIR")


#: Where dlrun looks for free ports when no --base-port is given (below Linux's ephemeral
#: ports, 32768 up): a window at a random offset, so that jobs started at once differ.
PORT_RANGE = (20000, 32768)


def ports_to_ask(config: LaunchConfig, inventory: Inventory, hosts: Sequence[Host], *,
                 given: bool) -> dict[str, tuple[int, ...]]:
    """host → the ports its agent is asked about: those its ranks will listen on (``--base-port``
    and up, to be checked), or a window of candidates to choose from. None for a job whose ranks
    listen nowhere (Horovod, none); ``given``: the user chose ``--base-port`` (on this machine
    alone dlrun chose it otherwise, with ``local_base_port``)."""
    if not (is_tf(config.framework) or is_torch(config.framework)) or (inventory.all_local and not given):
        return {}
    most = config.np or (inventory.total_slots if all(h.slots for h in inventory.hosts) else 16 * len(inventory.hosts))
    if config.base_port is not None:
        start, count = config.base_port, min(most, 65536 - config.base_port)
    else:
        count = most + 32  # room for ports other programs hold
        start = PORT_RANGE[0] + secrets.randbelow(max(1, PORT_RANGE[1] - PORT_RANGE[0] - count))
    return {h.name: tuple(range(start, start + count)) for h in hosts}


def check_ports_free(plan: Plan, free: Mapping[str, Sequence[int]]) -> None:
    """``--base-port``: every port a rank will listen on is free on its host, or nothing starts."""
    from dlrun.errors import PreflightError

    busy = [(spec.host.name, spec.port, spec.rank) for spec in listening_ranks(plan.framework, plan.ranks)
            if spec.host.name in free and spec.port not in free[spec.host.name]]
    if busy:
        lines = "\n".join(f"  {host}: port {port} (rank {rank}) is in use" for host, port, rank in busy)
        raise PreflightError(f"ports the ranks would listen on are taken; nothing was started:\n{lines}",
                             hint="pass another --base-port, or none: dlrun then picks ports free on every host")


def _probe_source() -> str:
    from dlrun.remote import source_of

    return source_of("probe")


class HostsEngine:
    """The inventory's hosts (SSH hosts, this machine) over a transport.

    Each host's agent starts before the plan: it runs the preflight probe and answers the code
    push's survey on its own channel, and an error finding closes it before anything starts.
    Then the plan, the push (``push_for_launch``) and, for each attempt, the render; the first
    attempt's ranks go to the agents started early, a restart's to fresh ones.
    """

    restart_unit = "the job"

    def __init__(self) -> None:
        self.inventory = Inventory(hosts=())
        self.used_hosts: tuple[Host, ...] = ()  # the hosts the job may use (all, when the probe counts slots)
        self.transport: Transport | None = None
        self.agents: HostAgents | None = None  # started early; handed to the first attempt
        self.addresses: Mapping[str, str] = {}
        self.cwd_for: Mapping[str, str | None] | None = None
        self.gpus: Mapping[str, Sequence[str]] = {}
        self.found_ifaces: Mapping[str, str] = {}
        self.base_port_given = False
        self.ports: Mapping[int, int] | None = None  # rank -> port, where dlrun chose free ones
        self.warnings: tuple[str, ...] = ()  # printed before the start, repeated in a failure's root cause
        self.dry_run_pushes: tuple[HostPushSummary, ...] = ()  # what --dry-run's push would send
        self.ports_chosen = False  # dlrun chose the base port (no --base-port): a restart chooses again
        self.reconnect: tuple[Host, ...] = ()  # hosts lost in the last attempt: reconnected, probed again
        self.dropped: tuple[str, ...] = ()  # hosts lost and left out (--min-hosts)
        self.job_secret = secrets.token_hex(32)  # a detached job's keepers' token (and rendezvous key's root)
        self.failed_at: float | None = None  # when the last attempt failed (its copies then may be half written)

    def prepare(self, config: LaunchConfig) -> LaunchConfig:
        config = replace(config, hosts=default_hosts(config.hosts))
        if config.hosts is None and config.np is not None and config.np < 1:
            raise UsageError("--np must be at least 1")
        self.inventory = resolve_inventory(config.hosts, config.np)
        self.base_port_given = config.base_port is not None
        if config.base_port is None and self.inventory.all_local:
            self.ports_chosen = True
            config = replace(config, base_port=local_base_port(self.inventory, config.np))
        slots_from_gpus = config.preflight and any(h.slots is None for h in self.inventory.hosts)
        if slots_from_gpus:  # slots come from the probe: every host may be used
            self.used_hosts = self.inventory.hosts
        else:  # validate the plan before any connection
            _, trial = render_commands(config, self.inventory, "plan-check")
            self.used_hosts = tuple({c.spec.host.name: c.spec.host for c in trial}.values())
        return config

    def dry_run(self, config: LaunchConfig, job_id: str) -> tuple[WorkerCommand, ...]:
        """Each rank's command as the launch would start it, nothing started or written. With a
        host to reach over the network, the launch's own ``session`` runs (connect, agents with
        the probe, the push survey and the free ports, the preflight, a push that writes
        nothing), so the dry run shows the addresses, interfaces, GPUs and ports the ranks get;
        where a host cannot be reached, the plan as written, with a warning. Ranks on this
        machine alone: the plan, which is what they get (their addresses and ``lo``)."""
        if not self.inventory.all_local:
            from dlrun.errors import TransportError

            try:
                with self.session(config, job_id) as placed:
                    return self._dry_commands(placed, job_id)
            except TransportError as exc:
                print("dlrun: warning: showing the plan as written, without the addresses, interfaces, GPUs and"
                      f" free ports the hosts would give: {exc}", file=sys.stderr)
                self.addresses, self.gpus, self.found_ifaces, self.ports = {}, {}, {}, None
                warning = keras_warning(config, self.inventory)
                if warning and not config.json_output:
                    print(f"dlrun: warning: {warning}", file=sys.stderr)
                planned_hosts = job_plan(config, self.inventory, job_id).hosts
                pushed = planned_push(config, planned_hosts)
        else:
            planned_hosts = job_plan(config, self.inventory, job_id).hosts
            pushed = dry_run_push(config, self.inventory, planned_hosts)
        self.dry_run_pushes = pushed.summaries
        self.inventory, self.cwd_for = pushed.apply(self.inventory), pushed.cwd_for
        self.addresses = reachable_addresses(planned_hosts, {})
        return self._dry_commands(replace(config, script=pushed.script) if pushed.script is not None else config,
                                  job_id)

    def _dry_commands(self, config: LaunchConfig, job_id: str) -> tuple[WorkerCommand, ...]:
        """``--dry-run``'s commands, rendered as ``place`` renders them (``render``); Horovod's
        rendezvous server is not started: its port is named, not chosen."""
        plan, commands = self.render(config, job_id)
        if config.framework == "horovod":  # dlrun's rendezvous server binds a free port when the job starts
            server = {"HOROVOD_GLOO_RENDEZVOUS_ADDR": facing_address([r.address for r in plan.ranks]),
                      "HOROVOD_GLOO_RENDEZVOUS_PORT": "<a free port, chosen at launch>"}
            commands = tuple(replace(c, env={**c.env, **server}) for c in commands)
        return commands

    @contextmanager
    def session(self, config: LaunchConfig, job_id: str) -> Iterator[LaunchConfig]:
        """Connect, start the agents (probe and survey first), check the preflight, plan, push.
        With ``config.dry_run`` (``dry_run``): the push surveys and writes nothing, no setup runs,
        and the agents are closed before they get any rank."""
        inventory, used_hosts = self.inventory, self.used_hosts
        transport = make_transport(inventory, config.ssh)
        agents = HostAgents(transport, used_hosts, pidns=config.pidns, host_timeout=config.ssh.host_timeout)
        code_dir = code_dir_to_push(config)
        pusher = ThreadPoolExecutor(1, thread_name_prefix="dlrun-scan")
        manifest: Future[Manifest] | None = None
        if code_dir is not None and any(not h.is_local for h in used_hosts):
            from dlrun.push.session import scan_code

            leave_out = Path(config.data) if config.data else None  # sent as shards, not with the code
            # hashes (or reads the cache) while we connect; over the size limit it raises before hashing
            manifest = pusher.submit(scan_code, code_dir, leave_out, log_dir=config.log_dir or DEFAULT_LOG_DIR,
                                     limit=push_limit(config), save_cache=not config.dry_run)
        try:
            addresses = reachable_addresses(used_hosts, transport.connect(used_hosts))
            if not config.push and not config.insecure_workdir:  # in place: the same folder check as a push
                from dlrun.push.session import check_in_place

                check_in_place(transport, used_hosts, in_place_folders(config, used_hosts))
            targets = survey_code(code_dir, used_hosts, manifest.result()) if code_dir and manifest is not None else {}
            surveys = None
            if targets:
                from dlrun.push.session import survey_request

                checked = not config.insecure_workdir  # a dry run writes nothing, so claims nothing
                surveys = {name: survey_request([target], owner_check=checked) if config.dry_run
                           else claiming(survey_request([target], owner_check=checked), job_id, name)
                           for name, target in targets.items()}
            # the agents start while we plan; each runs the probe, answers the push survey and
            # says which ports are free first
            ports_asked = ports_to_ask(config, inventory, used_hosts, given=self.base_port_given)
            agents.start(probe=_probe_source() if config.preflight else None, surveys=surveys, ports=ports_asked)
            answers: Mapping[str, AgentAnswer] = {}
            if config.preflight or targets or ports_asked:
                from dlrun.topo.preflight import PROBE_TIMEOUT  # the agents' answers wait as long as a probe

                answers = agents.answers(PROBE_TIMEOUT)
            if config.preflight:
                from dlrun.topo.preflight import check_preflight, report_from_answer

                reports = [report_from_answer(a.host, a.stdout, a.error) for a in answers.values()]
                if config.hosts is None and config.np is None:
                    inventory = default_ranks_for_gpus(inventory, reports)
                # an error finding raises here
                preflight = check_preflight(inventory, used_hosts, reports, framework=config.framework)
                warned: list[str] = []  # repeated in the root cause of a job that then fails
                for finding in preflight.findings:
                    if finding.severity == "warning":
                        where = f"{finding.host}: " if finding.host else ""
                        print(f"dlrun: preflight warning: {where}{finding.message}", file=sys.stderr)
                        warned.append(f"preflight: {where}{finding.message}")
                inventory = inventory.with_slots(preflight.gpu_slots())
                self.gpus = preflight.devices()
                self.found_ifaces = interfaces_at(reports, addresses)
                warning = keras_warning(config, inventory, reports)
                if warning:
                    print(f"dlrun: warning: {warning}", file=sys.stderr)
                    warned.append(warning)
                self.warnings = tuple(warned)
                if config.bench and config.attempt == 0:  # a restart does not measure again
                    from dlrun.topo.benchrun import check_bench

                    check_bench(transport, used_hosts, reports, config.bench, config.iface)
            plan = job_plan(config, inventory, job_id, addresses)
            if ports_asked:
                free = {name: a.free_ports for name, a in answers.items()
                        if name in ports_asked and a.free_ports is not None}
                if config.base_port is None:  # dlrun picks: free on each host that listens
                    self.ports = choose_ports(config.framework, plan.ranks, free)
                    plan = job_plan(config, inventory, job_id, addresses, self.ports)
                else:
                    check_ports_free(plan, free)
            settled = settled_hosts(targets, answers)
            settled.update(sharing_hosts(targets, answers, settled, [h.name for h in plan.hosts]))
            if config.dry_run:  # what a push would do: survey only, nothing written
                settled = {name: replace(summary, dry_run=True) for name, summary in settled.items()}
            pushed = push_for_launch(config, transport, plan.hosts, settled, dry_run=config.dry_run)
            self.dry_run_pushes = pushed.summaries if config.dry_run else ()
            if not config.dry_run:
                run_setup_step(config, transport, plan.hosts, pushed, job_id,
                               manifest.result() if manifest is not None else None)
            self.inventory, self.transport, self.agents = pushed.apply(inventory), transport, agents
            self.addresses, self.cwd_for = addresses, pushed.cwd_for
            yield config if pushed.script is None else replace(config, script=pushed.script)
        finally:
            pusher.shutdown(wait=False, cancel_futures=True)
            agents.close()
            transport.close()

    def regroup(self, config: LaunchConfig, failed: RunResult) -> str | None:
        """After a failed attempt: the hosts it lost are reconnected (and probed) by the next
        ``place``, or with ``--min-hosts`` left out while enough remain. None: go on; else why not."""
        self.failed_at = failed.stopped_at  # copies modified since then may be half written
        lost = [h for h in self.inventory.hosts if h.name in failed.lost_hosts]
        if not lost:
            return None
        if config.min_hosts is None:
            self.reconnect = tuple(lost)
            return None
        names = {h.name for h in lost}
        remaining = replace(self.inventory, hosts=tuple(h for h in self.inventory.hosts if h.name not in names))
        try:
            hosts = job_plan(self.shrunk(config, remaining), remaining, "regroup").hosts if remaining.hosts else ()
        except DlrunError as exc:
            return f"without {', '.join(sorted(names))} the job cannot be planned: {exc}"
        if len(hosts) < config.min_hosts:
            return (f"{len(hosts)} host{'s' if len(hosts) != 1 else ''} left without {', '.join(sorted(names))},"
                    f" fewer than --min-hosts {config.min_hosts}")
        self.inventory, self.dropped = remaining, (*self.dropped, *sorted(names))
        return None

    @staticmethod
    def shrunk(config: LaunchConfig, inventory: Inventory) -> LaunchConfig:
        """``--np`` capped at the slots left after dropping hosts (fewer ranks, not a plan error)."""
        if config.np is None or config.np <= inventory.total_slots:
            return config
        return replace(config, np=inventory.total_slots)

    def rejoin(self, config: LaunchConfig) -> HostAgents | None:
        """Reconnect the hosts lost in the last attempt; with the preflight, their agents start
        now and run the probe again (the other hosts' agents start with the ranks)."""
        hosts, self.reconnect = self.reconnect, ()
        assert self.transport is not None
        self.addresses = {**self.addresses, **reachable_addresses(hosts, self.transport.reconnect(hosts))}
        if not config.preflight:
            return None
        from dlrun.topo.preflight import PROBE_TIMEOUT, check_preflight, report_from_answer

        agents = HostAgents(self.transport, hosts, pidns=config.pidns, host_timeout=config.ssh.host_timeout)
        try:
            agents.start(probe=_probe_source())
            answers = agents.answers(PROBE_TIMEOUT)
            check_preflight(self.inventory, hosts, [report_from_answer(a.host, a.stdout, a.error)
                                                   for a in answers.values()])
        except BaseException:
            agents.close()
            raise
        return agents

    def render(self, config: LaunchConfig, job_id: str,
               rendezvous: Rendezvous | None = None) -> tuple[Plan, tuple[WorkerCommand, ...]]:
        """Every rank's command from what the session found: addresses, run folders, GPUs,
        interfaces and ports (``place`` and ``--dry-run`` alike)."""
        return render_commands(config, self.inventory, job_id, addresses=self.addresses, cwd_for=self.cwd_for,
                               rendezvous=rendezvous, gpus_for=self.gpus, found_ifaces=self.found_ifaces,
                               ports=self.ports)

    @contextmanager
    def place(self, config: LaunchConfig, job_id: str, view: View, *, detached: bool = False) -> Iterator[Placement]:
        """``detached``: Horovod's rendezvous is the leader keeper's, on host 0: the ranks get its
        address and the port ``0``, which the keepers fill in (``docs/detach.md``)."""
        assert self.transport is not None, "place() runs inside session()"
        agents, self.agents = self.agents, None  # a restart's ranks get fresh agents
        if config.attempt:
            config = self.shrunk(config, self.inventory)
            if self.ports_chosen:  # a fresh run of free ports (the last attempt's may still be held)
                config = replace(config, base_port=local_base_port(self.inventory, config.np))
            if self.reconnect:
                agents = self.rejoin(config)
        with ExitStack() as stack:
            plan = job_plan(config, self.inventory, job_id, self.addresses, self.ports)
            synced: tuple[str, ...] = ()
            if config.checkpoint_dirs and not (detached and config.attempt):  # keepers restart on their own
                synced = self.sync_checkpoints(config, plan.hosts)
                if not config.attempt:  # before anything starts, as the launch's other first lines
                    for line in synced:
                        print(f"dlrun: {line}", file=sys.stderr, flush=True)
            rendezvous: Rendezvous | None = None
            if config.framework == "horovod" and detached:
                from dlrun.remote.rendezvous import rendezvous_key

                rendezvous = (plan.ranks[0].address, 0, rendezvous_key(self.job_secret))
                if ":" in rendezvous[0]:
                    raise RendezvousError(
                        f"host {plan.ranks[0].host.name}'s address {rendezvous[0]} is IPv6; Horovod's rendezvous"
                        " client is IPv4-only", host=plan.ranks[0].host.name,
                        hint="give host 0 an IPv4 address in --hosts")
            elif config.framework == "horovod":
                rendezvous = stack.enter_context(horovod_rendezvous(plan))
            _, commands = self.render(config, job_id, rendezvous)
            yield Placement(self.transport, commands, agents,
                            ends_job=(lambda c: c.spec.task_type == "chief") if config.framework == "tf-ps" else None,
                            notes=synced)

    def sync_checkpoints(self, config: LaunchConfig, hosts: Sequence[Host]) -> tuple[str, ...]:
        """Make each ``--checkpoint-dir`` the same on ``hosts`` (``dlrun.push.checkpoint``); a
        line per folder with what moved and how long it took."""
        from dlrun.push.checkpoint import sync_folders

        assert self.transport is not None
        cwd_for = self.cwd_for or {}

        def cwd_of(host: Host) -> str:
            return cwd_for.get(host.name) or (os.getcwd() if host.is_local else host.workdir or "")

        done = sync_folders(self.transport, hosts, cwd_of, config.checkpoint_dirs,
                            failed_at=self.failed_at if config.attempt else None,
                            addresses=self.addresses if len(hosts) > 1 else None)
        return tuple(d.line() for d in done)


RESTART_PAUSE = 1.0  # seconds between a failed attempt and the next (the hosts' ports settle; keeper's too)


def restart_policy(config: LaunchConfig) -> dict[str, int | list[str] | None]:
    """The ``--dry-run --json`` document's ``restarts`` field (``checkpoint_dirs`` when given)."""
    policy: dict[str, int | list[str] | None] = {"max_restarts": config.max_restarts, "min_hosts": config.min_hosts}
    if config.checkpoint_dirs:
        policy["checkpoint_dirs"] = list(config.checkpoint_dirs)
    return policy


def restart_policy_text(config: LaunchConfig) -> str:
    """The restart policy, as ``--dry-run`` shows it."""
    folders = (f"\ncheckpoints: {', '.join(config.checkpoint_dirs)} made the same on every host before every"
               " attempt (per file, the newest copy written before a failure wins)" if config.checkpoint_dirs else "")
    if not config.max_restarts:
        return "restarts: none (a failed job ends; --max-restarts N runs it again)" + folders
    hosts = ("after a lost host, on the hosts left while at least "
             f"{config.min_hosts} remain (--min-hosts)" if config.min_hosts is not None
             else "always on the same hosts (a lost host is reconnected)")
    return (f"restarts: up to {config.max_restarts} after a failed rank or a lost host (not after Ctrl-C or"
            f" SIGTERM), {hosts}{folders}")


def check_restart_options(config: LaunchConfig) -> None:
    if config.checkpoint_dirs:
        from dlrun.push.checkpoint import check_folder

        for folder in config.checkpoint_dirs:
            check_folder(folder)
    if config.max_restarts < 0:
        raise UsageError(f"--max-restarts must be at least 0, not {config.max_restarts}")
    if config.min_hosts is not None:
        if config.min_hosts < 1:
            raise UsageError(f"--min-hosts must be at least 1, not {config.min_hosts}")
        if not config.max_restarts:
            raise UsageError("--min-hosts goes with --max-restarts N (it says where a restart may run)")


def run_job(config: LaunchConfig, engine: Engine | None = None, *, view: View | None = None) -> RunResult:
    """The pipeline, the same for every engine (default: ``HostsEngine``); how the job ended.

    ``--dry-run`` prints the commands and returns them (exit code 0). Otherwise every attempt is
    placed by the engine and supervised here; a failed one (a rank's failure or a lost host,
    never an interrupt) is run again (a new job id ``<job>-r<k>``, logs in
    ``<job>/attempt-<k>/``) up to ``max_restarts`` times; the hosts engine reconnects a lost host
    or, with ``min_hosts``, leaves it out (``HostsEngine.regroup``). ``view`` replaces the
    terminal's (tests, API).
    """
    engine = engine or HostsEngine()
    check_script(config)
    check_restart_options(config)
    config = engine.prepare(resolve_framework(config))
    if isinstance(engine, HostsEngine) and config.min_hosts is not None and config.min_hosts > len(engine.used_hosts):
        raise UsageError(f"--min-hosts {config.min_hosts}: the job has {len(engine.used_hosts)} hosts")
    if config.detach:
        from dlrun.run.detach import check_detach

        check_detach(config, isinstance(engine, HostsEngine))
    job_id = new_job_id()
    # with a preflight, the hosts' own Keras decides (HostsEngine.session warns then)
    probed = isinstance(engine, HostsEngine) and config.preflight and (
        not config.dry_run or not engine.inventory.all_local)  # a dry run on hosts runs the session too
    warning = None if probed else keras_warning(config, engine.inventory)
    if config.dry_run:
        hosts_engine = isinstance(engine, HostsEngine)
        if hosts_engine:  # the dry run's one usage check before it reaches the hosts (it writes nothing)
            code_dir_to_push(config, strict=not engine.inventory.all_local)
            say_framework(config)
        commands = engine.dry_run(config, job_id)  # Spark's refuses
        if not hosts_engine:
            say_framework(config)
        warn_replaced_env(config, commands)
        if config.json_output:
            document = plan_to_json(commands)
            document["restarts"] = restart_policy(config)
            if isinstance(engine, HostsEngine) and engine.dry_run_pushes:  # Spark ships a zip, no push
                from dlrun.push.view import summary_json

                document["push"] = summary_json(engine.dry_run_pushes)
            print(json.dumps(document, indent=2))
        else:
            if warning:
                print(f"dlrun: warning: {warning}", file=sys.stderr)
            print(dry_run_text(commands))
            if isinstance(engine, HostsEngine) and engine.ports is not None and config.base_port is None:
                print("ports: free on each host now; a launch asks again and may get others (--base-port P fixes them)")
            print(restart_policy_text(config))
        return RunResult(ranks=(), exit_code=0, commands=commands, job_id=job_id, attempts=0)
    check_local_inputs(config, engine.inventory)
    say_framework(config)
    if warning:
        print(f"dlrun: warning: {warning}", file=sys.stderr)
    shown = view or make_view(config.ranks_shown, force_plain=config.plain)
    logs = Path(config.log_dir or DEFAULT_LOG_DIR) / job_id
    history: list[Attempt] = []
    with engine.session(config, job_id) as config:
        if config.detach and isinstance(engine, HostsEngine):
            from dlrun.run.detach import start_detached

            return start_detached(config, engine, job_id, shown)
        warnings = (warning,) if warning else getattr(engine, "warnings", ())
        logs.mkdir(parents=True, exist_ok=True)
        logs.chmod(0o700)  # private, as the hosts' job folders are: the ranks' lines may hold secrets
        attempt = 0
        dropped: tuple[str, ...] = ()
        while True:
            attempt_id = job_id if attempt == 0 else f"{job_id}-r{attempt}"
            result = _attempt(replace(config, attempt=attempt, run_id=job_id), engine, attempt_id, shown,
                              logs / f"attempt-{attempt}" if config.max_restarts else logs, warnings=warnings)
            history.append(Attempt(attempt, attempt_id, tuple(dict.fromkeys(r.host for r in result.ranks)),
                                   result.exit_code, result.root_cause, result.interrupted_by, dropped))
            final = replace(result, job_id=job_id, attempts=attempt + 1, history=tuple(history))
            last = result.ok or result.interrupted_by is not None or attempt == config.max_restarts
            why_not = None if last or not isinstance(engine, HostsEngine) else engine.regroup(config, result)
            if why_not is not None:
                shown.notice(f"not restarting: {why_not}")
            shown.finish(final)
            if last or why_not is not None:
                return final
            attempt += 1
            newly = tuple(engine.dropped[len(dropped):]) if isinstance(engine, HostsEngine) else ()
            dropped = (*dropped, *newly)
            where = f" without {', '.join(newly)} (lost)" if newly else ""
            shown.notice(f"attempt {attempt} failed (exit code {result.exit_code}): relaunching {engine.restart_unit}"
                         f"{where} ({attempt} of {config.max_restarts} restarts)")
            signum = _pause(RESTART_PAUSE)
            if signum is not None:
                shown.notice(f"signal {signum} before the restart: not restarting")
                return replace(final, exit_code=128 + signum, interrupted_by=signum)


def _pause(seconds: float) -> int | None:
    """Wait between attempts; an interrupt (SIGINT, SIGTERM, SIGHUP) ends the wait and is returned."""
    if threading.current_thread() is not threading.main_thread():
        time.sleep(seconds)
        return None
    caught: list[int] = []
    woken = threading.Event()

    def handler(signum: int, _frame: FrameType | None) -> None:
        caught.append(signum)
        woken.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        woken.wait(seconds)
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
    return caught[0] if caught else None


def _attempt(config: LaunchConfig, engine: Engine, job_id: str, view: View, log_dir: Path, *,
             warnings: tuple[str, ...] = ()) -> RunResult:
    """One attempt: placed by the engine and supervised; the caller shows its summary once the
    engine cleaned up."""
    with engine.place(config, job_id, view) as placement:
        if config.attempt == 0:  # once, not again for each restart (--min-hosts may leave fewer ranks)
            check_ranks_shown(config, len(placement.commands))
            warn_replaced_env(config, placement.commands)
        else:
            hosts = len({c.host_name for c in placement.commands})
            notes = "".join(f"; {note}" for note in placement.notes)
            view.notice(f"attempt {config.attempt + 1} of {config.max_restarts + 1} (restart {config.attempt},"
                        f" job {job_id}): {len(placement.commands)} ranks on {hosts} host{'s' if hosts != 1 else ''}"
                        f"{notes}")
        supervisor = Supervisor(
            placement.transport,
            placement.commands,
            HeldView(view),
            log_dir=log_dir,
            grace=config.grace,
            host_timeout=config.ssh.host_timeout,
            pidns=config.pidns,
            ends_job=placement.ends_job,
            agents=placement.agents,
            gpu_every=config.gpu_every,
            gpu_idle_after=config.gpu_idle_after,
            hang_timeout=config.hang_timeout,
            control_id=config.run_id or job_id,
        )
        with forward_signals(supervisor), placement.watch():
            result = supervisor.run()
        placement.done(result)
    result = replace(result, warnings=warnings)  # repeated in a failure's root cause
    return result


def launch(config: LaunchConfig, engine: Engine | None = None) -> int:
    """Run the whole pipeline; return the exit code for the shell."""
    return run_job(config, engine).exit_code
