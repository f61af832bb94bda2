"""Test doubles that ship with dlrun: a scripted transport for supervisor unit tests.

``FakeTransport(behaviour)`` opens ``FakeChannel``s that play the host agent's part of the
protocol (``dlrun.remote.agent``) without starting any process: each rank prints the lines its
``FakeRank`` script gives, then exits with its code — unless it is told to stop first. A
fake is for fast tests of policy (fail fast, root cause, interrupts); every feature is also
tested with real processes and real sshd.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dlrun.errors import HostUnreachable
from dlrun.inventory import Host
from dlrun.remote import agent
from dlrun.transport.base import Channel, Transport


@dataclass(frozen=True)
class FakeRank:
    """What one fake rank does: print ``lines`` (one every ``delay`` s), then exit ``code``.

    ``code=None`` runs until stopped (then exits 143, as a SIGTERM'd process reports).
    """

    lines: Sequence[str] = ()
    code: int | None = 0
    delay: float = 0.0
    ignores_term: bool = False


class FakeChannel(Channel):
    """Reads what a real agent's stdin gets: the bootstrap's payload (``dlrun.remote.boot_payload``:
    the loader's stage, skipped, then 10 digits of length and the program, kept in ``program``), then JSON lines."""

    def __init__(self, host: str, ranks: Mapping[int, FakeRank], drop_after: float | None = None,
                 silent_after: float | None = None, start_after: float = 0.0) -> None:
        self.host = host
        self.ranks = ranks
        self.out: queue.Queue[bytes] = queue.Queue()
        self.stop_event = threading.Event()
        self.kill_event = threading.Event()
        self.stdin_closed = threading.Event()
        self.sent: list[dict[str, object]] = []
        self.drop_after = drop_after
        self.silent_after = silent_after  # then nothing more comes: no output, no PONG, no EOF
        self.silent = threading.Event()
        self.start_after = start_after  # the ranks start this late, or never if a stop comes first
        self._thread: threading.Thread | None = None
        self._ended = threading.Event()
        self.program = b""  # what the bootstrap's loader would run
        self._program_size: int | None = None
        self._inbox = b""

    def send(self, data: bytes | memoryview) -> None:
        if self._ended.is_set() and self.drop_after is not None:
            raise HostUnreachable("connection lost", host=self.host)
        self._inbox += data
        while self._program_size is None:
            if len(self._inbox) < 10:
                return
            size, rest = int(self._inbox[1:10] if self._inbox[:1] == b"+" else self._inbox[:10]), self._inbox[10:]
            if self._inbox[:1] != b"+":
                self._program_size, self._inbox = size, rest
            elif len(rest) >= size:  # the loader's stage (the code cache), not the program
                self._inbox = rest[size:]
            else:
                return
        if len(self.program) < self._program_size:
            take = self._program_size - len(self.program)
            self.program, self._inbox = self.program + self._inbox[:take], self._inbox[take:]
            if len(self.program) < self._program_size:
                return
        *lines, self._inbox = self._inbox.split(b"\n")
        for line in lines:
            if not line.strip():
                continue
            message = json.loads(line)
            self.sent.append(message)
            if "ranks" in message and self._thread is None:
                self._thread = threading.Thread(target=self._play, args=(message,), daemon=True)
                self._thread.start()
            elif message.get("op") == "stop":
                self.stop_event.set()
            elif message.get("op") == "kill":
                self.kill_event.set()
                self.stop_event.set()
            elif message.get("op") == "ping" and not self.silent.is_set():
                self.out.put(agent.frame(agent.PONG, agent.AGENT_RANK, b""))

    def _play(self, spec: dict[str, object]) -> None:
        put = self.out.put
        put(agent.frame(agent.HELLO, agent.AGENT_RANK, b"{}"))
        numbers = [int(r["rank"]) for r in spec["ranks"]]  # type: ignore[attr-defined]
        if self.start_after and self.stop_event.wait(self.start_after):
            put(agent.frame(agent.DONE, agent.AGENT_RANK, b""))  # stopped before starting anything
            self._ended.set()
            put(b"")
            return
        for n in numbers:
            put(agent.frame(agent.STARTED, n, b'{"pid": 0}'))
        start = time.monotonic()
        pending = {n: list(self.ranks.get(n, FakeRank()).lines) for n in numbers}
        alive = set(numbers)
        while alive:
            if self.silent_after is not None and time.monotonic() - start >= self.silent_after:
                self.silent.set()  # as a host that lost power: the rank threads just stop
                return
            if self.drop_after is not None and time.monotonic() - start >= self.drop_after:
                self._ended.set()
                put(b"")
                return
            for n in sorted(alive):
                behaviour = self.ranks.get(n, FakeRank())
                stopped = self.kill_event.is_set() or (self.stop_event.is_set() and not behaviour.ignores_term)
                if stopped:
                    put(agent.frame(agent.EXIT, n, b'{"code": %d}' % (137 if self.kill_event.is_set() else 143)))
                    alive.discard(n)
                elif pending[n]:
                    put(agent.frame(agent.STDOUT, n, (pending[n].pop(0) + "\n").encode()))
                elif behaviour.code is not None:
                    put(agent.frame(agent.EXIT, n, b'{"code": %d}' % behaviour.code))
                    alive.discard(n)
            time.sleep(max(0.001, min((self.ranks.get(n, FakeRank()).delay for n in numbers), default=0.001)))
        put(agent.frame(agent.DONE, agent.AGENT_RANK, b""))
        self._ended.set()
        put(b"")

    def recv(self, max_bytes: int = 65536) -> bytes:
        return self.out.get()

    def close_stdin(self) -> None:
        self.stdin_closed.set()
        self.kill_event.set()

    def wait(self, timeout: float | None = None) -> int | None:
        return 0 if self._ended.wait(timeout) else None

    def stderr_text(self) -> str:
        return ""

    def close(self) -> None:
        self.close_stdin()


class FakeTransport(Transport):
    """Hosts whose ranks follow ``FakeRank`` scripts (keyed by global rank)."""

    def __init__(
        self,
        ranks: Mapping[int, FakeRank] | None = None,
        *,
        unreachable: Sequence[str] = (),
        drop: Mapping[str, float] | None = None,
        silent: Mapping[str, float] | None = None,
        start_after: Mapping[str, float] | None = None,
    ) -> None:
        self.ranks = ranks or {}
        self.unreachable = set(unreachable)
        self.drop = drop or {}
        self.silent = silent or {}
        self.start_after = start_after or {}
        self.channels: dict[str, FakeChannel] = {}

    def connect(self, hosts: Sequence[Host]) -> Mapping[str, str]:
        for host in hosts:
            if host.name in self.unreachable:
                raise HostUnreachable("connection refused", host=host.name)
        return {h.name: h.address for h in hosts}

    def open(self, host: Host, argv: Sequence[str]) -> Channel:
        if host.name in self.unreachable:
            raise HostUnreachable("connection refused", host=host.name)
        channel = FakeChannel(host.name, self.ranks, drop_after=self.drop.get(host.name),
                              silent_after=self.silent.get(host.name), start_after=self.start_after.get(host.name, 0.0))
        self.channels[host.name] = channel
        return channel
