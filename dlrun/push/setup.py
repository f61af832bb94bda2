"""The setup step of a launch: one command (``setup`` in the inventory, or ``--setup``) run on
every host in the pushed code folder after the push and before any rank, on all hosts at once.

It runs again on a host only when the command or the pushed files changed since its last
success there: a stamp next to the code folder (``<workdir>/.dlrun-cache/<project>.setup``)
holds the key of that success (``setup_key``). The command runs as ``sh -c CMD`` inside a fixed
``sh`` wrapper that gets every value as an argument: nothing is pasted into a shell string.
Its output goes to the screen with the host's prefix and to ``<log dir>/setup-<host>.log``.
A failure on any host raises ``SetupError`` naming the host, the exit code and the last lines.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from dlrun.errors import DlrunError, TransportError
from dlrun.inventory import Host
from dlrun.logdir import private_folder
from dlrun.push.shard import host_dir_name
from dlrun.push.tree import Manifest
from dlrun.transport.base import Channel, Transport

#: ``$1`` folder ("" or ``~``-relative allowed), ``$2`` stamp file ("": next to the folder),
#: ``$3`` key, ``$4`` "always" or "changed", ``$5`` the command. First line: a marker. Where
#: ``flock`` exists, one setup at a time per stamp (two jobs, or hosts sharing an NFS folder): the
#: next finds the stamp the first wrote and runs nothing (no lock, as on an NFS without lockd:
#: it runs anyway, and says nothing before its marker line).
WRAPPER = r"""exec 2>&1
d=$1
case $d in "~") d=$HOME ;; "~/"*) d=$HOME/${d#"~/"} ;; esac
if [ -n "$d" ]; then cd "$d" || { echo "dlrun-setup: cannot enter $d"; exit 126; }; fi
stamp=$2
[ -n "$stamp" ] || stamp=$(dirname "$PWD")/.dlrun-cache/$(basename "$PWD").setup
(umask 077 && mkdir -p "$(dirname "$stamp")") 2>/dev/null
if command -v flock >/dev/null 2>&1 && (umask 077 && : >>"$stamp.lock") 2>/dev/null; then
  exec 9>>"$stamp.lock"
  flock 9 2>/dev/null
fi
if [ "$4" != always ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$3" ]; then
  echo "dlrun-setup: unchanged"
  exit 0
fi
echo "dlrun-setup: running in $PWD"
sh -c "$5" 9>&-
code=$?
if [ "$code" -eq 0 ]; then
  (umask 077 && printf '%s\n' "$3" > "$stamp.$$" && mv -f "$stamp.$$" "$stamp")
fi
exit "$code"
"""
MARKER = "dlrun-setup: "
TAIL_LINES = 12  # of a failed setup's output, in the error

Output = Callable[[str, str], None]  # (host, line)


class SetupError(DlrunError):
    """The setup command failed on at least one host: no rank was started."""

    exit_code = 1


@dataclass(frozen=True)
class SetupResult:
    """One host's setup: whether it ran (False: unchanged since its last success), and how."""

    host: str
    ran: bool
    exit_code: int
    tail: tuple[str, ...] = ()
    log: Path | None = None


def setup_commands(hosts: Sequence[Host], override: str | None) -> dict[str, str]:
    """host name → its setup command: ``--setup`` for every host, else the inventory's ``setup``."""
    out = {}
    for host in hosts:
        command = override if override is not None else host.setup
        if command and command.strip():
            out[host.name] = command
    return out


def setup_key(command: str, manifest: Manifest | None) -> str:
    """What a success is stamped with: the command and every pushed file (path, mode, sha256)."""
    digest = hashlib.sha256(json.dumps(command).encode())
    for entry in manifest.entries if manifest is not None else ():
        digest.update(json.dumps([entry.path, entry.mode, entry.sha256, entry.link]).encode())
    return digest.hexdigest()


def setup_argv(host: Host, command: str, folder: str, key: str, *, always: bool, stamp: str = "") -> list[str]:
    """The argv that runs ``command`` on ``host`` in ``folder`` (see ``WRAPPER``)."""
    env = [f"{name}={value}" for name, value in host.env.items()]
    return [*(["env", *env] if env else []), "sh", "-c", WRAPPER, "dlrun-setup", folder, stamp, key,
            "always" if always else "changed", command]


def local_stamp(folder: str) -> str:
    """Where a local host's stamp goes: dlrun's cache, not beside the user's project."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    name = hashlib.sha256(folder.encode("utf-8", "surrogateescape")).hexdigest()[:24]
    return os.path.join(base, "dlrun", "setup", f"{name}.stamp")


_PRINTING = threading.Lock()


def print_line(host: str, line: str) -> None:
    """The default output: ``[setup host] line`` on stdout, as ranks' lines are prefixed."""
    with _PRINTING:
        print(f"[setup {host}] {line}", file=sys.stdout, flush=True)


def run_setup(
    transport: Transport,
    hosts: Sequence[Host],
    commands: Mapping[str, str],
    folders: Mapping[str, str],
    keys: Mapping[str, str],
    log_dir: Path,
    *,
    always: bool = False,
    output: Output = print_line,
) -> tuple[SetupResult, ...]:
    """Run each host's setup command in its folder, all hosts in parallel; raise ``SetupError``
    naming every host where it failed (exit code and last lines)."""
    chosen = [h for h in hosts if h.name in commands]
    if not chosen:
        return ()
    private_folder(log_dir)  # the job's log folder is private, as the hosts' job folders are

    channels: list[Channel] = []

    def one(host: Host) -> SetupResult:
        folder = folders.get(host.name) or ""
        stamp = local_stamp(folder) if host.is_local else ""
        argv = setup_argv(host, commands[host.name], folder, keys.get(host.name, ""), always=always, stamp=stamp)
        log = log_dir / f"setup-{host_dir_name(host.name)}.log"
        channel = transport.open(host, argv)
        channels.append(channel)
        return _run_one(channel, host, log, output)

    pool = ThreadPoolExecutor(max_workers=min(32, len(chosen)), thread_name_prefix="dlrun-setup")
    futures = [pool.submit(one, host) for host in chosen]
    results: list[SetupResult] = []
    errors: list[BaseException] = []
    try:
        for future in futures:
            try:
                results.append(future.result())
            except TransportError as exc:
                errors.append(exc)
    except BaseException:  # Ctrl-C: drop every host's setup (its command loses its channel)
        for channel in list(channels):
            channel.close()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    if errors:
        raise errors[0]
    failed = [r for r in results if r.exit_code != 0]
    if failed:
        blocks = []
        for r in failed:
            tail = "\n".join(f"    {line}" for line in r.tail) or "    (no output)"
            blocks.append(f"{r.host}: setup `{commands[r.host]}` exited {r.exit_code}; last lines:\n{tail}")
        raise SetupError(
            f"setup failed on {len(failed)} of {len(results)} hosts; no rank was started\n" + "\n".join(blocks),
            host=failed[0].host if len(failed) == 1 else None,
            hint=f"the whole output is in {failed[0].log}; fix the command (inventory 'setup' or --setup) and launch"
            " again",
        )
    return tuple(results)


def _run_one(channel: Channel, host: Host, log: Path, output: Output) -> SetupResult:
    ran = True
    tail: list[str] = []
    pending = b""
    try:
        channel.close_stdin()
        with open(log, "w", encoding="utf-8") as fh:
            first = True

            def emit(raw: bytes) -> None:
                nonlocal first, ran
                line = raw.decode("utf-8", "replace").rstrip("\r")
                if first and line.startswith(MARKER):
                    first = False
                    ran = line != MARKER + "unchanged"
                    text = line[len(MARKER):] if ran else "unchanged since its last success here: skipped"
                    fh.write(f"# {text}\n")
                    output(host.name, text)
                    return
                first = False
                fh.write(line + "\n")
                tail.append(line)
                del tail[:-TAIL_LINES]
                output(host.name, line)

            while True:
                data = channel.recv(65536)
                if not data:
                    break
                pending += data
                *lines, pending = pending.split(b"\n")
                for raw in lines:
                    emit(raw)
            if pending:
                emit(pending)
            code = channel.wait(30)
            fh.write(f"# exit code {code}\n")
    finally:
        channel.close()
    if code is None:
        code = 255
    return SetupResult(host=host.name, ran=ran, exit_code=code, tail=tuple(tail), log=log)
