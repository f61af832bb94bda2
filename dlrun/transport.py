"""The transport seam: how dlrun reaches a host and runs a command there.

A ``Transport`` connects to hosts and opens ``Channel``s — one bidirectional byte stream per
command (stdin in, stdout out, stderr kept for errors). The supervisor, the probe and the push
speak only this interface, so a host is a host whether it is this machine (``LocalTransport``:
subprocesses), an SSH server (``dlrun.ssh.SSHTransport``: one paramiko connection per host)
or a test double (``dlrun.testing.FakeTransport``). ``HostRouter`` sends each host to the
transport that fits it: local hosts never need an sshd.
"""

from __future__ import annotations

import os
import shlex
import subprocess
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
    def send(self, data: bytes) -> None:
        """Write all of ``data`` to the command's stdin (raises HostUnreachable if gone)."""

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


class Transport(ABC):
    """Reaches hosts. ``connect`` first (all hosts, in parallel), then ``open``/``run``."""

    @abstractmethod
    def connect(self, hosts: Sequence[Host]) -> Mapping[str, str]:
        """Connect to every host or raise naming the first that failed.

        Returns host name → the network address other ranks reach it at.
        """

    @abstractmethod
    def open(self, host: Host, argv: Sequence[str]) -> Channel:
        """Start ``argv`` on the host (no shell parses it) and return its channel."""

    def run(self, host: Host, argv: Sequence[str], stdin: bytes = b"", timeout: float = 60.0) -> CommandResult:
        """Run a control command to completion and collect its output."""
        channel = self.open(host, argv)
        out = bytearray()
        reader = threading.Thread(target=_read_all, args=(channel, out), daemon=True)
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

    def close(self) -> None:  # noqa: B027 - optional hook; local subprocesses need nothing
        """Close every connection."""


def _read_all(channel: Channel, out: bytearray) -> None:
    while True:
        data = channel.recv()
        if not data:
            return
        out += data


# ----------------------------------------------------------------------------- local


class LocalChannel(Channel):
    def __init__(self, host: str, argv: Sequence[str]) -> None:
        self.host = host
        self._stderr = bytearray()
        try:
            self.proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # Ctrl-C reaches dlrun only; dlrun decides
            )
        except OSError as exc:
            raise HostUnreachable(f"cannot start {argv[0]}: {exc}", host=host) from exc
        self._err_reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._err_reader.start()
        self._stdin_lock = threading.Lock()

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        stream = self.proc.stderr
        while True:
            data = os.read(stream.fileno(), 65536)
            if not data:
                return
            self._stderr += data

    def send(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        with self._stdin_lock:
            try:
                self.proc.stdin.write(data)
                self.proc.stdin.flush()
            except (BrokenPipeError, ValueError, OSError) as exc:
                raise HostUnreachable("the local agent is gone", host=self.host) from exc

    def recv(self, max_bytes: int = 65536) -> bytes:
        assert self.proc.stdout is not None
        try:
            return os.read(self.proc.stdout.fileno(), max_bytes)
        except (OSError, ValueError):
            return b""

    def close_stdin(self) -> None:
        assert self.proc.stdin is not None
        with self._stdin_lock:
            try:
                self.proc.stdin.close()
            except OSError:
                pass

    def wait(self, timeout: float | None = None) -> int | None:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        self._err_reader.join(1)
        return 128 - code if code < 0 else code

    def stderr_text(self) -> str:
        return self._stderr.decode(errors="replace")

    def close(self) -> None:
        self.close_stdin()
        if self.proc.poll() is None:
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class LocalTransport(Transport):
    """This machine: commands are subprocesses (used for localhost hosts and with no --hosts)."""

    def connect(self, hosts: Sequence[Host]) -> Mapping[str, str]:
        return {h.name: "127.0.0.1" for h in hosts}

    def open(self, host: Host, argv: Sequence[str]) -> Channel:
        return LocalChannel(host.name, argv)


def default_python(host: Host) -> list[str]:
    """The python argv prefix a host's ranks (and its agent) run with.

    A local host with no ``python`` set uses the interpreter running dlrun, so a virtual
    environment works without being activated.
    """
    if host.python:
        return shlex.split(host.python)
    return [sys.executable] if host.is_local else ["python3"]


class HostRouter(Transport):
    """Local hosts to ``LocalTransport``; the others to the remote transport (SSH)."""

    def __init__(self, remote: Transport | None, local: Transport | None = None) -> None:
        self.local = local or LocalTransport()
        self.remote = remote

    def _for(self, host: Host) -> Transport:
        if host.is_local:
            return self.local
        if self.remote is None:
            raise HostUnreachable("no remote transport configured", host=host.name)
        return self.remote

    def connect(self, hosts: Sequence[Host]) -> Mapping[str, str]:
        addresses: dict[str, str] = {}
        local = [h for h in hosts if h.is_local]
        remote = [h for h in hosts if not h.is_local]
        if local:
            addresses.update(self.local.connect(local))
        if remote:
            addresses.update(self._for(remote[0]).connect(remote))
        return addresses

    def open(self, host: Host, argv: Sequence[str]) -> Channel:
        return self._for(host).open(host, argv)

    def run(self, host: Host, argv: Sequence[str], stdin: bytes = b"", timeout: float = 60.0) -> CommandResult:
        return self._for(host).run(host, argv, stdin, timeout)

    def close(self) -> None:
        self.local.close()
        if self.remote is not None:
            self.remote.close()
