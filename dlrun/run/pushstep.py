"""The launch's push step: the folder pushed as code (``code_dir_to_push``), the code and
data push to the hosts (``push_for_launch``, the ``--dry-run`` survey), the hosts whose
survey found the code in place or shared, and the setup command; ``Pushed`` says what it
changed (each host's env and run folder, the script as the ranks name it).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dlrun.command import runs_directly
from dlrun.errors import UsageError
from dlrun.inventory import Host, Inventory
from dlrun.run.agents import AgentAnswer
from dlrun.run.config import DEFAULT_LOG_DIR, LaunchConfig, names_project_files, script_given_alone
from dlrun.transport.base import Transport
from dlrun.transport.factory import make_transport

if TYPE_CHECKING:
    from dlrun.push.session import HostPushSummary, Manifest, PushTarget
    from dlrun.push.tree import PushLimit


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
                    settled: Mapping[str, HostPushSummary] | None = None, *, code_dir: Path | None,
                    dry_run: bool = False) -> Pushed:
    """Push each host's data shard (``--data``) and the script's directory (remote hosts).

    With code pushed, every rank runs in ``<workdir>/<script dir name>`` on its host and the
    script is named relative to it; local hosts run in the script's directory for the same
    relative name. ``settled``: hosts whose agent's survey found the code already in place
    (``dlrun.push.session.settled_push``); no push session is opened there. ``dry_run``: each
    host is surveyed and what would be sent is shown; nothing is written. ``code_dir``: the
    folder pushed as code (``code_dir_to_push``, computed once by the caller).
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


def dry_run_push(config: LaunchConfig, inventory: Inventory, hosts: Sequence[Host], *,
                 code_dir: Path | None) -> Pushed:
    """``--dry-run``: survey each host and show what the push would send and delete (nothing is
    written); where the hosts cannot be reached, what ``planned_push`` says, with a warning."""
    from dlrun.errors import TransportError

    if not config.data and (code_dir is None or all(h.is_local for h in hosts)):
        return planned_push(config, hosts, code_dir=code_dir)
    transport = make_transport(inventory, config.ssh)
    try:
        transport.connect(hosts)
        return push_for_launch(config, transport, hosts, code_dir=code_dir, dry_run=True)
    except TransportError as exc:
        print(f"dlrun: warning: cannot survey the hosts for the push ({exc}); showing the plan only",
              file=sys.stderr)
        return planned_push(config, hosts, code_dir=code_dir)
    finally:
        transport.close()


def run_setup_step(config: LaunchConfig, transport: Transport, hosts: Sequence[Host], pushed: Pushed, job_id: str,
                   manifest: Manifest | None, *, code_dir: Path | None) -> None:
    """The setup command (``--setup`` or the inventory's ``setup``) on every host, in its run
    folder, after the push and before any rank (``dlrun.push.setup``); a failure raises."""
    from dlrun.push.setup import run_setup, setup_commands, setup_key

    commands = setup_commands(hosts, config.setup)
    if not commands:
        return
    if manifest is None and code_dir is not None:
        from dlrun.push.session import scan_code

        manifest = scan_code(code_dir, Path(config.data) if config.data else None,  # only for the key:
                             log_dir=config.log_dir or DEFAULT_LOG_DIR, limit=None)  # nothing is sent
    folders = {h.name: (pushed.cwd_for or {}).get(h.name) or (os.getcwd() if h.is_local else h.workdir or "")
               for h in hosts}
    keys = {name: setup_key(command, manifest) for name, command in commands.items()}
    run_setup(transport, hosts, commands, folders, keys, Path(config.log_dir or DEFAULT_LOG_DIR) / job_id,
              always=config.setup_always)


def planned_push(config: LaunchConfig, hosts: Sequence[Host], *, code_dir: Path | None) -> Pushed:
    """What ``push_for_launch`` would change, without pushing (``--dry-run``): the shard env
    and, for a pushed script, each host's run directory as written (``~`` as on the host)."""
    from dlrun.push.session import code_dir_on, shard_env

    env_for = {h.name: shard_env(i, len(hosts), h) for i, h in enumerate(hosts)} if config.data else {}
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
