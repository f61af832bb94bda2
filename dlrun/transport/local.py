"""Local transport: ranks on this machine as plain subprocesses, and the router that picks a
transport per host."""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence

from dlrun.errors import HostUnreachable
from dlrun.inventory import Host
from dlrun.transport.base import Channel, CommandResult, Transport


class LocalChannel(Channel):
    """A subprocess of dlrun: the command itself, or what reaches the host (``srun``).
    ``env``: its environment (None: dlrun's); ``what``: how errors name it."""

    def __init__(self, host: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                 what: str = "the local agent") -> None:
        self.host = host
        self.what = what
        self._stderr = bytearray()
        try:
            self.proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # Ctrl-C reaches dlrun only; dlrun decides
                env=None if env is None else dict(env),
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

    def send(self, data: bytes | memoryview) -> None:
        assert self.proc.stdin is not None
        with self._stdin_lock:
            try:
                self.proc.stdin.write(data)
                self.proc.stdin.flush()
                return
            except ValueError as exc:  # dlrun closed it (close_stdin): the program may be well
                raise HostUnreachable(f"{self.what} is gone", host=self.host) from exc
            except OSError as exc:  # a broken pipe: the program stopped reading
                failed = exc
        raise HostUnreachable(self._gone(), host=self.host) from failed

    def _gone(self) -> str:
        """Why the program stopped reading: its exit code and last lines of stderr (a wrong
        ``python`` on this machine says why it failed, as a host over SSH does)."""
        code = self.wait(2)
        if code is None:
            return f"{self.what} closed its input"
        detail = " / ".join(self.stderr_text().strip().splitlines()[-3:])
        return f"{self.what} ended (exit {code}) before reading its input" + (f": {detail}" if detail else "")

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
        return self._split(hosts, lambda transport, some: transport.connect(some))

    def reconnect(self, hosts: Sequence[Host]) -> Mapping[str, str]:
        return self._split(hosts, lambda transport, some: transport.reconnect(some))

    def _split(self, hosts: Sequence[Host],
               step: Callable[[Transport, Sequence[Host]], Mapping[str, str]]) -> Mapping[str, str]:
        """``step`` for this machine's hosts, then for the remote ones, on their transports."""
        addresses: dict[str, str] = {}
        local = [h for h in hosts if h.is_local]
        remote = [h for h in hosts if not h.is_local]
        if local:
            addresses.update(step(self.local, local))
        if remote:
            addresses.update(step(self._for(remote[0]), remote))
        return addresses

    def open(self, host: Host, argv: Sequence[str]) -> Channel:
        return self._for(host).open(host, argv)

    def run(self, host: Host, argv: Sequence[str], stdin: bytes = b"", timeout: float = 60.0) -> CommandResult:
        return self._for(host).run(host, argv, stdin, timeout)

    def start(self, host: Host, argv: Sequence[str], stdin: bytes = b"", timeout: float = 60.0) -> CommandResult:
        return self._for(host).start(host, argv, stdin, timeout)

    def holds_programs(self, host: Host) -> bool:
        return self._for(host).holds_programs(host)

    def direct_address(self, host: Host) -> str | None:
        return self._for(host).direct_address(host)

    def close(self) -> None:
        self.local.close()
        if self.remote is not None:
            self.remote.close()
