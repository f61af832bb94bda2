"""What a host's login shell sees of dlrun: one fixed command line; the program's argv on stdin.

OpenSSH hands every command to the login user's shell (sh, bash, zsh, fish, csh, tcsh), after
that shell has read the user's startup files. So dlrun's command line is always
``BOOT_COMMAND``, a few words that every one of those shells parses alike, and the argv travels
on stdin as a POSIX ``sh`` script (``shlex.join``) that prints a random per-connection marker
on stderr and stdout and then execs the argv. The client discards whatever came before the
markers (a welcome text, ``conda init`` output) and names it once per host
(``noise_note``); if the marker never comes, the error names what the shell printed instead
(``not_started``). Pure functions; the SSH transport does the waiting. Why the client sends
nothing more until the marker arrives: docs/architecture.md, "The login shell".
"""

from __future__ import annotations

import secrets
import shlex
from collections.abc import Sequence

from dlrun.errors import LoginShellError

#: The whole remote command line: the same words parse in sh/dash, bash, zsh, fish, csh and tcsh.
BOOT_COMMAND = "exec /bin/sh -s"
MARKER_PREFIX = "dlrun-start-"
#: Where a startup file would print or stop, for the hint.
STARTUP_FILES = "~/.bashrc, ~/.zshenv, ~/.cshrc or ~/.config/fish/config.fish"
#: More output than this before the marker is not a startup file's greeting.
MAX_NOISE = 1 << 20


def new_token() -> str:
    """A fresh random token: each connection's marker differs, so no output can guess it."""
    return secrets.token_hex(12)


def marker(token: str) -> bytes:
    """The line the script prints first, on stdout and on stderr."""
    return f"{MARKER_PREFIX}{token}\n".encode()


def boot_script(argv: Sequence[str], token: str) -> bytes:
    """The script ``/bin/sh -s`` reads: the marker, then ``exec argv``, as one complete command.

    One complete command, so sh has parsed the ``exec`` before it prints the marker and reads no
    further: bytes sent after the marker reach the program, even from an ``sh`` that reads its
    script in blocks (dash). The marker is printed in two pieces, so the script's own text never
    holds it whole (a shell that echoes its input cannot fake it).

    An argv ``sh -c SCRIPT NAME ARGS...`` (the agent's PID-namespace wrapper) is run by this shell
    itself, one exec fewer on every host: ``set -- ARGS``, then SCRIPT in braces (still one
    complete command, parsed whole before the marker), then ``exit`` with its status where SCRIPT
    does not exec. Only ``$0`` differs (``sh``, not NAME).
    """
    if not argv:
        raise ValueError("an empty argv")
    say = shlex.join(["printf", "%s%s\\n", MARKER_PREFIX, token])
    if len(argv) >= 4 and argv[0] == "sh" and argv[1] == "-c":
        script = argv[2] if argv[2].endswith("\n") else argv[2] + "\n"
        return f"{say} >&2 && {say} && set -- {shlex.join(argv[4:])} && {{\n{script}}}; exit\n".encode()
    return f"{say} >&2 && {say} && exec {shlex.join(argv)}\n".encode()


def split_at_marker(data: bytes, mark: bytes) -> tuple[bytes, bytes] | None:
    """(what came before the marker, what came after it), or None while it has not come."""
    before, found, after = data.partition(mark)
    return (before, after) if found else None


def noise_lines(*streams: bytes) -> list[str]:
    """The lines of what the shell printed (stdout's, then stderr's), without trailing blank ones."""
    lines: list[str] = []
    for data in streams:
        text = data.decode("utf-8", errors="replace").splitlines()
        while text and not text[-1].strip():
            text.pop()
        lines += text
    return lines


def _shown(line: str, width: int = 80) -> str:
    """One line as the user sees it in a message: quoted, control characters escaped, cut."""
    line = line.strip()
    return repr(line if len(line) <= width else line[: width - 1] + "…")


def _count(lines: Sequence[str]) -> str:
    return f"{len(lines)} line" + ("" if len(lines) == 1 else "s")


def noise_note(host: str, stdout: bytes, stderr: bytes) -> str | None:
    """The note for a host whose login shell printed before dlrun's program started (None: it
    printed nothing)."""
    lines = noise_lines(stdout, stderr)
    if not lines:
        return None
    first = next((line for line in lines if line.strip()), lines[0])
    more = " …" if len(lines) > 1 else ""
    return (f"{host}'s login shell printed {_count(lines)} before dlrun's program started: {_shown(first)}{more}"
            " (ignored)")


def not_started(host: str, stdout: bytes, stderr: bytes, *, exit_code: int | None, timeout: float | None,
                overflow: bool = False) -> LoginShellError:
    """The error for a program that never started: the shell ended (``exit_code``), waited past
    ``timeout`` seconds, or printed more than ``MAX_NOISE`` (``overflow``); with what it printed."""
    lines = noise_lines(stdout, stderr)
    if overflow:
        what = f"the login shell printed more than {MAX_NOISE >> 20} MiB before starting dlrun's program"
    elif timeout is not None:
        what = f"the login shell did not start dlrun's program within {timeout:g} s (--connect-timeout)"
    else:
        code = "" if exit_code is None else f" (exit {exit_code})"
        what = f"the login shell ended{code} before starting dlrun's program"
    if lines:
        shown = " / ".join(_shown(line) for line in lines[-5:])
        what += f"; it printed {_count(lines)}" + (", the last: " if len(lines) > 5 else ": ") + shown
    else:
        what += "; it printed nothing"
    return LoginShellError(
        what, host=host,
        hint=f"the login user's startup files ({STARTUP_FILES}) must let a non-interactive command run:"
        " no exit, exec or waiting for input outside interactive shells",
    )
