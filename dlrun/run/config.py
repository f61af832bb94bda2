"""``LaunchConfig``: what the user asked ``dlrun launch`` for, and the questions asked of it
(which file holds the job's code, which framework its imports choose: ``resolve_framework``).
Built by ``dlrun.api`` and nowhere else; the pipeline (``dlrun.run.pipeline``) runs it.
"""

from __future__ import annotations

import os
import secrets
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from dlrun.command import SOURCE_SUFFIXES, entry_point, module_paths
from dlrun.inventory import Host
from dlrun.plan import AUTO, TF_AND_TORCH, Detected, detect_framework, is_tf
from dlrun.render import printable
from dlrun.transport.factory import SSHOptions

DEFAULT_LOG_DIR = "dlrun-logs"  # dlrun.push.tree.DEFAULT_LOG_DIR (importing it would load the push code)


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


def tf_job(config: LaunchConfig) -> bool:
    """Does the job run TensorFlow: ``tf``/``tf-ps``, or both contracts for a script that imports TF?"""
    if config.framework == TF_AND_TORCH:
        return config.detected is not None and "tf" in config.detected.imports
    return is_tf(config.framework)
