"""Every exception dlrun raises on purpose, and the exit code each one maps to.

Foreign exceptions (paramiko, OSError from a socket, tomllib.TOMLDecodeError, subprocess
errors) are translated into these at exactly one boundary, with ``raise X(...) from exc``.
An error names what the user needs to fix it: the file, line and key; the host; the rank
and the command.

The tree::

    DlrunError                      exit 2 unless stated
    ├── UsageError                  bad option combination or argument
    ├── InventoryError              hosts.toml / hostfile / inline list is invalid (file, line, key)
    ├── PlanError                   the inventory cannot hold the job (--np too large, roles)
    ├── TransportError              exit 255 (as ssh does)
    │   ├── HostUnreachable         DNS failure, refused, timeout, dropped connection
    │   ├── AuthenticationFailed    no key was accepted
    │   ├── HostKeyError            unknown (not opted in) or changed host key
    │   ├── LoginShellError         the login shell ended or waited instead of starting dlrun's program
    │   └── RemoteCommandError      a control command on a host failed (probe, push helper)
    ├── SyncError                   push failed (space, permission, verification) on a host
    ├── PreflightError              exit 1: error findings stop the launch
    ├── RendezvousError             the Horovod key-value server could not start
    ├── JobStartError               exit 1: a detached job's keepers or ranks did not start (the job is stopped)
    └── BackendError                a backend (Spark) cannot run the job (missing pyspark, slots)
        └── BackendUnavailable      exit 255: its cluster failed us (Spark did not start, tasks never reported)

A job whose ranks fail is not an exception: the supervisor returns a ``RunResult`` whose
root cause names rank, host, exit code and last lines, and dlrun exits with that rank's code.
"""

from __future__ import annotations


class DlrunError(Exception):
    """Base of every error dlrun reports to the user without a traceback."""

    exit_code: int = 2

    def __init__(self, message: str, *, host: str | None = None, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.host = host
        self.hint = hint

    def __str__(self) -> str:
        text = f"{self.host}: {self.message}" if self.host else self.message
        if self.hint:
            text += f"\n  hint: {self.hint}"
        return text


class UsageError(DlrunError):
    """An option or argument the user gave cannot work."""


class InventoryError(DlrunError):
    """The hosts inventory is invalid; names the source, the line (where known) and the key."""

    def __init__(
        self,
        message: str,
        *,
        source: str,
        line: int | None = None,
        key: str | None = None,
        hint: str | None = None,
    ) -> None:
        where = source if line is None else f"{source}:{line}"
        if key is not None:
            where += f": key {key!r}"
        super().__init__(f"{where}: {message}", hint=hint)
        self.source = source
        self.line = line
        self.key = key


class PlanError(DlrunError):
    """The job does not fit the inventory (too many ranks, impossible roles)."""


class TransportError(DlrunError):
    """Reaching or talking to a host failed."""

    exit_code = 255


class HostUnreachable(TransportError):
    """The host could not be connected to, or the connection dropped."""


class AuthenticationFailed(TransportError):
    """The host refused every key we offered."""


class HostKeyError(TransportError):
    """The host's key is unknown (and the user did not opt in) or differs from known_hosts."""


class LoginShellError(TransportError):
    """The login user's shell never started dlrun's program: a startup file exited, exec'd or
    waited; the message names what the shell printed instead."""


class RemoteCommandError(TransportError):
    """A control command on a host (probe, manifest, unpack) failed."""

    def __init__(
        self,
        message: str,
        *,
        host: str,
        command: str,
        exit_code: int,
        stderr: str = "",
        hint: str | None = None,
    ) -> None:
        detail = f"{message} (command {command!r} exited {exit_code})"
        tail = stderr.strip().splitlines()[-5:]
        if tail:
            detail += "\n    " + "\n    ".join(tail)
        super().__init__(detail, host=host, hint=hint)
        self.command = command
        self.remote_exit_code = exit_code
        self.stderr = stderr


class SyncError(DlrunError):
    """A push could not be completed on a host; nothing is left under a final name."""


class PreflightError(DlrunError):
    """Error findings of the topology probe stop the launch (override: --no-preflight)."""

    exit_code = 1


class RendezvousError(DlrunError):
    """The Horovod rendezvous server could not be started."""


class BackendError(DlrunError):
    """A backend (Spark) cannot run this job: missing dependency, too few slots, bad config."""


class BackendUnavailable(BackendError):
    """The backend's cluster failed before the job could start (Spark would not start, its stage
    failed or its tasks never reported): like an unreachable host, not a usage error."""

    exit_code = 255


class JobStartError(DlrunError):
    """A detached job could not start: a keeper failed to start, or its ranks did not all start
    in time. The keepers that did start stop the job; nothing is left running."""

    exit_code = 1
