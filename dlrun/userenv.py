"""The environment the user adds to every rank: ``-e NAME=VALUE``, ``-e NAME`` (this process's
own value, as ``docker -e NAME``) and ``--env-file FILE`` (``NAME=VALUE`` lines, in a file only
its owner may read), checked as the inventory's ``env`` tables are. ``-e NAME`` and the file keep
secrets off dlrun's command line, which every local user can read in ``/proc/<pid>/cmdline``.
Messages never echo a value, nor a bad name (it may be a value with a typo).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from dlrun.errors import UsageError
from dlrun.inventory import ENV_NAME
from dlrun.render import printable


def check_name(name: str, where: str) -> None:
    """A variable name as the inventory's ``env`` tables take them (``[A-Za-z_][A-Za-z0-9_]*``).
    A bad one is not echoed: ``API_KEY:s3cret`` is a secret with a typo, not a name."""
    if not ENV_NAME.fullmatch(name):
        raise UsageError(f"{where}: expected NAME=VALUE or NAME, with a variable name"
                         f" ({'none given' if not name else 'not shown, as it may hold a value'})",
                         hint="names are letters, digits and _, not starting with a digit")


def parse_env_args(pairs: Iterable[str], environ: Mapping[str, str] | None = None,
                   option: str = "--env") -> dict[str, str]:
    """``-e`` arguments: ``NAME=VALUE``, or ``NAME`` for ``environ``'s value (default: this
    process's environment; a name it lacks is an error, not an empty value)."""
    environ = os.environ if environ is None else environ
    env: dict[str, str] = {}
    for number, pair in enumerate(pairs, start=1):
        name, sep, value = pair.partition("=")
        check_name(name, f"{option} (argument {number})" if option == "--env" else option)
        if not sep:
            if name not in environ:
                raise UsageError(f"{option} {name}: {name} is not set in dlrun's environment",
                                 hint=f"export {name} first, or pass {option} {name}=VALUE")
            value = environ[name]
        if "\0" in value:
            raise UsageError(f"{option}: the value of {name} contains a NUL byte")
        env[name] = value
    return env


def read_env_file(path: str | Path, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``--env-file``: one ``NAME=VALUE`` per line, taken as is (no quotes removed, as Docker's
    ``--env-file``); blank lines and ``#`` comments are skipped; a bare ``NAME`` takes this
    process's value. The file must be a regular file that only its owner (this user) can read
    or write, as OpenSSH asks of a private key."""
    path = Path(path)
    where = f"--env-file {printable(str(path))}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise UsageError(f"{where}: {exc.strerror or exc}",
                         hint="a symlink is not followed: name the file itself") from exc
    with os.fdopen(fd, "rb") as fh:
        info = os.fstat(fh.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise UsageError(f"{where}: not a regular file")
        if info.st_uid != os.geteuid():
            raise UsageError(f"{where}: owned by uid {info.st_uid}, not by you (uid {os.geteuid()})",
                             hint="an env file holds secrets: keep your own copy, mode 600")
        if info.st_mode & 0o077:
            raise UsageError(f"{where}: mode {stat.S_IMODE(info.st_mode):04o} lets other users read or change it",
                             hint=f"chmod 600 {printable(str(path))}")
        data = fh.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{where}: not UTF-8 text (byte {exc.start})") from exc
    pairs = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name = line.partition("=")[0]
        try:
            check_name(name, f"{where}:{number}")
        except UsageError as exc:
            raise UsageError(exc.message, hint="lines are NAME=VALUE (or NAME for this process's value)") from None
        pairs.append(line)
    return parse_env_args(pairs, environ, option=f"{where}")


def rank_env(env: Mapping[str, str] | None, env_files: Sequence[str | Path] = ()) -> dict[str, str]:
    """The env every rank gets from the user: each file in order, then ``env`` (``-e``) over them."""
    merged: dict[str, str] = {}
    for path in env_files:
        merged.update(read_env_file(path))
    for name in env or {}:
        check_name(name, "--env")
    merged.update(env or {})
    return merged
