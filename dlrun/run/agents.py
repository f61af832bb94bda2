"""The job's host agents: starting one ``dlrun.remote.agent`` per host and talking to it.

``HostAgents`` opens every host's channel in parallel through the one bootstrap
(``dlrun.remote.boot_argv``, the agent's source first on its stdin), may ask each agent to run
the preflight probe, answer the code push's survey and say which ports are free before the spec, pings it while it
waits, and turns every frame and every closed channel into an event on one queue, which the
``Supervisor`` reads.
"""

from __future__ import annotations

import contextlib
import json
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from dlrun.errors import DlrunError
from dlrun.inventory import Host
from dlrun.plan import heartbeat_interval
from dlrun.remote import agent, boot_argv, boot_payload, source_of
from dlrun.run.events import Closed, Event, EventQueue, Frames
from dlrun.transport.base import Channel, Transport, default_python


@dataclass
class HostLink:
    host: Host
    ranks: list[int] = field(default_factory=list)
    channel: Channel | None = None
    closed: bool = False
    done: bool = False
    error: str | None = None  # why the agent could not be started
    heard: float = 0.0  # time.monotonic() when the agent last sent anything
    silent: bool = False  # declared lost for silence: its late frames are ignored
    pinged: bool = False  # a thread pings its agent
    ended: bool = False  # its reader saw the channel end: all it sent is queued, silence means nothing


def encode_message(message: Mapping[str, Any]) -> bytes:
    return json.dumps(message).encode() + b"\n"


def source_messages(op: str, source: str) -> Callable[[Mapping[str, Any]], bytes]:
    """Encodes ``{"op": op, "source": source, **rest}`` for each host with the source (tens of KB)
    encoded once per launch, not once per host (0.7 ms of the client's CPU per host)."""
    head = b'{"op": ' + json.dumps(op).encode() + b', "source": ' + json.dumps(source).encode()

    def encode(rest: Mapping[str, Any]) -> bytes:
        tail = json.dumps(dict(rest)).encode()
        return head + (b", " + tail[1:] if rest else b"}") + b"\n"

    return encode


def with_agent_words(reason: str, stderr: str, code: int | None) -> str:
    """``reason``, then the last lines the agent (or what started it) wrote, and its exit code
    (each unless ``reason`` says it already: a local agent's failed send does)."""
    detail = " / ".join(stderr.strip().splitlines()[-3:])
    if detail and detail not in reason:
        reason += ": " + detail
    return reason if code is None or f"(exit {code})" in reason else f"{reason} (agent exit {code})"


def close_aside(channel: Channel) -> None:
    """Close a channel in a thread of its own: over a dead connection closing can block."""
    threading.Thread(target=channel.close, name="dlrun-close", daemon=True).start()


def agent_argv(python: Sequence[str], *, pidns: bool = True) -> list[str]:
    """How a host's agent is started: the bootstrap's short loader (in a PID namespace); the
    channel sends ``boot_payload("agent")`` first."""
    argv = boot_argv(python, "agent")
    return agent.pidns_argv(argv) if pidns else argv


@dataclass(frozen=True)
class AgentAnswer:
    """What one host's agent answered before the spec: the probe's output and the push survey's
    reply (each None when not asked or not answered), or why there is no answer."""

    host: str
    stdout: str | None
    error: str | None = None
    survey: Mapping[str, Any] | None = None
    free_ports: tuple[int, ...] | None = None  # which of the asked ports are free there (None: not asked)


class HostAgents:
    """The job's agents, one per host, each on its own channel, with one event queue.

    ``start`` opens every channel in parallel (and may ask each agent to run a probe and a push
    survey first); the ``Supervisor`` then sends the spec of each host's ranks on the same
    channels. Every frame and every closed channel becomes an event on ``events``, in arrival
    order. With ``host_timeout``, each agent's silence clock runs from its start, and a thread per
    host pings it (``keep_alive``) until ``close``: an agent whose controller vanishes during the
    preflight or the push ends by itself, as it does during the job.
    """

    def __init__(self, transport: Transport, hosts: Sequence[Host], *, pidns: bool = True,
                 host_timeout: float | None = None) -> None:
        self.transport = transport
        self.pidns = pidns
        self.host_timeout = host_timeout or None
        self.quiet = threading.Event()  # set: the pingers stop
        self.links = {h.name: HostLink(h) for h in hosts}
        self.events: EventQueue = queue.Queue()
        self.asked: dict[str, frozenset[int]] = {}  # host -> the answer frames it was asked for
        self.payload = boot_payload("agent")  # the agent's source, on its stdin before any message

    def start(self, probe: str | None = None, surveys: Mapping[str, Mapping[str, Any]] | None = None,
              ports: Mapping[str, Sequence[int]] | None = None) -> None:
        """Start every agent not started yet (in parallel). With ``probe``, each runs it first;
        with ``surveys`` (host → ``dlrun.push.session.survey_request``), those hosts answer it first;
        with ``ports`` (host → ports), those hosts say which of them are free."""
        links = [link for link in self.links.values() if link.channel is None and link.error is None]
        if not links:
            return
        requests: dict[str, bytes] = {}
        watch = encode_message({"op": "watch", "host_timeout": self.host_timeout}) if self.host_timeout else b""
        probe_line = encode_message({"op": "probe", "source": probe}) if probe is not None else b""
        survey_line: Callable[[Mapping[str, Any]], bytes] | None = None
        for link in links:
            name, asked, request = link.host.name, set(), watch
            survey = (surveys or {}).get(name)
            if survey is not None:
                if survey_line is None:
                    survey_line = source_messages("survey", source_of("push_helper"))
                request += survey_line({"request": survey})
                asked.add(agent.SURVEY)
            if (wanted := (ports or {}).get(name)) is not None:
                request += encode_message({"op": "ports", "ports": list(wanted)})
                asked.add(agent.PORTS)
            if probe is not None:
                request += probe_line
                asked.add(agent.PROBE)
            self.asked[name] = frozenset(asked)
            requests[name] = request
        with ThreadPoolExecutor(max_workers=min(32, len(links))) as pool:
            list(pool.map(lambda link: self._start(link, requests[link.host.name]), links))
        if self.host_timeout is not None:
            self.keep_alive(self.host_timeout)

    def keep_alive(self, limit: float) -> None:
        """Ping every started agent that no thread pings yet, every ``heartbeat_interval(limit)``.
        Each host has a thread of its own: a send stuck on one dead connection must not starve
        the others."""
        interval = heartbeat_interval(limit)
        for name, link in self.links.items():
            if link.channel is not None and not link.pinged:
                link.pinged = True
                threading.Thread(target=self._pinger, args=(link, interval), name=f"dlrun-ping-{name}",
                                 daemon=True).start()

    def _pinger(self, link: HostLink, interval: float) -> None:
        ping = encode_message({"op": "ping"})
        while not self.quiet.wait(interval):
            if link.channel is None or link.closed or link.done or link.silent or self.quiet.is_set():
                return  # (quiet again: close() may have come during the checks)
            try:
                link.channel.send(ping)
            except DlrunError:
                return  # the reader sees the connection end and reports it

    def _start(self, link: HostLink, request: bytes) -> None:
        try:
            channel = self.transport.open(link.host, agent_argv(default_python(link.host), pidns=self.pidns))
            channel.send(self.payload + request)
        except DlrunError as exc:
            link.error = str(exc.message)
            return
        link.channel = channel
        link.heard = time.monotonic()
        threading.Thread(target=self._reader, args=(link, channel), daemon=True).start()

    def _reader(self, link: HostLink, channel: Channel) -> None:
        host = link.host.name
        decoder = agent.FrameDecoder()
        while True:
            data = channel.recv(65536)
            if not data:
                break
            link.heard = time.monotonic()
            frames = decoder.feed(data)
            if frames:
                self.events.put(Frames(host, frames))
        link.ended = True  # before the screen catches up (a paused pager): not a silent host
        code = channel.wait(5)
        self.events.put(Closed(host, code, channel.stderr_text()))

    def answers(self, timeout: float) -> dict[str, AgentAnswer]:
        """Wait until every started agent has answered what ``start`` asked (or ended); other
        events stay queued for the supervisor. A host asked nothing answers at once."""
        probes: dict[str, str] = {}
        surveys: dict[str, Mapping[str, Any]] = {}
        free: dict[str, tuple[int, ...]] = {}
        errors = {name: f"agent not started: {link.error}" for name, link in self.links.items()
                  if link.error is not None}
        waiting = {name for name in self.links if name not in errors and self.asked.get(name)}
        held: list[Event] = []
        deadline = time.monotonic() + timeout
        while waiting:
            try:
                event = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            held.append(event)
            if not isinstance(event, (Frames, Closed)):
                continue
            host = event.host
            if isinstance(event, Frames):
                for kind, _rank, payload in event.frames:
                    if kind == agent.PROBE:
                        probes[host] = payload.decode("utf-8", errors="replace")
                    elif kind == agent.SURVEY:
                        with contextlib.suppress(ValueError):
                            surveys[host] = json.loads(payload)
                        surveys.setdefault(host, {"error": "unreadable survey answer"})
                    elif kind == agent.PORTS:
                        try:
                            free[host] = tuple(int(p) for p in json.loads(payload)["free"])
                        except (ValueError, KeyError, TypeError):
                            free[host] = ()
            elif host in waiting:
                detail = " / ".join(event.stderr.strip().splitlines()[-3:])
                errors[host] = f"the agent ended (exit {event.code}) before answering" + (
                    f": {detail}" if detail else "")
            got = {agent.PROBE} if host in probes else set()
            got |= {agent.SURVEY} if host in surveys else set()
            got |= {agent.PORTS} if host in free else set()
            if host in errors or self.asked.get(host, frozenset()) <= got:
                waiting.discard(host)
        for name in waiting:
            errors.setdefault(name, f"no probe answer within {timeout:g} s")
        for event in held:  # the supervisor sees every event, in order
            self.events.put(event)
        return {name: AgentAnswer(name, probes.get(name), None if name in probes else errors.get(name),
                                  surveys.get(name), free.get(name)) for name in self.links}

    def assign(self, ranks: Sequence[tuple[Host, int]]) -> None:
        """This attempt's ranks (host, rank), for agents started before the plan was known: the
        hosts it does not use end now, hosts not started yet get a link, each link its ranks."""
        hosts = {host.name: host for host, _rank in ranks}
        self.release([name for name in self.links if name not in hosts])
        self.links.update({name: HostLink(host) for name, host in hosts.items() if name not in self.links})
        for host, rank in ranks:
            self.links[host.name].ranks.append(rank)

    def heard_now(self, host: str) -> None:
        """The silence clock of ``host`` starts again (its spec just went out)."""
        self.links[host].heard = time.monotonic()

    def fell_silent(self, limit: float) -> list[tuple[str, float]]:
        """Hosts whose agents sent nothing for ``limit`` seconds and still count (no end seen),
        with their silence; each is marked silent once (its late frames are ignored)."""
        now = time.monotonic()
        found = []
        for name, link in list(self.links.items()):
            if link.channel is None or link.closed or link.done or link.silent or link.ended:
                continue
            if now - link.heard > limit:
                link.silent = True
                found.append((name, now - link.heard))
        return found

    def finished(self, host: str) -> None:
        """The agent of ``host`` said DONE: its last word, whatever its channel does next."""
        self.links[host].done = True

    def lost(self, host: str) -> HostLink:
        """The channel of ``host`` ended or the host failed: its link, marked closed."""
        link = self.links[host]
        link.closed = True
        return link

    def hang_up(self) -> None:
        """The job ended: the pingers stop, and every channel closes but a silent host's (it was
        closed aside when it fell silent: closing it here could block on a dead connection)."""
        self.quiet.set()
        for link in self.links.values():
            if link.channel is not None and not link.silent:
                link.channel.close()

    def release(self, names: Sequence[str]) -> None:
        """Close these hosts' channels: their agents exit without starting anything."""
        for name in names:
            link = self.links.pop(name, None)
            if link is not None and link.channel is not None:
                link.closed = True
                link.channel.close()

    def close(self) -> None:
        self.quiet.set()
        for link in self.links.values():
            if link.channel is not None:
                link.channel.close()

