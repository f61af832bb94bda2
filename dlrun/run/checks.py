"""The launch's checks before anything starts: the script and the local inputs, the restart
options, the ranks shown, the free ports, and the warnings (``--env`` replaced, Keras 3
under TensorFlow). Each refuses with a ``UsageError`` (or a ``PreflightError``) or warns.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from dlrun.command import interpreter_for
from dlrun.errors import UsageError
from dlrun.inventory import Inventory
from dlrun.plan import Plan, listening_ranks
from dlrun.render import WorkerCommand, printable
from dlrun.run.config import DEFAULT_LOG_DIR, LaunchConfig, source_file, tf_job
from dlrun.run.pushstep import code_dir_to_push

if TYPE_CHECKING:
    from dlrun.topo.records import HostReport


def check_ranks_shown(config: LaunchConfig, world_size: int) -> None:
    """``--ranks`` names ranks of the job: nothing would be shown for others (a typo, not a wish)."""
    unknown = sorted(set(config.ranks_shown or ()) - set(range(world_size)))
    if unknown:
        raise UsageError(f"--ranks {','.join(map(str, unknown))}: the job has ranks 0 to {world_size - 1}")


def warn_replaced_env(config: LaunchConfig, commands: Sequence[WorkerCommand]) -> None:
    """Say which ``--env`` values the ranks do not get (dlrun sets them: TF_CONFIG, RANK …)."""
    for name in sorted(n for n in config.env if any(c.env.get(n) != config.env[n] for c in commands)):
        print(f"dlrun: warning: --env {name} is set by dlrun for each rank; yours is replaced", file=sys.stderr)


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


def check_ports_free(plan: Plan, free: Mapping[str, Sequence[int]]) -> None:
    """``--base-port``: every port a rank will listen on is free on its host, or nothing starts."""
    from dlrun.errors import PreflightError

    busy = [(spec.host.name, spec.port, spec.rank) for spec in listening_ranks(plan.framework, plan.ranks)
            if spec.host.name in free and spec.port not in free[spec.host.name]]
    if busy:
        lines = "\n".join(f"  {host}: port {port} (rank {rank}) is in use" for host, port, rank in busy)
        raise PreflightError(f"ports the ranks would listen on are taken; nothing was started:\n{lines}",
                             hint="pass another --base-port, or none: dlrun then picks ports free on every host")


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
