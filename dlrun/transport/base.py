"""The transport seam: how dlrun reaches a host and runs a command there.

A ``Transport`` connects to hosts and opens ``Channel``s — one bidirectional byte stream per
command (stdin in, stdout out, stderr kept for errors). The supervisor, the probe and the push
speak only this interface, so a host is a host whether it is this machine (``LocalTransport``:
subprocesses), an SSH server (``dlrun.transport.ssh.SSHTransport``: one paramiko connection per host)
or a test double (``dlrun.testing.FakeTransport``). ``HostRouter`` sends each host to the
transport that fits it: local hosts never need an sshd.
"""

from __future__ import annotations

import shlex
import sys
import threading
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dlrun.errors import HostUnreachable, RemoteCommandError
from dlrun.inventory import Host


@dataclass(frozen=True)
class CommandResult:
    """A finished control command (probe, manifest, unpack): exit code and output."""

    host: str
    argv: tuple[str, ...]
    exit_code: int
    stdout: bytes
    stderr: bytes

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def check(self, what: str) -> CommandResult:
        if not self.ok:
            raise RemoteCommandError(
                what,
                host=self.host,
                command=shlex.join(self.argv)[:200],
                exit_code=self.exit_code,
                stderr=self.stderr.decode(errors="replace"),
            )
        return self


class Channel(ABC):
    """A running command on a host: write to its stdin, read its stdout."""

    host: str

    @abstractmethod
    def send(self, data: bytes | memoryview) -> None:
        """Write all of ``data`` to the command's stdin (raises HostUnreachable if gone); a
        buffer is copied or written before this returns, so the caller may reuse it."""

    @abstractmethod
    def recv(self, max_bytes: int = 65536) -> bytes:
        """Block until stdout has data; ``b""`` at EOF."""

    @abstractmethod
    def close_stdin(self) -> None:
        """Send EOF: the agent's watchdog treats it as "the controller is gone"."""

    @abstractmethod
    def wait(self, timeout: float | None = None) -> int | None:
        """The command's exit status once it has ended (None if still running at timeout)."""

    @abstractmethod
    def stderr_text(self) -> str:
        """Whatever the command wrote to stderr so far (for error messages)."""

    @abstractmethod
    def close(self) -> None:
        """Drop the channel: the command sees EOF on stdin (and loses its stdout)."""

    def lost_reason(self) -> str:
        """Why the transport itself ended the connection (e.g. the host went silent), or ""."""
        return ""

    def recv_within(self, timeout: float, max_bytes: int = 1 << 20) -> bytes | None:
        """``recv`` that gives up (None) after ``timeout`` seconds without data (a thread per
        call here; transports that can time a read themselves do so)."""
        got: list[bytes] = []
        reader = threading.Thread(target=lambda: got.append(self.recv(max_bytes)), daemon=True)
        reader.start()
        reader.join(timeout)
        return got[0] if got else None


class Transport(ABC):
    """Reaches hosts. ``connect`` first (all hosts, in parallel), then ``open``/``run``."""

    @abstractmethod
    def connect(self, hosts: Sequence[Host]) -> Mapping[str, str]:
        """Connect to every host or raise naming the first that failed.

        Returns host name → the network address other ranks reach it at.
        """

    def reconnect(self, hosts: Sequence[Host]) -> Mapping[str, str]:
        """Connect to these hosts again, dropping their old connections (a restart after a lost
        host); as ``connect``. Transports without connections just connect."""
        return self.connect(hosts)

    @abstractmethod
    def open(self, host: Host, argv: Sequence[str]) -> Channel:
        """Start ``argv`` on the host (no shell parses it) and return its channel, once the
        program runs: whatever a login shell printed before it is not in the channel's output."""

    def run(self, host: Host, argv: Sequence[str], stdin: bytes = b"", timeout: float = 60.0) -> CommandResult:
        """Run a control command to completion and collect its output."""
        channel = self.open(host, argv)
        out = bytearray()
        reader = threading.Thread(target=read_all, args=(channel, out), daemon=True)
        reader.start()
        if stdin:
            channel.send(stdin)
        channel.close_stdin()
        reader.join(timeout)
        if reader.is_alive():
            channel.close()
            raise HostUnreachable(f"command did not finish within {timeout:.0f} s: {shlex.join(argv)[:120]}",
                                  host=host.name)
        code = channel.wait(timeout)
        result = CommandResult(
            host=host.name,
            argv=tuple(argv),
            exit_code=255 if code is None else code,
            stdout=bytes(out),
            stderr=channel.stderr_text().encode(),
        )
        channel.close()
        return result

    def start(self, host: Host, argv: Sequence[str], stdin: bytes = b"", timeout: float = 60.0) -> CommandResult:
        """Start a program that outlives dlrun (a detached job's keeper) and collect what it
        printed before it let go of its output. Here the program detaches itself (``run``);
        where ``holds_programs`` is true, the transport keeps it running instead."""
        return self.run(host, argv, stdin, timeout)

    def direct_address(self, host: Host) -> str | None:
        """The address this transport's own TCP connection reached ``host`` at (an SSH
        connection's peer), where a side channel to the host may go; None where there is no
        such connection (this machine, a proxy, srun)."""
        return None

    def holds_programs(self, host: Host) -> bool:
        """Whether ``start`` keeps the program running itself, so that it must not detach (a
        Slurm step holds its task: a process that leaves it leaves the job)."""
        return False

    def close(self) -> None:  # noqa: B027 - optional hook; local subprocesses need nothing
        """Close every connection."""


def default_python(host: Host) -> list[str]:
    """The python argv prefix a host's ranks (and its agent) run with.

    A local host with no ``python`` set uses the interpreter running dlrun, so a virtual
    environment works without being activated.
    """
    if host.python:
        return shlex.split(host.python)
    return [sys.executable] if host.is_local else ["python3"]


def read_all(channel: Channel, out: bytearray) -> None:
    while True:
        data = channel.recv()
        if not data:
            return
        out += data


# ----------------------------------------------------------------------------- local
